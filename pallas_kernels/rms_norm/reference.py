"""Plain-`jnp` RMSNorm with optional fused residual add: the oracle (O11).

`y = x / sqrt(mean(x², -1) + eps) · gamma`, statistics in f32, output in the
input dtype. With `residual`, the op first forms the new residual stream
`h = x + residual` and returns `(norm(h), h)`, as a pre-norm transformer block
needs. Works on any leading shape, in particular the packed `[t, d]` buffer.

With `quantize` (an `Fp8Output`, G4) the normalized output is returned as an
`Fp8Tensor`: `y` (in the input dtype, exactly as without `quantize`)
quantized along `d` in activation blocks, with `y` itself as its `source`,
so gradients flow as if the output were `y` (straight-through), and the next
`fp8_dot_general` reads 8-bit values without quantizing again.
"""

import dataclasses

import jax.numpy as jnp

from pallas_kernels import fp8


@dataclasses.dataclass(frozen=True)
class Fp8Output:
  """Quantization of the norm's output for an FP8 matmul (`pallas_kernels.fp8`).

  format: "deepseek" (1x128 blocks) or "mxfp8" (32x32 blocks).
  block: `(br, bc)` to override the format's activation block.
  hadamard, hadamard_seed: as in `fp8.quantize`; the weight it meets must
    use the same transform.
  """

  format: str = "deepseek"
  block: tuple[int, int] | None = None
  hadamard: int | None = None
  hadamard_seed: int = 0

  @property
  def activation_block(self) -> tuple[int, int]:
    if self.block is not None:
      return tuple(self.block)
    return fp8.FORMATS[self.format].activation_block


def as_fp8_output(quantize) -> Fp8Output | None:
  """`None`, an `Fp8Output`, or a format name for its defaults."""
  if quantize is None or isinstance(quantize, Fp8Output):
    return quantize
  if isinstance(quantize, str):
    return Fp8Output(format=quantize)
  raise TypeError(
    f"quantize must be None, a format name or Fp8Output: {quantize!r}"
  )


def quantize_output(y, q: Fp8Output, implementation=None):
  """`y` as an `Fp8Tensor` along its last axis (source `y`)."""
  return fp8.quantize(
    y,
    block=q.activation_block,
    hadamard=q.hadamard,
    hadamard_seed=q.hadamard_seed,
    format=q.format,
    axis=-1,
    kind="activation",
    implementation=implementation,
  )


def rms_norm_reference(
  x, gamma=None, residual=None, *, eps: float = 1e-6, quantize=None
):
  h = x if residual is None else x + residual
  h32 = h.astype(jnp.float32)
  inv = jnp.reciprocal(jnp.sqrt(jnp.mean(h32 * h32, -1, keepdims=True) + eps))
  y = h32 * inv
  if gamma is not None:
    y = y * gamma.astype(jnp.float32)
  y = y.astype(x.dtype)
  q = as_fp8_output(quantize)
  if q is not None:
    y = quantize_output(y, q, implementation="xla")
  return y if residual is None else (y, h)
