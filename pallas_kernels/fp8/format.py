"""The FP8 storage format: e4m3 values, power-of-two block scales (G4).

A tensor is quantized along one axis, the axis it will be contracted over
(the "contraction axis"). The values are stored with that axis moved last and
viewed as a matrix `[r, c]` (`r` = product of the other axes, `c` = the
contraction axis). Blocks of `br x bc` elements share one scale `s`, a power
of two (an E8M0 number: exponent only; stored here as float32 because it is
exact and the kernels read it as such):

  s = smallest power of two with  max|block| / s <= 448   (e4m3's largest)
  values = round_e4m3(x / s)                              (|values| <= 448)
  x ~= values * s

Formats (`FORMATS`):
  "mxfp8":    every tensor in 32x32 square blocks (the seed's MXFP8). A block
              of `x` is a block of `x.T`, so a tensor quantized once serves
              both the forward (contracted over `c`) and the backward
              (contracted over `r`) with the same values and scales.
  "deepseek": activations and gradients in 1x128 blocks, weights in 128x128
              blocks (DeepSeek-V3's FP8 training recipe). Hopper applies
              the scales once per 128 of the contraction instead of once per
              32: 2.7x faster on the H200 (1091 vs 401 TFLOP/s in one
              sweep), so it is the default there (`op.DEFAULT_FORMAT`).

Rounding: round-to-nearest-even onto the e4m3 grid, or (with a key)
stochastic rounding, unbiased: `E[round(y)] = y`. Both are done with integer
operations on the float32 bit pattern, identical in the `jnp` reference and
the Pallas kernel, so the two agree bit for bit.

Random Hadamard transform (optional): before quantizing, every block of `hb`
consecutive elements along the contraction axis is multiplied by
`M = D H / sqrt(hb)`, `D` a fixed diagonal of random signs (from
`hadamard_seed`), `H` the Sylvester Hadamard matrix. `M` is orthogonal, so
`(X M)(W^T M)^T = X W`: the product is unchanged while outliers are spread
over the block, which lowers the block maxima and so the rounding error.
Both operands of a product must use the same `(hb, hadamard_seed)`.

Scale math, by bits: for `amax = 1.f * 2^(E-127)` (E the float32 exponent
field), `amax / s <= 448 = 1.75 * 2^8` holds first for
`s = 2^(E-127-8)` if `1.f <= 1.75` (mantissa bits <= 0x600000), else for
twice that. `s` is clamped to at least 2^-126 so that `1/s` stays finite.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
# e4m3 has 3 mantissa bits: round-to-nearest is off by at most 2^-4 of the
# value (normal range), stochastic rounding by less than one step, 2^-3.
# Below 2^-6 (subnormals) the step is fixed at 2^-9 (times the scale).
RN_REL_ERR = 2.0**-4
SR_REL_ERR = 2.0**-3
SUBNORMAL_STEP = 2.0**-9


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  activation_block: tuple[int, int]
  weight_block: tuple[int, int]


FORMATS = {
  "mxfp8": Format("mxfp8", (32, 32), (32, 32)),
  "deepseek": Format("deepseek", (1, 128), (128, 128)),
}


def get_format(name: str) -> Format:
  try:
    return FORMATS[name]
  except KeyError:
    raise ValueError(
      f"unknown fp8 format {name!r}; choose one of {sorted(FORMATS)}"
    ) from None


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["values", "scales", "source"],
  meta_fields=["shape", "axis", "block", "hadamard", "hadamard_seed", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
  """A tensor quantized along `axis`; a pytree.

  Attributes:
    values: e4m3, the tensor with `axis` moved last (in the Hadamard domain
      when `hadamard` is set).
    scales: float32 powers of two, `[ceil(r / br), ceil(c / bc)]` over the
      `[r, c]` matrix view of `values`.
    source: the high-precision tensor it came from, or None. It is never read
      by the forward pass; it only routes gradients (straight-through) when
      the quantized tensor is used in `fp8_dot_general`. Drop it with
      `detach()` before storing the tensor.
    shape: the logical shape (that of `source`).
    axis: the contraction axis, non-negative.
    block: `(br, bc)`.
    hadamard: `hb` or None.
    hadamard_seed: seed of the random signs.
    dtype: the source dtype (default output dtype of products).
  """

  values: jax.Array
  scales: jax.Array
  source: jax.Array | None
  shape: tuple[int, ...]
  axis: int
  block: tuple[int, int]
  hadamard: int | None
  hadamard_seed: int
  dtype: jnp.dtype

  @property
  def matrix_shape(self) -> tuple[int, int]:
    c = self.shape[self.axis]
    return (int(np.prod(self.shape)) // max(c, 1) if c else 0, c)

  def detach(self) -> "Fp8Tensor":
    return dataclasses.replace(self, source=None)


# ---------------------------------------------------------------------------
# Bit-level helpers. Pure `jnp`/`lax` on int32 and float32 arrays, so the
# kernels call the very same functions on their register arrays.
# ---------------------------------------------------------------------------


def _i32(v: int) -> int:
  """An unsigned 32-bit constant as the int32 with the same bits."""
  return v - (1 << 32) if v >= (1 << 31) else v


def _srl(x, n: int):
  return lax.shift_right_logical(x, jnp.full_like(x, n))


def pow2_scale(amax):
  """`(s, 1/s)` for block maxima `amax >= 0` (float32, any shape)."""
  bits = lax.bitcast_convert_type(amax, jnp.int32)
  e = _srl(bits, 23)
  mant = bits & 0x7FFFFF
  e_s = e - 8 + jnp.where(mant > 0x600000, 1, 0)
  e_s = jnp.maximum(e_s, 1)
  scale = lax.bitcast_convert_type(e_s * (1 << 23), jnp.float32)
  inv = lax.bitcast_convert_type((254 - e_s) * (1 << 23), jnp.float32)
  return scale, inv


def hash32(x):
  """lowbias32 (C. Wellons): a well-mixed 32-bit hash on int32 bit patterns."""
  x = x ^ _srl(x, 16)
  x = x * _i32(0x7FEB352D)
  x = x ^ _srl(x, 15)
  x = x * _i32(0x846CA68B)
  return x ^ _srl(x, 16)


def random_bits(seed_hash, rows, cols, n_cols: int):
  """32 random bits per element from its (row, col) index and a seed."""
  return hash32((rows * n_cols + cols) ^ seed_hash)


def round_e4m3(y, bits=None):
  """Round float32 `y` (|y| <= 448) onto the e4m3 grid, result float32.

  `bits=None`: round to nearest, ties to even. Otherwise stochastic rounding
  with the given int32 random bits: the magnitude is rounded up with
  probability equal to its distance from the grid point below, in steps.
  """
  yb = lax.bitcast_convert_type(y, jnp.int32)
  sign = yb & _i32(0x80000000)
  mag = yb & 0x7FFFFFFF
  a = lax.bitcast_convert_type(mag, jnp.float32)
  # Normal e4m3 (|y| >= 2^-6): keep 3 of float32's 23 mantissa bits.
  if bits is None:
    lsb = _srl(mag, 20) & 1
    mag_n = (mag + (0x7FFFF + lsb)) & 0x7FF00000
    # Subnormal e4m3: multiples of 2^-9.
    sub = lax.round(a * 512.0, lax.RoundingMethod.TO_NEAREST_EVEN) * (
      1.0 / 512.0
    )
  else:
    mag_n = (mag + _srl(bits, 12)) & 0x7FF00000
    u = _srl(bits, 9).astype(jnp.float32) * (2.0**-23)
    sub = (a * 512.0 + u).astype(jnp.int32).astype(jnp.float32) * (1.0 / 512.0)
  normal = mag >= (121 << 23)
  r = jnp.where(normal, mag_n, lax.bitcast_convert_type(sub, jnp.int32))
  return lax.bitcast_convert_type(r | sign, jnp.float32)


def seed_hash_from_key(key) -> jax.Array:
  """An int32 scalar seed (already hashed) from a PRNG key."""
  bits = jax.random.bits(key, (), jnp.uint32)
  return hash32(lax.bitcast_convert_type(bits, jnp.int32))


# ---------------------------------------------------------------------------
# Hadamard transform.
# ---------------------------------------------------------------------------


@functools.cache
def hadamard_signed(hb: int, seed: int) -> np.ndarray:
  """`D H` with entries +-1 (float32, `[hb, hb]`); divide by sqrt(hb)."""
  if hb < 2 or hb & (hb - 1):
    raise ValueError(f"Hadamard block must be a power of two >= 2, got {hb}")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < hb:
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(seed).integers(0, 2, hb) * 2 - 1
  return (signs[:, None] * h).astype(np.float32)


def hadamard_norm(hb: int) -> float:
  return float(np.float32(1.0 / np.sqrt(hb)))
