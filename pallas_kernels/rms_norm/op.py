"""Public RMSNorm op: dispatch between implementations."""

from pallas_kernels import dispatch
from pallas_kernels.rms_norm.reference import rms_norm_reference

IMPLEMENTATIONS = {"xla": rms_norm_reference}


def rms_norm(
  x,
  gamma=None,
  residual=None,
  *,
  eps: float = 1e-6,
  implementation: str | None = None,
):
  """RMSNorm over the last axis; with `residual`, returns `(y, x + residual)`."""
  fn = dispatch.pick(
    "rms_norm", IMPLEMENTATIONS, implementation, gpu_default="mosaic"
  )
  return fn(x, gamma, residual, eps=eps)
