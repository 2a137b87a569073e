"""Plain-`jnp` RMSNorm with optional fused residual add: the oracle (O11).

`y = x / sqrt(mean(x², -1) + eps) · gamma`, statistics in f32, output in the
input dtype. With `residual`, the op first forms the new residual stream
`h = x + residual` and returns `(norm(h), h)`, as a pre-norm transformer block
needs. Works on any leading shape, in particular the packed `[t, d]` buffer.
"""

import jax.numpy as jnp


def rms_norm_reference(x, gamma=None, residual=None, *, eps: float = 1e-6):
  h = x if residual is None else x + residual
  h32 = h.astype(jnp.float32)
  inv = jnp.reciprocal(jnp.sqrt(jnp.mean(h32 * h32, -1, keepdims=True) + eps))
  y = h32 * inv
  if gamma is not None:
    y = y * gamma.astype(jnp.float32)
  y = y.astype(x.dtype)
  return y if residual is None else (y, h)
