"""GDPA's dK/dV kernel (Hopper, Mosaic GPU).

`backward_dkv`: per (128-row key tile, KV head), two consumer warpgroups of
64 key rows stream the (Q, dO) tiles of every query head of the group and
accumulate dK and dV; optionally it also stores `dS^T` (`dq_from_ds`) or
adds dQ itself (`backward_dkv_dq`). The technique and the shapes' legend
are in `mosaic_gpu.py`.
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.gdpa.mosaic_gpu import (
  act_and_grad,
)


def key_items(
  q_offsets, kv_offsets, s, *, block_q, block_kv, parts=1, q_tile_start=None
):
  """Items of the dK/dV kernel: `parts` per `block_kv`-row key tile (the
  tile's query tiles cut into `parts` runs), longest first (cost: the query
  tiles it streams); a tile's parts are consecutive, part fastest.

  Columns: 0 first packed row of the (8-aligned) key tile, 1-2 its valid
  rows `[lo, hi)`, 3 first packed row of the sequence's aligned query grid,
  4 query tiles of the sequence, 5 first query tile of this item, 6 query
  tiles of this item, 7 sequence, 8 key length, 9 part (split index), 10
  the tile's index in the sequence's key grid, 11 the id of the sequence's
  first query tile (`q_tile_start`: the query schedule's `tile_start_b`;
  0 without it).
  """
  kv_off, q_off = schedule.seq_tables(kv_offsets, s, q_offsets)
  q_len_b = q_off[1:] - q_off[:-1]
  kv_len_b = kv_off[1:] - kv_off[:-1]
  q_lead_b = schedule.lead_rows(q_off[:-1], mosaic.ALIGN)
  kv_lead_b = schedule.lead_rows(kv_off[:-1], mosaic.ALIGN)
  n_q_b = jnp.where(q_len_b > 0, pl.cdiv(q_len_b + q_lead_b, block_q), 0)
  sched = schedule.jagged_tile_schedule(
    kv_offsets,
    s,
    block_kv,
    align=mosaic.ALIGN,
    seq_cost=lambda seq: n_q_b[seq] + 1,
  )
  seq, tile, valid = sched.seq_i, sched.tile_i, sched.valid_i
  kv_pos = tile * block_kv - kv_lead_b[seq]
  lo = jnp.where(valid, jnp.clip(-kv_pos, 0, block_kv), 0)
  hi = jnp.where(valid, jnp.clip(kv_len_b[seq] - kv_pos, 0, block_kv), 0)
  n_q = n_q_b[seq]
  steps = jnp.where(valid, n_q, 0)
  part = jnp.arange(parts, dtype=jnp.int32)[None, :]
  first = part * steps[:, None] // parts
  count = (part + 1) * steps[:, None] // parts - first

  def rep(c):
    return jnp.broadcast_to(c[:, None], first.shape)

  cols = [
    rep(kv_off[seq] - kv_lead_b[seq] + tile * block_kv),
    rep(lo),
    rep(hi),
    rep(q_off[seq] - q_lead_b[seq]),
    rep(n_q),
    first,
    count,
    rep(seq),
    rep(kv_len_b[seq]),
    jnp.broadcast_to(part, first.shape),
    rep(tile),
    rep(
      jnp.zeros_like(seq)
      if q_tile_start is None
      else q_tile_start[jnp.minimum(seq, q_tile_start.shape[0] - 1)]
    ),
  ]
  return jnp.stack(cols, axis=-1).reshape(-1, len(cols)).astype(jnp.int32)


def backward_dkv_dq(q, k, v, do, q_side, do_side, items, static, parts=1):
  """(dQ, dK, dV), the dK/dV kernel also adding `dQ = dS K` (`dq_fused`):
  neither a dQ kernel recomputing `X`, `dP` and `a'(X)` nor a round trip
  of `dS^T` through memory. Each step both consumer warpgroups put their
  scaled `dS^T` (64 keys x 64 queries) in a double-buffered shared tile
  and meet; each then forms 64 of dQ's columns over the tile's 128 keys
  and adds them into dQ with TMA reduce-add, in the inputs' dtype: a dQ
  element takes one rounded add per 128-key tile of its sequence (and
  split part, `dkv_parts`), and adds land in arrival order, so its last
  bits may differ between runs. The GPU interpreter has no TMA
  reduction: there each item stores into a slice of its own (with spare
  rows: its stores cannot drop the rows past the end), summed here.

  The default where dQ does not come from `dS^T` (`dq_path`: longer
  keys), in place of the dQ kernel: 11-14% faster forward+backward on
  pooled, long self- and log-normal attention, with dQ's relative error
  0.004-0.0055 against the dQ kernel's 0.0023 (the other gradients
  unchanged), as for jagged attention's fused backward. Not for short
  keys: the per-step rendezvous keeps the two consumers in lockstep, where
  apart one's activation overlaps the other's wgmmas (8-9% slower than
  dQ from `dS^T` over 16 and 64 keys)."""
  t, n, h = q.shape
  interp = static.interpret is not None
  shape = (
    (items.shape[0], t + static.block_sizes.block_q, n, h)
    if interp
    else q.shape
  )
  dq = jax.new_ref(jnp.zeros(shape, q.dtype))
  dk, dv = backward_dkv(
    q, k, v, do, q_side, do_side, items, static, parts, dq=dq
  )
  dq = dq[...]
  if interp:
    dq = dq.astype(jnp.float32).sum(axis=0)[:t].astype(q.dtype)
  return dq, dk, dv


def backward_dkv(
  q, k, v, do, q_side, do_side, items, static, parts=1, ds_tiles=None,
  dq=None,
):  # fmt: skip
  """(dK, dV) `[s, k, h]`, reduced over each KV head's query-head group.

  `items`: `key_items(..., parts=parts)`; with `parts > 1` each item adds
  its part of the query stream into an f32 partial `[parts, s, k, h]`
  (one f32 staging buffer per warpgroup, dK then dV), summed by XLA.

  `ds_tiles` (`(key tiles of 64, query tiles)`, static): also return every
  scaled `dS^T` tile (`[n, key tiles, query tiles, 64, 64]`, key tile
  index in the sequence's 64-row grid, query tile by its id in the query
  schedule, i.e. `items` built with `q_tile_start`), for `dq_from_ds`.

  `dq` (a ref of `dq_buffer`'s zeros; `backward_dkv_dq`): also add `dQ =
  dS K` into it (`dq_fused`, see there).

  The four wgmmas of a step run one after the other: pairing them in
  flight (`X^T` with `dP^T`, then dV with dK) gained nothing beyond noise.
  """
  t, n, h = q.shape
  s, kh, _ = k.shape
  dtype = q.dtype
  group = n // kh
  bs = static.block_sizes
  bq, bkv, mcs = bs.block_q, 64, bs.dkv_stages
  out_dtype = jnp.float32 if parts > 1 else dtype
  wgs = 2  # consumer warpgroups, bkv key rows each
  num_items = items.shape[0]
  name, tanh, scale = static.activation, static.tanh, static.scale
  hstu = static.normalize == "hstu"
  with_ds = ds_tiles is not None
  fused = dq is not None
  if fused and (with_ds or h % 64):
    raise ValueError("dq: not with ds_tiles, and head dim a multiple of 64")
  interp = static.interpret

  def kernel(
    items_ref, q_ref, k_ref, v_ref, do_ref, qs_ref, dos_ref, *refs
  ):  # fmt: skip
    if with_ds:
      dk_ref, dv_ref, ds_ref, *scratch = refs
      ds_stage = scratch[9]
    elif fused:
      dq_ref, dk_ref, dv_ref, *scratch = refs
    else:
      dk_ref, dv_ref, *scratch = refs
    if fused:  # the dQ buffers share the dK / dV staging's memory
      (k_smem2, v_smem2, staging, q_smem, do_smem) = scratch[:5]
      (dk_smem2, dv_smem2), (ds_smem, dq_stage) = staging
      (kv_bar, q_bar, free, ds_bar) = scratch[5:]
    else:
      (k_smem2, v_smem2, dk_smem2, dv_smem2, q_smem, do_smem) = scratch[:6]
      (kv_bar, q_bar, free) = scratch[6:9]
    it = lax.axis_index("items")
    kv_head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    (kv_row, lo, hi, q_row0, n_q, t0, q_steps, seq, kv_len, part, kv_tile,
     tile_id0) = [items_ref[it, f] for f in range(12)]  # fmt: skip
    total = q_steps * group

    def coords(j):
      """Step j -> (query head, query tile)."""
      per = jnp.maximum(q_steps, 1)
      return kv_head * group + lax.div(j, per), t0 + lax.rem(j, per)

    @pl.when(hi > lo)
    def _work():
      @pl.when(wg < wgs)
      def _compute():
        plgpu.set_max_registers(
          mosaic.consumer_registers(wgs), action="increase"
        )
        k_smem = k_smem2.at[wg]
        v_smem = v_smem2.at[wg]
        base = mosaic.aligned(kv_row + wg * bkv)
        bar = kv_bar.at[wg]
        plgpu.copy_gmem_to_smem(
          k_ref.at[pl.ds(base, bkv), kv_head], k_smem, bar
        )
        plgpu.copy_gmem_to_smem(
          v_ref.at[pl.ds(base, bkv), kv_head], v_smem, bar
        )
        plgpu.barrier_wait(bar)
        zeros = plgpu.layout_cast(
          jnp.full((bkv, h), 0, jnp.float32), plgpu.Layout.WGMMA
        )
        if hstu:
          mult = jnp.where(kv_len > 0, 1.0 / kv_len.astype(jnp.float32), 0.0)
        ds_scale = mult * scale if hstu else scale

        def scores(xt):
          pt, dact = act_and_grad(xt * scale, name, tanh)
          return (pt * mult if hstu else pt), dact

        def store_ds(j, dst16):
          """This step's `dS^T` tile out (the previous store has long
          read the staging buffer)."""
          head, tile = coords(j)
          stage = ds_stage.at[wg]
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          stage[...] = dst16
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
            stage, ds_ref.at[head, 2 * kv_tile + wg, tile_id0 + tile]
          )

        def add_dq(j, ds16):
          """dQ of step j's query tile over all 128 keys
          (`mosaic.shared_ds_dq`), added into dQ with TMA reduce-add
          (interpret mode: stored into the item's own slice, summed
          outside)."""
          head, tile = coords(j)
          rows = pl.ds(mosaic.aligned(q_row0 + tile * bq), bq)

          def emit(part, cols):
            if interp is None:
              dst = dq_ref.at[rows, head, cols]
            else:  # the item's own slice (its windows are disjoint)
              dst = dq_ref.at[it, rows, head, cols]
            mosaic.staged_add(dq_stage.at[wg], part.astype(dtype), dst, interp)

          mosaic.shared_ds_dq(ds16, ds_smem, k_smem2, ds_bar, j, wg, emit)

        def step(j, carry):
          dk, dv = carry
          slot = lax.rem(j, mcs)
          plgpu.barrier_wait(q_bar.at[slot])
          q_t = q_smem.at[slot].transpose((1, 0))
          do_t = do_smem.at[slot].transpose((1, 0))
          pt, dact = scores(mosaic.matmul(k_smem, q_t, (bkv, bq)))
          dv = mosaic.accumulate(dv, pt.astype(dtype), do_smem.at[slot], interp)
          dpt = mosaic.matmul(v_smem, do_t, (bkv, bq))
          dst = dact * dpt * ds_scale
          if fused:
            # Keys outside the sequence (this tile's rows past its end or
            # before its start hold other sequences' keys) must add
            # nothing to dQ; their dK rows are never stored anyway.
            dst = dst * lax.broadcast_in_dim(key_ok, (bkv, bq), [0])
          dst16 = dst.astype(dtype)
          dk = mosaic.accumulate(dk, dst16, q_smem.at[slot], interp)
          if with_ds:
            store_ds(j, dst16)
          mosaic.release(free.at[slot])
          if fused:
            add_dq(j, dst16)
          return dk, dv

        my_lo = jnp.clip(lo - wg * bkv, 0, bkv)
        my_hi = jnp.clip(hi - wg * bkv, 0, bkv)
        count = jnp.maximum(my_hi - my_lo, 0)
        if fused:  # 1.0 on this warpgroup's keys of the sequence (rows)
          key_at = mosaic.row_iota(bkv)
          key_ok = ((key_at >= my_lo) & (key_at < my_hi)).astype(jnp.float32)

        def rows(dst):
          if parts > 1:
            return lambda r, size: dst.at[part, pl.ds(base + r, size), kv_head]
          return lambda r, size: dst.at[pl.ds(base + r, size), kv_head]

        @pl.when(count > 0)
        def _():
          dk, dv = lax.fori_loop(0, total, step, (zeros, zeros))
          if with_ds or fused:  # the last dS^T / dQ stores read their staging
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if fused:  # both are done with the dQ buffers (dK / dV's memory)
            mosaic.meet(ds_bar)
          if parts > 1:  # one f32 buffer: dK, then dV once it was read
            buf = dk_smem2.at[wg]
            for i, (val, dst) in enumerate(((dk, dk_ref), (dv, dv_ref))):
              if i:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              buf[...] = val
              plgpu.commit_smem()
              mosaic.ladder_store(buf, rows(dst), my_lo, count, bkv)
          else:
            dk_smem = dk_smem2.at[wg]
            dv_smem = dv_smem2.at[wg]
            dk_smem[...] = dk.astype(dtype)
            dv_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            for src, dst in ((dk_smem, dk_ref), (dv_smem, dv_ref)):
              mosaic.ladder_store(src, rows(dst), my_lo, count, bkv)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        # A warpgroup whose 64 key rows all lie past the sequence (short
        # keys: the common case of cross-attention) computes nothing, but
        # still consumes the ring so the barrier phases stay in step. (Its
        # `dS^T` tiles are never read: `dq_from_ds` visits only the
        # sequence's own 64-row key tiles.) Adding dQ, it still takes its
        # turns at dQ's columns, with a zero `dS^T` of its own.
        @pl.when(count == 0)
        def _():
          zero = plgpu.layout_cast(
            jnp.full((bkv, bq), 0, jnp.float32), plgpu.Layout.WGMMA
          ).astype(dtype)

          @pl.loop(0, total)
          def _(j):
            slot = lax.rem(j, mcs)
            plgpu.barrier_wait(q_bar.at[slot])
            plgpu.barrier_arrive(free.at[slot])
            if fused:
              add_dq(j, zero)

          if fused:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            mosaic.meet(ds_bar)

      @pl.when(wg == wgs)
      def _memory():
        plgpu.set_max_registers(
          mosaic.producer_registers(wgs), action="decrease"
        )

        def issue(j, slot):
          head, tile = coords(j)
          from_side = (tile == 0) | (tile == n_q - 1)
          for ref, side, dst in (
            (q_ref, qs_ref, q_smem),
            (do_ref, dos_ref, do_smem),
          ):

            @pl.when(from_side)
            def _(side=side, dst=dst):
              which = jnp.where(tile == 0, 0, 1)
              plgpu.copy_gmem_to_smem(
                side.at[seq, which, :, head], dst.at[slot], q_bar.at[slot]
              )

            @pl.when(jnp.logical_not(from_side))
            def _(ref=ref, dst=dst):
              rows = pl.ds(mosaic.aligned(q_row0 + tile * bq), bq)
              plgpu.copy_gmem_to_smem(
                ref.at[rows, head], dst.at[slot], q_bar.at[slot]
              )

        mosaic.produce_ring(total, mcs, free, issue)

  tile = mosaic.smem_tile
  staging = [
    plgpu.SMEM((wgs, bkv, h), out_dtype),
    # dV's buffer (f32 partials share dK's, one after the other).
    plgpu.SMEM((wgs, bkv, h) if parts == 1 else (8, h), dtype),
  ]
  if fused:  # dS^T (double-buffered) and dQ staging, until the end
    dq_bufs = [tile((2, wgs, bkv, bq), dtype), tile((wgs, bq, 64), dtype)]
    staging = [plgpu.RefUnion(staging, dq_bufs)]
  scratch = [
    tile((wgs, bkv, h), dtype),
    tile((wgs, bkv, h), dtype),
    *staging,
    tile((mcs, bq, h), dtype),
    tile((mcs, bq, h), dtype),
    plgpu.Barrier(num_arrivals=2, num_barriers=wgs),
    plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
    plgpu.Barrier(num_arrivals=wgs, num_barriers=mcs),
  ]
  kv_shape = (parts, s, kh, h) if parts > 1 else (s, kh, h)
  kv_type = jax.ShapeDtypeStruct(kv_shape, out_dtype)
  out_type = [kv_type, kv_type]
  args = [items, q, k, v, do, q_side, do_side]
  if with_ds:
    scratch.append(tile((wgs, bkv, bq), dtype))
    out_type.append(jax.ShapeDtypeStruct((n, *ds_tiles, bkv, bq), dtype))
  if fused:
    scratch.append(plgpu.Barrier(num_arrivals=wgs))
    args.append(dq)
  outs = mosaic.warp_specialized(
    kernel,
    out_type=out_type,
    scratch=scratch,
    grid=(kh, num_items),
    consumers=wgs,
    interpret=interp,
    items="items",
    name="dkv",
    family="gdpa",
  )(*args)
  dk, dv = outs[:2]
  if parts > 1:  # the parts simply add
    dk, dv = (x.sum(axis=0).astype(dtype) for x in (dk, dv))
  return (dk, dv, outs[2]) if with_ds else (dk, dv)
