"""Jagged flash attention, dQ kernel of the two-kernel backward (Hopper).

`backward_dq`: per query tile, recompute `S` and `P` over the key tiles and
accumulate `dQ = scale dS K`, also forming `delta = rowsum(O * dO)` for the
dK/dV kernel (`mosaic_gpu_bwd_dkv.py`); the technique and the shapes'
legend are in `mosaic_gpu.py`.
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.jagged_attention.mosaic_gpu import (
  LOG2E,
  heads_per_cta,
  key_loop,
  kv_producer,
  load_query_item,
  two_matmuls,
  visible,
)
from pallas_kernels.schedule import QueryItem


def backward_dq(
  q_tnh, k_skh, v_skh, k_side, v_side, o_tnh, do_tnh, lse, items, static
):
  """(dQ `[t, n, h]`, delta `f32[n, i * 64]`) on the forward's work list
  and side tiles (`block_kv` keys); steps of `block_kv_dq` keys (64 at head
  dim 128, where a 128-key ring does not fit beside the O/dQ buffers): the
  step count is recomputed from the key length, and a 64-key tile comes
  from half of a 128-row side tile. No second work list or side-tile
  gather is built for the backward.

  `delta = rowsum(O * dO)` is formed here from the O and dO tiles before
  the key loop and written out, tile-padded like `lse`, for the dK/dV
  kernel: no separate pass over O and dO. Its rows outside the sequence
  hold other rows' sums (finite); every consumer multiplies them by
  `P = 0`.

  Persistent, like the forward: about one CTA per SM over the head pairs walk
  the dealt item list (`schedule.deal_items`); the producer's K/V ring runs on
  across items, the consumers load the next item's Q, dO, O and lse right
  after the item's last `S`/`dP` wgmmas (O and lse were consumed at the
  item's start), and the dQ and delta stores drain while the next item
  computes. O has its own buffer (not dQ's staging), so the next O lands
  during the last step and the epilogue: 5% faster than one CTA per item
  at D128.
  """
  t, n, h = q_tnh.shape
  _, kh, _ = k_skh.shape
  dtype = q_tnh.dtype
  group = n // kh
  hpc = heads_per_cta(n, kh)
  bs = static.block_sizes
  bq, bkv, mcs = bs.block_q, bs.block_kv_dq, bs.max_concurrent_steps
  split = bs.block_kv // bkv  # dQ steps per forward key tile
  if k_side.shape[2] != bs.block_kv:
    raise ValueError("dQ kernel: side tiles must be the forward's")
  num_items = items.shape[0]
  causal, window = static.causal, static.window
  c = static.scale * LOG2E
  workers, dealt, counts = schedule.deal_items(
    items, n // hpc, True, bs.num_sms, bs.q_deal_swaps
  )

  def kernel(
    items_ref,
    deal_ref,
    count_ref,
    q_ref,
    k_ref,
    v_ref,
    ks_ref,
    vs_ref,
    o_ref,
    do_ref,
    lse_ref,
    dq_ref,
    delta_ref,
    *scratch,
  ):
    (q_smem2, do_smem2, o_smem2, lse_smem2, delta_smem2) = scratch[:5]
    (k_smem, v_smem, out_smem2) = scratch[5:8]
    (in_bar, k_bar, v_bar, k_free, v_free) = scratch[8:]
    w = lax.axis_index("workers")
    hp = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    kv_head = lax.div(hp * hpc, group)
    n_items = count_ref[w]

    def item(j):
      """Fields of the CTA's j-th item, its key steps (0 without valid
      rows) and the forward's key tiles of its sequence."""
      it = deal_ref[w, jnp.minimum(j, deal_ref.shape[1] - 1)]
      # 64-key steps under a window: the range is their own (below).
      fields = load_query_item(items_ref, it, window if split == 1 else None)
      (_, lo, hi, q_pos, _, kv_len, kv_lead, kv_steps, kv_total) = fields[:9]
      hi_lo = hi > lo
      first = fields[QueryItem.FIRST]
      if window is not None and split > 1:  # the window's bkv-key steps
        first, kv_steps = schedule.window_tile_range(
          q_pos, lo, hi, kv_len, kv_lead, bkv, window,
          "before" if causal else None,
        )  # fmt: skip
      elif split > 1:  # steps of bkv keys (as `query_items` counts them)
        kv_steps = jnp.where(
          kv_len > 0, lax.div(kv_len + kv_lead + bkv - 1, bkv), 0
        )
        if causal:
          last = jnp.maximum(q_pos + hi - 1 + kv_lead, 0)
          kv_steps = jnp.minimum(kv_steps, lax.div(last, bkv) + 1)
      return fields, hi_lo, jnp.where(hi_lo, kv_steps, 0), kv_total, first

    @pl.when(wg < hpc)
    def _compute():
      regs = mosaic.consumer_registers(hpc, bs.bwd_registers)
      plgpu.set_max_registers(regs, action="increase")
      head = hp * hpc + wg
      q_smem = q_smem2.at[wg]
      do_smem = do_smem2.at[wg]
      o_smem = o_smem2.at[wg]
      out_smem = out_smem2.at[wg]
      lse_smem = lse_smem2.at[wg]
      delta_smem = delta_smem2.at[wg]
      bar = in_bar.at[wg]

      def load_in(j):
        """Item j's Q, dO, O and lse tiles; issued once the previous item
        has read its own (last S / dP wgmma)."""
        (q_row, *_, tile_id, _), *_ = item(j)

        @pl.when(j < n_items)
        def _():
          plgpu.commit_smem()  # order earlier reads before the TMA writes
          rows = pl.ds(mosaic.aligned(q_row), bq)
          pad = pl.ds(tile_id * bq, bq)
          plgpu.copy_gmem_to_smem(q_ref.at[rows, head], q_smem, bar)
          plgpu.copy_gmem_to_smem(do_ref.at[rows, head], do_smem, bar)
          plgpu.copy_gmem_to_smem(o_ref.at[rows, head], o_smem, bar)
          plgpu.copy_gmem_to_smem(lse_ref.at[head, pad], lse_smem, bar)

      load_in(0)

      def body(j, base):
        fields, hi_lo, kv_steps, _, first = item(j)
        (q_row, lo, hi, q_pos, _, _, kv_lead, *_, tile_id, _) = fields
        plgpu.barrier_wait(bar)

        @pl.when(hi_lo)
        def _work():
          pad = pl.ds(tile_id * bq, bq)
          lse = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
          wgmma = plgpu.Layout.WGMMA
          o_tile = plgpu.load(o_smem, layout=wgmma).astype(jnp.float32)
          do_tile = plgpu.load(do_smem, layout=wgmma).astype(jnp.float32)
          delta = (o_tile * do_tile).sum(axis=1)
          # The previous item's stores must have read delta's and dQ's
          # buffers.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          delta_smem[...] = delta
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(delta_smem, delta_ref.at[head, pad])
          dq = plgpu.layout_cast(
            jnp.full((bq, h), 0, jnp.float32), plgpu.Layout.WGMMA
          )

          def step(i, dq, masked: bool):
            slot = lax.rem(base + i, mcs)

            def probs(s):
              p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, s.shape, [0]))
              if masked:
                kt = i if first is None else first + i
                q_at = mosaic.iota((bq, bkv), 0) + q_pos
                k_at = mosaic.iota((bq, bkv), 1) + (kt * bkv - kv_lead)
                p = mosaic.select(visible(q_at, k_at, causal, window), p, 0.0)
              return p

            plgpu.barrier_wait(k_bar.at[slot])
            k_t = k_smem.at[slot].transpose((1, 0))
            v_t = v_smem.at[slot].transpose((1, 0))
            if bs.bwd_pipeline:  # dP's wgmma runs during the exp
              plgpu.barrier_wait(v_bar.at[slot])
              p, dp = two_matmuls(
                q_smem, k_t, do_smem, v_t, (bq, bkv), probs, static.interpret
              )
            else:
              p = probs(mosaic.matmul(q_smem, k_t, (bq, bkv)))
              plgpu.barrier_wait(v_bar.at[slot])
              dp = mosaic.matmul(do_smem, v_t, (bq, bkv))
            mosaic.release(v_free.at[slot])
            # Last read of this item's Q and dO: fetch the next item's.
            pl.when(i == kv_steps - 1)(lambda: load_in(j + 1))
            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
            dq = mosaic.accumulate(
              dq, ds.astype(dtype), k_smem.at[slot], static.interpret
            )
            mosaic.release(k_free.at[slot])
            return dq

          dq = key_loop(
            step, dq, kv_steps, causal, q_pos + lo + kv_lead, bkv, window
          )
          # dQ leaves through a plain (unswizzled) buffer that the ladder
          # store can slice at any row.
          out_smem[...] = (dq * static.scale).astype(dtype)
          plgpu.commit_smem()
          mosaic.ladder_store(
            out_smem,
            lambda r, size: dq_ref.at[pl.ds(q_row + r, size), head],
            lo,
            hi - lo,
            bq,
          )

        pl.when(kv_steps == 0)(lambda: load_in(j + 1))  # no key loop
        return base + kv_steps

      lax.fori_loop(0, n_items, jax.named_call(body, name="item"), jnp.int32(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == hpc)
    def _memory():
      regs = mosaic.producer_registers(hpc, bs.bwd_registers)
      plgpu.set_max_registers(regs, action="decrease")
      kv_producer(
        n_items,
        item,
        (k_ref, v_ref),
        (ks_ref, vs_ref),
        (k_smem, v_smem),
        (k_bar, v_bar),
        (k_free, v_free),
        bkv=bkv,
        mcs=mcs,
        kv_head=kv_head,
        split=split,
      )

  scratch = [
    mosaic.smem_tile((hpc, bq, h), dtype),
    mosaic.smem_tile((hpc, bq, h), dtype),
    mosaic.smem_tile((hpc, bq, h), dtype),
    plgpu.SMEM((hpc, bq), jnp.float32),
    plgpu.SMEM((hpc, bq), jnp.float32),
    mosaic.smem_tile((mcs, bkv, h), dtype),
    mosaic.smem_tile((mcs, bkv, h), dtype),
    plgpu.SMEM((hpc, bq, h), dtype),
    plgpu.Barrier(num_arrivals=4, num_barriers=hpc),
    plgpu.Barrier(num_barriers=mcs),
    plgpu.Barrier(num_barriers=mcs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=mcs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=mcs),
  ]
  return mosaic.warp_specialized(
    kernel,
    out_type=[
      jax.ShapeDtypeStruct((t, n, h), dtype),
      jax.ShapeDtypeStruct((n, num_items * bq), jnp.float32),
    ],
    scratch=scratch,
    grid=(n // hpc, workers),
    consumers=hpc,
    interpret=static.interpret,
    name="dq",
    family="jagged_attention",
  )(
    items, dealt, counts, q_tnh, k_skh, v_skh, k_side, v_side, o_tnh,
    do_tnh, lse,
  )  # fmt: skip
