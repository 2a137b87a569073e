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
interpret mode on CPU). `None` picks "mosaic" on GPU. Both provide the 2-D
primitives this file is built on (`primitives.py`); configurations a kernel
does not cover fall back to the reference quantizer or product. A raw bf16
left operand whose quantized values nothing else reads (`lhs` unless the
weight gradient is FP8; `g` in `d lhs` unless it is) is quantized inside
the GEMM kernel (`mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu`),
with the same values and scales, where the product has at most
`primitives.QUANTIZE_IN_GEMM_MAX_N` output columns, a 16-bit output and
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

from pallas_kernels import dispatch
from pallas_kernels.fp8 import format as fmt
from pallas_kernels.fp8 import reference as ref
from pallas_kernels.fp8.format import Fp8Tensor
from pallas_kernels.fp8.primitives import IMPLEMENTATIONS

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
# Dispatch: the implementation of the 2-D primitives (`primitives.py`).
# ---------------------------------------------------------------------------


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
  seed_hash = None if key is None else fmt.seed_hash_from_key(key)
  da, db = _grads_fn(cfg)(g_mn, a_v, a_s, a_src, b_v, b_s, seed_hash)
  # The quantized operands get no gradient (None: zero); their sources do.
  return (None, None, da, None, None, db, None)


def _row_blocks(cfg) -> int:
  """Rows of `a` and of `g` that share a block scale (the least multiple
  of both blocks' row counts)."""
  return math.lcm(cfg.a_block[0], cfg.grad_block[0])


@functools.cache
def _grads_fn(cfg):
  """`_grads` for `cfg`, batched by folding the batch into rows where the
  right operand is shared.

  Under `vmap` (the train step maps the model over data shards) a shared
  weight's gradient must be one product over every entry's rows, as JAX's
  transpose of a plain `dot_general` writes it: left to `vmap`, the
  backward makes a `[entries, k, n]` weight gradient and sums it after
  (the BF16 layers' version of that made XLA all-reduce the sum over every
  device of the FSDP step instead of reduce-scattering it in the group;
  see `gemjax.model.layers._weight_grad`). Folded, every row keeps its own
  blocks (the rule folds only where no block straddles two entries), so
  `d a` and a BF16 `d b` are those of the entries one by one; an FP8 `d b`
  quantizes `g` and `a` along the folded rows, as for one larger batch.
  With stochastic rounding and a shared key, the folded rows draw their own
  bits where each entry used to repeat the same draws.
  """

  @jax.custom_batching.custom_vmap
  def f(g_mn, a_v, a_s, a_src, b_v, b_s, seed_hash):
    return _grads(cfg, g_mn, a_v, a_s, a_src, b_v, b_s, seed_hash)

  @f.def_vmap
  def _rule(axis_size, in_batched, g_mn, a_v, a_s, a_src, b_v, b_s, seed):
    args = (g_mn, a_v, a_s, a_src, b_v, b_s, seed)
    batched = tuple(bool(b) for b in in_batched)
    rows = g_mn.shape[-2]
    if not any(batched[4:]) and rows % _row_blocks(cfg) == 0:

      def fold(x, b):
        """`[axis_size, r, c]` (broadcast if unbatched) as `[axis_size * r,
        c]`; row blocks of `r` rows stay whole."""
        if x is None:
          return None
        if not b:
          x = jnp.broadcast_to(x, (axis_size, *x.shape))
        return x.reshape(axis_size * x.shape[1], *x.shape[2:])

      folded = [fold(x, b) for x, b in zip(args[:4], batched[:4])]
      da, db = _grads(cfg, *folded, b_v, b_s, seed)
      if da is not None:
        da = da.reshape(axis_size, rows, *da.shape[1:])
      return (da, db), (da is not None, False)
    # A weight per entry (or blocks across entries): one product each.
    axes = tuple(0 if b else None for b in batched)
    out = jax.vmap(functools.partial(_grads, cfg), in_axes=axes)(*args)
    return out, tuple(o is not None for o in out)

  return f


def _grads(cfg, g_mn, a_v, a_s, a_src, b_v, b_s, seed_hash):
  """`(d a, d b)` of the 2-D product from its output gradient `g_mn` and
  the forward's residuals (None where not needed)."""
  keep_a, keep_b = cfg.grad_lhs, cfg.grad_rhs
  impl = _pick(cfg.implementation)
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
  return da, db


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
