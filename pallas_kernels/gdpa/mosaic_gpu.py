"""GDPA for Hopper in Pallas Mosaic GPU (G2, O7, O10).

Shapes (legend): `t` packed query rows, `s` packed key/value rows, `b`
sequences, `n` query heads, `k` KV heads (`g = n // k`), `h` head dim, `i`
work items, `w` workers (persistent CTAs per head pair). Math (per head,
`x = scale * q . k`, `a = act`, optionally `/ N` with `N` keys):

    forward   O  = a(X) V
    backward  dV = a(X)^T dO,   dP = dO V^T,   dX = a'(X) * dP
              dQ = scale dX K,  dK = scale dX^T Q

No softmax means no running max, no rescaling of the accumulator and no
logsumexp to save: the backward recomputes `X` from Q and K.

Why a separate kernel (the seed's three techniques). Recommendation shapes
pair long query sides with short key sides (cross-attention: 2,048
candidate rows over 16-256 keys) or the reverse (pooled attention: 1-32
learned queries over a 2K history). With one or two key tiles per query
tile, a flash-attention kernel has no next key tile to prefetch, and its
CTAs (one per query tile) mostly wait on their own loads. So:

1. Pipeline over the outer loop. The forward and dQ kernels are
   persistent: each CTA (one pair of query heads, one "worker") walks a list
   of query tiles, and its producer warpgroup loads the next tiles' Q (and
   dO) while the consumers compute the current one, through a ring of
   `q_stages` tiles (up to `MAX_Q_STAGES` = 3 unless asked for more, as
   shared memory allows); a consumer hands a
   Q slot back right after the last matmul that reads it, not at the end
   of the tile. Short keys make these shapes memory-bound (Q in, O out), so
   what counts is how many tile loads are in flight. Keys and values go
   through a second ring of `kv_stages` tiles; when a sequence's keys fit
   in it (`kv_steps <= kv_stages`, the short-KV case) they are loaded once
   and stay resident for every following tile of the same sequence on that
   CTA. Each worker's items are gathered into one table row per item
   (`work_table`, XLA) and read one item ahead, so no dependent global
   loads sit at the head of a tile.
2. Skip empty tiles: the work list is `schedule.query_items` (built on
   device inside `jit`), which holds only tiles with rows, longest first.
3. Deal zig-zag across SMs: the sorted list is cut into chunks of
   `deal_chunk` consecutive tiles (consecutive tiles are usually one
   sequence, so resident keys get reused) and chunks are dealt with
   `schedule.deal`: worker `w` takes chunks `w, 2W-1-w, 2W+w,
   ...`, one long and one short per round, so per-SM work is balanced.

4. Narrow key tiles for short keys. The activation runs on every score
   of a `64 x block_kv` tile, zero-filled keys included; with 16 keys a
   64-row key tile would quadruple that ALU work (and its loads of zero
   rows). `block_kv` (16, 32, 64, or 128 for 65-256 keys in the forward)
   follows the caller's `max_len_kv` (`kv_block`).
5. Split-K for few query tiles over long keys (pooled attention: one query
   tile per 2K history cannot keep 132 SMs busy). With no softmax, the
   output is a plain sum over key tiles, so each query tile's keys are cut
   into `kv_split` parts, dealt as separate items, each writing an f32
   partial `[parts, t, n, h]` that XLA adds (dQ likewise).

Boundaries by zero-fill, as in the jagged kernel (G1), and here even
simpler: every activation has `a(0) = 0`, so a zero key row contributes
exactly nothing and needs no correction. Tiles sit on the 8-aligned row
grid of the jagged kernel; the first and last key tile of each sequence come
from its zero-filled side buffers (`side_tiles`), so no score is ever
masked. Query rows outside the sequence are computed and never written
(ladder of TMA stores from a plain buffer; whole tiles leave through a
swizzled one instead, which the wgmma-layout register store reaches
without bank conflicts). In the dK/dV kernel the *query* side needs the
same treatment (a garbage query row would add `a(x) dO` to dV): its first
and last query tiles (and dO tiles) also come from zero-filled side
buffers; a zero query row gives `a(0) = 0` for dV and `dX * 0 = 0` for dK.

GELU's tanh on the ALUs (G2). `gelu_tanh` needs `tanh(u)`, `u =
sqrt(2/pi) (x + 0.044715 x^3)`, which on the GPU runs on the special
function unit (16 results per clock per SM against 128 FMAs). The seed
replaces it by a degree-6 polynomial, valid because QK-norm bounds the
scores. We use the odd polynomial `u (c0 + c1 u^2 + c2 u^4)` (the degree-6
budget; the `u^6` term of an odd function is 0) with least-squares
coefficients on `|u| <= 1`: max error 4.1e-4 there (`TANH_POLY_ERROR`),
i.e. for GELU inputs `|x| <= 1.13`, where the GELU error is at most
`0.5 |x| 4.1e-4 = 2.3e-4`, under half a bf16 ulp of the output. (The
Taylor coefficients `1, -1/3, 2/15` have that error only up to `|u| = 0.5`
and 3.8e-2 at 1, so the fit doubles the range at the same cost.) Outside
`|u| <= TANH_POLY_RANGE` the kernel falls back to the exact `tanh`
(`tanh="poly"`); `tanh="exact"` (the default) always uses it. On the GPU
that fallback is a per-element select, so both forms are evaluated and
nothing is saved: it buys exactness everywhere. And with `approx_math`
the exact form is one `tanh.approx` on the special function unit, which
the H200 runs faster than the polynomial's ALU work (forward 1.24x,
forward+backward 1.13x at 256 keys); hence the default. The seed's saving is
`tanh="poly_unchecked"` (polynomial only), for callers that guarantee
`|u| <= 1`, e.g. QK-normed Q and K with `|scale q . k| <= 1.13`; outside the
range it is wrong (the odd polynomial turns back at `|u| ~ 1.2`). The
benchmark times all three.

Exact GELU needs `erf`, which Mosaic GPU does not lower: it is computed
with Abramowitz-Stegun 7.1.26 (`|error| <= 1.5e-7`, one `exp` that the
derivative reuses).

Work split. Forward and dQ: grid `(n // hpc, w)` persistent CTAs, `hpc`
(1 or 2) consumer warpgroups (one query head each, sharing every K/V tile)
plus one producer. dK/dV: one CTA per (128-row key tile, KV head), two
consumers of 64 key rows each, streaming the (Q, dO) tiles of all `g`
query heads of the KV head: the GQA reduction happens inside the kernel
(O7). Short keys give few key tiles (cross-attention: one per sequence),
so each tile's query stream is cut into `dkv_parts` parts, one CTA each,
adding f32 partials (XLA sums them). Interpret mode (CPU) runs the same
kernels; see
`pallas_kernels.mosaic.accumulate` for its one substitution.

Where the forward's time goes over 256 keys (parts of the consumer's step
taken out at lowering time): the activation about a fifth, P V a tenth;
what is left, Q in, O out and Q K^T, takes about as long as its bytes at
copy bandwidth plus its matmul at the dense rate, so a tile's loads and
stores overlap its math little (two Q stages, the most that fit beside 256
resident keys). Fewer ALU operations in `gelu_tanh` (the score scale folded
into its constants) and the activation in packed bf16x2 arithmetic did not
pay. The runs behind these and the tuning choices below:
docs/kernels/gdpa.md.

dQ for short keys (`dq_from_ds`). The dQ kernel recomputes `X`, `dP` and
`a'(X)` per score (3 of the backward's 7 matmul passes). A fused
backward that keeps dQ in a CTA needs every key of the sequence there,
and with D=128 the dK and dV accumulators of 256 keys (2 x 256 x 128 f32
= 256 KB) exceed the whole register file; the dK/dV kernel owns 128 keys
per CTA instead. So when the caller bounds the keys (`max_len_kv`, within
`DS_KEY_TILES` tiles of 64) the dK/dV kernel also writes each scaled
`dS^T` tile (64 keys x 64 queries, bf16) it forms anyway, and a light
persistent pass reads them back with K: `dQ = sum dS^T[tile]^T K[tile]`,
one matmul per tile pair, no recomputation. The `dS` round trip costs
`t n keys` bf16 twice; the dQ kernel read Q and dO and did 3 matmuls
and the derivative. The round trip wins: over 256 keys the backward is
20% faster, over 16 and 64 keys forward+backward 14%.

dQ for longer keys (`dq_fused`, `backward_dkv_dq`): the dK/dV kernel adds
each step's `dS^T[tile]^T K[tile]` into dQ itself with TMA reduce-add (one
rounded bf16 add per 128-key tile of the sequence), so dQ needs neither
the dQ kernel nor a `dS` buffer whose size grows with the keys. Which
path a call takes: `dq_path`.

Files: this one holds the settings (`BlockSizes`), the activations and the
choices made per call (`kv_block`, `kv_parts`, `dkv_parts`, `dq_path`); the
forward and dQ kernel over query tiles (and their per-worker work table)
is `mosaic_gpu_fwd.py`, the dK/dV kernel `mosaic_gpu_bwd_dkv.py`, dQ from
the stored `dS^T` `mosaic_gpu_bwd_dq.py`; the work lists and side tiles
are `pallas_kernels.schedule`'s; `op.py` is the public op.
"""

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels import mosaic

# tanh(u) ~ u (c0 + c1 u^2 + c2 u^4) on |u| <= TANH_POLY_RANGE (module doc).
TANH_POLY = (0.9969966957, -0.3073168678, 0.0722663395)
TANH_POLY_RANGE = 1.0
TANH_POLY_ERROR = 4.2e-4  # max |poly - tanh| on the range (tested)
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715
# erf(z) ~ 1 - (a1 t + ... + a5 t^5) exp(-z^2), t = 1 / (1 + p z), z >= 0.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and pipeline depths (H200; measured by benchmarks/gdpa.py).

  `None` means chosen per call: `block_kv` from the caller's `max_len_kv`
  (`kv_block`), `q_stages` the deepest Q ring that fits (`query_layout`),
  `kv_split` from the number of query tiles (`kv_parts`).
  """

  block_q: int = 64  # query rows per consumer warpgroup
  block_kv: int | None = None  # key rows per step (dQ: at least 64)
  kv_stages: int = 2  # K/V ring depth; keys of <= this many tiles stay
  q_stages: int | None = None  # Q (and dO) ring depth, at most
  kv_split: int | None = None  # key parts per query tile (split-K)
  full_store: bool = True  # whole output tiles leave via a swizzled buffer
  deal_chunk: int = 4  # consecutive tiles dealt to one worker together
  dkv_split: int | None = None  # dK/dV: query parts per key tile
  dkv_stages: int = 2  # dK/dV: (Q, dO) ring depth
  dq_from_ds: bool | None = None  # dQ from stored dS^T (`dq_path`)
  dq_fused: bool | None = None  # dQ added by the dK/dV kernel (`dq_path`)
  fold_heads: bool = True  # short query sides: heads into rows (op.py)
  num_sms: int | None = None  # persistent CTAs = about this many (None:
  # the GPU's SMs, `mosaic.num_sms`)

  def __post_init__(self):
    if self.dq_fused and self.dq_from_ds:
      raise ValueError("dq_fused and dq_from_ds: one dQ path at a time")
    if self.block_q != 64:
      raise ValueError(f"block_q={self.block_q} must be 64 (one warpgroup)")
    kv = self.block_kv
    if kv is not None and not (kv in (16, 32) or kv in (64, 128, 192, 256)):
      # Narrower V tiles take the 32/64-byte swizzle (`v_tile`); others
      # need whole 64-row swizzle groups.
      raise ValueError(f"block_kv={kv}: 16, 32, 64, 128, 192 or 256")
    for f in (
      "kv_stages",
      "deal_chunk",
      "num_sms",
      "q_stages",
      "kv_split",
      "dkv_split",
      "dkv_stages",
    ):
      if getattr(self, f) is not None and getattr(self, f) < 1:
        raise ValueError(f"{f} must be >= 1")


@dataclasses.dataclass(frozen=True)
class _Static:
  activation: str
  normalize: str | None
  tanh: str  # "poly", "poly_unchecked" or "exact" (gelu_tanh only)
  scale: float
  block_sizes: BlockSizes
  interpret: object  # None (compile) or plgpu.InterpretGPUParams
  max_len_kv: int | None = None  # the caller's static bound on key lengths


# --------------------------------------------------------------------------
# Activations with the ops Mosaic GPU lowers (f32 in, f32 out).


def tanh_poly(u):
  """The polynomial alone (valid on `|u| <= TANH_POLY_RANGE`)."""
  c0, c1, c2 = TANH_POLY
  v = u * u
  return u * (c0 + v * (c1 + v * c2))


def _tanh(u, mode: str):
  if mode == "exact":
    return jnp.tanh(u)
  if mode == "poly_unchecked":
    return tanh_poly(u)
  return mosaic.select(jnp.abs(u) <= TANH_POLY_RANGE, tanh_poly(u), jnp.tanh(u))


def _erf_parts(x):
  """`(erf(x / sqrt2), exp(-x^2 / 2))` for GELU (A&S 7.1.26)."""
  z = jnp.abs(x) * (1.0 / math.sqrt(2.0))
  e = jnp.exp(-(z * z))
  t = 1.0 / (1.0 + _ERF_P * z)
  a1, a2, a3, a4, a5 = _ERF_A
  poly = t * (a1 + t * (a2 + t * (a3 + t * (a4 + t * a5))))
  y = 1.0 - poly * e
  return mosaic.select(x >= 0.0, y, -y), e


def act(x, name: str, tanh: str = "exact"):
  """`a(x)` in kernel-friendly ops."""
  if name == "silu":
    return x / (1.0 + jnp.exp(-x))
  if name == "gelu":
    erf, _ = _erf_parts(x)
    return 0.5 * x * (1.0 + erf)
  if name == "gelu_tanh":
    u = _GELU_C * (x + _GELU_A * (x * x * x))
    return 0.5 * x * (1.0 + _tanh(u, tanh))
  raise ValueError(name)


def act_grad(x, name: str, tanh: str = "exact"):
  """`a'(x)` in kernel-friendly ops."""
  if name == "silu":
    sig = 1.0 / (1.0 + jnp.exp(-x))
    return sig * (1.0 + x * (1.0 - sig))
  if name == "gelu":
    erf, e = _erf_parts(x)
    return 0.5 * (1.0 + erf) + x * e * (1.0 / math.sqrt(2.0 * math.pi))
  if name == "gelu_tanh":
    x2 = x * x
    th = _tanh(_GELU_C * (x + _GELU_A * (x2 * x)), tanh)
    du = _GELU_C * (1.0 + (3.0 * _GELU_A) * x2)
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du
  raise ValueError(name)


def act_and_grad(x, name: str, tanh: str = "exact"):
  """`(a(x), a'(x))` sharing the transcendental parts (dK/dV kernel)."""
  if name == "silu":
    sig = 1.0 / (1.0 + jnp.exp(-x))
    return x * sig, sig * (1.0 + x * (1.0 - sig))
  if name == "gelu":
    erf, e = _erf_parts(x)
    cdf = 0.5 * (1.0 + erf)
    return x * cdf, cdf + x * e * (1.0 / math.sqrt(2.0 * math.pi))
  if name == "gelu_tanh":
    x2 = x * x
    th = _tanh(_GELU_C * (x + _GELU_A * (x2 * x)), tanh)
    du = _GELU_C * (1.0 + (3.0 * _GELU_A) * x2)
    half = 0.5 * (1.0 + th)
    return x * half, half + 0.5 * x * (1.0 - th * th) * du
  raise ValueError(name)


# dQ from dS^T by default for 1..5 key tiles of 64 (up to ~256 keys),
# where it beats the dQ kernel by 14-20% (see the module docstring).
DS_KEY_TILES = (1, 5)


def ds_key_tiles(max_len_kv: int | None) -> int | None:
  """Static bound on a sequence's 64-row key tiles (lead rows included)."""
  if max_len_kv is None:
    return None
  return max(1, -(-(max_len_kv + mosaic.ALIGN - 1) // DS_ROWS))


def use_dq_from_ds(bs, max_len_kv: int | None) -> bool:
  """dQ from the dK/dV kernel's `dS^T` (`dq_from_ds`) instead of the dQ
  kernel's recomputation: needs the caller's `max_len_kv` (the buffer is
  `[n, key tiles, query tiles, 64, 64]`); by default for short keys
  (`DS_KEY_TILES`)."""
  tiles = ds_key_tiles(max_len_kv)
  if bs.dq_from_ds is not None:
    if bs.dq_from_ds and tiles is None:
      raise ValueError("dq_from_ds needs max_len_kv")
    return bs.dq_from_ds
  lo, hi = DS_KEY_TILES
  return tiles is not None and lo <= tiles <= hi


def dq_path(bs, max_len_kv: int | None) -> str:
  """How the backward forms dQ: `"ds"`, read back from the dK/dV kernel's
  `dS^T` (`use_dq_from_ds`: by default up to ~256 keys); else `"fused"`,
  added by the dK/dV kernel itself (`backward_dkv_dq`; by default past
  that range), or `"kernel"`, the dQ kernel's recomputation
  (`dq_fused=False`)."""
  if bs.dq_fused:
    return "fused"
  if use_dq_from_ds(bs, max_len_kv):
    return "ds"
  return "kernel" if bs.dq_fused is False else "fused"


def dkv_parts(bs, seqs: int, kv_rows: int, kv_heads: int) -> int:
  """Query parts per dK/dV key tile (split over the query stream). One CTA
  per (128-row key tile, KV head) leaves SMs idle when keys are short
  (cross-attention over 16-64 keys: one tile per sequence, 2 x 32 CTAs on
  132 SMs); cutting each tile's query stream into parts, each writing an
  f32 partial that XLA adds, fills the chip. The real tiles are about
  `max(seqs, kv_rows / 128)` (static estimate). Over 16 keys 2 parts (the
  automatic choice) run forward+backward 18% faster than 1."""
  if bs.dkv_split is not None:
    return bs.dkv_split
  tiles = max(seqs, kv_rows // DKV_ROWS, 1)
  return max(
    1, min(MAX_DKV_SPLIT, mosaic.num_sms(bs.num_sms) // (kv_heads * tiles))
  )


# Q ring depth chosen when `q_stages` is None. A fourth stage, which fits
# beside 64-row key tiles since the output buffers share memory, measured
# no faster.
MAX_Q_STAGES = 3
MAX_KV_SPLIT = 3  # most key parts chosen when `kv_split` is None
MAX_DKV_SPLIT = 4  # most query parts chosen when `dkv_split` is None
DKV_ROWS = 128  # key rows per dK/dV CTA (two warpgroups of 64)
DS_ROWS = DKV_ROWS // 2  # key rows of a dS^T tile: one dK/dV warpgroup's


# Forward key tiles of 128 rows for keys up to this long (`kv_block`).
WIDE_KV_MAX = 256


def kv_block(
  max_len_kv: int | None, dq: bool = False, kv_stages: int = 2
) -> int:
  """Key rows per step when the caller leaves `block_kv` open: the
  activation runs on every score of a `64 x block_kv` tile, so short keys
  (cross-attention over 16-32 candidates' keys) get narrow tiles.

  Keys of 65 to `WIDE_KV_MAX` rows get 128-row tiles in the forward: with
  two K/V stages a sequence of up to ~250 keys stays resident, and each
  step's two wgmmas are twice as long (half the waits between them and
  the activation): the forward over 256 keys is 4-11% faster than with
  64-row tiles, streamed or resident. The dQ kernel keeps 64 (not
  measured wider; by default dQ comes from `dS^T` there), and so does a
  K/V ring of more than two stages (the caller's deeper ring of 64-row
  tiles takes the same shared memory). Longer keys (pooled histories)
  keep the 64-row steps they were tuned with.
  """
  if max_len_kv is not None:
    for rows in (16, 32):
      if max_len_kv <= rows:
        return rows
    wide = not dq and kv_stages * 128 <= WIDE_KV_MAX
    if wide and 64 < max_len_kv <= WIDE_KV_MAX:
      return 128
  return 64


def kv_parts(bs, num_items: int, groups: int, kv_rows: int, seqs: int) -> int:
  """Key parts per query tile (split-K). Few query tiles over long keys
  (pooled attention) leave most persistent CTAs idle and one CTA streaming
  a 2K history alone; splitting each tile's keys into parts gives every
  CTA work. `num_items` is the static bound on query tiles. Each part
  writes an f32 partial that XLA adds, so parts cost traffic, and past
  `MAX_KV_SPLIT` they cost more than they spread: on pooled attention
  (16 queries over 32 log-normal histories) 3 parts ran the forward 9-14%
  faster than 2 or 4."""
  if bs.kv_split is not None:
    return bs.kv_split
  workers = -(-mosaic.num_sms(bs.num_sms) // groups)
  if num_items >= 2 * workers:
    return 1
  mean_tiles = kv_rows // max(seqs, 1) // bs.block_kv
  parts = min(MAX_KV_SPLIT, -(-4 * workers // num_items), mean_tiles // 2)
  return max(1, parts)
