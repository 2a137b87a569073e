"""Basic layers with logical axis names on every parameter.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (names from
the model's point of view: `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`,
`table_rows`, `table_dim`); only `sharding/` maps these onto mesh axes.

Initialization follows O5: TruncatedNormal(std=0.02) for every projection,
QKV included, so widening d_model (384 -> 512) does not inflate activations.

FP8 (G4). `Fp8Dense` is a drop-in for `Dense` with the same parameters (so a
checkpoint does not care whether FP8 was on): `y = x @ w` computed by
`pallas_kernels.fp8_dot_general`, with `x` quantized along `d_in` in
activation blocks (1x128 "deepseek", 32x32 "mxfp8") and `w` along `d_in` in
weight blocks (128x128 / 32x32), e4m3 values with power-of-two scales. Its
`custom_vjp` computes dX in FP8 from the forward's quantized weight and dW in
BF16 from the dequantized activation (straight-through;
`model.fp8.weight_grads` computes dW in FP8 too). `fp8_for(cfg, family,
block)` decides per layer from `ModelConfig.fp8` (an `Fp8Config`): the
heads, the input projections and the last `fp8.keep_last` blocks stay in
the compute dtype by default.

Two fusions feed it 8-bit operands:
- activations: an `RMSNorm` built with `quantize=` returns its output as an
  `Fp8Tensor` (`pallas_kernels.rms_norm(..., quantize=...)`, one kernel), so
  Q, K and V (or the FFN's gate and up) read the same 8-bit activation;
- weights: a weight hook installed with `fp8_weight_hook` (by
  `sharding.fp8` under FSDP) supplies the quantized weight: quantized on the
  local shard, then all-gathered in 8 bits. The model never names a mesh
  axis; the hook receives the weight, its logical axes and the layer's
  quantizer.

8-bit saved activations (G9, `ModelConfig.saved_activations="fp8"`). A
dense layer's backward needs its input `x` for `dW = x^T dy`; kept across
the step, these inputs are a large part of the activation memory. With
`save8` a layer keeps `x` in e4m3 with a power-of-two scale per 1x128
block (`pallas_kernels.fp8_quantize`, scales stored as E8M0 bytes: 1.008
bytes a value against bf16's 2) and dequantizes it for `dW`; the forward
and `dX = dy W^T` are untouched, so only `dW` sees the 8-bit error
(e4m3's 3 mantissa bits: at most 2^-4 of each input value). Layers that
read one input (Q/K/V, gate/up) share one 8-bit copy (`saved_input`), and
SwiGLU keeps its gate and up outputs in 8 bits too (`swiglu_saved8`), the
block's largest residuals. Layers whose input another op keeps anyway
(the attention output projections: the attention kernel keeps its
output) and the f32 task towers keep theirs. Inside a region under
`jax.checkpoint` (`recomputed_region`) the activations are recomputed in
the backward, not kept, so the layers skip the 8-bit copy there.
"""

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from pallas_kernels import Fp8Tensor

TRUNC_NORMAL = nnx.initializers.truncated_normal(stddev=0.02)


def param(rngs: nnx.Rngs, shape, logical_axes, init=TRUNC_NORMAL) -> nnx.Param:
  if len(shape) != len(logical_axes):
    raise ValueError(f"shape {shape} vs logical axes {logical_axes}")
  return nnx.Param(
    init(rngs.params(), shape, jnp.float32), logical_axes=tuple(logical_axes)
  )


def matmul(x, w, dtype):
  """`x @ w` over the last axis of `x`, both operands cast to `dtype`; the
  result is `dtype`. On the GPU every GEMM of it, forward and backward,
  multiplies `dtype` operands and accumulates in f32 (cuBLAS's compute type
  for bf16); `dw` reaches the f32 parameter rounded once to `dtype`.

  Why not `einsum(..., preferred_element_type=f32).astype(dtype)`: JAX's
  transpose of that hands both backward GEMMs the f32 cotangent, so they
  ran f32 x f32 (TF32 on the H200: 8.8 of a 37.8 ms `onetrans_v31` step;
  23.2 ms with this function).
  Nor a `custom_vjp` that keeps `dw` in f32: with it, the 16-device FSDP
  step all-reduced one weight's whole gradient over every device instead of
  reduce-scattering it in its group (`tests/sharding/test_meshes.py`
  caught it).
  """
  return jnp.einsum("...i,io->...o", x.astype(dtype), w.astype(dtype))


class Dense(nnx.Module):
  """`y = x @ w (+ b)` over the last axis; `w` is `[d_in, d_out]`.

  `save8`: keep `x` for the backward in 8 bits (see the module doc); `x`
  may then be `saved_input`'s `Fp8Tensor`, shared with other layers.
  """

  def __init__(
    self,
    d_in: int,
    d_out: int,
    axes,
    *,
    rngs: nnx.Rngs,
    use_bias: bool = False,
    dtype=jnp.float32,
    save8: bool = False,
  ):
    self.w = param(rngs, (d_in, d_out), axes)
    self.b = (
      param(rngs, (d_out,), axes[1:], nnx.initializers.zeros)
      if use_bias
      else None
    )
    self.dtype = dtype
    self.save8 = save8

  def saved_input(self, x):
    """`x` as this layer's backward keeps it: quantized (an `Fp8Tensor`)
    while 8-bit saving is on, so that layers reading the same input keep
    one 8-bit copy; else `x` itself."""
    if not saving_fp8(self.save8):
      return x
    if isinstance(x, Fp8Tensor):
      if _saved_layout(x):
        return x
      x = x.source
    return quantize_saved(x.astype(self.dtype))

  def __call__(self, x):
    if saving_fp8(self.save8):
      xq = self.saved_input(x)
      y = matmul_saved8(xq, self.w[...], self.dtype)
    else:
      y = matmul(x.source if isinstance(x, Fp8Tensor) else x, self.w[...],
                 self.dtype)  # fmt: skip
    if self.b is not None:
      y = y + self.b[...].astype(self.dtype)
    return y


# ---------------------------------------------------------------------------
# 8-bit saved activations (G9)
# ---------------------------------------------------------------------------

# DeepSeek's 1x128 activation blocks: one scale per token and 128 features,
# so a token's 8-bit copy never depends on another request's values.
SAVED_BLOCK = (1, 128)

_RECOMPUTED = contextvars.ContextVar("recomputed_region", default=False)


@contextlib.contextmanager
def recomputed_region():
  """While tracing a region under `jax.checkpoint`: its activations are
  recomputed in the backward, not kept, so no layer makes 8-bit copies."""
  token = _RECOMPUTED.set(True)
  try:
    yield
  finally:
    _RECOMPUTED.reset(token)


def saving_fp8(save8: bool) -> bool:
  """Whether a layer built with `save8` keeps 8-bit inputs here."""
  return save8 and not _RECOMPUTED.get()


def quantize_saved(x) -> Fp8Tensor:
  """`x` in e4m3, 1x128 blocks along its last axis (source: `x`)."""
  return pallas_kernels.fp8_quantize(x, axis=-1, block=SAVED_BLOCK)


def _saved_layout(t: Fp8Tensor) -> bool:
  """Whether `t` is laid out as `quantize_saved` makes it."""
  return (
    t.axis == len(t.shape) - 1
    and tuple(t.block) == SAVED_BLOCK
    and not t.hadamard
  )


def _e8m0(scales):
  """Power-of-two f32 scales as one byte each, their exponent field (E8M0;
  exact: the scales are normal, 2^-126 and up). Integer bit operations,
  which every backend compiles, rather than the float8_e8m0fnu dtype."""
  bits = jax.lax.bitcast_convert_type(scales, jnp.int32)
  return jax.lax.shift_right_logical(bits, 23).astype(jnp.uint8)


def _from_e8m0(exponents):
  """`_e8m0`'s bytes back to the f32 scales."""
  bits = jax.lax.shift_left(exponents.astype(jnp.int32), 23)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _restore(values, scales_e8m0, dtype):
  """`quantize_saved`'s values and E8M0 scales dequantized to `dtype`."""
  t = Fp8Tensor(values=values, scales=_from_e8m0(scales_e8m0),
                source=None, shape=values.shape, axis=values.ndim - 1,
                block=SAVED_BLOCK, hadamard=None, hadamard_seed=0,
                dtype=jnp.dtype(dtype))  # fmt: skip
  return pallas_kernels.fp8_dequantize(t, dtype)


def _when(g, *arrays):
  """`arrays`, the kept 8-bit copies, read no earlier than `g` (the
  backward's cotangent): without the barrier XLA may dequantize them in
  the forward and keep the wide copy alive until the backward instead
  (XLA:CPU did: a SwiGLU stack kept more than in bf16)."""
  return jax.lax.optimization_barrier((g, *arrays))


@jax.custom_vjp
def _matmul8(x, w, values, scales):
  del values, scales
  return jnp.einsum("...i,io->...o", x, w)


def _matmul8_fwd(x, w, values, scales):
  # `x` is not kept: its 8-bit copy is (and `w`, a parameter, kept anyway).
  return _matmul8(x, w, values, scales), (w, values, scales)


def _matmul8_bwd(res, g):
  w, values, scales = res
  g, values, scales = _when(g, values, scales)
  x8 = _restore(values, scales, w.dtype)
  dx = jnp.einsum("...o,io->...i", g, w)
  return dx, _weight_grad(x8, g, w), None, None


_matmul8.defvjp(_matmul8_fwd, _matmul8_bwd)


@jax.custom_batching.custom_vmap
def _weight_grad(x, g, w):
  """`x^T g` over every row: `w`'s gradient (`w` only says whether it is
  batched)."""
  del w
  return jnp.einsum("...i,...o->io", x, g)


@_weight_grad.def_vmap
def _weight_grad_vmap(axis_size, in_batched, x, g, w):
  # Under `vmap` (the train step maps the model over data shards) a
  # shared weight's gradient is one contraction over the shards' rows too,
  # the product JAX's own transpose writes: left to `vmap`, the backward
  # made one gradient per shard and summed them, and the 16-device FSDP
  # step all-reduced that sum over every device instead of reduce-scattering
  # it inside the group.
  x_b, g_b, w_b = in_batched
  x = x if x_b else jnp.broadcast_to(x, (axis_size, *x.shape))
  g = g if g_b else jnp.broadcast_to(g, (axis_size, *g.shape))
  if w_b:  # a weight per batch entry: a gradient per entry
    return jax.vmap(lambda x, g: jnp.einsum("...i,...o->io", x, g))(x, g), True
  return jnp.einsum("...i,...o->io", x, g), False


def matmul_saved8(xq: Fp8Tensor, w, dtype):
  """`matmul(xq.source, w, dtype)` whose backward keeps `xq` (8 bits,
  `quantize_saved`'s layout) instead of the input, dequantized for `dW`;
  `dX` is exact."""
  if not _saved_layout(xq):
    raise ValueError(
      f"an 8-bit saved input is quantized along its last axis in "
      f"{SAVED_BLOCK} blocks without a Hadamard transform, got axis "
      f"{xq.axis}, block {xq.block}, hadamard {xq.hadamard}"
    )
  x = jnp.asarray(xq.source, dtype)
  return _matmul8(x, w.astype(dtype), xq.values, _e8m0(xq.scales))


@jax.custom_vjp
def swiglu_saved8(g, u):
  """`silu(g) * u` keeping `g` and `u` in 8 bits for its backward (the
  gate and up projections' outputs, `2 f` values a token)."""
  return jax.nn.silu(g) * u


def _swiglu8_fwd(g, u):
  qg, qu = quantize_saved(g), quantize_saved(u)
  res = (qg.values, _e8m0(qg.scales), qu.values, _e8m0(qu.scales))
  return swiglu_saved8(g, u), res


def _swiglu8_bwd(res, dh):
  dh, vg, sg, vu, su = _when(dh, *res)
  g = _restore(vg, sg, jnp.float32)
  u = _restore(vu, su, jnp.float32)
  dh32 = dh.astype(jnp.float32)
  sig = jax.nn.sigmoid(g)
  dg = dh32 * u * sig * (1 + g * (1 - sig))  # silu' = sig (1 + g (1 - sig))
  du = dh32 * g * sig
  return dg.astype(dh.dtype), du.astype(dh.dtype)


swiglu_saved8.defvjp(_swiglu8_fwd, _swiglu8_bwd)


# ---------------------------------------------------------------------------
# FP8 (G4)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fp8Settings:
  """How one layer quantizes: the `pallas_kernels.fp8` arguments."""

  format: str = "deepseek"
  hadamard: int | None = None
  implementation: str | None = None
  weight_grads: bool = False  # dW in FP8 (`grad_rhs_fp8`); default BF16

  def rms_norm_output(self) -> pallas_kernels.Fp8Output:
    """The fused norm output quantization that feeds this layer."""
    return pallas_kernels.Fp8Output(format=self.format, hadamard=self.hadamard)


def fp8_for(cfg, family: str, block: int | None = None):
  """`Fp8Settings` for a layer of `family`, or None to stay high precision.

  `cfg` is a `ModelConfig`; `block` is the block's depth index (SeqFormer
  blocks `0..num_layers-1`, then cross blocks), None outside the blocks.
  """
  f = cfg.fp8
  if f.format == "off" or family not in f.layers:
    return None
  if block is not None:
    depth = cfg.num_layers + cfg.cross_layers
    if block >= depth - f.keep_last:
      return None
  return Fp8Settings(
    format=f.format,
    hadamard=f.hadamard or None,
    implementation=f.implementation,
    weight_grads=f.weight_grads,
  )


_WEIGHT_HOOK = contextvars.ContextVar("fp8_weight_hook", default=None)


@contextlib.contextmanager
def fp8_weight_hook(hook):
  """Install `hook(w, logical_axes, quantize) -> Fp8Tensor | None` while
  tracing: `Fp8Dense` asks it for its quantized weight (`quantize(w_part)`
  is the layer's own weight quantizer, along axis 0 of `w`); None from the
  hook means "quantize the whole weight here"."""
  token = _WEIGHT_HOOK.set(hook)
  try:
    yield hook
  finally:
    _WEIGHT_HOOK.reset(token)


def quantize_weight(settings: Fp8Settings, w_io) -> Fp8Tensor:
  """A `[d_in, d_out]` weight quantized along `d_in` in weight blocks."""
  return pallas_kernels.fp8_quantize(
    w_io,
    axis=0,
    kind="weight",
    format=settings.format,
    hadamard=settings.hadamard,
    implementation=settings.implementation,
  )


class Fp8Dense(Dense):
  """`Dense` computed in FP8 (G4): same parameters, same call.

  `x` may be an array (quantized here) or an `Fp8Tensor` quantized along its
  last axis (from an `RMSNorm` with `quantize=`). Output in `dtype`.
  """

  def __init__(
    self,
    d_in: int,
    d_out: int,
    axes,
    *,
    rngs: nnx.Rngs,
    fp8: Fp8Settings,
    use_bias: bool = False,
    dtype=jnp.float32,
    save8: bool = False,
  ):
    super().__init__(
      d_in, d_out, axes, rngs=rngs, use_bias=use_bias, dtype=dtype,
      save8=save8,
    )  # fmt: skip
    self.fp8 = fp8
    self.axes = tuple(axes)

  def saved_input(self, x):
    """`x` quantized once by this layer's settings while 8-bit saving is
    on (the product then keeps these 8 bits for `dW`), else as given (the
    product quantizes it, in its kernel where it can)."""
    if isinstance(x, Fp8Tensor) or not saving_fp8(self.save8):
      return x
    return pallas_kernels.fp8_quantize(
      x.astype(self.dtype),
      axis=-1,
      format=self.fp8.format,
      hadamard=self.fp8.hadamard,
      implementation=self.fp8.implementation,
    )

  def quantized_weight(self) -> Fp8Tensor:
    w = self.w[...]
    quantize = functools.partial(quantize_weight, self.fp8)
    hook = _WEIGHT_HOOK.get()
    wq = None if hook is None else hook(w, self.axes, quantize)
    return quantize(w) if wq is None else wq

  def __call__(self, x):
    x = self.saved_input(x)
    if not isinstance(x, Fp8Tensor):
      x = x.astype(self.dtype)
    nd = len(x.shape)
    y = pallas_kernels.fp8_dot_general(
      x,
      self.quantized_weight(),
      (((nd - 1,), (0,)), ((), ())),
      preferred_element_type=self.dtype,
      format=self.fp8.format,
      hadamard=self.fp8.hadamard,
      grad_rhs_fp8=self.fp8.weight_grads,
      keep_fp8_lhs=saving_fp8(self.save8),
      implementation=self.fp8.implementation,
    )
    if self.b is not None:
      y = y + self.b[...].astype(self.dtype)
    return y


def fp8_weight_mask(module) -> dict:
  """A pure dict parallel to `module`'s parameters: True for the weights of
  its `Fp8Dense` layers (those a weight hook quantizes), False elsewhere.
  Placement code uses it to leave these weights sharded for the hook."""
  mask = jax.tree.map(
    lambda _: False, nnx.to_pure_dict(nnx.state(module, nnx.Param))
  )
  for path, m in nnx.iter_graph(module):
    if isinstance(m, Fp8Dense):
      node = mask
      for k in path:
        node = node[k]
      node["w"] = True
  return mask


def dense(d_in, d_out, axes, *, rngs, fp8=None, **kw) -> Dense:
  """`Fp8Dense` when `fp8` settings are given, else `Dense`."""
  if fp8 is None:
    return Dense(d_in, d_out, axes, rngs=rngs, **kw)
  return Fp8Dense(d_in, d_out, axes, rngs=rngs, fp8=fp8, **kw)


# ---------------------------------------------------------------------------
# Norm and FFN
# ---------------------------------------------------------------------------


class RMSNorm(nnx.Module):
  """RMSNorm with a learned gain, through `pallas_kernels.rms_norm` (O11).

  With `quantize` (`Fp8Settings` of the layers it feeds) the normalized
  output comes back as an `Fp8Tensor` (quantized in the same kernel, G4);
  its `source` is the high-precision output, which routes gradients.
  """

  def __init__(
    self,
    dim: int,
    axis_name: str,
    *,
    eps: float = 1e-6,
    implementation: str | None = None,
    quantize: Fp8Settings | None = None,
  ):
    self.gamma = nnx.Param(
      jnp.ones((dim,), jnp.float32), logical_axes=(axis_name,)
    )
    self.eps = eps
    self.implementation = implementation
    self.quantize = quantize

  def __call__(self, x, residual=None):
    """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)`."""
    return pallas_kernels.rms_norm(
      x,
      self.gamma[...].astype(x.dtype),
      residual,
      eps=self.eps,
      implementation=self.implementation,
      quantize=(
        None if self.quantize is None else self.quantize.rms_norm_output()
      ),
    )


class SwiGLU(nnx.Module):
  """`(silu(x Wg) * (x Wu)) Wd`, the FFN of every SeqFormer block."""

  def __init__(
    self,
    d: int,
    hidden: int,
    *,
    rngs: nnx.Rngs,
    dtype,
    fp8: Fp8Settings | None = None,
    save8: bool = False,
  ):
    kw = dict(rngs=rngs, dtype=dtype, fp8=fp8, save8=save8)
    self.gate = dense(d, hidden, ("embed", "mlp"), **kw)
    self.up = dense(d, hidden, ("embed", "mlp"), **kw)
    self.down = dense(hidden, d, ("mlp", "embed"), **kw)
    self.save8 = save8

  def __call__(self, x):
    x = self.gate.saved_input(x)  # one 8-bit copy for gate and up
    g, u = self.gate(x), self.up(x)
    if saving_fp8(self.save8):
      return self.down(swiglu_saved8(g, u))
    return self.down(jax.nn.silu(g) * u)


def swiglu_hidden(d_model: int, mult: float) -> int:
  """FFN width: `mult * d_model` rounded up to a multiple of 32."""
  return int(-(-int(d_model * mult) // 32) * 32)
