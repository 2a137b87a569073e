"""Public RMSNorm op: dispatch between implementations, `custom_vjp` (O11).

`rms_norm(x, gamma=None, residual=None, *, eps, quantize=None)` normalizes
over the last axis of any `[..., d]` array (the packed `[t, d]` token buffer,
or `[t, n, h]` for QK-norm with gamma `[h]`); with `residual` it returns
`(y, x + residual)`. On GPU it runs the Mosaic GPU kernels
(`mosaic_gpu_fwd.py`, `mosaic_gpu_bwd.py`, tiled by `mosaic_gpu.py`);
elsewhere, and for shapes those kernels do not cover, the plain-`jnp`
reference (`implementation="xla"`).

`quantize` (an `Fp8Output` or a format name, G4) returns `y` as an
`Fp8Tensor` (source `y`) for the next FP8 matmul. The Mosaic forward fuses
the 1x128 ("deepseek") quantization into the norm kernel when `d` is a
multiple of 128 and there is no Hadamard transform; other settings
(32x32 "mxfp8" blocks need 32 rows that different warps own; Hadamard
needs a matmul) quantize the kernel's `y` with `fp8.quantize` afterwards.
Either way the result is bit-identical to the reference's.
"""

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import dispatch, mosaic
from pallas_kernels.fp8 import Fp8Tensor
from pallas_kernels.rms_norm import mosaic_gpu
from pallas_kernels.rms_norm.mosaic_gpu_bwd import rms_norm_bwd
from pallas_kernels.rms_norm.mosaic_gpu_fwd import rms_norm_fwd
from pallas_kernels.rms_norm.reference import (
  as_fp8_output,
  quantize_output,
  rms_norm_reference,
)


@dataclasses.dataclass(frozen=True)
class _Static:
  eps: float
  fwd_block_sizes: mosaic_gpu.BlockSizes | None
  bwd_block_sizes: mosaic_gpu.BlockSizes | None
  interpret: plgpu.InterpretGPUParams | None  # `mosaic.resolve_interpret`
  has_residual: bool
  quantize: bool = False  # fused 1x128 FP8 output of the forward


def _config(x_td, gamma, residual, static: _Static, *, bwd: bool):
  t, d = x_td.shape
  return mosaic_gpu.make_config(
    t,
    d,
    x_td.dtype,
    None if gamma is None else gamma.dtype,
    residual is not None,
    static.eps,
    static.bwd_block_sizes if bwd else static.fwd_block_sizes,
    static.interpret,
    bwd=bwd,
    quantize=static.quantize and not bwd,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms_norm_td(x_td, gamma_d, residual_td, static: _Static):
  """`(y, [h], [q, s])`: always a tuple (see `mosaic_gpu_fwd.rms_norm_fwd`)."""
  out, _ = _fwd(x_td, gamma_d, residual_td, static)
  return out


def _fwd(x_td, gamma_d, residual_td, static: _Static):
  cfg = _config(x_td, gamma_d, residual_td, static, bwd=False)
  outs = rms_norm_fwd(x_td, gamma_d, residual_td, cfg)
  # Without a residual, h is x.
  h = outs[1] if static.has_residual else x_td
  return tuple(outs), (h, gamma_d)


def _bwd(static: _Static, res, ct):
  h_td, gamma_d = res
  # The quantized outputs' cotangents are ignored: gradients of an FP8 use
  # of `y` come back through `y` (straight-through, see `fp8.Fp8Tensor`).
  dy = ct[0]
  dh_out = ct[1] if static.has_residual else None
  cfg = _config(h_td, gamma_d, dh_out, static, bwd=True)
  dh, dgamma = rms_norm_bwd(h_td, dy, dh_out, gamma_d, cfg)
  if dgamma is not None:
    dgamma = dgamma.astype(gamma_d.dtype)
  # h = x + residual, so both receive dh: one array, returned twice.
  return dh, dgamma, dh if static.has_residual else None


_rms_norm_td.defvjp(_fwd, _bwd)
_rms_norm_td = mosaic.trace_once(_rms_norm_td, static_argnums=3)


def rms_norm_mosaic(
  x,
  gamma=None,
  residual=None,
  *,
  eps: float = 1e-6,
  quantize=None,
  fwd_block_sizes: mosaic_gpu.BlockSizes | None = None,
  bwd_block_sizes: mosaic_gpu.BlockSizes | None = None,
  interpret=None,
):
  """RMSNorm through the Mosaic GPU kernels (GPU interpret mode on CPU)."""
  q = as_fp8_output(quantize)
  d = x.shape[-1]
  t = math.prod(x.shape[:-1])
  gamma_dtype = None if gamma is None else gamma.dtype
  fits = (
    t > 0
    and (residual is None or residual.dtype == x.dtype)
    and (gamma is None or gamma.shape == (d,))
    and mosaic_gpu.fits(d, x.dtype, gamma_dtype, residual is not None)
  )
  if not fits:
    return rms_norm_reference(x, gamma, residual, eps=eps, quantize=q)
  interpret = mosaic.resolve_interpret(interpret)
  fused = (
    q is not None
    and q.activation_block == (1, mosaic_gpu.QUANT_BLOCK)
    and q.hadamard is None
    and mosaic_gpu.fits(
      d, x.dtype, gamma_dtype, residual is not None, quantize=True
    )
  )
  static = _Static(
    eps,
    fwd_block_sizes,
    bwd_block_sizes,
    interpret,
    residual is not None,
    fused,
  )
  r_td = None if residual is None else residual.reshape(t, d)
  outs = _rms_norm_td(x.reshape(t, d), gamma, r_td, static)
  y = outs[0].reshape(x.shape)
  if fused:
    v_td, s_tC = outs[-2:]
    y = Fp8Tensor(
      values=v_td.reshape(x.shape),
      scales=s_tC,
      source=y,
      shape=tuple(x.shape),
      axis=x.ndim - 1,
      block=(1, mosaic_gpu.QUANT_BLOCK),
      hadamard=None,
      hadamard_seed=q.hadamard_seed,
      dtype=y.dtype,
    )
  elif q is not None:
    y = quantize_output(y, q, implementation="mosaic")
  if residual is None:
    return y
  return y, outs[1].reshape(x.shape)


IMPLEMENTATIONS = {"xla": rms_norm_reference, "mosaic": rms_norm_mosaic}


def rms_norm(
  x,
  gamma=None,
  residual=None,
  *,
  eps: float = 1e-6,
  implementation: str | None = None,
  quantize=None,
):
  """RMSNorm over the last axis; with `residual`, returns `(y, x + residual)`.

  Args:
    x: `[..., d]`, any leading shape (e.g. `[t, d]` or `[t, n, h]`).
    gamma: optional `[d]` scale.
    residual: optional, shape and dtype of `x`; fused add.
    eps: added to the mean square.
    implementation: `None` (Mosaic GPU kernel on GPU, XLA elsewhere) or one
      of `IMPLEMENTATIONS`; "mosaic" on CPU runs in GPU interpret mode.
    quantize: None, or an `Fp8Output` / format name ("deepseek", "mxfp8"):
      `y` is returned as an `Fp8Tensor` quantized along `d` (G4).
  """
  fn = dispatch.pick(
    "rms_norm", IMPLEMENTATIONS, implementation, gpu_default="mosaic"
  )
  return fn(x, gamma, residual, eps=eps, quantize=quantize)
