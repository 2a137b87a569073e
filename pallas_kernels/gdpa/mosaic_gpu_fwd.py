"""GDPA's query-side kernel, forward and dQ (Hopper, Mosaic GPU).

`query_kernel`: persistent CTAs, each walking its worker's rows of the work
table (`work_table`: query tiles dealt zig-zag in chunks, split-K parts,
resident-key flags), computing `O = a(X) V` or, with dO, the dQ of the
recomputing backward. The technique and the shapes' legend are in
`mosaic_gpu.py`.
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.gdpa.mosaic_gpu import (
  MAX_Q_STAGES,
  act,
  act_grad,
  kv_parts,
)
from pallas_kernels.schedule import QueryItem

# Columns of the per-worker work table (`work_table`).
(
  W_QROW,  # first packed row of the (aligned) query tile
  W_LO,  # valid rows [lo, hi) of the tile
  W_HI,
  W_KVROW,  # first packed row of the sequence's aligned key grid
  W_KVLEN,  # key length of the sequence
  W_STEPS,  # key tiles of this item (its part of the grid)
  W_TOTAL,  # key tiles of the sequence's grid
  W_SEQ,  # sequence
  W_FIRST,  # first key tile of this item
  W_PART,  # key part (split-K index)
  W_TILE,  # sequence-major id of the query tile (dS tiles, `dq_from_ds`)
  W_REUSE,  # 1: keys resident from the worker's previous item
  W_RELEASE,  # 1: the worker's next item does not reuse them
) = range(13)


def v_tile(shape, dtype, block_kv):
  """Shared-memory V tiles `[..., block_kv, h]`: the PV matmul contracts
  over the `block_kv` rows, and wgmma steps over K in swizzle-wide groups,
  so tiles under 64 rows take the 32- or 64-byte swizzle (K tiles keep 128
  bytes: QK contracts over the head dim, against Q's 128-byte swizzle)."""
  swizzle = min(128, block_kv * jnp.dtype(dtype).itemsize)
  if swizzle == 128:
    return mosaic.smem_tile(shape, dtype)
  elems = swizzle // jnp.dtype(dtype).itemsize
  transforms = (
    plgpu.TilingTransform((8, elems)),
    plgpu.SwizzleTransform(swizzle),
  )
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def work_table(items, num_real, parts: int, workers: int, chunk: int, mcs):
  """Per-worker work: `int32[w, j, 13]` (columns `W_*`), real items per
  worker.

  `items` (`schedule.query_items`, sorted) become
  `parts` items each (key tiles `[p * steps // parts, (p + 1) * steps //
  parts)`), re-sorted by their key tiles; chunks of `chunk` are dealt
  zig-zag (`schedule.deal`), and each worker's rows are gathered here, with
  the resident-key flags worked out, so the kernel reads one row per item
  (no dependent loads) one item ahead.
  """
  num = items.shape[0]
  steps = items[:, QueryItem.STEPS]
  part = jnp.arange(parts, dtype=jnp.int32)[:, None]
  first = part * steps // parts
  count = (part + 1) * steps // parts - first

  def rep(c):
    return jnp.broadcast_to(items[:, c], (parts, num))

  q = QueryItem  # W_QROW .. W_TILE, in order
  cols = [rep(q.ROW), rep(q.LO), rep(q.HI), rep(q.KV_ROW), rep(q.KV_LEN)]
  cols += [count, rep(q.KV_TILES), rep(q.SEQ), first]
  cols += [jnp.broadcast_to(part, (parts, num)), rep(q.TILE_ID)]
  table = jnp.stack(cols, axis=-1).reshape(parts * num, len(cols))
  num_real = num_real * parts
  if parts > 1:
    real = jnp.broadcast_to(jnp.arange(num) < num_real // parts, (parts, num))
    key = jnp.where(real.reshape(-1), -table[:, W_STEPS] - 1, num + 1)
    table = table[schedule.stable_order(key)]
  dealt, counts = schedule.deal(parts * num, num_real, workers, chunk)
  wt = table[dealt]  # [w, j, cols]
  j = jnp.arange(1, dealt.shape[1], dtype=jnp.int32)
  same = (
    (j[None, :] < counts[:, None])
    & (wt[:, 1:, W_SEQ] == wt[:, :-1, W_SEQ])
    & (wt[:, 1:, W_PART] == wt[:, :-1, W_PART])
    & (wt[:, 1:, W_STEPS] <= mcs)
  )
  edge = jnp.zeros((workers, 1), bool)
  reuse = jnp.concatenate([edge, same], axis=1)
  release = jnp.concatenate([~same, ~edge], axis=1)
  flags = jnp.stack([reuse, release], axis=-1).astype(jnp.int32)
  return jnp.concatenate([wt, flags], axis=-1).astype(jnp.int32), counts


def _deal_query_table(items, num_real, parts: int, groups: int, bs, mcs):
  """`work_table` for a persistent query-side kernel: about `num_sms` CTAs
  over all `groups` (head pairs), taking runs of up to `deal_chunk`
  items (fewer when there are not two runs per CTA). Returns (CTAs per
  group, table, real items per CTA)."""
  num = parts * items.shape[0]
  workers = schedule.persistent_workers(groups, mosaic.num_sms(bs.num_sms), num)
  chunk = max(1, min(bs.deal_chunk, num // (2 * workers)))
  wt, counts = work_table(items, num_real, parts, workers, chunk, mcs)
  return workers, wt, counts


def _table_row(wt_ref, w, j, cols):
  """Columns `cols` of row `j` of worker `w`'s table (clamped to the last
  row). Kernels read it one item ahead, so the loads are in flight while
  the current tile computes, and each side reads only what it uses (the
  producer runs on 40 registers)."""
  jj = jnp.minimum(j, wt_ref.shape[1] - 1)
  return tuple(wt_ref[w, jj, c] for c in cols)


def _out_smem(hpc, h, bs, out_bytes):
  """Output staging of a query-side kernel (`_out_buffers`) and 1 KiB for
  its barriers."""
  return hpc * bs.block_q * h * out_bytes + 1024


def _out_buffers(hpc, bq, h, out_dtype, full):
  """Output staging of a query-side kernel: a plain buffer per consumer
  warpgroup (partial tiles, `mosaic.ladder_store`) and, when `full`, a
  swizzled view of the same memory for whole tiles: one `plgpu.RefUnion`
  per warpgroup (a tile uses one view or the other, and
  `_store_query_tile` waits for the previous tile's stores to have read
  it; the views of a union alias as a whole, so one union for both
  warpgroups would make each one's stores race with the other's).
  Sharing the memory is what lets 128-row key tiles keep two
  Q stages with the swizzled store at head dim 128 (forward 2% faster
  than the plain buffer alone over 256 keys), and gives the dQ kernel two
  (Q, dO) stages instead of one."""
  if not full:
    return plgpu.SMEM((hpc, bq, h), out_dtype)
  return [
    plgpu.RefUnion(
      plgpu.SMEM((bq, h), out_dtype), mosaic.smem_tile((bq, h), out_dtype)
    )
    for _ in range(hpc)
  ]


def _store_own_tile(out_bufs, wg, acc, out_ref, *args):
  """`_store_query_tile(acc, out_ref, plain, swizzled, *args)` with
  consumer warpgroup `wg`'s buffers of `_out_buffers` (a list of unions
  with the swizzled view, one per warpgroup, or one plain buffer)."""
  if not isinstance(out_bufs, (list, tuple)):
    _store_query_tile(acc, out_ref, out_bufs.at[wg], None, *args)
    return
  for g, (plain, swizzled) in enumerate(out_bufs):

    @pl.when(wg == g)
    def _(plain=plain, swizzled=swizzled):
      _store_query_tile(acc, out_ref, plain, swizzled, *args)


def _query_smem(hpc, q_stages, h, bs, dq, out_bytes):
  q_ring = q_stages * hpc * bs.block_q * h * 2 * (2 if dq else 1)
  kv_ring = bs.kv_stages * bs.block_kv * h * 2 * 2
  return q_ring + kv_ring + _out_smem(hpc, h, bs, out_bytes)


def query_layout(n, kh, h, bs, dq: bool, out_bytes: int = 2):
  """(query heads per CTA, Q ring depth, swizzled full-tile store). Two
  heads per CTA share every K/V tile (when the group is even); then the
  deepest Q ring that fits shared memory, at most `q_stages` (or
  `MAX_Q_STAGES`), and the swizzled whole-tile store when asked for and
  the output is 16-bit (it shares the plain buffer's memory,
  `_out_buffers`)."""
  group = n // kh
  full = bs.full_store and out_bytes == 2
  for hpc in (2, 1) if group % 2 == 0 else (1,):
    for qs in range(bs.q_stages or MAX_Q_STAGES, 0, -1):
      smem = _query_smem(hpc, qs, h, bs, dq, out_bytes)
      if smem <= mosaic.SMEM_PER_BLOCK:
        return hpc, qs, full
  raise ValueError(f"head dim {h} with {bs} does not fit shared memory")


def _store_query_tile(
  acc, out_ref, o_tile, of_tile, head, q_row, lo, hi, part, bq, out_dtype
):
  """Rows `[lo, hi)` of a query tile's result `acc` into `out_ref` (`[t, n,
  h]`, or `[parts, t, n, h]` with `part`) with TMA. Partial tiles go
  through the plain buffer `o_tile` and the ladder; whole tiles through
  the swizzled `of_tile` (when given), which the wgmma-layout register
  store reaches without bank conflicts (8-way into a plain 256-byte-row
  buffer)."""
  # The previous tile's stores must have read the buffers before reuse.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if part is not None:
    dst = lambda r, size: out_ref.at[part, pl.ds(q_row + r, size), head]  # noqa: E731
  else:
    dst = lambda r, size: out_ref.at[pl.ds(q_row + r, size), head]  # noqa: E731
  whole = (lo == 0) & (hi == bq) if of_tile is not None else False

  @pl.when(jnp.logical_not(whole))
  def _():
    o_tile[...] = acc.astype(out_dtype)
    plgpu.commit_smem()
    mosaic.ladder_store(o_tile, dst, lo, hi - lo, bq)

  if of_tile is not None:

    @pl.when(whole)
    def _():
      of_tile[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      rows = pl.ds(mosaic.aligned(q_row), bq)
      plgpu.copy_smem_to_gmem(of_tile, out_ref.at[rows, head])


def query_kernel(q, k, v, k_side, v_side, do, items, num_real, static):
  """Forward (`do is None`: returns O) or dQ (returns dQ), `[t, n, h]`.

  `items`: `schedule.query_items` table (sorted),
  `num_real` its number of real items; `k_side`: `side_tiles` of K
  (`[b + 1, ...]`).
  """
  t, n, h = q.shape
  s, kh, _ = k.shape
  dtype = q.dtype
  group = n // kh
  is_dq = do is not None
  bs = static.block_sizes
  bq, bkv, mcs = bs.block_q, bs.block_kv, bs.kv_stages
  if is_dq and bkv < 64:
    # dQ contracts dS against K over the key rows: its K tile would need
    # the narrow swizzle, but QK needs the 128-byte one (op.py uses 64).
    raise ValueError(f"dQ needs block_kv >= 64, got {bkv}")
  parts = kv_parts(bs, items.shape[0], max(n // 2, 1), s, k_side.shape[0] - 1)
  out_dtype = jnp.float32 if parts > 1 else dtype
  hpc, qs, full = query_layout(
    n, kh, h, bs, is_dq, jnp.dtype(out_dtype).itemsize
  )
  workers, wt, counts = _deal_query_table(
    items, num_real, parts, n // hpc, bs, mcs
  )
  name, tanh, scale = static.activation, static.tanh, static.scale
  hstu = static.normalize == "hstu"

  def kernel(*refs):
    (wt_ref, count_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref) = refs[:7]
    if is_dq:
      do_ref, out_ref = refs[7:9]
      scratch = refs[9:]
    else:
      do_ref, out_ref = None, refs[7]
      scratch = (refs[8], None, *refs[9:])
    (q_smem, do_smem, k_smem, v_smem, out_bufs) = scratch[:5]
    (q_bar, kv_bar, q_free, kv_free) = scratch[5:9]
    w = lax.axis_index("workers")
    hp = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    n_steps = count_ref[w]
    kv_head = lax.div(hp * hpc, group)

    def fetch(j, cols):
      return _table_row(wt_ref, w, j, cols)

    @pl.when(wg < hpc)
    def _consumer():
      plgpu.set_max_registers(mosaic.consumer_registers(hpc), action="increase")
      head = hp * hpc + wg

      cols = (W_QROW, W_LO, W_HI, W_STEPS, W_REUSE, W_RELEASE)
      cols += (W_KVLEN,) * hstu + (W_PART,) * (parts > 1)

      def body(j, carry):
        loads, cur = carry[0], dict(zip(cols, carry[1:], strict=True))
        nxt = fetch(j + 1, cols)
        q_row, lo, hi, steps = (cur[W_QROW], cur[W_LO], cur[W_HI], cur[W_STEPS])
        reuse, release = cur[W_REUSE] != 0, cur[W_RELEASE] != 0
        slot = lax.rem(j, qs)
        base = jnp.where(reuse, loads - steps, loads)
        plgpu.barrier_wait(q_bar.at[slot])
        q_tile = q_smem.at[slot, wg]
        if hstu:
          kv_len = cur[W_KVLEN]
          mult = jnp.where(kv_len > 0, 1.0 / kv_len.astype(jnp.float32), 0.0)
        acc = plgpu.layout_cast(
          jnp.full((bq, h), 0, jnp.float32), plgpu.Layout.WGMMA
        )

        def step(i, acc):
          s = lax.rem(base + i, mcs)

          @pl.when(jnp.logical_not(reuse))
          def _():
            plgpu.barrier_wait(kv_bar.at[s])

          x = mosaic.matmul(q_tile, k_smem.at[s].transpose((1, 0)), (bq, bkv))
          if is_dq:
            dp = mosaic.matmul(
              do_smem.at[slot, wg], v_smem.at[s].transpose((1, 0)), (bq, bkv)
            )

          @pl.when(i == steps - 1)
          def _():
            # Q (and dO) are read by the matmuls above only: hand the slot
            # back now, so the next load overlaps the rest of this tile.
            mosaic.release(q_free.at[slot])

          x = x * scale
          if is_dq:
            ds = act_grad(x, name, tanh) * dp
            ds = ds * (mult * scale) if hstu else ds * scale
            acc = mosaic.accumulate(
              acc, ds.astype(dtype), k_smem.at[s], static.interpret
            )
          else:
            p = act(x, name, tanh)
            if hstu:
              p = p * mult
            acc = mosaic.accumulate(
              acc, p.astype(dtype), v_smem.at[s], static.interpret
            )

          @pl.when(release)
          def _():
            # Order this step's reads of the slot before the producer's
            # next TMA write into it (see `mosaic.release`).
            mosaic.release(kv_free.at[s])

          return acc

        # No overlap beyond the two consumers' own: the two warpgroups
        # already interleave one's wgmmas with the other's activation, and
        # issuing the next step's QK early (a second accumulator) or making
        # them take turns as the jagged forward does measured slower.
        acc = lax.fori_loop(0, steps, step, acc)

        @pl.when(steps == 0)
        def _():
          mosaic.release(q_free.at[slot])

        part = cur[W_PART] if parts > 1 else None
        _store_own_tile(
          out_bufs, wg, acc, out_ref, head, q_row, lo, hi, part, bq, out_dtype
        )
        return (jnp.where(reuse, loads, loads + steps), *nxt)

      lax.fori_loop(0, n_steps, body, (jnp.int32(0), *fetch(0, cols)))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == hpc)
    def _producer():
      plgpu.set_max_registers(mosaic.producer_registers(hpc), action="decrease")

      def issue_kv(i, s, kv_row, total, seq):
        """Key tile i of the sequence into ring slot s (side tiles at
        the ends)."""
        item = (kv_row, None, total, seq)
        for ref, side, dst in (
          (k_ref, ks_ref, k_smem),
          (v_ref, vs_ref, v_smem),
        ):
          schedule.load_kv_tile(
            ref, side, dst.at[s], kv_bar.at[s], i, item, bkv, kv_head
          )

      cols = (W_QROW, W_KVROW, W_STEPS, W_TOTAL, W_SEQ, W_FIRST, W_REUSE)

      def body(j, carry):
        loads, cur = carry[0], dict(zip(cols, carry[1:], strict=True))
        nxt = fetch(j + 1, cols)
        slot = lax.rem(j, qs)

        @pl.when(j >= qs)
        def _():
          plgpu.barrier_wait(q_free.at[slot])

        rows = pl.ds(mosaic.aligned(cur[W_QROW]), bq)
        for g in range(hpc):
          plgpu.copy_gmem_to_smem(
            q_ref.at[rows, hp * hpc + g], q_smem.at[slot, g], q_bar.at[slot]
          )
          if is_dq:
            plgpu.copy_gmem_to_smem(
              do_ref.at[rows, hp * hpc + g],
              do_smem.at[slot, g],
              q_bar.at[slot],
            )
        n_load = jnp.where(cur[W_REUSE] != 0, 0, cur[W_STEPS])

        def load(i, loads):
          s = lax.rem(loads, mcs)

          @pl.when(loads >= mcs)
          def _():
            plgpu.barrier_wait(kv_free.at[s])

          issue_kv(cur[W_FIRST] + i, s, cur[W_KVROW], cur[W_TOTAL], cur[W_SEQ])
          return loads + 1

        return (lax.fori_loop(0, n_load, load, loads), *nxt)

      init = (jnp.int32(0), *fetch(0, cols))
      carry = lax.fori_loop(0, n_steps, body, init)
      loads = carry[0]
      mosaic.observe_releases(loads, mcs, kv_free)
      mosaic.observe_releases(n_steps, qs, q_free)

  tile = mosaic.smem_tile
  scratch = [
    tile((qs, hpc, bq, h), dtype),
    *([tile((qs, hpc, bq, h), dtype)] if is_dq else []),
    tile((mcs, bkv, h), dtype),
    v_tile((mcs, bkv, h), dtype, bkv),
    _out_buffers(hpc, bq, h, out_dtype, full),
    plgpu.Barrier(num_arrivals=hpc * (2 if is_dq else 1), num_barriers=qs),
    plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=qs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=mcs),
  ]
  args = [wt, counts, q, k, v, k_side, v_side]
  if is_dq:
    args.append(do)
  return _run_query_side(
    kernel, scratch, args, (t, n, h), dtype, parts, hpc, workers, static
  )


def _run_query_side(
  kernel, scratch, args, shape, dtype, parts, hpc, workers, static
):
  """Launch a query-side kernel (`query_kernel`, `dq_from_ds`): persistent
  CTAs `(n // hpc, workers)`, `hpc` consumer warpgroups and a producer;
  output `shape` (`[t, n, h]`), or `[parts, t, n, h]` f32 split-K partials
  (no softmax, so the parts simply add) summed into `dtype`."""
  n = shape[1]
  out_shape = (parts, *shape) if parts > 1 else shape
  out = mosaic.warp_specialized(
    kernel,
    out_type=jax.ShapeDtypeStruct(
      out_shape, jnp.float32 if parts > 1 else dtype
    ),
    scratch=scratch,
    grid=(n // hpc, workers),
    consumers=hpc,
    interpret=static.interpret,
    name="query",
    family="gdpa",
  )(*args)
  if parts > 1:
    out = out.sum(axis=0).astype(dtype)
  return out
