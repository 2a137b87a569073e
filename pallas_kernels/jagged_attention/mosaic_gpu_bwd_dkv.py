"""Jagged flash attention, dK/dV kernel (Hopper, Mosaic GPU).

`backward_dkv`: per key tile, stream the query tiles of every query head of
its KV head and accumulate dK and dV (the GQA reduction in the kernel);
fused (`backward_dkv_dq`) it also adds `dQ = dS K` into a zero-filled
buffer by TMA reduce-add, after `backward_delta` formed `delta`. The
technique and the shapes' legend are in `mosaic_gpu.py`.
"""

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.jagged_attention.mosaic_gpu import (
  LOG2E,
  two_matmuls,
  visible,
)
from pallas_kernels.schedule import KeyItem, QueryItem


def backward_delta(o_tnh, do_tnh, items, static):
  """`delta = rowsum(O * dO)` in `lse`'s tile-padded layout `f32[n, i * bq]`
  for the fused backward (the unfused one forms it in its dQ kernel): one
  small CTA per (query head, query item) loads the O and dO tiles by TMA
  and writes the row sums. Rows of a tile outside its sequence get other
  rows' sums (finite): every consumer multiplies them by `P = 0`.
  """
  t, n, h = o_tnh.shape
  dtype = o_tnh.dtype
  bq = static.block_sizes.block_q
  num_items = items.shape[0]

  def kernel(items_ref, o_ref, do_ref, delta_ref, o_smem, do_smem, d_smem, bar):
    it = lax.axis_index("items")
    head = lax.axis_index("heads")
    q_row = items_ref[it, QueryItem.ROW]
    lo, hi = items_ref[it, QueryItem.LO], items_ref[it, QueryItem.HI]
    tile_id = items_ref[it, QueryItem.TILE_ID]

    @pl.when(hi > lo)
    def _():
      rows = pl.ds(mosaic.aligned(q_row), bq)
      plgpu.copy_gmem_to_smem(o_ref.at[rows, head], o_smem, bar)
      plgpu.copy_gmem_to_smem(do_ref.at[rows, head], do_smem, bar)
      plgpu.barrier_wait(bar)
      wgmma = plgpu.Layout.WGMMA
      o_tile = plgpu.load(o_smem, layout=wgmma).astype(jnp.float32)
      do_tile = plgpu.load(do_smem, layout=wgmma).astype(jnp.float32)
      d_smem[...] = (o_tile * do_tile).sum(axis=1)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
        d_smem, delta_ref.at[head, pl.ds(tile_id * bq, bq)]
      )
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((n, num_items * bq), jnp.float32),
    scratch_types=[
      mosaic.smem_tile((bq, h), dtype),
      mosaic.smem_tile((bq, h), dtype),
      plgpu.SMEM((bq,), jnp.float32),
      plgpu.Barrier(num_arrivals=2),
    ],
    grid=(n, num_items),
    grid_names=("heads", "items"),
    compiler_params=plgpu.CompilerParams(approx_math=True),
    interpret=static.interpret,
    kernel_name="jagged_attention_delta",
  )(items, o_tnh, do_tnh)


# --------------------------------------------------------------------------
# dK, dV (per key tile, streaming query tiles of every head).


DKV_WARPGROUPS = 2  # consumers of the dK/dV kernel, block_kv_dkv keys each


def dq_buffer(q_tnh, num_items, static):
  """The zero-filled buffer the fused backward reduce-adds dQ into:

  - `BlockSizes.dq_f32`: f32 `[t + block_q, n, h]` (one spare tile of rows,
    since a query tile's window may run past `t`), unscaled; a pass after
    the kernel scales it, casts it and drops the spare rows.
  - otherwise: the inputs' dtype, `[t, n, h]`: each added tile is scaled
    first, so the buffer is dQ (TMA drops the rows of a tile past `t`;
    they would add zeros: those rows' `P` is 0). dQ then takes one bf16
    (fp16) rounding per key tile of its sequence instead of one in all:
    about `sqrt(tiles) x` the error of a single rounding (0.0017 relative
    for one, 0.0037 for 9, 0.0048 for 16 tiles, simulated in numpy). The
    adds land in arrival order in either form, so dQ's last bits may
    differ between runs; in this one more often.

  In interpret mode (the GPU interpreter has no TMA reduction, and its
  stores cannot drop rows) one slice per item and consumer warpgroup, in
  the accumulation dtype, with the spare rows; `backward_dkv_dq` sums them.
  """
  t, n, h = q_tnh.shape
  bs = static.block_sizes
  spare = bs.dq_f32 or static.interpret is not None
  shape = (t + bs.block_q if spare else t, n, h)
  if static.interpret is not None:
    shape = (num_items, DKV_WARPGROUPS, *shape)
  return jnp.zeros(shape, jnp.float32 if bs.dq_f32 else q_tnh.dtype)


def backward_dkv_dq(q_tnh, k_skh, v_skh, do_tnh, lse, delta, items, static,
                    k_side):  # fmt: skip
  """The fused backward (`backward_dkv` with `dq`): (dQ `[t, n, h]` in the
  inputs' dtype, dK, dV), through `dq_buffer`."""
  dq = jax.new_ref(dq_buffer(q_tnh, items.shape[0], static))
  dk, dv = backward_dkv(
    q_tnh, k_skh, v_skh, do_tnh, lse, delta, items, static, k_side, dq
  )
  dq = dq[...]
  if static.interpret is not None:
    dq = dq.astype(jnp.float32).sum(axis=(0, 1))
  if static.block_sizes.dq_f32:
    dq = dq * static.scale
  return dq[: q_tnh.shape[0]].astype(q_tnh.dtype), dk, dv


def backward_dkv(
  q_tnh, k_skh, v_skh, do_tnh, lse, delta, items, static, k_side=None, dq=None
):
  """(dK, dV) `[s, k, h]`, reduced over each KV head's query-head group.

  Fused (`dq`, a ref of `dq_buffer`'s zeros, which says its forms): the
  kernel also forms `dQ = dS K` (in f32: unscaled) and adds it
  into `dq` with TMA reduce-add, so
  no dQ kernel recomputes `S` and `dP` (5 matmul passes per tile pair
  instead of 7). Each step, both consumers write their `dS^T` (64 keys x 64
  queries, bf16) into a double-buffered shared tile and meet at a barrier;
  then each computes 64 of dQ's columns over all 128 keys
  (`dS^T[w]^T K[w]` for both halves `w`; with head dim 64 the one column
  block goes to the warpgroups in turn) and reduce-adds it from its own f32
  staging buffer. The double buffer lets a warpgroup write step `j+1`'s dS
  while the other may still read step `j`'s; step `j+2` waits for the
  barrier of `j+1`, which the other passes only after its step-`j` dQ.
  That barrier holds the two consumers in step (a producer stall or one
  warpgroup's softmax stops both). Dropping it, each consumer adding its
  own half's `dS^T[w]^T K[w]` over all columns (twice the reduce
  traffic), was 8-21% slower and was removed.
  Key rows outside the tile's sequence must be zero here (else `dS K`
  picks up other sequences' keys): a sequence's first and last key tile
  come from the forward's zero-filled side tiles `k_side` (same 128-row
  grid). Their `dS` is not zero (`P = 2^(-lse)`), but `dS 0 = 0`.

  Persistent (fused or not): about one CTA per SM over the KV heads walk the
  dealt key-tile list; the producer's Q/dO/lse/delta ring runs on across
  items (global step count, which also picks the dS buffer), each consumer
  loads the next item's K/V rows right after its key loop (fused: once
  both consumers are past it, since each one's dQ wgmmas read the other's
  K) and they land during the dK/dV stores: 1-4% faster than one CTA per
  item. A ready/free hand-off of dS instead of the lockstep barrier, and
  zeroing the f32 dQ buffer in the delta kernel, measured no better.
  """
  fused = dq is not None
  t, n, h = q_tnh.shape
  if fused and (k_side.shape[2] != 2 * static.block_sizes.block_kv_dkv):
    raise ValueError("fused backward: side tiles must match the key tile")
  s, kh, _ = k_skh.shape
  dtype = q_tnh.dtype
  group = n // kh
  bs = static.block_sizes
  bq, bkv, mcs = bs.block_q, bs.block_kv_dkv, bs.max_concurrent_steps
  wgs = DKV_WARPGROUPS
  causal = static.causal
  c = static.scale * LOG2E

  workers, dealt, counts = schedule.deal_items(
    items, kh, True, bs.num_sms, bs.kv_deal_swaps, group
  )

  def kernel(
    items_ref,
    deal_ref,
    count_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
  ):
    if fused:
      ks_ref, dq_ref, dk_ref, dv_ref, *scratch = refs
      (ds_smem, dq_stage, ds_bar, item_bar) = scratch[13:]
    else:
      dk_ref, dv_ref, *scratch = refs
    (k_smem2, v_smem2, kv_stage) = scratch[:3]
    (q_smem, do_smem, lse_smem, delta_smem) = scratch[3:7]
    (kv_bar, q_bar, do_bar, lse_bar, delta_bar, free) = scratch[7:13]
    w = lax.axis_index("workers")
    kv_head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    n_items = count_ref[w]

    def item(j):
      """Fields of the CTA's j-th item and its steps (query tiles x heads;
      0 without valid rows)."""
      it = deal_ref[w, jnp.minimum(j, deal_ref.shape[1] - 1)]
      fields = [items_ref[it, f] for f in range(len(KeyItem))]
      lo, hi = fields[KeyItem.LO], fields[KeyItem.HI]
      q_steps = fields[KeyItem.STEPS]
      return it, fields, jnp.where(hi > lo, q_steps * group, 0)

    def coords(fields, j):
      """Step j of an item -> (query head, query tile)."""
      t_first, q_steps = fields[KeyItem.FIRST], fields[KeyItem.STEPS]
      per = jnp.maximum(q_steps, 1)
      return kv_head * group + lax.div(j, per), t_first + lax.rem(j, per)

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(
        mosaic.consumer_registers(wgs, bs.bwd_registers), action="increase"
      )
      k_smem = k_smem2.at[wg]
      v_smem = v_smem2.at[wg]
      bar = kv_bar.at[wg]

      def load_kv(j):
        """This warpgroup's key/value rows of item j; issued once the
        previous item's wgmmas have read the buffers."""
        _, fields, _ = item(j)
        kv_row, seq = fields[KeyItem.ROW], fields[KeyItem.SEQ]
        kv_tile, kv_total = fields[KeyItem.TILE], fields[KeyItem.TILES]
        base = mosaic.aligned(kv_row + wg * bkv)

        @pl.when(j < n_items)
        def _():
          plgpu.commit_smem()  # order earlier reads before the TMA writes
          if fused:  # zero rows outside the sequence (see docstring)
            edge = (kv_tile == 0) | (kv_tile == kv_total - 1)

            @pl.when(edge)
            def _():
              which = jnp.where(kv_tile == 0, 0, 1)
              plgpu.copy_gmem_to_smem(
                ks_ref.at[seq, which, pl.ds(wg * bkv, bkv), kv_head],
                k_smem,
                bar,
              )

            @pl.when(jnp.logical_not(edge))
            def _():
              plgpu.copy_gmem_to_smem(
                k_ref.at[pl.ds(base, bkv), kv_head], k_smem, bar
              )
          else:
            plgpu.copy_gmem_to_smem(
              k_ref.at[pl.ds(base, bkv), kv_head], k_smem, bar
            )
          plgpu.copy_gmem_to_smem(
            v_ref.at[pl.ds(base, bkv), kv_head], v_smem, bar
          )

      def reduce_add(it, dq_part, rows, head, cols):
        value = dq_part if bs.dq_f32 else (dq_part * static.scale).astype(dtype)
        if static.interpret is None:
          dst = dq_ref.at[rows, head, cols]
        else:
          # Each warpgroup of each item its own slice (one item's steps
          # touch disjoint (head, query tile) windows), summed outside.
          dst = dq_ref.at[it, wg, rows, head, cols]
        mosaic.staged_add(dq_stage.at[wg], value, dst, static.interpret)

      def add_dq(it, g, head, q_row, ds16):
        """dQ of this step's query tile from both halves' dS."""
        rows = pl.ds(mosaic.aligned(q_row), bq)
        mosaic.shared_ds_dq(
          ds16, ds_smem, k_smem2, ds_bar, g, wg,
          lambda part, cols: reduce_add(it, part, rows, head, cols),
        )  # fmt: skip

      load_kv(0)
      zeros = plgpu.layout_cast(
        jnp.full((bkv, h), 0, jnp.float32), plgpu.Layout.WGMMA
      )

      def body(j, base_step):
        it, fields, total = item(j)
        (kv_row, lo, hi, kv_pos, q_row0, q_lead, _, q_steps, n_masked,
         tile_id0) = fields[:10]  # fmt: skip
        plgpu.barrier_wait(bar)
        my_pos = kv_pos + wg * bkv  # position of this warpgroup's first key

        def step(jj, carry, masked: bool):
          dk, dv = carry
          g = base_step + jj  # global step: ring slot, dS buffer
          slot = lax.rem(g, mcs)
          head, tile = coords(fields, jj)
          q_t = q_smem.at[slot].transpose((1, 0))
          do_t = do_smem.at[slot].transpose((1, 0))

          def probs(st):
            plgpu.barrier_wait(lse_bar.at[slot])
            lse_r = plgpu.load(
              lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)
            )
            pt = jnp.exp2(st * c - lax.broadcast_in_dim(lse_r, st.shape, [1]))
            if masked:
              q_at = mosaic.iota((bkv, bq), 1) + (tile * bq - q_lead)
              k_at = mosaic.iota((bkv, bq), 0) + my_pos
              ok = visible(q_at, k_at, causal, static.window)
              pt = mosaic.select(ok, pt, 0.0)
            return pt

          def grad_s(pt, dpt):
            plgpu.barrier_wait(delta_bar.at[slot])
            delta_r = plgpu.load(
              delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)
            )
            dst = pt * (dpt - lax.broadcast_in_dim(delta_r, dpt.shape, [1]))
            return dst.astype(dtype)

          def dq_then(ds16):
            if not fused:
              return None
            return lambda: add_dq(it, g, head, q_row0 + tile * bq, ds16)

          plgpu.barrier_wait(q_bar.at[slot])
          if bs.bwd_pipeline:
            # S^T and dP^T issued together (the exp runs during dP^T), then
            # dV and dK together, with dS's store to shared memory and the
            # fused dQ queued behind them: two drains per step, not five.
            plgpu.barrier_wait(do_bar.at[slot])
            pt, dpt = two_matmuls(
              k_smem, q_t, v_smem, do_t, (bkv, bq), probs, static.interpret
            )
            ds16 = grad_s(pt, dpt)
            dv, dk = mosaic.accumulate_many(
              [(dv, pt.astype(dtype), do_smem.at[slot]),
               (dk, ds16, q_smem.at[slot])],
              static.interpret,
              dq_then(ds16),
            )  # fmt: skip
            mosaic.release(free.at[slot])
            return dk, dv
          pt = probs(mosaic.matmul(k_smem, q_t, (bkv, bq)))
          plgpu.barrier_wait(do_bar.at[slot])
          dv = mosaic.accumulate(
            dv, pt.astype(dtype), do_smem.at[slot], static.interpret
          )
          ds16 = grad_s(pt, mosaic.matmul(v_smem, do_t, (bkv, bq)))
          dk = mosaic.accumulate(dk, ds16, q_smem.at[slot], static.interpret)
          mosaic.release(free.at[slot])
          if fused:
            dq_then(ds16)()
          return dk, dv

        carry = (zeros, zeros)
        if causal or static.window is not None:

          def head_loop(gh, carry):
            j0 = gh * q_steps
            carry = lax.fori_loop(
              j0, j0 + n_masked, functools.partial(step, masked=True), carry
            )
            return lax.fori_loop(
              j0 + n_masked,
              j0 + q_steps,
              functools.partial(step, masked=False),
              carry,
            )

          carry = lax.fori_loop(
            0, jnp.where(total > 0, group, 0), head_loop, carry
          )
        else:
          carry = lax.fori_loop(
            0, total, functools.partial(step, masked=False), carry
          )
        dk, dv = carry
        if fused:
          # The other warpgroup's dQ wgmmas read this one's K: both finish
          # the item before either loads the next.
          mosaic.meet(item_bar)
        # K and V are read; the next item's land during the stores.
        load_kv(j + 1)
        # dK, then dV, through one staging buffer.
        stage = kv_stage.at[wg]
        base = mosaic.aligned(kv_row + wg * bkv)
        my_lo = jnp.clip(lo - wg * bkv, 0, bkv)
        my_hi = jnp.clip(hi - wg * bkv, 0, bkv)
        count = jnp.maximum(my_hi - my_lo, 0)
        for val, dst in ((dk * static.scale, dk_ref), (dv, dv_ref)):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          stage[...] = val.astype(dtype)
          plgpu.commit_smem()
          mosaic.ladder_store(
            stage,
            lambda r, size, dst=dst: dst.at[pl.ds(base + r, size), kv_head],
            my_lo,
            count,
            bkv,
          )
        return base_step + total

      lax.fori_loop(0, n_items, jax.named_call(body, name="item"), jnp.int32(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == wgs)
    def _memory():
      plgpu.set_max_registers(
        mosaic.producer_registers(wgs, bs.bwd_registers), action="decrease"
      )

      def body(j, base_step):
        _, fields, total = item(j)
        q_row0 = fields[KeyItem.Q_ROW]
        tile_id0 = fields[KeyItem.Q_TILE_START]

        def issue(jj, slot):
          head, tile = coords(fields, jj)
          rows = pl.ds(mosaic.aligned(q_row0 + tile * bq), bq)
          pad = pl.ds((tile_id0 + tile) * bq, bq)
          plgpu.copy_gmem_to_smem(
            q_ref.at[rows, head], q_smem.at[slot], q_bar.at[slot]
          )
          plgpu.copy_gmem_to_smem(
            lse_ref.at[head, pad], lse_smem.at[slot], lse_bar.at[slot]
          )
          plgpu.copy_gmem_to_smem(
            do_ref.at[rows, head], do_smem.at[slot], do_bar.at[slot]
          )
          plgpu.copy_gmem_to_smem(
            delta_ref.at[head, pad], delta_smem.at[slot], delta_bar.at[slot]
          )

        @pl.loop(0, total)
        def _(jj):
          g = base_step + jj
          slot = lax.rem(g, mcs)

          @pl.when(g >= mcs)
          def _():
            plgpu.barrier_wait(free.at[slot])

          issue(jj, slot)

        return base_step + total

      total = lax.fori_loop(0, n_items, body, jnp.int32(0))
      mosaic.observe_releases(total, mcs, free)

  scratch = [
    mosaic.smem_tile((wgs, bkv, h), dtype),
    mosaic.smem_tile((wgs, bkv, h), dtype),
    plgpu.SMEM((wgs, bkv, h), dtype),
    mosaic.smem_tile((mcs, bq, h), dtype),
    mosaic.smem_tile((mcs, bq, h), dtype),
    plgpu.SMEM((mcs, bq), jnp.float32),
    plgpu.SMEM((mcs, bq), jnp.float32),
    plgpu.Barrier(num_arrivals=2, num_barriers=wgs),
    plgpu.Barrier(num_barriers=mcs),
    plgpu.Barrier(num_barriers=mcs),
    plgpu.Barrier(num_barriers=mcs),
    plgpu.Barrier(num_barriers=mcs),
    plgpu.Barrier(num_arrivals=wgs, num_barriers=mcs),
  ]
  args = [items, dealt, counts, q_tnh, k_skh, v_skh, do_tnh, lse, delta]
  if fused:
    dq_stage = mosaic.smem_tile((wgs, bq, 64), dtype)
    if bs.dq_f32:
      swizzled = (plgpu.TilingTransform((8, 32)), mosaic.SWIZZLE)
      dq_stage = plgpu.SMEM(
        (wgs, bq, 64), jnp.float32, transforms=swizzled if bs.dq_swizzle else ()
      )
    scratch += [
      mosaic.smem_tile((2, wgs, bkv, bq), dtype),
      dq_stage,
      plgpu.Barrier(num_arrivals=wgs),
      plgpu.Barrier(num_arrivals=wgs),
    ]
    args += [k_side, dq]
  kv_type = jax.ShapeDtypeStruct((s, kh, h), dtype)
  return mosaic.warp_specialized(
    kernel,
    out_type=[kv_type, kv_type],
    scratch=scratch,
    grid=(kh, workers),
    consumers=wgs,
    interpret=static.interpret,
    name="dkv_dq" if fused else "dkv",
    family="jagged_attention",
  )(*args)
