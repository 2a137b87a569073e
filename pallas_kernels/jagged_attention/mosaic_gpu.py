"""Jagged flash attention for Hopper in Pallas Mosaic GPU (G1, O7, O10).

Shapes (legend): `t` packed query rows, `s` packed key/value rows, `b`
sequences, `n` query heads, `k` KV heads (`g = n // k` query heads share one),
`h` head dim, `i` work items. Sequence `j` owns query rows
`q_offsets[j]:q_offsets[j+1]` and key rows `kv_offsets[j]:kv_offsets[j+1]`.

Math (per query row `p` of sequence `j`, per head, `c = scale * log2(e)`):

    s_x = c * q_p . k_x          over the keys x the row sees
    m   = max_x s_x,   l = sum_x 2^(s_x - m),   o_p = sum_x 2^(s_x - m) v_x / l

computed online over key tiles (flash attention), with `lse = m + log2 l`
saved for the backward, which recomputes `P = 2^(s - lse)` tile by tile and
never materializes the `[L, L]` score matrix:

    dP = dO V^T,  delta = rowsum(dO * O),  dS = P * (dP - delta)
    dQ = scale dS K,   dK = scale dS^T Q,   dV = P^T dO

Work list (no padding is ever computed). A grid over `[b, max_len]` would
spend most CTAs on tiles past short sequences' ends. Instead
`pallas_kernels.schedule` lists, on device inside `jit`, only the non-empty
(sequence, 64-row tile) items, longest first (the hardware block scheduler
then runs the long tiles of a 2K sequence first on separate SMs: greedy LPT).
Every kernel but the small delta one runs about one persistent CTA per SM,
each walking its share of the items dealt zig-zag from that list (the
forward and dQ kernels: (query tile, pair of query heads); the dK/dV
kernel: (128-row key tile, KV head)), so the next item's tiles load while
the current one finishes and its stores drain while the next computes.

Boundaries by zero-fill, not masks (G1). On CUDA, Triton gives each
sequence its own TMA descriptor whose bounds are the sequence's ends, so the
copy engine fills rows outside it with zeros. Pallas cannot express that: a
TMA descriptor's bounds are the whole packed buffer's (fixed at launch), and
Mosaic's TMA into tiled (8, 64) shared memory needs the first row of a window
to be a multiple of 8 (proved with `pl.multiple_of`). So every sequence is
cut into tiles on the 8-aligned row grid: tile `f` of sequence `j` covers
packed rows `off_j - lead_j + f * blk ...` with `lead_j = off_j % 8`, and
only the first tile (up to 7 lead rows of the previous sequence) and the last
tile (rows past the end) hold rows of other sequences. For keys and values,
a tiny gather before the kernel copies those two tiles of every sequence into
a zero-filled side buffer `[b+1, 2, bkv, k, h]` (`schedule.side_tiles`, ~1%
of K/V bytes), and the producer warpgroup loads a sequence's first and last tile
from there, the others from the packed buffer. Every tile the consumers see
is then real rows and zeros, and no select/mask runs on any score for
sequence boundaries. A zero key row gives score `c * q . 0 = 0` exactly, so
the row sums pick up `z` surplus terms `2^(0 - m_t)`, each rescaled like
every other term to `2^(0 - m)` with the final row max `m`. A zero value row
adds nothing to `o`. So after the last tile

    l_true = l - z * 2^(-m)

is the exact denominator, where `z` (known from the lengths) is the number of
zero-filled keys the row saw: `steps * bkv - L_kv` (with causal masking, the
`lead` ones before the sequence plus those past its end at positions `<= p`).
The row max `m` may be the surplus 0 rather than the true max; the
stabilized form stays exact in exact arithmetic, and in f32 the subtraction
loses about `z * 2^-24 / sum_x 2^(s_x - m)` relatively, negligible unless
every true score of a row is far (> ~10 nats) below zero -- QK-norm keeps
scores bounded. The tests `test_surplus_subtraction_*` check this against
the reference, with large positive scores (max far above the zero terms) and
with moderate negative ones (the zeros are the max).

Query rows outside a sequence (lead rows, rows past the end) are computed
(they are other sequences' rows, finite) and never written back: the output
tile leaves through a plain shared-memory buffer with a ladder of TMA stores
of 64, 32, ..., 1 rows chosen by the bits of the valid row count (the
technique of JAX's ragged_dot), starting at the first valid row. The saved
`lse` of such rows is `+inf` (tile-padded layout `[n, i * 64]`), so in the
backward their `P = 2^(s - lse)` is exactly 0 and they add nothing to dK/dV
without a mask. In dQ, the zero-filled key rows give `P != 0` but `dP = 0`
and `dS K = 0`.
Only causal diagonal tiles build a (position) mask, and, with a sliding
window (`window=w`: row `p` sees keys `|p - j| <= w`), every visited tile:
a query tile visits only the key tiles holding a key within `w` positions
of one of its valid rows (`schedule.window_tile_range`; the dK/dV work list
likewise lists only the query tiles in reach), keys outside the sequence are
masked too (no zero-fill surplus to subtract), and since a row may see no
key of a visited tile, the running max is kept from `-inf - -inf`.
Rows of the buffer tail past `offsets[-1]` and rows of sequences without
keys get zeros (forward, dQ) and sequences without queries get zero
dK/dV: the schedule lists those tiles as zero-work items. The packed
inputs' tail rows must be finite.

Hopper specifics: TMA loads into 128-byte-swizzled shared memory, wgmma with
f32 accumulators, and warp specialization: one producer warpgroup (40
registers) streams K/V (or Q/dO/lse/delta in the dK/dV kernel) through a
2-stage ring guarded by mbarriers, while two consumer warpgroups compute.
In the forward and dQ kernels the two consumers take two query heads of one
KV-head group on the same rows (they share every K/V tile and stop together),
ping-ponging softmax against the tensor core as in FlashAttention-3; the
head-dim-128 forward instead overlaps each consumer's softmax with its own
next wgmmas (FlashAttention-3's intra-warpgroup overlap,
`BlockSizes.fwd_overlap`). In the dK/dV kernel each consumer owns 64 key
rows and accumulates dK/dV over all `g` query heads of its KV head before
one store: the GQA reduction happens inside the kernel (O7). With an odd
group the forward/dQ CTAs take one head.

The backward at head dim 64 (`BlockSizes.fused_bwd`) is a small delta
kernel (`delta = rowsum(O * dO)`, tile-padded like `lse`) and one fused
kernel: the dK/dV kernel also forms `dS K` for each (query tile, key tile)
pair, scales it and adds it in the inputs' dtype into the zero-filled dQ
with TMA reduce-add, 5 matmul passes per tile pair (FlashAttention-3 adds
into f32 and ends with a scale-and-cast pass, `BlockSizes.dq_f32`; see
`default` for what each costs and `backward_dkv_dq` for the error). At
head dim 128 (measured faster there), two
kernels (dQ, which also forms delta; dK/dV) each recompute `S` and `P`: 7
passes. In every backward step two wgmmas are in flight per wait
(`BlockSizes.bwd_pipeline`): `S` and `dP` issued together with the exp
between, then `dV` and `dK` together with dS's store (and the fused dQ)
behind them. Measured numbers: BENCHMARKS.md (`benchmarks/jagged_attention.py`,
whose --breakdown times the kernels alone).

The exponentials (the special function unit's `exp2`, one per score) take
3.7-7.7% of the time (measured by replacing each with a multiply-add), so
no trick on them (a polynomial on the FMA units for part of them, as
FlashAttention-4 does on Blackwell) could give more; Mosaic GPU does not
lower `floor`, which the usual polynomial needs. The runs behind this and
every tuning choice below: docs/kernels/jagged_attention.md.

Interpret mode (CPU CI) runs the same kernels, except that "accumulate into a
live wgmma accumulator" (`pl.run_state`, and wgmma with a register operand,
which the GPU interpreter does not handle) becomes `acc + jnp.dot(a, b)`.
"""

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.schedule import KeyItem, QueryItem

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes; defaults tuned on the H200 (`default` says how)."""

  block_q: int = 64  # query rows per consumer warpgroup (all kernels)
  block_kv: int = 128  # key rows per step, forward
  block_kv_dq: int = 64  # key rows per step, dQ kernel (when = block_kv
  # the backward reuses the forward's work list and side tiles)
  block_kv_dkv: int = 64  # key rows per consumer warpgroup, dK/dV kernel
  max_concurrent_steps: int = 2  # ring depth of the producer
  persistent: bool = True  # forward: persistent CTAs (see `forward`)
  fwd_overlap: bool = False  # forward: tile i's Q K^T and tile i-1's P V
  # in flight together, the softmax under them (FlashAttention-3)
  fused_bwd: bool = True  # dQ inside the dK/dV kernel (`backward_dkv`)
  dq_swizzle: bool = True  # fused, dq_f32: f32 dQ staging tiled + swizzled
  # (plain memory: the wgmma-layout store hits one bank octet per 8 rows)
  dq_f32: bool = False  # fused: dQ accumulated in f32, then scaled and cast
  # by a pass over it; False: in the input dtype, each tile scaled before
  # its add, so the buffer is dQ (no cast pass, half the fill and the
  # reduce-add bytes, one rounding per key tile; `backward_dkv_dq`)
  bwd_pipeline: bool = True  # backward: two wgmmas in flight per wait
  # (`_two_matmuls`, `mosaic.accumulate_many`)
  bwd_registers: int = mosaic.CONSUMER_REGISTERS  # backward consumers'
  # registers (the producer gets `mosaic.REGISTER_BUDGET` - 2x this: 40, or
  # 24 with FA3's 240)
  fold_heads: bool = True  # non-causal short query sides: heads into rows
  num_sms: int | None = None  # persistent CTAs = about this many (None:
  # the GPU's SMs, `mosaic.num_sms`)
  q_deal_swaps: int = 0  # persistent forward and dQ kernels: rounds of
  # `schedule.pair_swaps` after the zig-zag deal of the query items (evens
  # out the CTAs' loads by item cost; `default` says where it pays)
  kv_deal_swaps: int = 0  # the same for the key items (the dK/dV kernel,
  # fused or not)

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name.startswith("block_") and v % 64:
        raise ValueError(f"{f.name}={v} must be a multiple of 64")
    if self.block_kv % self.block_kv_dq:
      raise ValueError("block_kv_dq must divide block_kv (dQ reuses its list)")
    if self.max_concurrent_steps < 1:
      raise ValueError("max_concurrent_steps must be >= 1")
    for name in ("q_deal_swaps", "kv_deal_swaps"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
    lo, hi = mosaic.CONSUMER_REGISTERS, mosaic.ONE_CONSUMER_REGISTERS
    if self.bwd_registers % 8 or not lo <= self.bwd_registers <= hi:
      raise ValueError("bwd_registers must be 232 or 240")

  @staticmethod
  def default(head_dim: int) -> "BlockSizes":
    """Tuned on the H200 (the runs: docs/kernels/jagged_attention.md).

    - `fwd_overlap` at D128 only: 1.5-2.8% faster forward+backward there;
      7% slower at D64, where the softmax is the larger share and the two
      consumers' ping-pong already hides it.
    - `fused_bwd` at D64 only: 5% faster than the two kernels there, 7-9%
      slower at D128, which keeps the dQ kernel with 64-key steps (a
      128-key ring does not fit beside its buffers, 233.6 KB > 227 KB).
    - `bwd_pipeline`: 8% (D64) / 4% (D128) faster than the serial step.
    - `bwd_registers=232`: 240 (producer on 24) measured no better.
    - `q_deal_swaps` / `kv_deal_swaps` = 2 at D128: about 2% faster on
      log-normal lengths; at D64 the evener deal did not show in the
      timing, so it keeps the plain deal.
    - `dq_f32=False`: the fused dQ added in the inputs' dtype is 5-7%
      faster at D64 (half the reduce-add bytes, no cast pass), with dQ's
      error 0.0046-0.0056 against 0.0024 in f32 (cuDNN's: 0.0024).

    Tried and dropped (slower): the consumers also taking turns on their
    wgmmas, dK/dV steps over two query heads at once, dS from P rounded to
    bf16, and part of the exponentials on a polynomial."""
    if head_dim <= 64:
      return BlockSizes(block_kv_dq=128)
    return BlockSizes(
      fused_bwd=False, fwd_overlap=True, q_deal_swaps=2, kv_deal_swaps=2
    )


@dataclasses.dataclass(frozen=True)
class _Static:
  causal: bool
  scale: float
  block_sizes: BlockSizes
  interpret: object  # None (compile) or plgpu.InterpretGPUParams
  window: int | None = None  # sliding window (positions each side)


# --------------------------------------------------------------------------
# Forward.


def _heads_per_cta(n, kh):
  group = n // kh
  return 2 if group % 2 == 0 else 1


def _load_query_item(items_ref, it, window):
  """The 12 `QueryItem` fields of item `it`; the first key tile (`FIRST`)
  is read only under a sliding window (else None: the loop starts at
  tile 0)."""
  fields = [items_ref[it, f] for f in range(QueryItem.FIRST)]
  first = items_ref[it, QueryItem.FIRST] if window is not None else None
  return fields + [first]


def _visible(q_at, k_at, causal: bool, window: int | None):
  """Which (query, key) position pairs the causal mask and the sliding
  window keep."""
  ok = q_at >= k_at if causal else None
  if window is not None:
    d = q_at - k_at
    near = (d <= window) & (d >= -window)
    ok = near if ok is None else ok & near
  return ok


def _key_loop(step, carry, kv_steps, causal, first_row, bkv, window=None,
              start=0):  # fmt: skip
  """`step(i, carry, masked=...)` over a query tile's key tiles
  `[start, kv_steps)`. Causal: key tiles wholly at key-grid positions `<=
  first_row` (the tile's first valid query row) need no mask, the rest
  (the diagonal) do; with a window all are masked; otherwise none is."""
  if window is not None:
    return lax.fori_loop(
      start, kv_steps, functools.partial(step, masked=True), carry
    )
  if not causal:
    return lax.fori_loop(
      start, kv_steps, functools.partial(step, masked=False), carry
    )
  n_full = jnp.clip(lax.div(first_row + 1, bkv), start, kv_steps)
  carry = lax.fori_loop(
    start, n_full, functools.partial(step, masked=False), carry
  )
  return lax.fori_loop(
    n_full, kv_steps, functools.partial(step, masked=True), carry
  )


def _two_matmuls(a1, b1, a2, b2, shape, mid, interpret):
  """`(mid(a1 @ b1), a2 @ b2)` with both wgmmas issued back to back and
  `mid` (the softmax's exp) running while the second is in flight: one
  drain for two matmuls. Interpret mode: plain sequential matmuls."""
  if interpret is not None:
    x = mid(mosaic.matmul(a1, b1, shape))
    return x, mosaic.matmul(a2, b2, shape)

  def scoped(acc1, acc2):
    plgpu.wgmma(acc1, a1, b1)
    plgpu.wgmma(acc2, a2, b2)
    x = mid(plgpu.wgmma_accumulator_load(acc1, wait_n=1))
    return x, plgpu.wgmma_accumulator_load(acc2, wait_n=0)

  return pl.run_scoped(
    scoped, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32)
  )


def _kv_producer(
  n_items, item, refs, sides, smem, bars, free, *, bkv, mcs, kv_head, split=1
):
  """Producer warpgroup of the persistent forward and dQ kernels: stream
  the key/value tiles of this worker's `n_items` items into the ring, then
  observe the consumers' last releases. `item(j)` -> (the `query_items`
  fields of item `j`, whether it has rows, its key steps, the key tiles
  of its sequence's grid, its first key step or None for 0).
  The ring runs on across items (global step `g` = steps of the earlier
  items + `i`), so the next item's first tiles load while the consumers
  finish the current one; slot `g % mcs` is reused once its consumers
  release it (steps `g >= mcs`). `split`: as in `load_kv_tile`."""
  k_free, v_free = free

  def body(j, base):
    fields, _, kv_steps, kv_grid, first = item(j)
    kv_item = (
      fields[QueryItem.KV_ROW],
      kv_steps,
      kv_grid,
      fields[QueryItem.SEQ],
    )

    @pl.loop(0, kv_steps)
    def _(i):
      g = base + i
      slot = lax.rem(g, mcs)
      tile = i if first is None else first + i
      for ref, side, dst, bar, rel in zip(
        refs, sides, smem, bars, free, strict=True
      ):

        @pl.when(g >= mcs)
        def _(rel=rel):
          plgpu.barrier_wait(rel.at[slot])

        schedule.load_kv_tile(
          ref,
          side,
          dst.at[slot],
          bar.at[slot],
          tile,
          kv_item,
          bkv,
          kv_head,
          split,
        )

    return base + kv_steps

  total = lax.fori_loop(0, n_items, body, jnp.int32(0))
  mosaic.observe_releases(total, mcs, k_free, v_free)


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
  hpc = _heads_per_cta(n, kh)
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
      fields = _load_query_item(items_ref, it, window)
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
              ok = _visible(q_at, k_at, causal, window)
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
            carry = _key_loop(
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
            acc, m_i, l_i = _key_loop(
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
      _kv_producer(
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
# Backward: dQ (per query tile, streaming keys).


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
  hpc = _heads_per_cta(n, kh)
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
      fields = _load_query_item(items_ref, it, window if split == 1 else None)
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
                p = mosaic.select(_visible(q_at, k_at, causal, window), p, 0.0)
              return p

            plgpu.barrier_wait(k_bar.at[slot])
            k_t = k_smem.at[slot].transpose((1, 0))
            v_t = v_smem.at[slot].transpose((1, 0))
            if bs.bwd_pipeline:  # dP's wgmma runs during the exp
              plgpu.barrier_wait(v_bar.at[slot])
              p, dp = _two_matmuls(
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

          dq = _key_loop(
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
      _kv_producer(
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


# --------------------------------------------------------------------------
# Backward: dK, dV (per key tile, streaming query tiles of every head).


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
              ok = _visible(q_at, k_at, causal, static.window)
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
            pt, dpt = _two_matmuls(
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
