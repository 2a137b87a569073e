"""Public FP8 ops: `quantize`, `dequantize`, `fp8_dot_general` (G4).

`fp8_dot_general(lhs, rhs, dimension_numbers, ...)` has `lax.dot_general`'s
signature and computes the product from FP8 operands with block scales:

  forward   out = deq(Q(lhs)) . deq(Q(rhs))          FP8 x FP8, f32 sums
  backward  d lhs = Q(g) . deq(Q(rhs))^T              FP8 x FP8
            d rhs = g^T . lhs                         BF16 (default), or
            d rhs = Q(g)^T . deq(Q(lhs))              FP8 (`grad_rhs_fp8`)

`Q` quantizes along the contraction axis (format.py), once per tensor: the
backward reuses the forward's quantized rhs (with MXFP8's square blocks the
transposed use shares values and scales; with 1x128 activations the FP8
weight gradient quantizes g and the lhs again along m, transposed, in one
pass each: `mosaic_gpu_transpose_quantize.transpose_quantize_mgpu` reads g
as it is and the lhs as the forward's values and scales, without writing a
transpose; its pass over g also quantizes g along n for dX (`rows_too`), so
g is read once for both (15-25% faster than two passes).
Gradients are straight-through: the derivative of the FP8 product is taken
as that of the exact product of its operands. The BF16 weight gradient
reads the lhs as the caller passed it (its `source` for an `Fp8Tensor`),
which the backward keeps instead of the quantized lhs: it carries no
activation quantization error, needs no dequantize pass (on the H200 that
pass cost more than the FP8 product saved at 65536 x 2048 x 512), and
keeps what a BF16 layer keeps. `keep_fp8_lhs` trades that for memory:
the backward keeps the lhs's FP8 values and scales instead (about half the
bytes of a bf16 lhs, for activations kept across a training step) and
dequantizes them for the BF16 weight gradient, which then carries the
activation's quantization error. With a Hadamard transform the FP8
gradients are rotated back (`d x = d(x M) M^T`).

Operands may be raw arrays (quantized here) or `Fp8Tensor`s from `quantize`
(e.g. weights quantized once per step, or on their FSDP shard before the
all-gather); an `Fp8Tensor` routes its gradient to its `source`.

Supported dimension numbers: one contracting dimension per side, any free
dimensions, and batch dimensions on raw operands (mapped with `jax.vmap`).

Implementations (`implementation=`): "xla" (the `jnp` reference: dequantize,
then an f32-accumulated dot) and "mosaic" (the Pallas kernels, in GPU
interpret mode on CPU). `None` picks "mosaic" on GPU. Configurations a kernel
does not cover fall back to the reference quantizer or product. A raw bf16
left operand whose quantized values nothing else reads (`lhs` unless the
weight gradient is FP8; `g` in `d lhs` unless it is) is quantized inside
the GEMM kernel (`mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu`),
with the same values and scales, where the product has at most
`QUANTIZE_IN_GEMM_MAX_N` output columns, a 16-bit output and
round-to-nearest.

Error bound of the forward (tested): per element of `out`,
|out - x.w| <= sum_k |x_k||w_k| (2 u + u^2) + subnormal terms, u = 2^-4
(RN) or 2^-3 (stochastic rounding); for random data the relative Frobenius
error is about 2 u / sqrt(3) ~ 4%.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import dispatch, mosaic
from pallas_kernels.fp8 import format as fmt
from pallas_kernels.fp8 import (
  mosaic_gpu_matmul,
  mosaic_gpu_quantize,
  mosaic_gpu_quantizing_matmul,
  mosaic_gpu_transpose_quantize,
)
from pallas_kernels.fp8 import reference as ref
from pallas_kernels.fp8.format import Fp8Tensor

# The default on Hopper: DeepSeek-style 1x128 / 128x128 blocks. Measured on the
# H200 (`benchmarks/fp8_matmul.py --sweep-only`), its kernel ran at 1036-1211
# TFLOP/s against ~400
# for MXFP8's 32x32 blocks (Hopper has no block-scaled MMA,
# so the scales are applied after every block of the contraction: 4x less often
# with 128, and a 128x128 weight scale folds into the row scales), at the same
# error (3.79% vs f32 on random data, both). MXFP8 (format="mxfp8") stays
# available: its square blocks let the backward reuse a tensor transposed, which
# matters for FP8 weight gradients and on GPUs with native MX scaling.
DEFAULT_FORMAT = "deepseek"

# ---------------------------------------------------------------------------
# Implementations of the two 2-D primitives.
# ---------------------------------------------------------------------------


def _quantize_2d_xla(x_rc, block, hadamard, hadamard_seed, seed_hash):
  return ref.quantize_reference(
    x_rc,
    block=block,
    hadamard=hadamard,
    hadamard_seed=hadamard_seed,
    seed_hash=seed_hash,
  )


def _bf16_source(x, scales, x_block):
  """`x` as bf16: itself if raw (`scales` None), else dequantized (bf16
  holds every e4m3 value times a power-of-two scale exactly, down to
  2^-133, and the quantize kernel reads bf16)."""
  if scales is None:
    return x
  return ref.dequantize_reference(x, scales, block=x_block, dtype=jnp.bfloat16)


def _quantize_t_of_source(quantize_2d, x, scales, x_block, block, seed_hash):
  """`x^T` quantized in `block`s by `quantize_2d`: `x` raw, or values with
  `scales` in `x_block`s (dequantized first)."""
  return quantize_2d(
    _bf16_source(x, scales, x_block).T, block, None, 0, seed_hash
  )


_quantize_t_xla = functools.partial(_quantize_t_of_source, _quantize_2d_xla)


def _matmul_xla(a, b, out_dtype):
  (a_v, a_s, a_block), (b_v, b_s, b_block) = a, b
  return ref.scaled_matmul_reference(
    a_v, a_s, a_block, b_v, b_s, b_block, out_dtype=out_dtype
  )


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _map_batch(fn, axis_size, in_batched, args):
  """`fn` over a batch one entry at a time (`lax.map`), the arguments
  without a batch axis broadcast to one: a kernel call's vmap rule where
  the batch cannot be folded into its rows."""
  args = tuple(
    a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
    for a, batched in zip(args, in_batched, strict=True)
  )
  return lax.map(lambda t: fn(*t), args)


@functools.cache
def _quantize_kernel_fn(block, hadamard, hadamard_seed, sr, r, c):
  """The kernel call on one `[r, c]` matrix, batched by folding into rows."""
  cp = _round_up(c, mosaic_gpu_quantize.TILE_C)
  br, bc = block

  def one(x_rc, seed_hash):
    rows = x_rc.shape[0]
    x = jnp.pad(
      x_rc.astype(jnp.bfloat16),
      ((0, _round_up(rows, mosaic_gpu_quantize.TILE_R) - rows), (0, cp - c)),
    )
    v, se = mosaic_gpu_quantize.quantize_mgpu(
      x,
      seed_hash,
      block=block,
      hadamard=hadamard,
      hadamard_seed=hadamard_seed,
      sr=sr,
      interpret=mosaic.resolve_interpret(),
      n_cols=c,
    )
    s = se[:, ::br].T  # [rows_p / br, cp / bc]
    return v[:rows, :c], s[: -(-rows // br), : -(-c // bc)]

  @jax.custom_batching.custom_vmap
  def f(x_rc, seed_hash):
    return one(x_rc, seed_hash)

  @f.def_vmap
  def _rule(axis_size, in_batched, x_vrc, seed_hash):
    x_batched, seed_batched = in_batched
    if r % br == 0 and not seed_batched:
      # Blocks never straddle two batch entries: fold the batch into rows.
      if not x_batched:
        x_vrc = jnp.broadcast_to(x_vrc, (axis_size, r, c))
      v, s = one(x_vrc.reshape(axis_size * r, c), seed_hash)
      return (
        v.reshape(axis_size, r, c),
        s.reshape(axis_size, r // br, -1),
      ), (True, True)
    out = _map_batch(one, axis_size, in_batched, (x_vrc, seed_hash))
    return out, (True, True)

  return f


def _quantize_2d_mosaic(x_rc, block, hadamard, hadamard_seed, seed_hash):
  r, c = x_rc.shape
  if (
    tuple(block) not in mosaic_gpu_quantize.SUPPORTED_BLOCKS
    or hadamard not in mosaic_gpu_quantize.SUPPORTED_HADAMARD
    or r == 0
    or c == 0
    # The kernel reads bf16; other inputs would be rounded to bf16 first and
    # so differ from the reference.
    or x_rc.dtype != jnp.bfloat16
  ):
    return _quantize_2d_xla(x_rc, block, hadamard, hadamard_seed, seed_hash)
  sr = seed_hash is not None
  seed = jnp.asarray(seed_hash if sr else 0, jnp.int32)
  f = _quantize_kernel_fn(tuple(block), hadamard, hadamard_seed, sr, r, c)
  return f(x_rc, seed)


@functools.cache
def _transpose_quantize_fn(r: int, c: int, rows_too: bool = False):
  """The transposing kernel on one `[r, c]` matrix (padded to tiles), bf16
  or e4m3 with its compact scales; batched with `lax.map`. Returns the
  values and compact scales of `x^T`, and with `rows_too` (bf16) those of
  `x` quantized along its rows too."""
  tile = mosaic_gpu_quantize.TILE_C
  rp, cp = _round_up(r, tile), _round_up(c, tile)

  def one(x, *scales):
    x = jnp.pad(x, ((0, rp - r), (0, cp - c)))
    # The scales one per (128-column block, row); padded rows are zeros,
    # which any scale (1) keeps zero.
    sx = [
      jnp.pad(_expand(s, 1, r), ((0, 0), (0, rp - r)), constant_values=1)
      for s in scales
    ]
    v, se, *rows = mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
      x, *sx, interpret=mosaic.resolve_interpret(), rows_too=rows_too
    )
    out = (v[:c, :r], se.T[:c, : -(-r // tile)])
    if rows_too:
      vr, ser = rows
      out += (vr[:r, :c], ser.T[:r, : -(-c // tile)])
    return out

  @jax.custom_batching.custom_vmap
  def f(*args):
    return one(*args)

  @f.def_vmap
  def _rule(axis_size, in_batched, *args):
    out = _map_batch(one, axis_size, in_batched, args)
    return out, (True,) * len(out)

  return f


def _quantize_t_mosaic(x, scales, x_block, block, seed_hash):
  """`_quantize_t_xla` by the transposing kernel where it applies (1 x 128
  blocks, round to nearest, bf16 `x` or e4m3 `x` in 1 x 128 blocks), else
  by the quantize kernel on the transposed bf16 source."""
  r, c = x.shape
  raw = scales is None
  if (
    tuple(block) == (1, 128)
    and seed_hash is None
    and 0 not in (r, c)
    and (
      (raw and x.dtype == jnp.bfloat16)
      or (not raw and x.dtype == fmt.E4M3 and tuple(x_block) == (1, 128))
    )
  ):
    f = _transpose_quantize_fn(r, c)
    return f(x) if raw else f(x, scales)
  return _quantize_t_of_source(
    _quantize_2d_mosaic, x, scales, x_block, block, seed_hash
  )


def _quantize_both_mosaic(x, block):
  """`x` quantized along its rows and, transposed, along its columns, from
  one read of `x` (the transposing kernel's `rows_too`): `(quantize_2d's
  values and scales, quantize_t's)`, where that applies (bf16 `x`, 1 x 128
  blocks, round to nearest); None elsewhere."""
  r, c = x.shape
  if tuple(block) != (1, 128) or x.dtype != jnp.bfloat16 or 0 in (r, c):
    return None
  v_t, s_t, v, s = _transpose_quantize_fn(r, c, rows_too=True)(x)
  return (v, s), (v_t, s_t)


def _expand(s_RC, br: int, rows: int):
  """Compact scales `[R, J]` to the kernel's `[J, rows]` (one per row)."""
  return jnp.repeat(s_RC.T, br, axis=1)[:, :rows]


@functools.cache
def _matmul_kernel_fn(kb, out_dtype, m, n, k, b_rows, quantize_a):
  """The kernel on one product; `quantize_a`: `a` raw bf16 (no `sa` arg),
  quantized in the kernel. Batched by folding into rows of `a`."""

  def uniform(bs) -> bool:
    """`b_scale_uniform` for a kernel in tiles `bs`: one column scale per
    warpgroup tile and k-block (128 x 128 weight blocks)."""
    return b_rows % bs.tile_n == 0

  if quantize_a:
    bs = mosaic_gpu_quantizing_matmul.QuantizingBlockSizes()
    cta_m, cta_n = bs.cta_rows(), 2 * bs.tile_n
    tile_k = kb
  else:
    # Per-row weight scales (FP8 weight gradients) have tiles of their own.
    bs = mosaic_gpu_matmul.default_block_sizes(
      kb, out_dtype, uniform(mosaic_gpu_matmul.BlockSizes())
    )
    cta_n, tile_k = bs.cluster_tile()[1], bs.tile_k
  kp = _round_up(k, tile_k)

  def one(a_mk, sa_Jm, b_nk, sb_Jn):
    rows = a_mk.shape[0]
    if quantize_a:
      mp = _round_up(rows, cta_m)
    else:
      # Any multiple of 8 rows, at least one tile
      # (`mosaic_gpu_matmul.row_start`).
      mp = max(_round_up(rows, 8), bs.cta_tile()[0])
    np_ = _round_up(n, cta_n)
    jp = kp // kb
    # Zero padding (quantized to zeros with scale 2^-126) adds nothing.
    a = jnp.pad(a_mk, ((0, mp - rows), (0, kp - k)))
    b = jnp.pad(b_nk, ((0, np_ - n), (0, kp - k)))
    sb = jnp.pad(sb_Jn, ((0, jp - sb_Jn.shape[0]), (0, 0)))
    # Padded columns repeat the last scale: a 128-column group's scale
    # stays uniform (`b_scale_uniform` reads it from the group's first 64
    # entries, which zeros past n would break for n % 128 < 64).
    sb = jnp.pad(sb, ((0, 0), (0, np_ - n)), mode="edge")
    kw = dict(
      out_dtype=out_dtype,
      block_sizes=bs,
      interpret=mosaic.resolve_interpret(),
      b_scale_uniform=uniform(bs),
    )
    if quantize_a:
      out = mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu(a, b, sb, **kw)
    else:
      sa = jnp.pad(sa_Jm, ((0, jp - sa_Jm.shape[0]), (0, mp - rows)))
      # Too few output tiles for the chip (weight gradients): split-K,
      # with f32 partial tiles (and the epilogue buffers for them), in
      # the tile that fills the chip better.
      split_bs, splits = mosaic_gpu_matmul.split_k_plan(
        mp, np_, kp, kb, uniform=uniform(bs)
      )
      if splits > 1:
        kw.update(block_sizes=split_bs, b_scale_uniform=uniform(split_bs))
      out = mosaic_gpu_matmul.scaled_matmul_mgpu(
        a, sa, b, sb, kb=kb, splits=splits, **kw
      )
    return out[:rows, :n]

  def split(args):
    """`f`'s arguments as (a, sa, b, sb); sa None when quantized here."""
    return (args[0], None, *args[1:]) if quantize_a else tuple(args)

  @jax.custom_batching.custom_vmap
  def f(*args):
    return one(*split(args))

  @f.def_vmap
  def _rule(axis_size, in_batched, *args):
    a, sa, b, sb = split(args)
    ab, sab, bb, sbb = split(in_batched)
    if ab and sab in (None, True) and not bb and not sbb:
      # Shared right operand: fold the batch into rows of the left one.
      if sa is not None:
        sa = jnp.moveaxis(sa, 0, 1).reshape(sa.shape[1], axis_size * m)
      out = one(a.reshape(axis_size * m, k), sa, b, sb)
      return out.reshape(axis_size, m, n), True
    one_of = lambda *t: one(*split(t))
    return _map_batch(one_of, axis_size, in_batched, args), True

  return f


def _matmul_mosaic(a, b, out_dtype):
  (a_v, a_s, a_block), (b_v, b_s, b_block) = a, b
  m, k = a_v.shape
  n = b_v.shape[0]
  kb = a_block[1]
  if kb != b_block[1] or kb not in (32, 64, 128) or 0 in (m, n, k):
    return _matmul_xla(a, b, out_dtype)
  f = _matmul_kernel_fn(kb, jnp.dtype(out_dtype), m, n, k, b_block[0], False)
  return f(a_v, _expand(a_s, a_block[0], m), b_v, _expand(b_s, b_block[0], n))


# Widest product whose forward quantizes `a` in its kernel. That kernel
# quantizes each `a` tile once per 256 output columns, the separate pass
# once in all: 9% faster than quantize + GEMM at 512 output columns,
# slower at 1024 and wider (docs/kernels/fp8.md).
QUANTIZE_IN_GEMM_MAX_N = 512


def _quantizing_matmul_mosaic(a_rc, a_block, b, out_dtype):
  """The product with raw `a` quantized in its kernel, where that is
  faster (bf16 `a` in 1 x 128 blocks, 128 x 128 weight blocks, `n <=
  QUANTIZE_IN_GEMM_MAX_N`) and fits
  (`mosaic_gpu_quantizing_matmul.quantizing_fits`); None elsewhere (the
  caller quantizes first)."""
  b_v, b_s, b_block = b
  (m, k), n = a_rc.shape, b_v.shape[0]
  if (
    a_block != (1, 128)
    or b_block != (128, 128)
    or a_rc.dtype != jnp.bfloat16
    or not mosaic_gpu_quantizing_matmul.quantizing_fits(out_dtype)
    or not 0 < n <= QUANTIZE_IN_GEMM_MAX_N
    or 0 in (m, k)
  ):
    return None
  f = _matmul_kernel_fn(128, jnp.dtype(out_dtype), m, n, k, 128, True)
  return f(a_rc, b_v, _expand(b_s, 128, n))


@dataclasses.dataclass(frozen=True)
class _Impl:
  quantize_2d: object
  matmul: object
  # `(a_rc, a_block, b, out_dtype)`: the product with a raw left operand
  # quantized in the kernel (round to nearest, no Hadamard), or None where
  # it does not apply. None: never.
  quantizing_matmul: object = None
  # `(x, scales, x_block, block, seed_hash)`: `x^T` quantized in `block`s
  # (no Hadamard), `x` raw (`scales` None) or quantized in `x_block`s.
  quantize_t: object = _quantize_t_xla
  # `(x, block)`: `(quantize_2d(x), quantize_t(x))` from one pass over a
  # raw `x` (round to nearest), or None where it does not apply. None:
  # never (the two separately).
  quantize_both: object = None


IMPLEMENTATIONS = {
  "xla": _Impl(_quantize_2d_xla, _matmul_xla),
  "mosaic": _Impl(
    _quantize_2d_mosaic,
    _matmul_mosaic,
    _quantizing_matmul_mosaic,
    _quantize_t_mosaic,
    _quantize_both_mosaic,
  ),
}


def _pick(implementation):
  return dispatch.pick("fp8", IMPLEMENTATIONS, implementation, "mosaic")


# ---------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------


def _normalize_block(block) -> tuple[int, int]:
  if isinstance(block, int):
    return (block, block)
  return tuple(int(b) for b in block)


def quantize(
  x,
  *,
  block=None,
  hadamard: int | None = None,
  key=None,
  format: str = DEFAULT_FORMAT,
  axis: int = -1,
  kind: str = "activation",
  hadamard_seed: int = 0,
  implementation: str | None = None,
) -> Fp8Tensor:
  """Quantize `x` along `axis` (the axis it will be contracted over).

  Args:
    x: any float array.
    block: `(br, bc)` or an int for square blocks; default from `format`
      and `kind` ("activation" or "weight").
    hadamard: Hadamard block size (power of two dividing `x.shape[axis]`),
      or None.
    key: PRNG key: stochastic rounding when given, else round to nearest.
    format: "deepseek" (default) or "mxfp8" (see `format.FORMATS`).
    axis: the contraction axis; values are stored with it moved last.
    hadamard_seed: seed of the transform's random signs (static).
    implementation: None, "xla" or "mosaic".

  Returns an `Fp8Tensor` whose `source` is `x` (for gradients).
  """
  if kind not in ("activation", "weight"):
    raise ValueError(f"kind must be 'activation' or 'weight', got {kind!r}")
  f = fmt.get_format(format)
  if block is None:
    block = f.activation_block if kind == "activation" else f.weight_block
  block = _normalize_block(block)
  axis = axis % x.ndim
  xm = jnp.moveaxis(lax.stop_gradient(x), axis, -1)
  c = xm.shape[-1]
  r = math.prod(xm.shape[:-1])
  seed_hash = None if key is None else fmt.seed_hash_from_key(key)
  v, s = _pick(implementation).quantize_2d(
    xm.reshape(r, c), block, hadamard, hadamard_seed, seed_hash
  )
  return Fp8Tensor(
    values=v.reshape(xm.shape),
    scales=s,
    source=x,
    shape=tuple(x.shape),
    axis=axis,
    block=block,
    hadamard=hadamard,
    hadamard_seed=hadamard_seed,
    dtype=jnp.dtype(x.dtype),
  )


def dequantize(t: Fp8Tensor, dtype=None):
  """The tensor `t` approximates, in its logical layout (Hadamard undone)."""
  r, c = t.matrix_shape
  x = ref.dequantize_reference(
    t.values.reshape(r, c),
    t.scales,
    block=t.block,
    hadamard=t.hadamard,
    hadamard_seed=t.hadamard_seed,
    dtype=dtype or t.dtype,
  )
  stored = t.values.shape
  return jnp.moveaxis(x.reshape(stored), -1, t.axis)


# ---------------------------------------------------------------------------
# The 2-D product with its custom VJP.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Cfg:
  a_block: tuple[int, int]
  b_block: tuple[int, int]
  grad_block: tuple[int, int]
  hadamard: int | None
  hadamard_seed: int
  out_dtype: jnp.dtype
  a_dtype: jnp.dtype
  b_dtype: jnp.dtype
  grad_rhs_fp8: bool
  implementation: str | None
  grad_lhs: bool  # whether lhs / rhs carry a source to differentiate
  grad_rhs: bool
  # The rhs contracts a dimension other than its last: `b` (contraction
  # last) is a transpose of it, and so is its gradient.
  b_transposed: bool = False
  # The backward keeps the quantized lhs, not its source, for a BF16 dW.
  keep_fp8_lhs: bool = False


def _hadamard_undo(x, cfg):
  if cfg.hadamard:
    return ref.hadamard_apply(x, cfg.hadamard, cfg.hadamard_seed, inverse=True)
  return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _mm(a_v, a_s, a_src, b_v, b_s, b_src, key, cfg):
  """The product; `a_v = a_s = None`: the raw `a_src` is quantized here."""
  del b_src, key
  impl = _pick(cfg.implementation)
  b = (b_v, b_s, cfg.b_block)
  if a_v is None:
    return _raw_matmul(
      impl,
      a_src,
      cfg.a_block,
      b,
      cfg.out_dtype,
      lambda: _quantize_a(cfg, a_src),
    )
  return impl.matmul((a_v, a_s, cfg.a_block), b, cfg.out_dtype)


def _raw_matmul(impl, a_rc, a_block, b, out_dtype, quantized):
  """The product with a raw left operand quantized round to nearest: in
  the product's kernel where the implementation has one for it, else
  `quantized()` (its values and scales) and the plain product."""
  if impl.quantizing_matmul is not None:
    out = impl.quantizing_matmul(a_rc, a_block, b, out_dtype)
    if out is not None:
      return out
  return impl.matmul((*quantized(), a_block), b, out_dtype)


def _quantize_a(cfg, a_src):
  """A raw lhs's values and scales (round to nearest, no Hadamard)."""
  return _pick(cfg.implementation).quantize_2d(
    a_src, cfg.a_block, None, 0, None
  )


def _mm_fwd(a_v, a_s, a_src, b_v, b_s, b_src, key, cfg):
  # The lhs residual: none without a weight gradient; the lhs as passed
  # for the BF16 one (see `_mm_bwd`); its values and scales for the FP8
  # one, with `keep_fp8_lhs` or where it came without a source, quantized
  # first then (a product that quantizes `a` itself returns none).
  a_res = (None, None, None)
  keep_src = not (cfg.grad_rhs_fp8 or cfg.keep_fp8_lhs)
  if cfg.grad_rhs and keep_src and a_src is not None:
    a_res = (None, None, a_src)
  elif cfg.grad_rhs:
    if a_v is None:
      a_v, a_s = _quantize_a(cfg, a_src)
    a_res = (a_v, a_s, None)
  out = _mm(a_v, a_s, a_src, b_v, b_s, b_src, key, cfg)
  return out, (*a_res, b_v, b_s, key)


def _transposed(v, s, block):
  return v.T, s.T, (block[1], block[0])


def _acc_dtype(cfg, dtype):
  return jnp.float32 if cfg.hadamard else dtype


def _mm_bwd(cfg, res, g_mn):
  a_v, a_s, a_src, b_v, b_s, key = res
  keep_a, keep_b = cfg.grad_lhs, cfg.grad_rhs
  impl = _pick(cfg.implementation)
  seed_hash = None if key is None else fmt.seed_hash_from_key(key)
  grad_block = cfg.grad_block
  fp8_dw = keep_b and cfg.grad_rhs_fp8

  @functools.cache
  def g_both():
    """g quantized along n (for dX) and, transposed, along m (for an FP8
    dW) in one pass, where both are needed and the implementation can
    (1 x 128 blocks, round to nearest); None elsewhere."""
    if not (keep_a and fp8_dw and seed_hash is None and impl.quantize_both):
      return None
    return impl.quantize_both(g_mn, grad_block)

  @functools.cache
  def g_q():
    if g_both() is not None:
      return g_both()[0]
    return impl.quantize_2d(g_mn, grad_block, None, 0, seed_hash)

  da = db = None
  if keep_a:
    # d a = g . b: contraction over n; b used transposed, `[k, n]`.
    bt = _transposed(b_v, b_s, cfg.b_block)
    if bt[2][1] != grad_block[1]:
      # The scale blocks along n differ (e.g. 1x128 activations on the right):
      # quantize the dequantized `b^T` again along n.
      bq = impl.quantize_2d(
        ref.dequantize_reference(b_v, b_s, block=cfg.b_block).T,
        grad_block,
        None,
        0,
        None,
      )
      bt = (*bq, grad_block)
    # Without a Hadamard transform to undo, the kernel writes the gradient's
    # dtype directly (one rounding of the f32 sums either way).
    acc = _acc_dtype(cfg, cfg.a_dtype)
    if seed_hash is None and not fp8_dw:
      # No other use of the quantized g (round to nearest): in the
      # product's kernel where it can.
      da = _raw_matmul(impl, g_mn, grad_block, bt, acc, g_q)
    else:
      da = impl.matmul((*g_q(), grad_block), bt, acc)
    da = _hadamard_undo(da, cfg).astype(cfg.a_dtype)
  if keep_b:
    # d b = g^T . a: contraction over m.
    if cfg.grad_rhs_fp8:
      if grad_block[0] == grad_block[1] and cfg.a_block[0] == cfg.a_block[1]:
        gt = _transposed(*g_q(), grad_block)
        at = _transposed(a_v, a_s, cfg.a_block)
      else:
        # Both operands quantized again along m, transposed: g from bf16,
        # the lhs from its values and scales (dequantized in registers).
        if g_both() is not None:
          gt = g_both()[1]
        else:
          gt = impl.quantize_t(g_mn, None, None, grad_block, seed_hash)
        at = impl.quantize_t(a_v, a_s, cfg.a_block, grad_block, None)
        gt, at = (*gt, grad_block), (*at, grad_block)
      acc = _acc_dtype(cfg, cfg.b_dtype)
      if cfg.b_transposed:
        # The product in the rhs's own layout, `a^T g`: the move back
        # from `b`'s cancels this transpose, where `g^T a` would have left
        # a pass over dW to XLA.
        db = impl.matmul(at, gt, acc).T
      else:
        db = impl.matmul(gt, at, acc)
      db = _hadamard_undo(db, cfg)
    else:
      # BF16 from the lhs the caller passed (in its own basis: no Hadamard
      # to undo), or from the dequantized one where it passed no source.
      a_bf = a_src
      if a_bf is None:
        a_bf = ref.dequantize_reference(
          a_v, a_s, block=cfg.a_block, dtype=jnp.bfloat16
        )
      db = lax.dot_general(
        g_mn.astype(jnp.bfloat16),
        a_bf.astype(jnp.bfloat16),
        (((0,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
      )
      if a_src is None:
        db = _hadamard_undo(db, cfg)
    db = db.astype(cfg.b_dtype)
  # The quantized operands get no gradient (None: zero); their sources do.
  return (None, None, da, None, None, db, None)


_mm.defvjp(_mm_fwd, _mm_bwd)


# ---------------------------------------------------------------------------
# fp8_dot_general
# ---------------------------------------------------------------------------


def _to_quantize(x, axis: int, block) -> Fp8Tensor:
  """`x` as an `Fp8Tensor` still to be quantized (no values or scales):
  the product quantizes it, round to nearest, no Hadamard transform."""
  return Fp8Tensor(
    values=None,
    scales=None,
    source=x,
    shape=tuple(x.shape),
    axis=axis % x.ndim,
    block=tuple(block),
    hadamard=None,
    hadamard_seed=0,
    dtype=jnp.dtype(x.dtype),
  )


def _as_matrix(t: Fp8Tensor):
  r, c = t.matrix_shape
  src = None
  if t.source is not None:
    src = jnp.moveaxis(t.source, t.axis, -1).reshape(r, c)
  if t.values is None:
    return None, None, src
  return t.values.reshape(r, c), t.scales, src


def fp8_dot_general(
  lhs,
  rhs,
  dimension_numbers,
  precision=None,
  preferred_element_type=None,
  *,
  format: str = DEFAULT_FORMAT,
  hadamard: int | None = None,
  hadamard_seed: int = 0,
  grad_rhs_fp8: bool = False,
  keep_fp8_lhs: bool = False,
  key=None,
  implementation: str | None = None,
):
  """`lax.dot_general` computed in FP8 with block scales (see module doc).

  Args:
    lhs, rhs: arrays (quantized here: `lhs` as an activation, `rhs` as a
      weight) or `Fp8Tensor`s quantized along the contracting dimension.
    dimension_numbers: as `lax.dot_general`; one contracting dimension.
    precision: ignored (FP8 is the precision); accepted for compatibility.
    preferred_element_type: output dtype; default the lhs (source) dtype.
    format, hadamard, hadamard_seed: quantization of raw operands;
      `format` also sets the output gradient's blocks.
    grad_rhs_fp8: compute the rhs (weight) gradient in FP8 too; default
      BF16, as the seed keeps weight gradients in BF16.
    keep_fp8_lhs: for a BF16 weight gradient, keep the quantized lhs
      (dequantized in the backward) instead of its source: less memory,
      the lhs's quantization error in the weight gradient.
    key: PRNG key for stochastic rounding of the output gradient.
    implementation: None, "xla" or "mosaic".
  """
  del precision
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = tuple(lc), tuple(rc), tuple(lb), tuple(rb)
  if len(lc) != 1 or len(rc) != 1:
    raise NotImplementedError(
      f"fp8_dot_general: exactly one contracting dimension, got {lc}, {rc}"
    )
  kw = dict(
    preferred_element_type=preferred_element_type,
    format=format,
    hadamard=hadamard,
    hadamard_seed=hadamard_seed,
    grad_rhs_fp8=grad_rhs_fp8,
    keep_fp8_lhs=keep_fp8_lhs,
    key=key,
    implementation=implementation,
  )
  if lb or rb:
    if isinstance(lhs, Fp8Tensor) or isinstance(rhs, Fp8Tensor):
      raise NotImplementedError(
        "fp8_dot_general: batch dimensions need raw operands"
      )
    if len(lb) != len(rb):
      raise ValueError(f"batch dimensions {lb} and {rb} differ in number")
    # Batch dims to the front, then vmap over them one at a time.
    lhs = jnp.moveaxis(lhs, lb, tuple(range(len(lb))))
    rhs = jnp.moveaxis(rhs, rb, tuple(range(len(rb))))
    lc2 = _moved_index(lc[0], lb)
    rc2 = _moved_index(rc[0], rb)
    nb = len(lb)

    def unbatched(x, w):
      return fp8_dot_general(x, w, (((lc2 - nb,), (rc2 - nb,)), ((), ())), **kw)

    f = unbatched
    for _ in range(nb):
      f = jax.vmap(f)
    return f(lhs, rhs)
  return _dot_unbatched(lhs, rhs, lc[0], rc[0], **kw)


def _moved_index(i: int, batch: tuple[int, ...]) -> int:
  """Where axis `i` lands after moving `batch` axes to the front."""
  return len(batch) + i - sum(b < i for b in batch)


def _dot_unbatched(
  lhs,
  rhs,
  lc: int,
  rc: int,
  *,
  preferred_element_type,
  format,
  hadamard,
  hadamard_seed,
  grad_rhs_fp8,
  keep_fp8_lhs,
  key,
  implementation,
):
  qkw = dict(
    format=format,
    hadamard=hadamard,
    hadamard_seed=hadamard_seed,
    implementation=implementation,
  )
  if not isinstance(lhs, Fp8Tensor):
    if hadamard is None:
      # Quantized by the product itself (in its kernel where it can).
      lhs = _to_quantize(lhs, lc, fmt.get_format(format).activation_block)
    else:
      lhs = quantize(lhs, axis=lc, kind="activation", **qkw)
  if not isinstance(rhs, Fp8Tensor):
    rhs = quantize(rhs, axis=rc, kind="weight", **qkw)
  lc, rc = lc % len(lhs.shape), rc % len(rhs.shape)
  for t, axis, name in ((lhs, lc, "lhs"), (rhs, rc, "rhs")):
    if t.axis != axis:
      raise ValueError(
        f"fp8_dot_general: {name} was quantized along axis {t.axis} but is"
        f" contracted along {axis}; quantize it along the contraction axis"
      )
  if (lhs.hadamard, lhs.hadamard_seed) != (rhs.hadamard, rhs.hadamard_seed):
    raise ValueError(
      "fp8_dot_general: both operands need the same Hadamard transform, got"
      f" {(lhs.hadamard, lhs.hadamard_seed)} and"
      f" {(rhs.hadamard, rhs.hadamard_seed)}"
    )
  if lhs.shape[lc] != rhs.shape[rc]:
    raise ValueError(
      f"contracting sizes differ: {lhs.shape[lc]} and {rhs.shape[rc]}"
    )
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  cfg = _Cfg(
    a_block=lhs.block,
    b_block=rhs.block,
    grad_block=fmt.get_format(format).activation_block,
    hadamard=lhs.hadamard,
    hadamard_seed=lhs.hadamard_seed,
    out_dtype=out_dtype,
    a_dtype=jnp.dtype(lhs.dtype),
    b_dtype=jnp.dtype(rhs.dtype),
    grad_rhs_fp8=grad_rhs_fp8,
    implementation=implementation,
    grad_lhs=lhs.source is not None,
    grad_rhs=rhs.source is not None,
    b_transposed=rhs.axis != len(rhs.shape) - 1,
    keep_fp8_lhs=keep_fp8_lhs,
  )
  a_v, a_s, a_src = _as_matrix(lhs)
  b_v, b_s, b_src = _as_matrix(rhs)
  out = _mm(a_v, a_s, a_src, b_v, b_s, b_src, key, cfg)
  free_l = tuple(d for i, d in enumerate(lhs.shape) if i != lc)
  free_r = tuple(d for i, d in enumerate(rhs.shape) if i != rc)
  return out.reshape(free_l + free_r)


def fp8_dot_general_reference(lhs, rhs, dimension_numbers, **kwargs):
  """The same op on the `jnp` reference path (`implementation="xla"`)."""
  return fp8_dot_general(
    lhs, rhs, dimension_numbers, implementation="xla", **kwargs
  )
