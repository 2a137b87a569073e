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
  """`y = x @ w (+ b)` over the last axis; `w` is `[d_in, d_out]`."""

  def __init__(
    self,
    d_in: int,
    d_out: int,
    axes,
    *,
    rngs: nnx.Rngs,
    use_bias: bool = False,
    dtype=jnp.float32,
  ):
    self.w = param(rngs, (d_in, d_out), axes)
    self.b = (
      param(rngs, (d_out,), axes[1:], nnx.initializers.zeros)
      if use_bias
      else None
    )
    self.dtype = dtype

  def __call__(self, x):
    y = matmul(x, self.w[...], self.dtype)
    if self.b is not None:
      y = y + self.b[...].astype(self.dtype)
    return y


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
  ):
    super().__init__(
      d_in, d_out, axes, rngs=rngs, use_bias=use_bias, dtype=dtype
    )
    self.fp8 = fp8
    self.axes = tuple(axes)

  def quantized_weight(self) -> Fp8Tensor:
    w = self.w[...]
    quantize = functools.partial(quantize_weight, self.fp8)
    hook = _WEIGHT_HOOK.get()
    wq = None if hook is None else hook(w, self.axes, quantize)
    return quantize(w) if wq is None else wq

  def __call__(self, x):
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
  ):
    kw = dict(rngs=rngs, dtype=dtype, fp8=fp8)
    self.gate = dense(d, hidden, ("embed", "mlp"), **kw)
    self.up = dense(d, hidden, ("embed", "mlp"), **kw)
    self.down = dense(hidden, d, ("mlp", "embed"), **kw)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def swiglu_hidden(d_model: int, mult: float) -> int:
  """FFN width: `mult * d_model` rounded up to a multiple of 32."""
  return int(-(-int(d_model * mult) // 32) * 32)
