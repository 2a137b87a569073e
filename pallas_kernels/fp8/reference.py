"""Plain-`jnp` FP8 quantize / dequantize / block-scaled product: the oracle.

Everything here works on the matrix view `[r, c]` of a tensor quantized along
its last axis (`c`, the contraction axis); `op.py` maps N-D tensors and
`dot_general` dimension numbers onto it. See `format.py` for the format and
the rounding, which these functions share with the kernels bit for bit.

Shapes: `x_rc` the input, `v_rc` e4m3 values, `s_RC` block scales with
`R = ceil(r / br)`, `C = ceil(c / bc)`.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8 import format as fmt

HIGHEST = lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("hb", "seed", "inverse"))
def hadamard_apply(x_rc, hb: int, seed: int, *, inverse: bool = False):
  """`x` times `blockdiag(D H) / sqrt(hb)` along `c` (or its transpose)."""
  r, c = x_rc.shape
  if c % hb:
    raise ValueError(f"Hadamard block {hb} must divide the axis length {c}")
  m = jnp.asarray(fmt.hadamard_signed(hb, seed))
  if inverse:
    m = m.T
  y = jnp.dot(
    x_rc.astype(jnp.float32).reshape(r, c // hb, hb), m, precision=HIGHEST
  )  # [r, c/hb, hb]
  return y.reshape(r, c) * fmt.hadamard_norm(hb)


def _pad_to(x, rows: int, cols: int):
  r, c = x.shape
  return jnp.pad(x, ((0, rows - r), (0, cols - c)))


@functools.partial(
  jax.jit, static_argnames=("block", "hadamard", "hadamard_seed")
)
def quantize_reference(
  x_rc,
  *,
  block: tuple[int, int],
  hadamard: int | None = None,
  hadamard_seed: int = 0,
  seed_hash=None,
):
  """`(v_rc, s_RC)`; stochastic rounding when `seed_hash` (int32) is given."""
  r, c = x_rc.shape
  br, bc = block
  x = x_rc.astype(jnp.float32)
  if hadamard:
    x = hadamard_apply(x, hadamard, hadamard_seed)
  rb, cb = -(-r // br), -(-c // bc)
  x = _pad_to(x, rb * br, cb * bc).reshape(rb, br, cb, bc)
  amax = jnp.max(jnp.abs(x), axis=(1, 3))  # [R, C]
  scale, inv = fmt.pow2_scale(amax)
  y = x * inv[:, None, :, None]
  bits = None
  if seed_hash is not None:
    rows = lax.broadcasted_iota(jnp.int32, (rb * br, cb * bc), 0)
    cols = lax.broadcasted_iota(jnp.int32, (rb * br, cb * bc), 1)
    bits = fmt.random_bits(seed_hash, rows, cols, c).reshape(y.shape)
  q = fmt.round_e4m3(y, bits).astype(fmt.E4M3)
  return q.reshape(rb * br, cb * bc)[:r, :c], scale


@functools.partial(jax.jit, static_argnames=("block", "shape"))
def expand_scales(s_RC, block, shape):
  """Block scales repeated to one per element, `[r, c]`."""
  br, bc = block
  r, c = shape
  return jnp.repeat(jnp.repeat(s_RC, br, axis=0), bc, axis=1)[:r, :c]


@functools.partial(
  jax.jit,
  static_argnames=(
    "block",
    "hadamard",
    "hadamard_seed",
    "undo_hadamard",
    "dtype",
  ),
)
def dequantize_reference(
  v_rc,
  s_RC,
  *,
  block: tuple[int, int],
  hadamard: int | None = None,
  hadamard_seed: int = 0,
  undo_hadamard: bool = True,
  dtype=jnp.float32,
):
  """`values * scales`, back in the original domain unless told otherwise."""
  x = v_rc.astype(jnp.float32) * expand_scales(s_RC, block, v_rc.shape)
  if hadamard and undo_hadamard:
    x = hadamard_apply(x, hadamard, hadamard_seed, inverse=True)
  return x.astype(dtype)


@functools.partial(jax.jit, static_argnames=("a_block", "b_block", "out_dtype"))
def scaled_matmul_reference(
  a_mk, sa, a_block, b_nk, sb, b_block, *, out_dtype=jnp.float32
):
  """`out[m, n] = sum_k deq(a)[m, k] deq(b)[n, k]`, f32 products and sums.

  Both operands are in the same (Hadamard or plain) domain along `k`, so no
  transform is undone: the product is already the product of the originals.
  On GPU the dequantized operands are bf16, which holds every e4m3 value
  times a power of two exactly, and the sums are f32 (tensor cores).
  """
  on_cpu = jax.default_backend() == "cpu"
  dt = jnp.float32 if on_cpu else jnp.bfloat16
  a = dequantize_reference(a_mk, sa, block=a_block, dtype=dt)
  b = dequantize_reference(b_nk, sb, block=b_block, dtype=dt)
  out = lax.dot_general(
    a,
    b,
    (((1,), (1,)), ((), ())),
    precision=HIGHEST if on_cpu else None,
    preferred_element_type=jnp.float32,
  )
  return out.astype(out_dtype)
