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

Files: this one holds the settings (`BlockSizes`) and the pieces the
kernels share; the forward kernel is `mosaic_gpu_fwd.py`, the dQ kernel
`mosaic_gpu_bwd_dq.py`, the dK/dV kernel (fused with dQ or not) and the
delta kernel `mosaic_gpu_bwd_dkv.py`; the work lists and side tiles are
`pallas_kernels.schedule`'s; `op.py` is the public op.

Interpret mode (CPU CI) runs the same kernels, except that "accumulate into a
live wgmma accumulator" (`pl.run_state`, and wgmma with a register operand,
which the GPU interpreter does not handle) becomes `acc + jnp.dot(a, b)`.
"""

import dataclasses
import functools
import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.schedule import QueryItem

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
  # (`two_matmuls`, `mosaic.accumulate_many`)
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
# Pieces the kernels share.


def heads_per_cta(n, kh):
  group = n // kh
  return 2 if group % 2 == 0 else 1


def load_query_item(items_ref, it, window):
  """The 12 `QueryItem` fields of item `it`; the first key tile (`FIRST`)
  is read only under a sliding window (else None: the loop starts at
  tile 0)."""
  fields = [items_ref[it, f] for f in range(QueryItem.FIRST)]
  first = items_ref[it, QueryItem.FIRST] if window is not None else None
  return fields + [first]


def visible(q_at, k_at, causal: bool, window: int | None):
  """Which (query, key) position pairs the causal mask and the sliding
  window keep."""
  ok = q_at >= k_at if causal else None
  if window is not None:
    d = q_at - k_at
    near = (d <= window) & (d >= -window)
    ok = near if ok is None else ok & near
  return ok


def key_loop(step, carry, kv_steps, causal, first_row, bkv, window=None,
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


def two_matmuls(a1, b1, a2, b2, shape, mid, interpret):
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


def kv_producer(
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
