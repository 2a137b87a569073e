"""GDPA's dQ from the dK/dV kernel's `dS^T` tiles (short keys; Hopper).

`dq_from_ds`: a light persistent pass, `dQ = sum dS^T[tile]^T K[tile]`,
one matmul per tile pair, on the query-side kernel's work table and launch
(`mosaic_gpu_fwd.py`). The technique and the shapes' legend are in
`mosaic_gpu.py`.
"""

import dataclasses

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.gdpa.mosaic_gpu import (
  DS_ROWS,
  kv_parts,
)
from pallas_kernels.gdpa.mosaic_gpu_fwd import (
  W_FIRST,
  W_HI,
  W_KVROW,
  W_LO,
  W_PART,
  W_QROW,
  W_SEQ,
  W_STEPS,
  W_TILE,
  W_TOTAL,
  _deal_query_table,
  _out_buffers,
  _out_smem,
  _run_query_side,
  _store_own_tile,
  _table_row,
)


def _ds_ring(bs, hpc: int, h: int, out_bytes: int) -> int:
  """Ring depth of `dq_from_ds`: `kv_stages + 2` slots of (K tile, `hpc`
  `dS^T` tiles), fewer (down to 2) where they would not fit beside the
  output buffers (`_out_smem`, as `query_layout` counts). Raises if even 2
  do not fit."""
  slot = (DS_ROWS * h + hpc * DS_ROWS * bs.block_q) * 2
  out = _out_smem(hpc, h, bs, out_bytes)
  for mcs in range(bs.kv_stages + 2, 1, -1):
    if mcs * slot + out <= mosaic.SMEM_PER_BLOCK:
      return mcs
  raise ValueError(
    f"dQ from dS^T: head dim {h} with {hpc} heads per CTA needs "
    f"{2 * slot + out} B of shared memory for a 2-slot ring, over "
    f"{mosaic.SMEM_PER_BLOCK}"
  )


def dq_from_ds(k, k_side, ds, items, num_real, static, t):
  """dQ `[t, n, h]` = sum over the sequence's 64-row key tiles of
  `dS^T[tile]^T K[tile]` (`ds` from `backward_dkv(..., ds_tiles)`, scale
  included), with no recomputation of `X`, `a'(X)` or `dP`.

  For short keys the dQ kernel's recomputation (`QK^T`, `dO V^T` and the
  activation's derivative per score) costs more than reading `dS` back:
  this pass is one matmul per tile pair and streams `dS^T` (64 x 64 per
  query tile, head and key tile) and K. Persistent CTAs as in the
  forward (same work table; `items`: `query_items` with 64-row key
  tiles), `hpc` consumer warpgroups (one query head each, sharing the K
  tile) and a producer filling a ring of (K, `dS^T` per head) slots, the
  deepest that fits shared memory up to `kv_stages + 2` (`_ds_ring`); keys
  are not kept resident (K tiles come from L2).
  `k_side`: `side_tiles(k, kv_offsets, 64)`, so key rows outside the
  sequence are zero and the (finite) `dS^T` rows there add nothing.
  """
  s, kh, h = k.shape
  n = ds.shape[0]
  dtype = k.dtype
  group = n // kh
  bs = static.block_sizes
  bq, bkv = bs.block_q, DS_ROWS
  parts = kv_parts(
    dataclasses.replace(bs, block_kv=bkv),
    items.shape[0],
    max(n // 2, 1),
    s,
    k_side.shape[0] - 1,
  )
  out_dtype = jnp.float32 if parts > 1 else dtype
  hpc = 2 if group % 2 == 0 else 1
  full = bs.full_store and out_dtype == dtype
  mcs = _ds_ring(bs, hpc, h, jnp.dtype(out_dtype).itemsize)
  workers, wt, counts = _deal_query_table(
    items, num_real, parts, n // hpc, bs, 0
  )

  def kernel(wt_ref, count_ref, k_ref, ks_ref, ds_ref, out_ref, *scratch):
    (k_smem, ds_smem, out_bufs, kv_bar, kv_free) = scratch[:5]
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
      cols = (W_QROW, W_LO, W_HI, W_STEPS) + (W_PART,) * (parts > 1)

      def body(j, carry):
        loads, cur = carry[0], dict(zip(cols, carry[1:], strict=True))
        nxt = fetch(j + 1, cols)
        q_row, lo, hi, steps = (cur[W_QROW], cur[W_LO], cur[W_HI], cur[W_STEPS])
        acc = plgpu.layout_cast(
          jnp.full((bq, h), 0, jnp.float32), plgpu.Layout.WGMMA
        )

        def step(i, acc):
          s = lax.rem(loads + i, mcs)
          plgpu.barrier_wait(kv_bar.at[s])
          acc = mosaic.accumulate(
            acc,
            ds_smem.at[s, wg].transpose((1, 0)),
            k_smem.at[s],
            static.interpret,
          )
          mosaic.release(kv_free.at[s])
          return acc

        acc = lax.fori_loop(0, steps, step, acc)
        part = cur[W_PART] if parts > 1 else None
        _store_own_tile(
          out_bufs, wg, acc, out_ref, head, q_row, lo, hi, part, bq, out_dtype
        )
        return (loads + steps, *nxt)

      lax.fori_loop(0, n_steps, body, (jnp.int32(0), *fetch(0, cols)))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == hpc)
    def _producer():
      plgpu.set_max_registers(mosaic.producer_registers(hpc), action="decrease")
      cols = (W_KVROW, W_STEPS, W_TOTAL, W_SEQ, W_FIRST, W_TILE)

      def body(j, carry):
        loads, cur = carry[0], dict(zip(cols, carry[1:], strict=True))
        nxt = fetch(j + 1, cols)

        def load(i, loads):
          s = lax.rem(loads, mcs)

          @pl.when(loads >= mcs)
          def _():
            plgpu.barrier_wait(kv_free.at[s])

          kt = cur[W_FIRST] + i
          item = (cur[W_KVROW], None, cur[W_TOTAL], cur[W_SEQ])
          schedule.load_kv_tile(
            k_ref, ks_ref, k_smem.at[s], kv_bar.at[s], kt, item, bkv, kv_head
          )
          for g in range(hpc):
            plgpu.copy_gmem_to_smem(
              ds_ref.at[hp * hpc + g, kt, cur[W_TILE]],
              ds_smem.at[s, g],
              kv_bar.at[s],
            )
          return loads + 1

        return (lax.fori_loop(0, cur[W_STEPS], load, loads), *nxt)

      carry = lax.fori_loop(0, n_steps, body, (jnp.int32(0), *fetch(0, cols)))
      mosaic.observe_releases(carry[0], mcs, kv_free)

  tile = mosaic.smem_tile
  scratch = [
    tile((mcs, bkv, h), dtype),
    tile((mcs, hpc, bkv, bq), dtype),
    _out_buffers(hpc, bq, h, out_dtype, full),
    plgpu.Barrier(num_arrivals=1 + hpc, num_barriers=mcs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=mcs),
  ]
  return _run_query_side(
    kernel,
    scratch,
    (wt, counts, k, k_side, ds),
    (t, n, h),
    dtype,
    parts,
    hpc,
    workers,
    static,
  )
