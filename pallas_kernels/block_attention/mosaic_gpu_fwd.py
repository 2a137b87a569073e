"""Block attention, forward kernel (Hopper, Mosaic GPU).

`forward`: persistent CTAs over the 64-row tiles of `work_items`, two
consumer warpgroups each taking query heads of the tile's KV head. The
technique and the shapes' legend are in `mosaic_gpu.py`.
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic
from pallas_kernels.block_attention.mosaic_gpu import (
  LOG2E,
  PART,
  TILE,
  _cos_sin,
  _cs_planes,
  _deal,
  _fwd_smem,
  _heads_of,
  _launch,
  _load_kv,
  _load_parts,
  _load_tile,
  _probs,
  _pv,
  _relayout,
  _scores,
  _Static,
  _store_tile,
)


def forward(q, k, v, cs, items, num_real, static: _Static):
  """O `[t, n, h]` (rows past the data zero)."""
  t, n, h = q.shape
  _, kh, _ = k.shape
  dtype = q.dtype
  group = n // kh
  nwg = 2 if group >= 2 else 1
  rope = static.rope
  f32_rot = static.block_sizes.rope_f32
  stages = static.block_sizes.q_stages
  while (
    stages > 1 and _fwd_smem(h, nwg, stages, rope, f32_rot) > mosaic.SMEM_LIMIT
  ):
    stages -= 1
  cs_planes = _cs_planes(f32_rot)
  rot_dtype = jnp.float32 if f32_rot else dtype
  parts, hp = h // PART, PART
  c = static.scale * LOG2E
  workers, dealt, counts = _deal(items, num_real, kh, static)
  heads_of = [_heads_of(wg, group, nwg) for wg in range(nwg)]
  jobs = [len(heads) for heads in heads_of]

  def kernel(items_ref, deal_ref, count_ref, q_ref, k_ref, v_ref, *rest):
    if rope:
      cs_ref, o_ref, *scratch = rest
    else:
      o_ref, *scratch = rest
      cs_ref = None
    (k_raw, v_raw, k_t, v_t, q_raw, o_slots, csm) = scratch[:7]
    (kv_bar, cs_bar, raw_free, q_bar, q_free, sync) = scratch[7:]
    o_sw, o_pl = o_slots  # aliased views of the same buffers
    w = lax.axis_index("workers")
    kv_head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    n_steps = count_ref[w]

    def item(j):
      it = deal_ref[w, j]
      return [items_ref[it, f] for f in range(3)]

    def q_slot(wg_i, j, jj):
      """Ring slot (and its barrier index) of warpgroup `wg_i`'s `jj`-th
      query head of tile `j`; `cnt` counts that warpgroup's queries."""
      cnt = j * jobs[wg_i] + jj
      slot = lax.rem(cnt, stages)
      return cnt, slot, wg_i * stages + slot

    @pl.when(wg < nwg)
    def _consumer():
      plgpu.set_max_registers(mosaic.consumer_registers(nwg), action="increase")

      def sync_wgs(i):
        if nwg == 2:
          mosaic.meet(sync.at[i])

      def run(wg_i):
        heads = heads_of[wg_i]
        rot = None
        if rope:  # the same for every tile: in registers for the kernel
          plgpu.barrier_wait(cs_bar)
          rot = _cos_sin(csm, rot_dtype)

        def body(j, _):
          row, valid, tail = item(j)
          keep = (1 - tail).astype(jnp.float32)

          def query(jj):
            """Query head `jj` straight into registers (wgmma's A
            operand): its slot is free for the next load before any math
            on it."""
            _, slot, qb = q_slot(wg_i, j, jj)
            plgpu.barrier_wait(q_bar.at[qb])
            qs = _load_parts(q_raw.at[wg_i, slot], rot)
            mosaic.release(q_free.at[qb])
            return [x.astype(dtype) for x in qs]

          # The first query before the K / V relayout: its rotation fills
          # what the unequal shares (K rotated, V not) would leave idle.
          qs = query(0)
          plgpu.barrier_wait(kv_bar)
          # K (with RoPE) by warpgroup 0, V by the last one.
          if wg_i == 0:
            _relayout(k_raw, k_t, rot=rot, keep_rows=valid)
          if wg_i == nwg - 1:
            _relayout(v_raw, v_t, keep_rows=valid)
          mosaic.release(raw_free)
          sync_wgs(0)  # both tiled K and V are in place
          for jj, g in enumerate(heads):
            # The next query is rotated after the previous head's store:
            # rotated while P V ran, it held O's accumulators, the table
            # and the raw query at once and spilled (384 bytes), 119.0 /
            # 87.4 us a set against 112.4 / 82.1 (all-2,048 / log-normal).
            if jj:
              qs = query(jj)
            x = _scores(qs, k_t, static)
            p = _probs(x * c, valid, static).astype(dtype)
            os = _pv(p, v_t, static)
            _store_tile(
              [(o * keep).astype(dtype) for o in os],
              (o_sw.at[wg_i], o_pl.at[wg_i]),
              o_ref,
              row,
              kv_head * group + g,
              valid,
            )
          sync_wgs(1)  # both done with the tiled K and V
          return 0

        lax.fori_loop(0, n_steps, jax.named_call(body, name="item"), 0)
        plgpu.wait_smem_to_gmem(0)

      for wg_i in range(nwg):
        pl.when(wg == wg_i)(lambda wg_i=wg_i: run(wg_i))

    @pl.when(wg == nwg)
    def _producer():
      plgpu.set_max_registers(mosaic.producer_registers(nwg), action="decrease")
      kv_buffers = (k_raw, v_raw, kv_bar, raw_free)

      def load_q(j, rows, wg_i, jj):
        cnt, slot, qb = q_slot(wg_i, j, jj)

        @pl.when(cnt >= stages)
        def _():
          plgpu.barrier_wait(q_free.at[qb])

        head = kv_head * group + heads_of[wg_i][jj]
        _load_tile(q_ref, rows, head, q_raw.at[wg_i, slot], q_bar.at[qb])

      def body(j, _):
        row = item(j)[0]
        rows = pl.ds(row, TILE)
        _load_kv(j, rows, kv_head, (k_ref, v_ref), kv_buffers)
        # Each warpgroup's first query, then the rest.
        for wg_i in range(nwg):
          load_q(j, rows, wg_i, 0)
        for wg_i in range(nwg):
          for jj in range(1, jobs[wg_i]):
            load_q(j, rows, wg_i, jj)
        return 0

      if rope:  # the RoPE table, once for every tile
        plgpu.copy_gmem_to_smem(cs_ref, csm, cs_bar)
      lax.fori_loop(0, n_steps, body, 0)

      # Observe the last releases (every barrier phase consumed).
      @pl.when(n_steps > 0)
      def _():
        plgpu.barrier_wait(raw_free)

      for wg_i in range(nwg):
        total = n_steps * jobs[wg_i]

        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(cnt, wg_i=wg_i):
          plgpu.barrier_wait(q_free.at[wg_i * stages + lax.rem(cnt, stages)])

  swizzled, tiled, plain = mosaic.smem_swizzled, mosaic.smem_tile, plgpu.SMEM
  tile = (parts * TILE, hp)
  scratch = [
    swizzled(tile, dtype),
    swizzled(tile, dtype),
    tiled(tile, dtype),
    tiled(tile, dtype),
    swizzled((nwg, stages, *tile), dtype),
    plgpu.RefUnion(swizzled((nwg, *tile), dtype), plain((nwg, *tile), dtype)),
    swizzled((cs_planes, TILE, h // 2), jnp.float16) if rope else None,
    plgpu.Barrier(num_arrivals=2 * parts),  # K and V, one TMA per part
    plgpu.Barrier() if rope else None,  # the RoPE table
    plgpu.Barrier(num_arrivals=nwg),
    plgpu.Barrier(num_arrivals=parts, num_barriers=nwg * stages),
    plgpu.Barrier(num_barriers=nwg * stages),
    plgpu.Barrier(num_arrivals=nwg, num_barriers=2),
  ]
  args = [items, dealt, counts, q, k, v] + ([cs[:cs_planes]] if rope else [])
  return _launch(
    kernel,
    scratch,
    jax.ShapeDtypeStruct((t, n, h), dtype),
    (kh, workers),
    nwg,
    static,
    args,
    "block_fwd",
  )
