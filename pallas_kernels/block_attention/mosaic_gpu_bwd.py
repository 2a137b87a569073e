"""Block attention, backward kernel (Hopper, Mosaic GPU).

`backward`: two consumer warpgroups per CTA share each tile and split the
work of every query head by role, so each keeps one gradient in registers
for the whole tile:
  warpgroup 0 relayouts K (RoPE), computes P (`Q K^T`, softmax), writes
    it to shared memory, then `dV += P^T dO` and `dQ = dS K`, and stores
    dQ (RoPE backward in its epilogue) and, at the tile's end, dV;
  warpgroup 1 relayouts V and, every head, Q (RoPE) and dO, computes P
    again and `dO V^T` (both wgmmas in flight, `_scores_and_dp`),
    `delta` and dS, writes dS, then `dK += dS^T Q`, and stores dK (RoPE
    backward) at the tile's end.
Warpgroup 1 does both of a head's relayouts because after the second
barrier warpgroup 0 has four wgmmas and dQ's epilogue against its two:
with one relayout each, warpgroup 1 waited at the next head's first
barrier. Two barriers between the two per head: Q and dO in place, P
and dS in place. The tiled Q and dO alternate between two buffers by
head, so warpgroup 1 relayouts the next head while warpgroup 0 still
reads this one's; only after a tile's last head do both wait until
every wgmma is done (a third barrier), before dK's staging (aliasing P
and dS) and the next tile's K and V are written. Each computes `Q K^T`
(two small wgmmas) rather than pass P or dS in f32 through shared
memory. The RoPE table's high terms alone (`_cos_sin`) rotate and
un-rotate, which frees half the table's shared memory (16 KiB) toward
the second Q and dO buffers (32 KiB): 208 KiB in all at head dim 128
with RoPE.
This split is 5-6% faster than the Q relayout on warpgroup 0 and about
20% faster than one Q and dO buffer with a barrier after every head's
products; ptxas reports no spills (the two-term cos and sin had spilled
as four f32 planes beside the gradients). 240 / 24 registers, an uneven
split between warpgroups 0 and 1, and both K and V relayouts on
warpgroup 0 measured no better (docs/kernels/block_attention.md).

The technique and the shapes' legend are in `mosaic_gpu.py`.
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic
from pallas_kernels.block_attention.mosaic_gpu import (
  BWD_QD_STAGES,
  LOG2E,
  PART,
  TILE,
  _all_parts,
  _cos_sin,
  _cs_planes,
  _deal,
  _grad_k,
  _grads_vq,
  _launch,
  _load_kv,
  _load_tile,
  _probs,
  _relayout,
  _scores,
  _scores_and_dp,
  _Static,
  _store_tile,
  _unrope,
  _zeros,
)


def backward(q, k, v, do, cs, items, num_real, static: _Static):
  """(dQ `[t, n, h]`, dK `[t, k, h]`, dV `[t, k, h]`)."""
  t, n, h = q.shape
  _, kh, _ = k.shape
  dtype = q.dtype
  group = n // kh
  rope = static.rope
  rot_dtype = jnp.float32 if static.block_sizes.rope_f32 else dtype
  # The table's high terms, whatever the dtype (see `BlockSizes.rope_f32`).
  cs_planes = _cs_planes(f32=False)
  parts, hp = h // PART, PART
  c = static.scale * LOG2E
  scale = static.scale
  workers, dealt, counts = _deal(items, num_real, kh, static)

  def kernel(items_ref, deal_ref, count_ref, q_ref, k_ref, v_ref, do_ref,
             *rest):  # fmt: skip
    if rope:
      cs_ref, dq_ref, dk_ref, dv_ref, *scratch = rest
    else:
      dq_ref, dk_ref, dv_ref, *scratch = rest
      cs_ref = None
    (k_raw, v_raw, k_t, v_t, q_raw, do_raw, q_tt, do_tt) = scratch[:8]
    (stage_k, stage_vq, csm) = scratch[8:11]
    (kv_bar, cs_bar, raw_free, qd_bar, qd_free, sync) = scratch[11:]
    # P and dS share dK's staging buffer: dK is staged after the tile's
    # last head (its P and dS read), and the next P is written after
    # warpgroup 1 saw that store read it (before the first barrier).
    staging_k, (p_s, ds_s) = tuple(stage_k[:2]), stage_k[2]
    staging_vq = (stage_vq[0], stage_vq[1])
    w = lax.axis_index("workers")
    kv_head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    n_steps = count_ref[w]

    def item(j):
      it = deal_ref[w, j]
      return [items_ref[it, f] for f in range(3)]

    def stage_out(xs, staging, dst_ref, row, head, count):
      """f32 parts -> packed rows (see `_store_tile`)."""
      xs = [x.astype(dtype) for x in xs]
      _store_tile(xs, staging, dst_ref, row, head, count)

    def rotation():
      return _cos_sin(csm, rot_dtype) if rope else None

    def run(wg_i):
      def body(j, _):
        row, valid, tail = item(j)
        keep = (1 - tail).astype(jnp.float32)
        plgpu.barrier_wait(kv_bar)
        if wg_i == 0:
          _relayout(k_raw, k_t, rot=rotation(), keep_rows=valid)
        else:
          _relayout(v_raw, v_t, keep_rows=valid)
        mosaic.release(raw_free)
        acc = tuple(_zeros((TILE, hp)) for _ in range(parts))  # dV or dK

        def head_step(g, acc):
          slot = lax.rem(j * group + g, BWD_QD_STAGES)
          buf = lax.rem(j * group + g, 2)
          q_t, do_t = q_tt.at[buf], do_tt.at[buf]
          if wg_i == 1:  # both of the head's relayouts (see above)
            plgpu.barrier_wait(qd_bar.at[slot])
            _relayout(q_raw.at[slot], q_t, rot=rotation())
            _relayout(do_raw.at[slot], do_t, keep_rows=valid)
            # dK's staging (P and dS) read by its store.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            mosaic.release(qd_free.at[slot])
          mosaic.meet(sync.at[0])  # Q, dO (and K, V) tiled; P and dS free
          probs = lambda x: _probs(x * c, valid, static)  # noqa: E731
          if wg_i == 0:
            p_s[...] = probs(_scores(_all_parts(q_t), k_t, static)).astype(
              dtype
            )
          else:
            p, dp = _scores_and_dp(q_t, k_t, do_t, v_t, probs, static)
            delta = (p * dp).sum(axis=1)
            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
            ds_s[...] = ds.astype(dtype)
          plgpu.commit_smem()
          mosaic.meet(sync.at[1])  # P and dS in place
          if wg_i == 0:
            acc, dq = _grads_vq(acc, p_s, ds_s, do_t, k_t, static)
          else:
            acc = _grad_k(acc, ds_s, q_t, static)

          @pl.when(g == group - 1)
          def _():
            # P, dS, K and V read: dK's staging (P and dS) and the next
            # tile's relayouts may write them.
            mosaic.meet(sync.at[2])

          if wg_i == 0:
            if rope:
              dq = _unrope(*dq, _cos_sin(csm))
            out = [a * (scale * keep) for a in dq]
            stage_out(out, staging_vq, dq_ref, row, kv_head * group + g, valid)
          return acc

        acc = lax.fori_loop(0, group, head_step, acc)
        # Epilogue: one store of dV (warpgroup 0) or of dK (warpgroup 1,
        # after its RoPE backward).
        if wg_i == 0:
          stage_out(
            [a * keep for a in acc], staging_vq, dv_ref, row, kv_head, valid
          )
        else:
          if rope:
            acc = _unrope(*acc, _cos_sin(csm))
          stage_out(
            [a * (scale * keep) for a in acc],
            staging_k,
            dk_ref,
            row,
            kv_head,
            valid,
          )
        return 0

      if rope:  # the RoPE table, once for every tile
        plgpu.barrier_wait(cs_bar)
      lax.fori_loop(0, n_steps, jax.named_call(body, name="item"), 0)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg < 2)
    def _consumers():
      plgpu.set_max_registers(mosaic.consumer_registers(2), action="increase")
      for wg_i in range(2):
        pl.when(wg == wg_i)(lambda wg_i=wg_i: run(wg_i))

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(mosaic.producer_registers(2), action="decrease")
      kv_buffers = (k_raw, v_raw, kv_bar, raw_free)

      def load_qd(rows, cnt, g):
        slot = lax.rem(cnt, BWD_QD_STAGES)

        @pl.when(cnt >= BWD_QD_STAGES)
        def _():
          plgpu.barrier_wait(qd_free.at[slot])

        head = kv_head * group + g
        _load_tile(q_ref, rows, head, q_raw.at[slot], qd_bar.at[slot])
        _load_tile(do_ref, rows, head, do_raw.at[slot], qd_bar.at[slot])

      def body(j, _):
        rows = pl.ds(item(j)[0], TILE)
        _load_kv(j, rows, kv_head, (k_ref, v_ref), kv_buffers)

        @pl.loop(0, group)
        def _(g):
          load_qd(rows, j * group + g, g)

        return 0

      if rope:  # the RoPE table, once for every tile
        plgpu.copy_gmem_to_smem(cs_ref, csm, cs_bar)
      lax.fori_loop(0, n_steps, body, 0)

      @pl.when(n_steps > 0)
      def _():
        plgpu.barrier_wait(raw_free)

      mosaic.observe_releases(n_steps * group, BWD_QD_STAGES, qd_free)

  swizzled, tiled, plain = mosaic.smem_swizzled, mosaic.smem_tile, plgpu.SMEM
  tile = (parts * TILE, hp)
  ring = (BWD_QD_STAGES, *tile)
  staging = lambda: (swizzled(tile, dtype), plain(tile, dtype))  # noqa: E731
  scratch = [
    swizzled(tile, dtype),
    swizzled(tile, dtype),
    tiled(tile, dtype),
    tiled(tile, dtype),
    swizzled(ring, dtype),
    swizzled(ring, dtype),
    tiled((2, *tile), dtype),  # Q tiled, by head parity
    tiled((2, *tile), dtype),  # dO tiled, by head parity
    plgpu.RefUnion(
      *staging(),
      (tiled((TILE, TILE), dtype), tiled((TILE, TILE), dtype)),
    ),
    plgpu.RefUnion(*staging()),
    swizzled((cs_planes, TILE, h // 2), jnp.float16) if rope else None,
    plgpu.Barrier(num_arrivals=2 * parts),  # K and V, one TMA per part
    plgpu.Barrier() if rope else None,  # the RoPE table
    plgpu.Barrier(num_arrivals=2),  # K and V raw released by both
    # Q and dO, per ring slot
    plgpu.Barrier(num_arrivals=2 * parts, num_barriers=BWD_QD_STAGES),
    plgpu.Barrier(num_arrivals=1, num_barriers=BWD_QD_STAGES),
    plgpu.Barrier(num_arrivals=2, num_barriers=3),  # between the consumers
  ]
  args = [items, dealt, counts, q, k, v, do] + (
    [cs[:cs_planes]] if rope else []
  )
  kv_type = jax.ShapeDtypeStruct((t, kh, h), dtype)
  return _launch(
    kernel,
    scratch,
    [jax.ShapeDtypeStruct((t, n, h), dtype), kv_type, kv_type],
    (kh, workers),
    2,
    static,
    args,
    "block_bwd",
  )
