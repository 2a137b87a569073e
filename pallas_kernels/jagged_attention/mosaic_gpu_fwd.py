"""Jagged flash attention, forward kernel (Hopper, Mosaic GPU).

`forward`: per (query tile, pair of query heads) the online softmax over
the key tiles, on `schedule.query_items`' work list; the technique and the
shapes' legend are in `mosaic_gpu.py`.
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.jagged_attention.mosaic_gpu import (
  LOG2E,
  _Static,
  heads_per_cta,
  key_loop,
  kv_producer,
  load_query_item,
  visible,
)
from pallas_kernels.schedule import QueryItem


def forward(q_tnh, k_skh, v_skh, k_side, v_side, items, static: _Static):
  """Returns (o `[t, n, h]`, lse `f32[n, i * block_q]` tile-padded, log2).

  Persistent (`BlockSizes.persistent`): `w` CTAs per head pair walk the
  longest-first item list dealt zig-zag (`schedule.deal`). Per item, the
  consumers issue the next item's Q load into their Q buffer right after the
  item's last Q K^T wgmma (it lands during the last P V and the epilogue),
  the producer keeps streaming K/V into the ring
  across item boundaries, and the output's TMA store drains while the next
  item computes (waited on only before its buffer is rewritten). Without
  it, one CTA per item (`w = i`, one item each).

  The key loop, per consumer: by default each step waits for its own
  `Q K^T`, runs the softmax and then `P V` (`step`), and a barrier makes
  the two consumers take turns, so one's softmax runs under the other's
  wgmmas. With `fwd_overlap` a consumer overlaps itself instead: tile 0's
  scores and softmax alone (`first_step`), then per step tile i's `Q K^T`
  and tile i-1's `P V` in flight together with tile i's softmax under
  the `P V` and the accumulator's rescale after it (`overlapped_step`),
  and the last tile's `P V` after the loop (`last_pv`). The two orders
  run the same arithmetic: their outputs were equal bit for bit on the
  H200 at D=64 and D=128.
  """
  t, n, h = q_tnh.shape
  _, kh, _ = k_skh.shape
  dtype = q_tnh.dtype
  group = n // kh
  hpc = heads_per_cta(n, kh)
  bs = static.block_sizes
  bq, bkv, mcs = bs.block_q, bs.block_kv, bs.max_concurrent_steps
  num_items = items.shape[0]
  causal, window = static.causal, static.window
  c = static.scale * LOG2E
  workers, dealt, counts = schedule.deal_items(
    items, n // hpc, bs.persistent, bs.num_sms, bs.q_deal_swaps
  )
  # The two consumers ping-pong (not with `fwd_overlap`, where each
  # overlaps its own softmax with its wgmmas); only then is there a
  # barrier for their turns.
  pingpong = hpc == 2 and not bs.fwd_overlap

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
    lse_ref,
    *scratch,
  ):
    (q_smem2, o_smem2, lse_smem2, k_smem, v_smem) = scratch[:5]
    (q_bar, k_bar, v_bar, k_free, v_free, *sched_bar) = scratch[5:]
    sched_bar = sched_bar[0] if pingpong else None
    w = lax.axis_index("workers")
    hp = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    kv_head = lax.div(hp * hpc, group)
    n_items = count_ref[w]

    def item(j):
      it = deal_ref[w, jnp.minimum(j, deal_ref.shape[1] - 1)]
      fields = load_query_item(items_ref, it, window)
      # Steps of this item: 0 when it has no valid rows (skipped); its
      # sequence's key tiles (the side tiles' first and last); its first.
      hi_lo = fields[QueryItem.HI] > fields[QueryItem.LO]
      steps = jnp.where(hi_lo, fields[QueryItem.STEPS], 0)
      kv_tiles, first = fields[QueryItem.KV_TILES], fields[QueryItem.FIRST]
      return fields, hi_lo, steps, kv_tiles, first

    def sched():
      if pingpong:
        mosaic.meet(sched_bar)

    @pl.when(wg < hpc)
    def _compute():
      plgpu.set_max_registers(mosaic.consumer_registers(hpc), action="increase")
      head = hp * hpc + wg

      q_smem = q_smem2.at[wg]

      def load_q(j):
        """Item j's Q tile into this warpgroup's buffer; issued once the
        previous item's last Q K^T wgmma has read it."""
        (q_row, *_), *_ = item(j)

        @pl.when(j < n_items)
        def _():
          plgpu.commit_smem()  # order the wgmma reads before the TMA write
          plgpu.copy_gmem_to_smem(
            q_ref.at[pl.ds(mosaic.aligned(q_row), bq), head],
            q_smem,
            q_bar.at[wg],
          )

      load_q(0)

      def body(j, base):
        fields, hi_lo, kv_steps, _, first = item(j)
        (q_row, lo, hi, q_pos, _, kv_len, kv_lead, *_, tile_id, _) = fields
        plgpu.barrier_wait(q_bar.at[wg])

        @pl.when(hi_lo)
        def _work():
          m_i = plgpu.layout_cast(
            jnp.full((bq,), -jnp.inf, jnp.float32),
            plgpu.Layout.WGMMA.reduce(1),
          )
          l_i = plgpu.layout_cast(
            jnp.full((bq,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
          )
          acc = plgpu.layout_cast(
            jnp.full((bq, h), 0, jnp.float32), plgpu.Layout.WGMMA
          )

          @pl.when(kv_steps > 0)
          def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(base, mcs)])

          if pingpong:
            pl.when(wg == 1)(sched)

          def softmax(qk, m_i, l_i, i, masked: bool):
            """Online softmax of key tile i's scores: (P in the input
            dtype, new row max, new row sum, the old terms' rescale)."""
            if masked:
              kt = i if first is None else first + i
              q_at = mosaic.iota((bq, bkv), 0) + q_pos
              k_at = mosaic.iota((bq, bkv), 1) + (kt * bkv - kv_lead)
              ok = visible(q_at, k_at, causal, window)
              if window is not None:
                # Keys outside the sequence are masked too (no surplus
                # terms to subtract); a row may see no key of this tile.
                ok = ok & (k_at >= 0) & (k_at < kv_len)
              qk = mosaic.select(ok, qk, -jnp.inf)
            m_ij = jnp.maximum(m_i, qk.max(axis=1) * c)
            m_use = m_ij
            if window is not None:  # exp2(-inf - -inf) would be NaN
              m_use = mosaic.select(m_ij == -jnp.inf, 0.0, m_ij)
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_use, qk.shape, [0]))
            l_i = l_i * alpha
            p16 = p.astype(dtype)
            l_i = l_i + p.sum(axis=1)
            return p16, m_ij, l_i, alpha

          def rescale(acc, alpha):
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

          def step(i, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(base + i, mcs)

            def qk_body(acc_ref):
              plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
              sched()
              return acc_ref[...]

            qk = pl.run_scoped(qk_body, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            # Last read of this item's Q: prefetch the next item's.
            pl.when(i == kv_steps - 1)(lambda: load_q(j + 1))
            p16, m_ij, l_i, alpha = softmax(qk, m_i, l_i, i, masked)
            acc = rescale(acc, alpha)
            acc, l_i, m_ij, p16 = lax.optimization_barrier(
              (acc, l_i, m_ij, p16)
            )
            if pingpong:
              plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(v_bar.at[slot])
            if pingpong:
              plgpu.barrier_wait(sched_bar)

            def wait_next_k():
              @pl.when(i + 1 < kv_steps)
              def _():
                plgpu.barrier_wait(k_bar.at[lax.rem(base + i + 1, mcs)])

            acc = mosaic.accumulate(
              acc, p16, v_smem.at[slot], static.interpret, wait_next_k
            )
            # The ring now runs across items, so this slot's next write can
            # follow this read closely: fence, then release.
            mosaic.release(v_free.at[slot])
            return acc, m_ij, l_i

          def first_step(i, carry):
            """Pipelined: tile 0's scores and softmax, no P V yet."""
            acc, m_i, l_i, _ = carry
            slot = lax.rem(base, mcs)
            qk = mosaic.matmul(
              q_smem, k_smem.at[slot].transpose((1, 0)), (bq, bkv)
            )
            plgpu.barrier_arrive(k_free.at[slot])
            pl.when(kv_steps == 1)(lambda: load_q(j + 1))
            p16, m_ij, l_i, _ = softmax(
              qk, m_i, l_i, i, causal or window is not None
            )
            return acc, m_ij, l_i, p16

          def overlapped_step(i, carry, masked: bool):
            """Pipelined step i >= 1 (FlashAttention-3's intra-warpgroup
            overlap): tile i's Q K^T and tile i-1's P V issued together,
            tile i's softmax while the P V runs, then the rescale."""
            acc, m_i, l_i, p_prev = carry
            slot = lax.rem(base + i, mcs)
            prev = lax.rem(base + i - 1, mcs)
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[prev])
            k_t = k_smem.at[slot].transpose((1, 0))
            if static.interpret is not None:
              qk = mosaic.matmul(q_smem, k_t, (bq, bkv))
              acc = mosaic.accumulate(
                acc, p_prev, v_smem.at[prev], static.interpret
              )
              p16, m_ij, l_i, alpha = softmax(qk, m_i, l_i, i, masked)
            else:

              def body(refs):
                o_ref, s_ref, p_ref, m_ref, l_ref, a_ref = refs
                plgpu.wgmma(s_ref, q_smem, k_t)
                plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
                qk = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                outs = softmax(qk, m_i, l_i, i, masked)
                for ref, val in zip((p_ref, m_ref, l_ref, a_ref), outs):
                  ref[...] = val

              zeros = plgpu.layout_cast(
                jnp.full((bq, bkv), 0, jnp.float32), plgpu.Layout.WGMMA
              )
              acc, _, p16, m_ij, l_i, alpha = pl.run_state(body)(
                (plgpu.ACC.init(acc), plgpu.ACC.init(zeros), p_prev, m_i,
                 l_i, m_i)
              )  # fmt: skip
            plgpu.barrier_arrive(k_free.at[slot])
            pl.when(i == kv_steps - 1)(lambda: load_q(j + 1))
            mosaic.release(v_free.at[prev])
            return rescale(acc, alpha), m_ij, l_i, p16

          def last_pv(i, carry):
            """Pipelined: the last tile's P V."""
            acc, m_i, l_i, p16 = carry
            last = lax.rem(base + kv_steps - 1, mcs)
            plgpu.barrier_wait(v_bar.at[last])
            acc = mosaic.accumulate(acc, p16, v_smem.at[last], static.interpret)
            mosaic.release(v_free.at[last])
            return acc, m_i, l_i, p16

          if bs.fwd_overlap:
            once = jnp.minimum(kv_steps, 1)
            p0 = plgpu.layout_cast(
              jnp.full((bq, bkv), 0, dtype), plgpu.Layout.WGMMA
            )
            carry = lax.fori_loop(0, once, first_step, (acc, m_i, l_i, p0))
            carry = key_loop(
              overlapped_step,
              carry,
              kv_steps,
              causal,
              q_pos + lo + kv_lead,
              bkv,
              window,
              start=1,
            )
            acc, m_i, l_i, _ = lax.fori_loop(0, once, last_pv, carry)
          else:
            acc, m_i, l_i = key_loop(
              step,
              (acc, m_i, l_i),
              kv_steps,
              causal,
              q_pos + lo + kv_lead,
              bkv,
              window,
            )
          if pingpong:
            pl.when(wg == 0)(sched)

          # Zero-filled keys the rows saw (module docstring): positions
          # [-lead, 0) and [kv_len, seen_end).
          seen_end = kv_steps * bkv - kv_lead
          rows = mosaic.row_iota(bq)
          if window is not None:  # zero-filled keys were masked
            z = rows * 0
          elif causal:
            after = jnp.clip(
              jnp.minimum(q_pos + rows + 1, seen_end) - kv_len, 0
            )
            z = kv_lead + after
          else:
            z = seen_end + kv_lead - kv_len + rows * 0
          z = z * (kv_steps > 0).astype(jnp.int32)
          surplus = mosaic.select(
            z > 0, z.astype(jnp.float32) * jnp.exp2(-m_i), 0.0
          )
          l_i = l_i - surplus
          ok = l_i > 0
          l_safe = mosaic.select(ok, l_i, 1.0)
          inv = mosaic.select(ok, 1.0 / l_safe, 0.0)
          out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
          in_seq = (rows >= lo) & (rows < hi)
          lse = mosaic.select(ok & in_seq, m_i + jnp.log2(l_safe), jnp.inf)
          o_smem = o_smem2.at[wg]
          lse_smem = lse_smem2.at[wg]
          # The previous item's stores must have read these buffers.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          o_smem[...] = out.astype(dtype)
          lse_smem[...] = lse
          plgpu.commit_smem()
          mosaic.ladder_store(
            o_smem,
            lambda r, size: o_ref.at[pl.ds(q_row + r, size), head],
            lo,
            hi - lo,
            bq,
          )
          plgpu.copy_smem_to_gmem(
            lse_smem, lse_ref.at[head, pl.ds(tile_id * bq, bq)]
          )

        pl.when(kv_steps == 0)(lambda: load_q(j + 1))  # no key loop
        return base + kv_steps

      lax.fori_loop(0, n_items, jax.named_call(body, name="item"), jnp.int32(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == hpc)
    def _memory():
      plgpu.set_max_registers(mosaic.producer_registers(hpc), action="decrease")
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
      )

  scratch = [
    mosaic.smem_tile((hpc, bq, h), dtype),
    plgpu.SMEM((hpc, bq, h), dtype),
    plgpu.SMEM((hpc, bq), jnp.float32),
    mosaic.smem_tile((mcs, bkv, h), dtype),
    mosaic.smem_tile((mcs, bkv, h), dtype),
    plgpu.Barrier(num_barriers=hpc),
    plgpu.Barrier(num_barriers=mcs),
    plgpu.Barrier(num_barriers=mcs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=mcs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=mcs),
    *([plgpu.Barrier(num_arrivals=hpc)] if pingpong else []),
  ]
  out_type = [
    jax.ShapeDtypeStruct((t, n, h), dtype),
    jax.ShapeDtypeStruct((n, num_items * bq), jnp.float32),
  ]
  return mosaic.warp_specialized(
    kernel,
    out_type=out_type,
    scratch=scratch,
    grid=(n // hpc, workers),
    consumers=hpc,
    interpret=static.interpret,
    name="forward",
    family="jagged_attention",
  )(items, dealt, counts, q_tnh, k_skh, v_skh, k_side, v_side)
