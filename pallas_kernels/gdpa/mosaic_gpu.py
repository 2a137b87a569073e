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
"""

import dataclasses
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.schedule import QueryItem

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


# --------------------------------------------------------------------------
# Work lists.


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


# --------------------------------------------------------------------------
# Forward and dQ: persistent CTAs over query tiles.

# Q ring depth chosen when `q_stages` is None. A fourth stage, which fits
# beside 64-row key tiles since the output buffers share memory, measured
# no faster.
MAX_Q_STAGES = 3
MAX_KV_SPLIT = 3  # most key parts chosen when `kv_split` is None
MAX_DKV_SPLIT = 4  # most query parts chosen when `dkv_split` is None
DKV_ROWS = 128  # key rows per dK/dV CTA (two warpgroups of 64)
DS_ROWS = DKV_ROWS // 2  # key rows of a dS^T tile: one dK/dV warpgroup's

# Columns of the per-worker work table (`work_table`).
(
  W_QROW,  # first packed row of the (aligned) query tile
  W_LO,  # valid rows [lo, hi) of the tile
  W_HI,
  W_KVROW,  # first packed row of the sequence's aligned key grid
  W_KVLEN,  # key length of the sequence
  W_STEPS,  # key tiles of this item (its part of the grid)
  W_TOTAL,  # key tiles of the sequence's grid
  W_SEQ,  # sequence
  W_FIRST,  # first key tile of this item
  W_PART,  # key part (split-K index)
  W_TILE,  # sequence-major id of the query tile (dS tiles, `dq_from_ds`)
  W_REUSE,  # 1: keys resident from the worker's previous item
  W_RELEASE,  # 1: the worker's next item does not reuse them
) = range(13)


def v_tile(shape, dtype, block_kv):
  """Shared-memory V tiles `[..., block_kv, h]`: the PV matmul contracts
  over the `block_kv` rows, and wgmma steps over K in swizzle-wide groups,
  so tiles under 64 rows take the 32- or 64-byte swizzle (K tiles keep 128
  bytes: QK contracts over the head dim, against Q's 128-byte swizzle)."""
  swizzle = min(128, block_kv * jnp.dtype(dtype).itemsize)
  if swizzle == 128:
    return mosaic.smem_tile(shape, dtype)
  elems = swizzle // jnp.dtype(dtype).itemsize
  transforms = (
    plgpu.TilingTransform((8, elems)),
    plgpu.SwizzleTransform(swizzle),
  )
  return plgpu.SMEM(shape, dtype, transforms=transforms)


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


def work_table(items, num_real, parts: int, workers: int, chunk: int, mcs):
  """Per-worker work: `int32[w, j, 13]` (columns `W_*`), real items per
  worker.

  `items` (`schedule.query_items`, sorted) become
  `parts` items each (key tiles `[p * steps // parts, (p + 1) * steps //
  parts)`), re-sorted by their key tiles; chunks of `chunk` are dealt
  zig-zag (`schedule.deal`), and each worker's rows are gathered here, with
  the resident-key flags worked out, so the kernel reads one row per item
  (no dependent loads) one item ahead.
  """
  num = items.shape[0]
  steps = items[:, QueryItem.STEPS]
  part = jnp.arange(parts, dtype=jnp.int32)[:, None]
  first = part * steps // parts
  count = (part + 1) * steps // parts - first

  def rep(c):
    return jnp.broadcast_to(items[:, c], (parts, num))

  q = QueryItem  # W_QROW .. W_TILE, in order
  cols = [rep(q.ROW), rep(q.LO), rep(q.HI), rep(q.KV_ROW), rep(q.KV_LEN)]
  cols += [count, rep(q.KV_TILES), rep(q.SEQ), first]
  cols += [jnp.broadcast_to(part, (parts, num)), rep(q.TILE_ID)]
  table = jnp.stack(cols, axis=-1).reshape(parts * num, len(cols))
  num_real = num_real * parts
  if parts > 1:
    real = jnp.broadcast_to(jnp.arange(num) < num_real // parts, (parts, num))
    key = jnp.where(real.reshape(-1), -table[:, W_STEPS] - 1, num + 1)
    table = table[schedule.stable_order(key)]
  dealt, counts = schedule.deal(parts * num, num_real, workers, chunk)
  wt = table[dealt]  # [w, j, cols]
  j = jnp.arange(1, dealt.shape[1], dtype=jnp.int32)
  same = (
    (j[None, :] < counts[:, None])
    & (wt[:, 1:, W_SEQ] == wt[:, :-1, W_SEQ])
    & (wt[:, 1:, W_PART] == wt[:, :-1, W_PART])
    & (wt[:, 1:, W_STEPS] <= mcs)
  )
  edge = jnp.zeros((workers, 1), bool)
  reuse = jnp.concatenate([edge, same], axis=1)
  release = jnp.concatenate([~same, ~edge], axis=1)
  flags = jnp.stack([reuse, release], axis=-1).astype(jnp.int32)
  return jnp.concatenate([wt, flags], axis=-1).astype(jnp.int32), counts


def _deal_query_table(items, num_real, parts: int, groups: int, bs, mcs):
  """`work_table` for a persistent query-side kernel: about `num_sms` CTAs
  over all `groups` (head pairs), taking runs of up to `deal_chunk`
  items (fewer when there are not two runs per CTA). Returns (CTAs per
  group, table, real items per CTA)."""
  num = parts * items.shape[0]
  workers = schedule.persistent_workers(groups, mosaic.num_sms(bs.num_sms), num)
  chunk = max(1, min(bs.deal_chunk, num // (2 * workers)))
  wt, counts = work_table(items, num_real, parts, workers, chunk, mcs)
  return workers, wt, counts


def _table_row(wt_ref, w, j, cols):
  """Columns `cols` of row `j` of worker `w`'s table (clamped to the last
  row). Kernels read it one item ahead, so the loads are in flight while
  the current tile computes, and each side reads only what it uses (the
  producer runs on 40 registers)."""
  jj = jnp.minimum(j, wt_ref.shape[1] - 1)
  return tuple(wt_ref[w, jj, c] for c in cols)


def _out_smem(hpc, h, bs, out_bytes):
  """Output staging of a query-side kernel (`_out_buffers`) and 1 KiB for
  its barriers."""
  return hpc * bs.block_q * h * out_bytes + 1024


def _out_buffers(hpc, bq, h, out_dtype, full):
  """Output staging of a query-side kernel: a plain buffer per consumer
  warpgroup (partial tiles, `mosaic.ladder_store`) and, when `full`, a
  swizzled view of the same memory for whole tiles: one `plgpu.RefUnion`
  per warpgroup (a tile uses one view or the other, and
  `_store_query_tile` waits for the previous tile's stores to have read
  it; the views of a union alias as a whole, so one union for both
  warpgroups would make each one's stores race with the other's).
  Sharing the memory is what lets 128-row key tiles keep two
  Q stages with the swizzled store at head dim 128 (forward 2% faster
  than the plain buffer alone over 256 keys), and gives the dQ kernel two
  (Q, dO) stages instead of one."""
  if not full:
    return plgpu.SMEM((hpc, bq, h), out_dtype)
  return [
    plgpu.RefUnion(
      plgpu.SMEM((bq, h), out_dtype), mosaic.smem_tile((bq, h), out_dtype)
    )
    for _ in range(hpc)
  ]


def _store_own_tile(out_bufs, wg, acc, out_ref, *args):
  """`_store_query_tile(acc, out_ref, plain, swizzled, *args)` with
  consumer warpgroup `wg`'s buffers of `_out_buffers` (a list of unions
  with the swizzled view, one per warpgroup, or one plain buffer)."""
  if not isinstance(out_bufs, (list, tuple)):
    _store_query_tile(acc, out_ref, out_bufs.at[wg], None, *args)
    return
  for g, (plain, swizzled) in enumerate(out_bufs):

    @pl.when(wg == g)
    def _(plain=plain, swizzled=swizzled):
      _store_query_tile(acc, out_ref, plain, swizzled, *args)


def _query_smem(hpc, q_stages, h, bs, dq, out_bytes):
  q_ring = q_stages * hpc * bs.block_q * h * 2 * (2 if dq else 1)
  kv_ring = bs.kv_stages * bs.block_kv * h * 2 * 2
  return q_ring + kv_ring + _out_smem(hpc, h, bs, out_bytes)


def query_layout(n, kh, h, bs, dq: bool, out_bytes: int = 2):
  """(query heads per CTA, Q ring depth, swizzled full-tile store). Two
  heads per CTA share every K/V tile (when the group is even); then the
  deepest Q ring that fits shared memory, at most `q_stages` (or
  `MAX_Q_STAGES`), and the swizzled whole-tile store when asked for and
  the output is 16-bit (it shares the plain buffer's memory,
  `_out_buffers`)."""
  group = n // kh
  full = bs.full_store and out_bytes == 2
  for hpc in (2, 1) if group % 2 == 0 else (1,):
    for qs in range(bs.q_stages or MAX_Q_STAGES, 0, -1):
      smem = _query_smem(hpc, qs, h, bs, dq, out_bytes)
      if smem <= mosaic.SMEM_PER_BLOCK:
        return hpc, qs, full
  raise ValueError(f"head dim {h} with {bs} does not fit shared memory")


def _store_query_tile(
  acc, out_ref, o_tile, of_tile, head, q_row, lo, hi, part, bq, out_dtype
):
  """Rows `[lo, hi)` of a query tile's result `acc` into `out_ref` (`[t, n,
  h]`, or `[parts, t, n, h]` with `part`) with TMA. Partial tiles go
  through the plain buffer `o_tile` and the ladder; whole tiles through
  the swizzled `of_tile` (when given), which the wgmma-layout register
  store reaches without bank conflicts (8-way into a plain 256-byte-row
  buffer)."""
  # The previous tile's stores must have read the buffers before reuse.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if part is not None:
    dst = lambda r, size: out_ref.at[part, pl.ds(q_row + r, size), head]  # noqa: E731
  else:
    dst = lambda r, size: out_ref.at[pl.ds(q_row + r, size), head]  # noqa: E731
  whole = (lo == 0) & (hi == bq) if of_tile is not None else False

  @pl.when(jnp.logical_not(whole))
  def _():
    o_tile[...] = acc.astype(out_dtype)
    plgpu.commit_smem()
    mosaic.ladder_store(o_tile, dst, lo, hi - lo, bq)

  if of_tile is not None:

    @pl.when(whole)
    def _():
      of_tile[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      rows = pl.ds(mosaic.aligned(q_row), bq)
      plgpu.copy_smem_to_gmem(of_tile, out_ref.at[rows, head])


def query_kernel(q, k, v, k_side, v_side, do, items, num_real, static):
  """Forward (`do is None`: returns O) or dQ (returns dQ), `[t, n, h]`.

  `items`: `schedule.query_items` table (sorted),
  `num_real` its number of real items; `k_side`: `side_tiles` of K
  (`[b + 1, ...]`).
  """
  t, n, h = q.shape
  s, kh, _ = k.shape
  dtype = q.dtype
  group = n // kh
  is_dq = do is not None
  bs = static.block_sizes
  bq, bkv, mcs = bs.block_q, bs.block_kv, bs.kv_stages
  if is_dq and bkv < 64:
    # dQ contracts dS against K over the key rows: its K tile would need
    # the narrow swizzle, but QK needs the 128-byte one (op.py uses 64).
    raise ValueError(f"dQ needs block_kv >= 64, got {bkv}")
  parts = kv_parts(bs, items.shape[0], max(n // 2, 1), s, k_side.shape[0] - 1)
  out_dtype = jnp.float32 if parts > 1 else dtype
  hpc, qs, full = query_layout(
    n, kh, h, bs, is_dq, jnp.dtype(out_dtype).itemsize
  )
  workers, wt, counts = _deal_query_table(
    items, num_real, parts, n // hpc, bs, mcs
  )
  name, tanh, scale = static.activation, static.tanh, static.scale
  hstu = static.normalize == "hstu"

  def kernel(*refs):
    (wt_ref, count_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref) = refs[:7]
    if is_dq:
      do_ref, out_ref = refs[7:9]
      scratch = refs[9:]
    else:
      do_ref, out_ref = None, refs[7]
      scratch = (refs[8], None, *refs[9:])
    (q_smem, do_smem, k_smem, v_smem, out_bufs) = scratch[:5]
    (q_bar, kv_bar, q_free, kv_free) = scratch[5:9]
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

      cols = (W_QROW, W_LO, W_HI, W_STEPS, W_REUSE, W_RELEASE)
      cols += (W_KVLEN,) * hstu + (W_PART,) * (parts > 1)

      def body(j, carry):
        loads, cur = carry[0], dict(zip(cols, carry[1:], strict=True))
        nxt = fetch(j + 1, cols)
        q_row, lo, hi, steps = (cur[W_QROW], cur[W_LO], cur[W_HI], cur[W_STEPS])
        reuse, release = cur[W_REUSE] != 0, cur[W_RELEASE] != 0
        slot = lax.rem(j, qs)
        base = jnp.where(reuse, loads - steps, loads)
        plgpu.barrier_wait(q_bar.at[slot])
        q_tile = q_smem.at[slot, wg]
        if hstu:
          kv_len = cur[W_KVLEN]
          mult = jnp.where(kv_len > 0, 1.0 / kv_len.astype(jnp.float32), 0.0)
        acc = plgpu.layout_cast(
          jnp.full((bq, h), 0, jnp.float32), plgpu.Layout.WGMMA
        )

        def step(i, acc):
          s = lax.rem(base + i, mcs)

          @pl.when(jnp.logical_not(reuse))
          def _():
            plgpu.barrier_wait(kv_bar.at[s])

          x = mosaic.matmul(q_tile, k_smem.at[s].transpose((1, 0)), (bq, bkv))
          if is_dq:
            dp = mosaic.matmul(
              do_smem.at[slot, wg], v_smem.at[s].transpose((1, 0)), (bq, bkv)
            )

          @pl.when(i == steps - 1)
          def _():
            # Q (and dO) are read by the matmuls above only: hand the slot
            # back now, so the next load overlaps the rest of this tile.
            mosaic.release(q_free.at[slot])

          x = x * scale
          if is_dq:
            ds = act_grad(x, name, tanh) * dp
            ds = ds * (mult * scale) if hstu else ds * scale
            acc = mosaic.accumulate(
              acc, ds.astype(dtype), k_smem.at[s], static.interpret
            )
          else:
            p = act(x, name, tanh)
            if hstu:
              p = p * mult
            acc = mosaic.accumulate(
              acc, p.astype(dtype), v_smem.at[s], static.interpret
            )

          @pl.when(release)
          def _():
            # Order this step's reads of the slot before the producer's
            # next TMA write into it (see `mosaic.release`).
            mosaic.release(kv_free.at[s])

          return acc

        # No overlap beyond the two consumers' own: the two warpgroups
        # already interleave one's wgmmas with the other's activation, and
        # issuing the next step's QK early (a second accumulator) or making
        # them take turns as the jagged forward does measured slower.
        acc = lax.fori_loop(0, steps, step, acc)

        @pl.when(steps == 0)
        def _():
          mosaic.release(q_free.at[slot])

        part = cur[W_PART] if parts > 1 else None
        _store_own_tile(
          out_bufs, wg, acc, out_ref, head, q_row, lo, hi, part, bq, out_dtype
        )
        return (jnp.where(reuse, loads, loads + steps), *nxt)

      lax.fori_loop(0, n_steps, body, (jnp.int32(0), *fetch(0, cols)))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == hpc)
    def _producer():
      plgpu.set_max_registers(mosaic.producer_registers(hpc), action="decrease")

      def issue_kv(i, s, kv_row, total, seq):
        """Key tile i of the sequence into ring slot s (side tiles at
        the ends)."""
        item = (kv_row, None, total, seq)
        for ref, side, dst in (
          (k_ref, ks_ref, k_smem),
          (v_ref, vs_ref, v_smem),
        ):
          schedule.load_kv_tile(
            ref, side, dst.at[s], kv_bar.at[s], i, item, bkv, kv_head
          )

      cols = (W_QROW, W_KVROW, W_STEPS, W_TOTAL, W_SEQ, W_FIRST, W_REUSE)

      def body(j, carry):
        loads, cur = carry[0], dict(zip(cols, carry[1:], strict=True))
        nxt = fetch(j + 1, cols)
        slot = lax.rem(j, qs)

        @pl.when(j >= qs)
        def _():
          plgpu.barrier_wait(q_free.at[slot])

        rows = pl.ds(mosaic.aligned(cur[W_QROW]), bq)
        for g in range(hpc):
          plgpu.copy_gmem_to_smem(
            q_ref.at[rows, hp * hpc + g], q_smem.at[slot, g], q_bar.at[slot]
          )
          if is_dq:
            plgpu.copy_gmem_to_smem(
              do_ref.at[rows, hp * hpc + g],
              do_smem.at[slot, g],
              q_bar.at[slot],
            )
        n_load = jnp.where(cur[W_REUSE] != 0, 0, cur[W_STEPS])

        def load(i, loads):
          s = lax.rem(loads, mcs)

          @pl.when(loads >= mcs)
          def _():
            plgpu.barrier_wait(kv_free.at[s])

          issue_kv(cur[W_FIRST] + i, s, cur[W_KVROW], cur[W_TOTAL], cur[W_SEQ])
          return loads + 1

        return (lax.fori_loop(0, n_load, load, loads), *nxt)

      init = (jnp.int32(0), *fetch(0, cols))
      carry = lax.fori_loop(0, n_steps, body, init)
      loads = carry[0]
      mosaic.observe_releases(loads, mcs, kv_free)
      mosaic.observe_releases(n_steps, qs, q_free)

  tile = mosaic.smem_tile
  scratch = [
    tile((qs, hpc, bq, h), dtype),
    *([tile((qs, hpc, bq, h), dtype)] if is_dq else []),
    tile((mcs, bkv, h), dtype),
    v_tile((mcs, bkv, h), dtype, bkv),
    _out_buffers(hpc, bq, h, out_dtype, full),
    plgpu.Barrier(num_arrivals=hpc * (2 if is_dq else 1), num_barriers=qs),
    plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=qs),
    plgpu.Barrier(num_arrivals=hpc, num_barriers=mcs),
  ]
  args = [wt, counts, q, k, v, k_side, v_side]
  if is_dq:
    args.append(do)
  return _run_query_side(
    kernel, scratch, args, (t, n, h), dtype, parts, hpc, workers, static
  )


def _run_query_side(
  kernel, scratch, args, shape, dtype, parts, hpc, workers, static
):
  """Launch a query-side kernel (`query_kernel`, `dq_from_ds`): persistent
  CTAs `(n // hpc, workers)`, `hpc` consumer warpgroups and a producer;
  output `shape` (`[t, n, h]`), or `[parts, t, n, h]` f32 split-K partials
  (no softmax, so the parts simply add) summed into `dtype`."""
  n = shape[1]
  out_shape = (parts, *shape) if parts > 1 else shape
  out = mosaic.warp_specialized(
    kernel,
    out_type=jax.ShapeDtypeStruct(
      out_shape, jnp.float32 if parts > 1 else dtype
    ),
    scratch=scratch,
    grid=(n // hpc, workers),
    consumers=hpc,
    interpret=static.interpret,
    name="query",
    family="gdpa",
  )(*args)
  if parts > 1:
    out = out.sum(axis=0).astype(dtype)
  return out


# --------------------------------------------------------------------------
# dK, dV: per key tile, streaming the query tiles of every head of the group.


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


# --------------------------------------------------------------------------
# dQ from the dK/dV kernel's dS^T tiles (short keys).


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
