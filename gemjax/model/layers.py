"""Basic layers with logical axis names on every parameter.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (names from
the model's point of view: `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`,
`table_rows`, `table_dim`); only `sharding/` maps these onto mesh axes.

Initialization follows O5: TruncatedNormal(std=0.02) for every projection,
QKV included, so widening d_model (384 -> 512) does not inflate activations.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels

TRUNC_NORMAL = nnx.initializers.truncated_normal(stddev=0.02)


def param(rngs: nnx.Rngs, shape, logical_axes, init=TRUNC_NORMAL) -> nnx.Param:
  if len(shape) != len(logical_axes):
    raise ValueError(f"shape {shape} vs logical axes {logical_axes}")
  return nnx.Param(
    init(rngs.params(), shape, jnp.float32), logical_axes=tuple(logical_axes)
  )


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
    y = jnp.einsum(
      "...i,io->...o",
      x.astype(self.dtype),
      self.w[...].astype(self.dtype),
      preferred_element_type=jnp.float32,
    ).astype(self.dtype)
    if self.b is not None:
      y = y + self.b[...].astype(self.dtype)
    return y


class RMSNorm(nnx.Module):
  """RMSNorm with a learned gain, through `pallas_kernels.rms_norm` (O11)."""

  def __init__(
    self,
    dim: int,
    axis_name: str,
    *,
    eps: float = 1e-6,
    implementation: str | None = None,
  ):
    self.gamma = nnx.Param(
      jnp.ones((dim,), jnp.float32), logical_axes=(axis_name,)
    )
    self.eps = eps
    self.implementation = implementation

  def __call__(self, x, residual=None):
    """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)`."""
    return pallas_kernels.rms_norm(
      x,
      self.gamma[...].astype(x.dtype),
      residual,
      eps=self.eps,
      implementation=self.implementation,
    )


class SwiGLU(nnx.Module):
  """`(silu(x Wg) * (x Wu)) Wd`, the FFN of every SeqFormer block."""

  def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs, dtype):
    self.gate = Dense(d, hidden, ("embed", "mlp"), rngs=rngs, dtype=dtype)
    self.up = Dense(d, hidden, ("embed", "mlp"), rngs=rngs, dtype=dtype)
    self.down = Dense(hidden, d, ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def rope(x_tnh, pos_t, theta: float):
  """Rotary position embedding on the last axis (pairs split in halves)."""
  h = x_tnh.shape[-1]
  freq = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
  ang = pos_t.astype(jnp.float32)[:, None] * freq[None, :]  # [t, h/2]
  cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
  x1, x2 = jnp.split(x_tnh.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return out.astype(x_tnh.dtype)


def swiglu_hidden(d_model: int, mult: float) -> int:
  """FFN width: `mult * d_model` rounded up to a multiple of 32."""
  return int(-(-int(d_model * mult) // 32) * 32)
