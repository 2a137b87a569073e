"""Public RMSNorm op: dispatch between implementations, `custom_vjp` (O11).

`rms_norm(x, gamma=None, residual=None, *, eps)` normalizes over the last
axis of any `[..., d]` array (the packed `[t, d]` token buffer, or
`[t, n, h]` for QK-norm with gamma `[h]`); with `residual` it returns
`(y, x + residual)`. On GPU it runs the Mosaic GPU kernels of
`mosaic_gpu.py`; elsewhere, and for shapes those kernels do not cover, the
plain-`jnp` reference (`implementation="xla"`).
"""

import dataclasses
import functools
import math

import jax

from pallas_kernels import dispatch
from pallas_kernels.rms_norm import mosaic_gpu
from pallas_kernels.rms_norm.reference import rms_norm_reference


@dataclasses.dataclass(frozen=True)
class _Static:
  eps: float
  fwd_block_sizes: mosaic_gpu.BlockSizes | None
  bwd_block_sizes: mosaic_gpu.BlockSizes | None
  interpret: bool
  has_residual: bool


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
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms_norm_td(x_td, gamma_d, residual_td, static: _Static):
  out, _ = _fwd(x_td, gamma_d, residual_td, static)
  return out


def _fwd(x_td, gamma_d, residual_td, static: _Static):
  cfg = _config(x_td, gamma_d, residual_td, static, bwd=False)
  outs = mosaic_gpu.rms_norm_fwd(x_td, gamma_d, residual_td, cfg)
  if residual_td is None:
    (y,) = outs
    return y, (x_td, gamma_d)  # without a residual, h is x
  y, h = outs
  return (y, h), (h, gamma_d)


def _bwd(static: _Static, res, ct):
  h_td, gamma_d = res
  dy, dh_out = ct if static.has_residual else (ct, None)
  cfg = _config(h_td, gamma_d, dh_out, static, bwd=True)
  dh, dgamma = mosaic_gpu.rms_norm_bwd(h_td, dy, dh_out, gamma_d, cfg)
  if dgamma is not None:
    dgamma = dgamma.astype(gamma_d.dtype)
  # h = x + residual, so both receive dh: one array, returned twice.
  return dh, dgamma, dh if static.has_residual else None


_rms_norm_td.defvjp(_fwd, _bwd)


def rms_norm_mosaic(
  x,
  gamma=None,
  residual=None,
  *,
  eps: float = 1e-6,
  fwd_block_sizes: mosaic_gpu.BlockSizes | None = None,
  bwd_block_sizes: mosaic_gpu.BlockSizes | None = None,
  interpret: bool | None = None,
):
  """RMSNorm through the Mosaic GPU kernels (GPU interpret mode on CPU)."""
  d = x.shape[-1]
  t = math.prod(x.shape[:-1])
  fits = (
    t > 0
    and mosaic_gpu.supported(d, x.dtype)
    and (residual is None or residual.dtype == x.dtype)
    and (gamma is None or gamma.shape == (d,))
  )
  if not fits:
    return rms_norm_reference(x, gamma, residual, eps=eps)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  static = _Static(
    eps, fwd_block_sizes, bwd_block_sizes, interpret, residual is not None
  )
  r_td = None if residual is None else residual.reshape(t, d)
  out = _rms_norm_td(x.reshape(t, d), gamma, r_td, static)
  if residual is None:
    return out.reshape(x.shape)
  y, h = out
  return y.reshape(x.shape), h.reshape(x.shape)


IMPLEMENTATIONS = {"xla": rms_norm_reference, "mosaic": rms_norm_mosaic}


def rms_norm(
  x,
  gamma=None,
  residual=None,
  *,
  eps: float = 1e-6,
  implementation: str | None = None,
):
  """RMSNorm over the last axis; with `residual`, returns `(y, x + residual)`.

  Args:
    x: `[..., d]`, any leading shape (e.g. `[t, d]` or `[t, n, h]`).
    gamma: optional `[d]` scale.
    residual: optional, shape and dtype of `x`; fused add.
    eps: added to the mean square.
    implementation: `None` (Mosaic GPU kernel on GPU, XLA elsewhere) or one
      of `IMPLEMENTATIONS`; "mosaic" on CPU runs in GPU interpret mode.
  """
  fn = dispatch.pick(
    "rms_norm", IMPLEMENTATIONS, implementation, gpu_default="mosaic"
  )
  return fn(x, gamma, residual, eps=eps)
