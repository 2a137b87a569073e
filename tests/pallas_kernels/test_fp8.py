"""FP8 block-scaled quantize / dot_general (G4): numerics and kernels.

Bounds used below (u = 2^-4 for round-to-nearest, 2^-3 for stochastic
rounding; `s` the block scale; e4m3 subnormal step 2^-9):

  |deq(x) - x| <= u |x| + d,   d = 2^-10 s (RN) or 2^-9 s (SR)

and for a product of two quantized operands, summed over k,

  |out - x.w| <= sum_k (u|x| + dx)((1 + u)|w| + dw) + |x|(u|w| + dw)
                 + f32 summation (K 2^-24 sum |x||w|) + output rounding.

CPU tests run the `jnp` reference. Every Mosaic GPU kernel case runs twice
from one body (`conftest.py`'s `interpret`, or `mode` for the op, which
picks the kernels' mode from the backend): in GPU interpret mode on the
CPU at small shapes, and compiled under `-m gpu` on the H200, which adds
real shapes (the `test_gpu_*` tests).
"""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch, fp8
from pallas_kernels.fp8 import format as fmt
from pallas_kernels.fp8 import (
  mosaic_gpu,
  mosaic_gpu_matmul,
  mosaic_gpu_quantize,
  mosaic_gpu_quantizing_matmul,
  mosaic_gpu_transpose_quantize,
  primitives,
)
from pallas_kernels.fp8 import op as fp8_op
from pallas_kernels.fp8 import reference as ref

DN = (((1,), (0,)), ((), ()))
HI = lax.Precision.HIGHEST


def _data(key, shape, dtype=jnp.float32, spread=2.0):
  """Normal data whose magnitude varies by rows and columns (many scales)."""
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, shape, jnp.float32)
  rows = jnp.exp(spread * jax.random.normal(k2, shape[:-1] + (1,)))
  cols = jnp.exp(spread * jax.random.normal(k3, (shape[-1],)))
  return (x * rows * cols).astype(dtype)


def _block_scales(s_RC, block, shape):
  return np.asarray(ref.expand_scales(s_RC, block, shape))


# ---------------------------------------------------------------------------
# Format: scales and rounding.
# ---------------------------------------------------------------------------


def test_pow2_scale_is_the_smallest_power_of_two_that_fits():
  rng = np.random.default_rng(0)
  amax = np.concatenate(
    [
      np.exp(rng.uniform(-80, 80, 4000)).astype(np.float32),
      np.float32([0.0, 448.0, 448.00003, 449.0, 1.0, 1.75, 1.7500001, 3.0e38]),
    ]
  )
  s, inv = fmt.pow2_scale(jnp.asarray(amax))
  s, inv = np.asarray(s, np.float64), np.asarray(inv, np.float64)
  assert np.all(np.log2(s) == np.round(np.log2(s)))  # powers of two
  np.testing.assert_array_equal(s * inv, 1.0)
  assert np.all(amax / s <= 448.0)
  tiny = s == 2.0**-126
  assert np.all((amax / (s / 2) > 448.0) | tiny)  # and the smallest such


def test_round_to_nearest_matches_ml_dtypes():
  rng = np.random.default_rng(1)
  y = np.concatenate(
    [
      rng.uniform(-448, 448, 20000),
      rng.uniform(-(2**-5), 2**-5, 20000),  # e4m3 subnormals and their edge
      np.exp(rng.uniform(-12, 6, 20000)) * rng.choice([-1, 1], 20000),
      [0.0, 448.0, -448.0, 2**-6, 2**-9, 1.5 * 2**-9, 17.0, 18.0, 19.0],
    ]
  ).astype(np.float32)
  got = np.asarray(fmt.round_e4m3(jnp.asarray(y)))
  want = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(got, want)
  # and the result is exactly representable, so the final cast is exact
  np.testing.assert_array_equal(
    got.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), got
  )


def test_stochastic_rounding_lands_on_a_neighbour():
  y = jnp.asarray(
    np.random.default_rng(2).uniform(-448, 448, 4096), jnp.float32
  )
  bits = fmt.random_bits(fmt.hash32(jnp.int32(7)), jnp.arange(4096), 0, 1)
  r = np.asarray(fmt.round_e4m3(y, bits))
  lo = np.asarray(y).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  assert np.all(np.abs(r - np.asarray(y)) < 2 * np.abs(np.asarray(y)) / 8 + 1)
  np.testing.assert_array_equal(
    r.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), r
  )
  assert np.any(r != lo)  # it does not merely round to nearest


# ---------------------------------------------------------------------------
# quantize / dequantize error bounds, per block.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (37, 70), (3, 5, 96), (0, 64)])
@pytest.mark.parametrize("format", ["mxfp8", "deepseek"])
@pytest.mark.parametrize("kind", ["activation", "weight"])
def test_quantize_error_bound_per_block(shape, format, kind):
  x = _data(jax.random.key(3), shape)

  @jax.jit
  def q(x):
    t = fp8.quantize(x, format=format, kind=kind, implementation="xla")
    return t, fp8.dequantize(t, jnp.float32)

  t, deq = q(x)
  assert t.values.dtype == jnp.float8_e4m3fn
  br, bc = t.block
  assert t.block == getattr(fmt.FORMATS[format], f"{kind}_block")
  r, c = t.matrix_shape
  assert t.scales.shape == (-(-r // br), -(-c // bc))
  deq = np.asarray(deq).reshape(r, c)
  xs = np.asarray(x).reshape(r, c)
  s = _block_scales(t.scales, t.block, (r, c))
  err = np.abs(deq - xs)
  bound = fmt.RN_REL_ERR * np.abs(xs) + 0.5 * fmt.SUBNORMAL_STEP * s
  assert np.all(err <= bound)
  # Scales are as small as allowed: each block's maximum uses the top binade.
  if r and c:
    v = np.abs(np.asarray(t.values, np.float32)).reshape(r, c)
    bmax = np.zeros(t.scales.shape)
    np.maximum.at(bmax, (np.arange(r)[:, None] // br, np.arange(c) // bc), v)
    amax = np.zeros(t.scales.shape)
    np.maximum.at(
      amax, (np.arange(r)[:, None] // br, np.arange(c) // bc), np.abs(xs)
    )
    nonzero = amax > 0
    assert np.all(bmax[nonzero] > 448 / 2 - 16)  # RN may round 224+ down


def test_quantize_along_an_inner_axis_keeps_the_logical_layout():
  w = _data(jax.random.key(4), (96, 5, 64))
  t = fp8.quantize(w, axis=0, kind="weight", implementation="xla")
  assert t.values.shape == (5, 64, 96) and t.shape == w.shape
  deq = fp8.dequantize(t, jnp.float32)
  assert deq.shape == w.shape
  rel = jnp.linalg.norm(deq - w) / jnp.linalg.norm(w)
  assert rel < 2 * fmt.RN_REL_ERR / np.sqrt(3)


# ---------------------------------------------------------------------------
# Hadamard transform.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("hb", [2, 32, 128])
def test_hadamard_is_orthogonal_and_undone_exactly(hb):
  m = fmt.hadamard_signed(hb, 5).astype(np.float64) / np.sqrt(hb)
  np.testing.assert_allclose(m @ m.T, np.eye(hb), atol=1e-12)
  x = _data(jax.random.key(6), (8, 4 * hb))
  y = ref.hadamard_apply(x, hb, 5)
  back = ref.hadamard_apply(y, hb, 5, inverse=True)
  np.testing.assert_allclose(
    back, x, rtol=2e-6, atol=1e-6 * float(jnp.max(jnp.abs(x)))
  )
  # (X M)(W^T M)^T = X W
  w = _data(jax.random.key(7), (4 * hb, 16))
  lhs = jnp.dot(y, ref.hadamard_apply(w.T, hb, 5).T, precision=HI)
  np.testing.assert_allclose(
    lhs,
    jnp.dot(x, w, precision=HI),
    rtol=1e-4,
    atol=1e-4
    * float(jnp.max(jnp.abs(jnp.dot(jnp.abs(x), jnp.abs(w), precision=HI)))),
  )
  # the random signs differ between seeds
  assert (
    not np.array_equal(fmt.hadamard_signed(hb, 5), fmt.hadamard_signed(hb, 6))
    or hb == 2
  )


def test_hadamard_spreads_an_outlier():
  x = jnp.zeros((32, 128)).at[:, 3].set(100.0) + _data(
    jax.random.key(8), (32, 128), spread=0.1
  )
  plain = fp8.quantize(x, implementation="xla")
  rot = fp8.quantize(x, hadamard=128, implementation="xla")
  err = lambda t: float(jnp.linalg.norm(fp8.dequantize(t, jnp.float32) - x))
  assert err(rot) < err(plain)


def test_dequantize_with_hadamard_error_bound():
  x = _data(jax.random.key(9), (64, 256))
  t = fp8.quantize(x, hadamard=64, implementation="xla")
  xh = ref.hadamard_apply(x, 64, 0)
  s = _block_scales(t.scales, t.block, (64, 256))
  # The error is bounded in the rotated domain; M is orthogonal, so the
  # Frobenius norm of the error is the same in the original one.
  bound = fmt.RN_REL_ERR * np.abs(np.asarray(xh)) + 2.0**-10 * s
  err = np.asarray(fp8.dequantize(t, jnp.float32) - x)
  assert np.linalg.norm(err) <= np.linalg.norm(bound) * (1 + 1e-5)


# ---------------------------------------------------------------------------
# Stochastic rounding.
# ---------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased():
  """Mean error over N keys -> 0 like 1/sqrt(N) (Hoeffding, cannot flake).

  Each sample error e lies in (-ulp, ulp) with E[e] = 0, so
  P(|mean_N e| >= c ulp / sqrt(N)) <= 2 exp(-c^2 / 2): 1e-14 for c = 8, per
  element. The keys are fixed, so the test is also deterministic.
  Round-to-nearest, by contrast, keeps a bias that does not shrink.
  """
  x = _data(jax.random.key(10), (32, 32), spread=0.5)
  _, s = ref.quantize_reference(x, block=(32, 32))
  y = np.asarray(x, np.float64) / float(s[0, 0])  # in units of the scale
  # e4m3 step at each value (normal range; subnormals: 2^-9)
  e = np.floor(np.log2(np.maximum(np.abs(y), 2.0**-6)))
  ulp = 2.0 ** (e - 3)
  keys = jax.random.split(jax.random.key(11), 4096)

  def one(key):
    v, _ = ref.quantize_reference(
      x, block=(32, 32), seed_hash=fmt.seed_hash_from_key(key)
    )
    return v.astype(jnp.float32)

  samples = np.asarray(jax.lax.map(one, keys, batch_size=256), np.float64)
  errs = samples - y[None]
  assert np.all(np.abs(errs) < ulp[None])
  for n in (64, 4096):
    mean = errs[:n].mean(0)
    assert np.all(np.abs(mean) <= 8 * ulp / np.sqrt(n)), n
  rn = np.asarray(ref.quantize_reference(x, block=(32, 32))[0], np.float64)
  rn_bias = np.abs(rn - y)
  # RN is biased: for many elements its error is far above the SR bound.
  assert np.mean(rn_bias > 8 * ulp / np.sqrt(4096)) > 0.5
  assert np.abs(errs.mean(0)).mean() < 0.1 * rn_bias.mean()


def test_quantize_with_key_uses_stochastic_rounding():
  x = _data(jax.random.key(12), (64, 64))
  a = fp8.quantize(x, key=jax.random.key(0), implementation="xla")
  b = fp8.quantize(x, key=jax.random.key(1), implementation="xla")
  c = fp8.quantize(x, key=jax.random.key(0), implementation="xla")
  assert not np.array_equal(a.values, b.values)
  np.testing.assert_array_equal(a.values, c.values)
  s = _block_scales(a.scales, a.block, (64, 64))
  err = np.abs(np.asarray(fp8.dequantize(a, jnp.float32) - x))
  bound = fmt.SR_REL_ERR * np.abs(np.asarray(x)) + fmt.SUBNORMAL_STEP * s
  assert np.all(err <= bound)


# ---------------------------------------------------------------------------
# fp8_dot_general: values and gradients against f32.
# ---------------------------------------------------------------------------


def _product_bound(x, w, xq, wq, u=fmt.RN_REL_ERR):
  """Elementwise bound on |deq(x) deq(w) - x w| (module docstring)."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  dx = 2.0**-10 * np.asarray(
    ref.expand_scales(xq.scales, xq.block, x.shape), np.float64
  )
  # `wq` is quantized along axis 0: its matrix view is w^T.
  dw = (
    2.0**-10
    * np.asarray(
      ref.expand_scales(wq.scales, wq.block, w.T.shape), np.float64
    ).T
  )
  ax, aw = np.abs(x), np.abs(w)
  bound = (u * ax + dx) @ ((1 + u) * aw + dw) + ax @ (u * aw + dw)
  k = x.shape[1]
  return bound + (k * 2.0**-24 + 2.0**-23) * (ax @ aw)


@pytest.mark.parametrize(
  "m,k,n", [(1, 32, 8), (37, 70, 5), (64, 128, 96), (5, 1, 3), (0, 64, 16)]
)
@pytest.mark.parametrize("format", ["mxfp8", "deepseek"])
def test_dot_value_error_bound(m, k, n, format):
  x = _data(jax.random.key(13), (m, k))
  w = _data(jax.random.key(14), (k, n))
  out = jax.jit(
    functools.partial(
      fp8.fp8_dot_general,
      dimension_numbers=DN,
      preferred_element_type=jnp.float32,
      format=format,
      implementation="xla",
    )
  )(x, w)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  xq = fp8.quantize(x, format=format, implementation="xla")
  wq = fp8.quantize(
    w, axis=0, kind="weight", format=format, implementation="xla"
  )
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  err = np.abs(np.asarray(out, np.float64) - exact)
  assert np.all(err <= _product_bound(x, w, xq, wq))


def test_dot_typical_relative_error_and_dtype():
  x = _data(jax.random.key(15), (128, 256), jnp.bfloat16, spread=0.5)
  w = _data(jax.random.key(16), (256, 64), jnp.bfloat16, spread=0.5)
  out = fp8.fp8_dot_general(x, w, DN, implementation="xla")
  assert out.dtype == jnp.bfloat16
  exact = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=HI)
  rel = jnp.linalg.norm(out.astype(jnp.float32) - exact) / jnp.linalg.norm(
    exact
  )
  assert rel < 0.05  # about 2 u / sqrt(3) = 3.6% for RN, plus bf16 output


def _grads(f, x, w, g):
  @jax.jit
  def run(x, w, g):
    out, pull = jax.vjp(f, x, w)
    return out, pull(g)

  return run(x, w, g)


@pytest.mark.parametrize("format", ["mxfp8", "deepseek"])
@pytest.mark.parametrize("grad_rhs_fp8", [False, True])
@pytest.mark.parametrize("hadamard", [None, 32])
def test_dot_gradients(format, grad_rhs_fp8, hadamard):
  m, k, n = 48, 128, 40
  x = _data(jax.random.key(17), (m, k))
  w = _data(jax.random.key(18), (k, n))
  g = _data(jax.random.key(19), (m, n))
  kw = dict(format=format, hadamard=hadamard, implementation="xla")
  f = functools.partial(
    fp8.fp8_dot_general,
    dimension_numbers=DN,
    grad_rhs_fp8=grad_rhs_fp8,
    preferred_element_type=jnp.float32,
    **kw,
  )
  _, (dx, dw) = _grads(f, x, w, g)
  # What the backward computes, from the definitions (straight-through):
  wq = fp8.quantize(w, axis=0, kind="weight", **kw)
  gq = fp8.quantize(g, **kw | dict(hadamard=None))
  w_h = ref.dequantize_reference(
    wq.values, wq.scales, block=wq.block, undo_hadamard=False
  )  # [n, k] in the rotated domain
  g_d = fp8.dequantize(gq, jnp.float32)
  dx_want = jnp.dot(g_d, w_h, precision=HI)
  if hadamard:
    dx_want = ref.hadamard_apply(dx_want, hadamard, 0, inverse=True)
  np.testing.assert_allclose(
    dx, dx_want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(dx_want)))
  )
  # And against the exact f32 gradients: the FP8 error, in norm.
  dx_exact = jnp.dot(g, w.T, precision=HI)
  dw_exact = jnp.dot(x.T, g, precision=HI)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(dx, dx_exact) < 2.5 * fmt.RN_REL_ERR
  assert rel(dw, dw_exact) < 2.5 * fmt.RN_REL_ERR
  if not grad_rhs_fp8:
    # BF16 weight gradient: g times x as the caller passed it (both as
    # bf16), in x's own basis whatever the Hadamard transform.
    bf = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
    dw_want = jnp.dot(bf(x).T, bf(g), precision=HI)
    np.testing.assert_allclose(
      dw, dw_want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(dw_want)))
    )
    assert rel(dw, dw_exact) < 0.01  # bf16 inputs only: no FP8 error


@pytest.mark.parametrize("hadamard", [None, 32])
def test_keep_fp8_lhs_keeps_8_bits_for_the_bf16_weight_gradient(hadamard):
  """`keep_fp8_lhs`: the backward keeps the lhs's e4m3 values and scales
  instead of its bf16 source (about half the bytes), same output and dX,
  and dW is `g^T` times the dequantized lhs (its quantization error,
  rotated back when a Hadamard transform is on)."""
  m, k, n = 48, 256, 40
  x = _data(jax.random.key(23), (m, k), jnp.bfloat16, spread=1.0)
  w = _data(jax.random.key(24), (k, n), spread=1.0)
  g = _data(jax.random.key(25), (m, n), spread=1.0)
  kw = dict(hadamard=hadamard, implementation="xla")
  f = lambda keep: functools.partial(
    fp8.fp8_dot_general, dimension_numbers=DN, keep_fp8_lhs=keep,
    preferred_element_type=jnp.float32, **kw,
  )  # fmt: skip
  out, (dx, dw) = _grads(f(False), x, w, g)
  out8, (dx8, dw8) = _grads(f(True), x, w, g)
  np.testing.assert_array_equal(out8, out)
  np.testing.assert_array_equal(dx8, dx)

  def kept(keep):
    res = jax.eval_shape(lambda x, w: jax.vjp(f(keep), x, w)[1], x, w)
    return {(r.shape, r.dtype.name) for r in jax.tree.leaves(res)}

  assert ((m, k), "bfloat16") in kept(False) - kept(True)
  assert ((m, k), "float8_e4m3fn") in kept(True) - kept(False)
  xq = fp8.quantize(x, **kw)
  x8 = fp8.dequantize(xq, jnp.float32)  # Hadamard undone
  bf = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
  dw_want = jnp.dot(x8.T, bf(g), precision=HI)
  np.testing.assert_allclose(
    dw8, dw_want, rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(dw_want)))
  )
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(dw8, dw_want) < 2.0**-7  # bf16 operand rounding only
  assert 0.005 < rel(dw8, dw) < 2.5 * fmt.RN_REL_ERR  # e4m3's rounding


def test_prequantized_weight_routes_its_gradient_to_the_source():
  x = _data(jax.random.key(20), (32, 64))
  w = _data(jax.random.key(21), (64, 16))
  g = _data(jax.random.key(22), (32, 16))
  raw = lambda x, w: fp8.fp8_dot_general(x, w, DN, implementation="xla")

  def pre(x, w):
    wq = fp8.quantize(w, axis=0, kind="weight", implementation="xla")
    return fp8.fp8_dot_general(x, wq, DN, implementation="xla")

  out1, (dx1, dw1) = _grads(raw, x, w, g)
  out2, (dx2, dw2) = _grads(pre, x, w, g)
  np.testing.assert_array_equal(out1, out2)
  np.testing.assert_array_equal(dx1, dx2)
  np.testing.assert_array_equal(dw1, dw2)
  # a detached tensor gives no gradient path, but still computes
  wq = fp8.quantize(w, axis=0, kind="weight", implementation="xla").detach()
  out3, pull = jax.vjp(
    lambda x: fp8.fp8_dot_general(x, wq, DN, implementation="xla"), x
  )
  np.testing.assert_array_equal(out3, out1)
  np.testing.assert_array_equal(pull(g)[0], dx1)


@pytest.mark.usefixtures("mode")
@pytest.mark.parametrize("impl", ["xla", "mosaic"])
def test_fp8_weight_gradient_in_either_rhs_layout(impl):
  """The FP8 weight gradient of `w [k, n]` (contracted first: computed as
  `x^T g` and transposed, which the layout change cancels) and of `w^T
  [n, k]` (contracted last: `g^T x`) are transposes of each other."""
  x = _data(jax.random.key(64), (256, 128), jnp.bfloat16, spread=1.0)
  w = _data(jax.random.key(65), (128, 128), jnp.bfloat16, spread=1.0)
  g = _data(jax.random.key(66), (256, 128), jnp.bfloat16, spread=1.0)
  kw = dict(grad_rhs_fp8=True, implementation=impl)
  dw_kn = _grads(
    functools.partial(fp8.fp8_dot_general, dimension_numbers=DN, **kw), x, w, g
  )[1][1]
  dn_t = (((1,), (1,)), ((), ()))
  dw_nk = _grads(
    functools.partial(fp8.fp8_dot_general, dimension_numbers=dn_t, **kw),
    x,
    w.T,
    g,
  )[1][1]
  assert dw_kn.shape == w.shape and dw_nk.shape == w.T.shape
  _close_bf16(dw_nk.T, dw_kn)


def test_dot_general_dimension_numbers_match_lax():
  rng = jax.random.split(jax.random.key(23), 6)
  cases = [
    # dense: [b, t, d] x [d, f]
    ((2, 3, 64), (64, 24), (((2,), (0,)), ((), ()))),
    # einsum 'btd,dhk->bthk'
    ((2, 3, 64), (64, 4, 8), (((2,), (0,)), ((), ()))),
    # contraction on the lhs's first axis, rhs's last: 'dm,nd->mn'
    ((64, 10), (12, 64), (((0,), (1,)), ((), ()))),
    # experts: 'ebd,edf->ebf'
    ((3, 16, 64), (3, 64, 20), (((2,), (1,)), ((0,), (0,)))),
    # batch dims not in front: 'bde,edf->ebf'... as 'bed,edf' -> e,b,f
    ((5, 3, 64), (3, 64, 20), (((2,), (1,)), ((1,), (0,)))),
  ]
  for i, (ls, rs, dn) in enumerate(cases):
    x = _data(rng[i], ls)
    w = _data(rng[5], rs)
    got = jax.jit(
      functools.partial(
        fp8.fp8_dot_general,
        dimension_numbers=dn,
        preferred_element_type=jnp.float32,
        implementation="xla",
      )
    )(x, w)
    want = lax.dot_general(x, w, dn, precision=HI)
    assert got.shape == want.shape, (i, got.shape, want.shape)
    rel = jnp.linalg.norm(got - want) / jnp.linalg.norm(want)
    assert rel < 2 * fmt.RN_REL_ERR, (i, rel)


def test_jit_vmap_grad_compose():
  x = _data(jax.random.key(24), (4, 16, 64))
  w = _data(jax.random.key(25), (64, 32))

  def f(x, w):
    return fp8.fp8_dot_general(
      x, w, DN, preferred_element_type=jnp.float32, implementation="xla"
    )

  loss = lambda x, w: jnp.sum(jax.vmap(f, in_axes=(0, None))(x, w) ** 2)
  g_vmap = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  # The same as an explicit loop (blocks never straddle batch entries: 16
  # rows = half a 32-row block per entry, padded per entry).
  loop = lambda x, w: sum(jnp.sum(f(x[i], w) ** 2) for i in range(4))
  g_loop = jax.grad(loop, argnums=(0, 1))(x, w)
  for a, b in zip(g_vmap, g_loop, strict=True):
    np.testing.assert_allclose(
      a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b)))
    )


@pytest.mark.parametrize(
  "format,grad_rhs_fp8,keep_fp8_lhs",
  [
    ("deepseek", False, False),
    ("deepseek", False, True),
    ("deepseek", True, False),
    ("mxfp8", False, False),
    ("mxfp8", True, False),
  ],
)
@pytest.mark.parametrize("prequantized", [False, True])
def test_weight_gradient_under_vmap_is_one_contraction(
  format, grad_rhs_fp8, keep_fp8_lhs, prequantized
):
  """The train step maps the model over data shards: a shared weight's
  gradient must come out as one product over every shard's rows (as JAX's
  transpose of `dot_general` writes it), never as a gradient per shard
  summed after. So the vmapped gradient equals that of the shards' rows
  stacked into one matrix, bit for bit, and dX equals each shard's own. A
  weight per batch entry still gets its own gradient. Both
  implementations' programs are checked; the values on "xla"."""
  s, t, k, n = 4, 32, 256, 128
  x = _data(jax.random.key(60), (s, t, k), jnp.bfloat16, spread=1.0)
  w = _data(jax.random.key(61), (k, n), jnp.float32, spread=1.0)
  ct = _data(jax.random.key(62), (s, t, n), jnp.float32, spread=1.0)

  def loss(impl, x, w, ct):
    if prequantized:  # as the FSDP weight hook hands it over
      w = fp8.quantize(w, axis=0, kind="weight", format=format,
                       implementation=impl)  # fmt: skip
    y = fp8.fp8_dot_general(
      x, w, (((x.ndim - 1,), (0,)), ((), ())),
      preferred_element_type=jnp.bfloat16, format=format,
      grad_rhs_fp8=grad_rhs_fp8, keep_fp8_lhs=keep_fp8_lhs,
      implementation=impl,
    )  # fmt: skip
    return jnp.sum(y.astype(jnp.float32) * ct)

  def shared(impl):
    return jax.grad(
      lambda x, w: jnp.sum(
        jax.vmap(functools.partial(loss, impl), (0, None, 0))(x, w, ct)
      ),
      (0, 1),
    )

  for impl in ("xla", "mosaic"):
    text = jax.jit(shared(impl)).lower(x, w).as_text()
    for shape in (f"{s}x{k}x{n}x", f"{s}x{n}x{k}x"):
      assert f"tensor<{shape}" not in text, (impl, shape)  # per shard
  dx, dw = jax.jit(shared("xla"))(x, w)
  # One product over the stacked rows.
  rows = lambda a: a.reshape(s * t, -1)
  dw_rows = jax.jit(jax.grad(functools.partial(loss, "xla"), 1))(
    rows(x), w, rows(ct)
  )
  np.testing.assert_array_equal(dw, dw_rows)
  ws = jnp.stack([w * (i + 1) for i in range(s)])
  one = jax.jit(jax.grad(functools.partial(loss, "xla"), (0, 1)))
  per = jax.jit(jax.vmap(jax.grad(functools.partial(loss, "xla"), (0, 1))))(
    x, ws, ct
  )
  for i in range(s):
    np.testing.assert_array_equal(dx[i], one(x[i], w, ct[i])[0])
    want = one(x[i], ws[i], ct[i])
    np.testing.assert_array_equal(per[0][i], want[0])
    np.testing.assert_array_equal(per[1][i], want[1])


def test_errors():
  x = _data(jax.random.key(26), (8, 64))
  w = _data(jax.random.key(27), (64, 8))
  wq = fp8.quantize(w, axis=0, kind="weight", hadamard=32, implementation="xla")
  with pytest.raises(ValueError, match="Hadamard"):
    fp8.fp8_dot_general(x, wq, DN, implementation="xla")
  wq1 = fp8.quantize(w, axis=1, implementation="xla")
  with pytest.raises(ValueError, match="quantized along axis 1"):
    fp8.fp8_dot_general(x, wq1, DN, implementation="xla")
  with pytest.raises(ValueError, match="unknown fp8 format"):
    fp8.quantize(x, format="mx6")
  with pytest.raises(ValueError, match="must divide"):
    fp8.quantize(x[:, :48], hadamard=32, implementation="xla")
  with pytest.raises(NotImplementedError, match="one contracting"):
    fp8.fp8_dot_general(x, x, (((0, 1), (0, 1)), ((), ())))


# ---------------------------------------------------------------------------
# The Mosaic GPU kernels in GPU interpret mode, against the reference.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "block,hb,sr,num_sms,rows,tile",
  [
    # The defaults (grid form for 32x32, ring form for 1x128 and with a
    # Hadamard transform).
    ((32, 32), None, False, 132, 192, {}),
    ((1, 128), 128, True, 132, 192, {}),
    ((32, 32), 32, False, 132, 192, {}),
    ((1, 128), None, False, 1, 384, {}),
    # Grid form: one program walks a 3-step pipeline.
    ((32, 32), 32, True, 1, 192, dict(warpgroups=0)),
    # Grid form, hardware round-to-nearest, 128-row tiles in two parts.
    ((1, 128), None, False, 1, 384, dict(warpgroups=0, tile_r=128, stages=3)),
    ((32, 32), None, False, 1, 256, dict(tile_r=128, stages=2)),
    # Persistent form: warpgroups of one CTA each walk their own ring of
    # tiles (some get fewer tiles than others), sharing the Hadamard matrix.
    ((1, 128), None, False, 1, 384, dict(warpgroups=4, out_slots=2)),
    ((1, 128), 128, False, 1, 192, dict(warpgroups=2, out_slots=1)),
    ((32, 32), 32, True, 2, 256, dict(warpgroups=1, tile_r=128, stages=3)),
  ],
)
def test_quantize_kernel_equals_reference(
  block, hb, sr, num_sms, rows, tile, interpret
):
  x = _data(jax.random.key(28), (rows, 128), jnp.bfloat16)
  # A subnormal e4m3 result and zeros (the row maximum sets the scale).
  x = x.at[0, :4].set(jnp.asarray([1e-3, -(2.0**-12), 0.0, 0.0], jnp.bfloat16))
  seed = fmt.hash32(jnp.int32(99)) if sr else None
  v, se = mosaic_gpu_quantize.quantize_mgpu(
    x,
    seed,
    block=block,
    hadamard=hb,
    sr=sr,
    interpret=interpret,
    num_sms=num_sms,
    **tile,
  )
  rv, rs = ref.quantize_reference(x, block=block, hadamard=hb, seed_hash=seed)
  np.testing.assert_array_equal(se[:, :: block[0]].T, rs)
  if hb is None:
    np.testing.assert_array_equal(v.astype(jnp.float32), rv.astype(jnp.float32))
  else:
    # Hadamard sums may differ in order: at most one e4m3 step apart.
    d = np.abs(np.asarray(v, np.float32) - np.asarray(rv, np.float32))
    step = 2.0 ** (
      np.floor(np.log2(np.maximum(np.abs(np.asarray(rv, np.float32)), 2.0**-6)))
      - 3
    )
    assert np.all(d <= step) and np.mean(d == 0) > 0.999


def _spy(monkeypatch, module, name, note):
  """Wrap kernel `module.name`: each call appends `note(*args, **kwargs)`
  to the returned list. Traced kernels are forgotten, so the next traces
  call the wrapper."""
  calls = []
  kernel = getattr(module, name)

  def spy(*args, **kwargs):
    calls.append(note(*args, **kwargs))
    return kernel(*args, **kwargs)

  monkeypatch.setattr(module, name, spy)
  _forget_traces()
  return calls


def _forget_traces():
  primitives._matmul_kernel_fn.cache_clear()
  primitives._transpose_quantize_fn.cache_clear()
  jax.clear_caches()


# The kernel's three forms: x^T from bf16 (one warpgroup), from bf16 with
# x along its rows too (two compute warpgroups), from e4m3 values.
TRANSPOSE_FORMS = ["bf16", "bf16 rows_too", "e4m3"]


@pytest.mark.parametrize("form", TRANSPOSE_FORMS)
@pytest.mark.parametrize(
  "r,c,num_sms,steps", [(384, 256, 4, 1), (1536, 128, 4, 3)]
)
def test_transpose_quantize_equals_quantize_of_transpose(
  r, c, num_sms, steps, form, interpret
):
  """`x^T` quantized from `x` as stored (bf16, or e4m3 values with their
  scales, dequantized in registers) equals `quantize_mgpu` of the
  transposed (dequantized) matrix bit for bit: the identity wgmma's sums
  are exact. Programs of one tile, and of three (the output slots wrap).
  From bf16, `rows_too` also gives `quantize_mgpu(x)` itself, bit for bit,
  from the same read (the FP8 backward's two quantizations of `g`)."""
  # About one program per SM: 6 of one tile, 4 of three.
  assert (
    mosaic_gpu.steps_per_program(r // 128, c // 128, num_sms, per_sm=1) == steps
  )
  x = _data(jax.random.key(50), (r, c), jnp.bfloat16)
  # A subnormal e4m3 result and zeros (the block maximum sets the scale).
  x = x.at[:4, 0].set(jnp.asarray([1e-3, -(2.0**-12), 0.0, 0.0], jnp.bfloat16))
  src, sx = x, None
  if form == "e4m3":
    src, sx = mosaic_gpu_quantize.quantize_mgpu(
      x, block=(1, 128), interpret=interpret
    )
    sx_rc = jnp.repeat(sx, 128, axis=0).T  # one scale per element
    x = (src.astype(jnp.float32) * sx_rc).astype(jnp.bfloat16)  # exact
  rows_too = form == "bf16 rows_too"
  v, se, *rows = mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
    src, sx, interpret=interpret, num_sms=num_sms, rows_too=rows_too
  )
  rv, rse = mosaic_gpu_quantize.quantize_mgpu(
    x.T, block=(1, 128), interpret=interpret
  )
  assert v.shape == (c, r) and se.shape == (r // 128, c)
  np.testing.assert_array_equal(se, rse)
  np.testing.assert_array_equal(v.astype(jnp.float32), rv.astype(jnp.float32))
  assert len(rows) == (2 if rows_too else 0)
  if rows_too:
    vr, ser = rows
    want_v, want_s = mosaic_gpu_quantize.quantize_mgpu(
      x, block=(1, 128), interpret=interpret
    )
    assert vr.shape == (r, c) and ser.shape == want_s.shape
    np.testing.assert_array_equal(ser, want_s)
    np.testing.assert_array_equal(
      vr.astype(jnp.float32), want_v.astype(jnp.float32)
    )


def test_transpose_quantize_refuses_bad_input():
  x = jnp.zeros((128, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="128"):
    mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
      x[:64], interpret=True
    )
  with pytest.raises(ValueError, match="scales go with e4m3"):
    mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
      x, jnp.ones((1, 128)), interpret=True
    )
  with pytest.raises(ValueError, match="must be bf16"):
    mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
      x.astype(jnp.float32), interpret=True
    )
  with pytest.raises(ValueError, match="scales"):
    mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
      x.astype(jnp.float8_e4m3fn), jnp.ones((2, 128)), interpret=True
    )
  with pytest.raises(ValueError, match="rows_too quantizes a bf16"):
    mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
      x.astype(jnp.float8_e4m3fn),
      jnp.ones((1, 128)),
      interpret=True,
      rows_too=True,
    )


@pytest.mark.usefixtures("mode")
def test_fp8_weight_gradient_quantizes_transposed_in_one_pass(monkeypatch):
  """The FP8 weight gradient (1 x 128 activations) quantizes g^T from g
  and the lhs^T from the forward's values and scales with the transposing
  kernel, not by writing transposes first, and g for dX in the same pass
  as g^T; results equal the reference, also off the 128-row tile and
  under vmap."""
  calls = _spy(
    monkeypatch,
    mosaic_gpu_transpose_quantize,
    "transpose_quantize_mgpu",
    lambda x, *_, rows_too=False, **__: (x.shape, x.dtype.name, rows_too),
  )
  plain = _spy(
    monkeypatch,
    mosaic_gpu_quantize,
    "quantize_mgpu",
    lambda x, *_, **__: x.shape,
  )
  x = _data(jax.random.key(51), (70, 256), jnp.bfloat16, spread=1.0)
  w = _data(jax.random.key(52), (256, 300), jnp.bfloat16, spread=1.0)
  g = _data(jax.random.key(53), (70, 300), jnp.bfloat16, spread=1.0)
  f = functools.partial(
    fp8.fp8_dot_general, dimension_numbers=DN, grad_rhs_fp8=True
  )
  o1, grads1 = _grads(functools.partial(f, implementation="mosaic"), x, w, g)
  # g [70, 300] (both ways) and x [70, 256], rows padded to 128, columns
  # to 384 / 256; the quantize kernel only for x and w in the forward.
  assert calls == [
    ((128, 384), "bfloat16", True),
    ((128, 256), "float8_e4m3fn", False),
  ]
  assert (128, 384) not in plain, plain
  o2, grads2 = _grads(functools.partial(f, implementation="xla"), x, w, g)
  for a, b in ((o1, o2), *zip(grads1, grads2, strict=True)):
    _close_bf16(a, b)
  xs = jnp.stack([x, x[::-1]])
  gs = jnp.stack([g, g[::-1]])

  def batched(impl):
    one = functools.partial(f, implementation=impl)
    return jax.vmap(lambda x, g: _grads(one, x, w, g)[1][1])(xs, gs)

  _close_bf16(batched("mosaic"), batched("xla"))


_B, _D = mosaic_gpu_matmul.BlockSizes, mosaic_gpu_matmul.Dim


@pytest.mark.parametrize(
  "kb,ablk,bblk,bs,k",
  [
    (32, (32, 32), (32, 32), _B(), 256),
    (128, (1, 128), (128, 128), _B(), 256),
    # Whole rings per tile and two tiles per program: the pipelines of one
    # program's tiles are chained (the next tile's fetches start early).
    (128, (1, 128), (128, 128), _B(max_concurrent_steps=2), 512),
    (32, (32, 32), (32, 32), _B(max_concurrent_steps=2), 256),
    # primitives.py's default for this test's f32 output: 192 x 128 CTA tiles of
    # three warpgroups, weight scale folded into the row scales, 3 stages;
    # the 256 rows are one row tile and one overlapping it (`row_start`).
    (
      128,
      (1, 128),
      (128, 128),
      mosaic_gpu_matmul.default_block_sizes(128, jnp.float32),
      384,  # chained: 3 steps per tile in a 3-stage ring
    ),
    # Three warpgroups in 2-CTA clusters along N (multicast activations).
    (128, (1, 128), (128, 128), _B(compute_wgs=3, cluster_dimension=_D.N), 256),
    # Two block products in flight per warpgroup.
    (128, (1, 128), (128, 128), _B(tile_k=256, max_concurrent_steps=2), 256),
    # Per-row scales on both sides (an FP8 weight gradient): the op's
    # default for them, two block products in flight, a column scale per
    # element in the promotion.
    (
      128,
      (1, 128),
      (1, 128),
      mosaic_gpu_matmul.default_block_sizes(128, jnp.float32, uniform=False),
      768,
    ),
    (32, (32, 32), (32, 32), _B(cluster_dimension=_D.N), 256),
  ],
)
def test_matmul_kernel_equals_reference(kb, ablk, bblk, bs, k, interpret):
  m, n = 256, 256
  a = _data(jax.random.key(29), (m, k))
  b = _data(jax.random.key(30), (n, k))
  av, as_ = ref.quantize_reference(a, block=ablk)
  bv, bs_ = ref.quantize_reference(b, block=bblk)
  out = mosaic_gpu_matmul.scaled_matmul_mgpu(
    av,
    jnp.repeat(as_.T, ablk[0], axis=1)[:, :m],
    bv,
    jnp.repeat(bs_.T, bblk[0], axis=1)[:, :n],
    kb=kb,
    out_dtype=jnp.float32,
    interpret=interpret,
    num_sms=2,  # persistent programs walk several output tiles
    block_sizes=bs,
    b_scale_uniform=bblk[0] == 128,
  )
  want = ref.scaled_matmul_reference(av, as_, ablk, bv, bs_, bblk)
  _close_fp8_sums(out, want, (av, as_, ablk, bv, bs_, bblk), interpret)


@pytest.mark.parametrize("splits,num_sms", [(2, 2), (4, 3), (2, 132)])
def test_matmul_kernel_split_k_equals_reference(splits, num_sms, interpret):
  """Split-K: the contraction cut into `splits` runs, each an f32 output
  tile of its own, summed; programs walking several (run, tile) items
  (num_sms 2 and 3) and one each (132)."""
  m, n, k = 256, 128, 1024
  a = _data(jax.random.key(55), (m, k))
  b = _data(jax.random.key(56), (n, k))
  av, as_ = ref.quantize_reference(a, block=(1, 128))
  bv, bs_ = ref.quantize_reference(b, block=(1, 128))
  out = mosaic_gpu_matmul.scaled_matmul_mgpu(
    av,
    as_.T,
    bv,
    bs_.T,
    kb=128,
    out_dtype=jnp.bfloat16,
    interpret=interpret,
    num_sms=num_sms,
    splits=splits,
  )
  assert out.dtype == jnp.bfloat16
  want = ref.scaled_matmul_reference(av, as_, (1, 128), bv, bs_, (1, 128))
  _close_bf16(out, want)
  with pytest.raises(ValueError, match="splits=3"):
    mosaic_gpu_matmul.scaled_matmul_mgpu(
      av, as_.T, bv, bs_.T, kb=128, interpret=interpret, splits=3
    )


def test_k_splits_fill_the_chip_with_long_runs():
  bs = mosaic_gpu_matmul.default_block_sizes(128)  # 192 x 128 CTA tiles
  # Weight gradients over 65,536 tokens: 44 / 48 CTAs -> two runs.
  assert mosaic_gpu_matmul.k_splits(2048, 512, 65536, bs) == 2
  assert mosaic_gpu_matmul.k_splits(512, 2048, 65536, bs) == 2
  # 12 CTAs over 65,536: four runs would leave 128 steps each, eight 64.
  assert mosaic_gpu_matmul.k_splits(512, 512, 65536, bs) == 8
  # Enough tiles, or too short a contraction: none.
  assert mosaic_gpu_matmul.k_splits(4096, 4096, 16384, bs) == 1
  assert mosaic_gpu_matmul.k_splits(2048, 512, 4096, bs) == 1


def test_split_k_plan_takes_the_tile_that_fills_the_chip():
  default = mosaic_gpu_matmul.default_block_sizes(128, jnp.float32)
  # dW [2048, 512] / [512, 2048] over 65,536 tokens: 44 / 48 tiles of
  # 192 x 128 in two runs fill 88 / 96 of 132 SMs, 64 of 128 x 128 fill 128.
  for m, n in [(2048, 512), (512, 2048)]:
    bs, splits = mosaic_gpu_matmul.split_k_plan(m, n, 65536, 128, num_sms=132)
    assert (bs.cta_tile(), splits) == ((128, 128), 2)
    assert (
      mosaic_gpu_matmul.smem_bytes(bs, 128, jnp.float32)
      <= mosaic_gpu_matmul.SMEM_BYTES
    )
  # Two runs of 16 tiles of 192 x 128 fill 32 SMs (24 of 128 x 128, too
  # many to split, fill 24): the default.
  bs, splits = mosaic_gpu_matmul.split_k_plan(768, 512, 65536, 128, num_sms=32)
  assert (bs, splits) == (default, 2)
  # Enough tiles: no split.
  assert (
    mosaic_gpu_matmul.split_k_plan(4096, 4096, 16384, 128, num_sms=132)[1] == 1
  )
  # Per-row scales on both sides (the FP8 weight gradient): their default
  # tile, 128 x 128 with two block products in flight, in two runs.
  per_row = mosaic_gpu_matmul.default_block_sizes(
    128, jnp.float32, uniform=False
  )
  assert (per_row.cta_tile(), per_row.tile_k) == ((128, 128), 256)
  plan = mosaic_gpu_matmul.split_k_plan(
    2048, 512, 65536, 128, 132, uniform=False
  )
  assert plan == (per_row, 2)
  # Rows for neither tile.
  with pytest.raises(ValueError, match="fits neither"):
    mosaic_gpu_matmul.split_k_plan(64, 512, 65536, 128)


@pytest.mark.usefixtures("mode")
def test_op_splits_k_for_weight_gradients(monkeypatch):
  """The FP8 weight gradient of a product with few output tiles runs
  split-K (here with runs of 2 k-steps, so small shapes qualify) and
  equals the reference."""
  monkeypatch.setattr(mosaic_gpu_matmul, "_SPLIT_MIN_K_STEPS", 2)
  seen = _spy(
    monkeypatch,
    mosaic_gpu_matmul,
    "scaled_matmul_mgpu",
    lambda *_, splits=1, **__: splits,
  )
  x = _data(jax.random.key(57), (512, 128), jnp.bfloat16, spread=1.0)
  w = _data(jax.random.key(58), (128, 256), jnp.bfloat16, spread=1.0)
  g = _data(jax.random.key(59), (512, 256), jnp.bfloat16, spread=1.0)
  f = functools.partial(
    fp8.fp8_dot_general, dimension_numbers=DN, grad_rhs_fp8=True
  )
  got = _grads(functools.partial(f, implementation="mosaic"), x, w, g)
  assert max(seen) > 1  # dW [256, 128] over 512 rows: 2 CTA tiles
  want = _grads(functools.partial(f, implementation="xla"), x, w, g)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    _close_bf16(a, b)


_QB = mosaic_gpu_quantizing_matmul.QuantizingBlockSizes


@pytest.mark.parametrize(
  "m,k,n,num_sms,bs,uniform",
  [
    # Two quantizers taking the steps in turn, no cluster; two programs,
    # two output tiles each, three k-steps per tile.
    (128, 384, 512, 2, _QB(), True),
    # One quantizer, 3-deep weight ring, weight scales per column; one
    # program walks all three tiles.
    (192, 640, 256, 1, _QB(quantizers=1, stages_b=3), False),
    # One bf16 tile in flight per quantizer, fewer steps than ring slots.
    (64, 128, 512, 4, _QB(stages_a=1, stages_b=2), True),
    # CTAs in clusters along M multicasting the weight tiles: one cluster
    # of two walks two 128 x 256 tiles; two clusters of two, one tile
    # each, with weight scales per column; one cluster of four.
    (128, 384, 512, 2, _QB(cluster_m=2), True),
    (256, 256, 256, 4, _QB(cluster_m=2), False),
    (256, 256, 512, 4, _QB(cluster_m=4), True),
  ],
)
def test_quantizing_matmul_equals_reference(
  m, k, n, num_sms, bs, uniform, interpret
):
  a = _data(jax.random.key(41), (m, k), jnp.bfloat16)
  # A subnormal e4m3 result, zeros, and an all-zero block (scale 2^-126).
  a = a.at[0, :4].set(jnp.asarray([1e-3, -(2.0**-12), 0.0, 0.0], a.dtype))
  a = a.at[1, :128].set(0)
  b = _data(jax.random.key(42), (n, k))
  bblk = (128, 128) if uniform else (1, 128)
  bv, bs_ = ref.quantize_reference(b, block=bblk)
  # An f32 output where it fits in shared memory (the interpreter has no
  # such limit), else bf16: the same sums, rounded once more.
  f32 = interpret or mosaic_gpu_quantizing_matmul.quantizing_fits(
    jnp.float32, bs
  )
  out = mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu(
    a,
    bv,
    jnp.repeat(bs_.T, bblk[0], axis=1)[:, :n],
    out_dtype=jnp.float32 if f32 else jnp.bfloat16,
    interpret=interpret,
    num_sms=num_sms,
    block_sizes=bs,
    b_scale_uniform=uniform,
  )
  av, as_ = ref.quantize_reference(a, block=(1, 128))
  want = ref.scaled_matmul_reference(av, as_, (1, 128), bv, bs_, bblk)
  if not f32:
    _close_bf16(out, want)
    return
  operands = (av, as_, (1, 128), bv, bs_, bblk)
  _close_fp8_sums(out, want, operands, interpret)


def test_quantizing_matmul_refuses_what_does_not_fit():
  """The default tiles with an f32 output take the kernel over its shared
  memory (234,624 B lowered for CUDA): a clear error when compiling (the
  op quantizes first there), none in interpret mode."""
  assert not mosaic_gpu_quantizing_matmul.quantizing_fits(jnp.float32)
  assert mosaic_gpu_quantizing_matmul.quantizing_fits(jnp.bfloat16)
  # One bf16 stage per quantizer frees enough for f32.
  small = mosaic_gpu_quantizing_matmul.QuantizingBlockSizes(stages_a=1)
  assert mosaic_gpu_quantizing_matmul.quantizing_fits(jnp.float32, small)
  a = jnp.ones((64, 128), jnp.bfloat16)
  b = jnp.ones((256, 128), jnp.float8_e4m3fn)
  sb = jnp.ones((1, 256), jnp.float32)
  with pytest.raises(ValueError, match="float32 output does not fit"):
    mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu(
      a, b, sb, out_dtype=jnp.float32
    )


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_quantizing_matmul_is_race_free(cluster_m):
  """The quantizers' hand-offs (and the multicast weight ring's releases
  across a cluster) under the interpreter's race detector."""
  a = _data(jax.random.key(43), (128 * cluster_m, 384), jnp.bfloat16)
  bv, bs_ = ref.quantize_reference(
    _data(jax.random.key(44), (512, 384)), block=(128, 128)
  )
  log = io.StringIO()
  with contextlib.redirect_stdout(log):
    jax.block_until_ready(
      mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu(
        a,
        bv,
        jnp.repeat(bs_.T, 128, axis=1),
        interpret=plgpu.InterpretGPUParams(detect_races=True),
        num_sms=2 * cluster_m,
        block_sizes=_QB(cluster_m=cluster_m),
        b_scale_uniform=True,
      )
    )
  assert "RACE DETECTED" not in log.getvalue(), log.getvalue()[:4000]


# Hopper's FP8 tensor-core instructions accumulate with fewer mantissa
# bits than f32 (the reason the kernels promote each k-block's partial sum
# into f32 registers): an f32 output may differ from the exact f32 sums
# by a small fraction of the sum of the products' magnitudes, large beside
# an entry whose terms cancel. The interpreter sums in f32.
FP8_ACCUMULATION = 2.0**-9


def _close_fp8_sums(got, want, operands, interpret):
  """`got` against the reference's f32 sums `want` of the quantized
  `operands` (a values, a scales, a block, b values, b scales, b block):
  to f32 rounding in interpret mode; on the GPU within FP8_ACCUMULATION
  of each entry's sum of absolute products."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if interpret:
    np.testing.assert_allclose(
      got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
    )
    return
  av, as_, ablk, bv, bs_, bblk = operands
  mag = np.asarray(
    ref.scaled_matmul_reference(
      jnp.abs(av.astype(jnp.float32)), as_, ablk,
      jnp.abs(bv.astype(jnp.float32)), bs_, bblk,
    ),
    np.float32,
  )  # fmt: skip
  ratio = np.abs(got - want) / np.maximum(mag, np.finfo(np.float32).tiny)
  print(f"fp8 accumulation: worst |error| / sum|products| = {ratio.max():.2e}")
  assert ratio.max() <= FP8_ACCUMULATION, ratio.max()


def _close_bf16(got, want):
  """bf16 results of the same quantized operands whose f32 sums differ
  only in order: a bf16 step (2^-8 relative) apart at most."""
  a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max())


@pytest.mark.slow
@pytest.mark.usefixtures("mode")
def test_op_quantizes_in_the_gemm_where_no_residual_needs_it(monkeypatch):
  """A raw bf16 left operand of a product with n <= 512 output columns
  and a 16-bit output is quantized in the kernel unless the FP8 weight
  gradient reads its quantized values: x in the forward (differentiated
  or not), g in dx = g w^T. Results equal the reference."""
  calls = _spy(
    monkeypatch,
    mosaic_gpu_quantizing_matmul,
    "quantizing_matmul_mgpu",
    lambda a, *_, **__: a.shape,
  )
  # Each phase traces (and meets the spy) anew.
  fresh = _forget_traces

  x = _data(jax.random.key(45), (70, 256), jnp.bfloat16, spread=1.0)
  w = _data(jax.random.key(46), (256, 300), jnp.bfloat16, spread=1.0)
  g = _data(jax.random.key(47), (70, 300), jnp.bfloat16, spread=1.0)
  f = functools.partial(fp8.fp8_dot_general, dimension_numbers=DN)
  fresh()
  got = f(x, w, implementation="mosaic")
  assert calls == [(128, 256)]  # rows padded to the 64-row tile
  want = f(x, w, implementation="xla")
  _close_bf16(got, want)
  # Differentiated: x in the forward, g (k padded to 384) in dx.
  fresh()
  o1, grads1 = _grads(functools.partial(f, implementation="mosaic"), x, w, g)
  assert calls[1:] == [(128, 256), (128, 384)]
  o2, grads2 = _grads(functools.partial(f, implementation="xla"), x, w, g)
  for a, b in ((o1, o2), *zip(grads1, grads2, strict=True)):
    _close_bf16(a, b)
  # The FP8 weight gradient reads both quantized: quantized first.
  del calls[:]
  fresh()
  fp8_dw = functools.partial(f, grad_rhs_fp8=True, implementation="mosaic")
  o3, grads3 = _grads(fp8_dw, x, w, g)
  assert calls == []
  o4, grads4 = _grads(
    functools.partial(f, grad_rhs_fp8=True, implementation="xla"), x, w, g
  )
  for a, b in ((o3, o4), *zip(grads3, grads4, strict=True)):
    _close_bf16(a, b)
  # Wider outputs, and f32 outputs (whose epilogue does not fit beside the
  # quantizer's buffers), quantize first.
  f(x, jnp.concatenate([w, w], axis=1), implementation="mosaic")
  f(x, w, preferred_element_type=jnp.float32, implementation="mosaic")
  assert calls == []
  # Under vmap with a shared weight the batch folds into rows of x.
  fresh()
  xs = jnp.stack([x[:64], x[6:]])
  got = jax.vmap(functools.partial(f, implementation="mosaic"), (0, None))(
    xs, w
  )
  assert calls[-1] == (128, 256)  # 2 x 64 rows in one kernel call
  want = jax.vmap(functools.partial(f, implementation="xla"), (0, None))(xs, w)
  _close_bf16(got, want)


# n = 300: the last 128-column group has 44 real columns, fewer than the
# 64 scale entries the kernel reads for it (they were zero-padded once,
# zeroing rows 44-63 of those columns).
@pytest.mark.usefixtures("mode")
@pytest.mark.parametrize("n", [100, 300])
def test_op_mosaic_equals_xla(n):
  x = _data(jax.random.key(31), (70, 128), jnp.bfloat16, spread=1.0)
  w = _data(jax.random.key(32), (128, n), jnp.bfloat16, spread=1.0)
  g = _data(jax.random.key(33), (70, n), jnp.bfloat16, spread=1.0)
  res = {}
  for impl in ("xla", "mosaic"):
    f = functools.partial(
      fp8.fp8_dot_general,
      dimension_numbers=DN,
      key=jax.random.key(3),
      implementation=impl,
    )
    res[impl] = _grads(f, x, w, g)
  (o1, (dx1, dw1)), (o2, (dx2, dw2)) = res["xla"], res["mosaic"]
  # Same quantized operands (bit-exact kernels); bf16 results whose f32 sums
  # differ only in order: a bf16 step (2^-8 relative) apart at most.
  for a, b in ((o1, o2), (dx1, dx2), (dw1, dw2)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max())


@pytest.mark.usefixtures("mode")
def test_op_overlaps_the_last_row_tile_instead_of_padding(monkeypatch):
  """200 rows are one 192-row tile and one overlapping it: the kernel
  gets the rows as they are (no pad, no slice) and equals the reference."""
  rows = _spy(
    monkeypatch,
    mosaic_gpu_matmul,
    "scaled_matmul_mgpu",
    lambda a, *_, **__: a.shape[0],
  )
  x = _data(jax.random.key(62), (200, 256), jnp.bfloat16, spread=1.0)
  w = _data(jax.random.key(63), (256, 128), jnp.bfloat16, spread=1.0)
  xq = fp8.quantize(x, axis=1).detach()
  got, want = (
    fp8.fp8_dot_general(xq, w, DN, implementation=impl)
    for impl in ("mosaic", "xla")
  )
  assert rows == [200]
  _close_bf16(got, want)


@pytest.mark.usefixtures("mode")
def test_op_mosaic_under_vmap_and_grad():
  """The kernels' batching rules: fold into rows, or loop (batched rhs)."""
  bf = jnp.bfloat16  # the quantize kernel's input type
  x = _data(jax.random.key(38), (2, 32, 128), bf, spread=1.0)
  w = _data(jax.random.key(39), (128, 64), bf, spread=1.0)
  ws = _data(jax.random.key(40), (2, 128, 64), bf, spread=1.0)

  def loss(impl, x, w, w_axis):
    f = functools.partial(
      fp8.fp8_dot_general,
      dimension_numbers=DN,
      preferred_element_type=jnp.float32,
      format="mxfp8",
      implementation=impl,
    )
    return jnp.sum(jax.vmap(f, in_axes=(0, w_axis))(x, w) ** 2)

  for w_, w_axis in ((w, None), (ws, 0)):
    got = jax.grad(functools.partial(loss, "mosaic", w_axis=w_axis), (0, 1))(
      x, w_
    )
    want = jax.grad(functools.partial(loss, "xla", w_axis=w_axis), (0, 1))(
      x, w_
    )
    for a, b in zip(got, want, strict=True):
      # bf16 gradients whose f32 sums differ only in order: a bf16 step
      # (2^-8 relative) apart at most, hence 1e-2.
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max())


# ---------------------------------------------------------------------------
# On the H200 alone: real shapes, far too slow to interpret.
# ---------------------------------------------------------------------------


_RING = [
  dict(warpgroups=4, stages=2, out_slots=2),
  dict(warpgroups=3, stages=2, out_slots=2),
  dict(warpgroups=1, ctas_per_sm=4, stages=2, out_slots=2),
]
_GRID = dict(warpgroups=0, tile_r=64, stages=2)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "block,hb,sr,kw",
  [
    ((32, 32), None, False, {}),
    ((32, 32), 32, True, {}),
    ((32, 32), 32, False, _GRID),
    ((1, 128), 128, False, {}),
    ((1, 128), None, False, {}),
    ((1, 128), 128, False, _GRID),
    ((1, 128), None, False, _GRID),
    *[((1, 128), None, False, kw) for kw in _RING],
    *[((1, 128), 128, False, kw) for kw in _RING[1:]],
    ((1, 128), 128, True, _RING[1]),
    ((32, 32), None, False, _RING[0]),
  ],
)
def test_gpu_quantize_kernel(block, hb, sr, kw):
  """Compiled over 6144 x 2048 (1536 tiles, so the persistent workers get
  unequal counts), with the default 132 SMs."""
  x = _data(jax.random.key(34), (6144, 2048), jnp.bfloat16)
  seed = fmt.hash32(jnp.int32(5)) if sr else None
  v, se = mosaic_gpu_quantize.quantize_mgpu(
    x, seed, block=block, hadamard=hb, sr=sr, **kw
  )
  rv, rs = ref.quantize_reference(x, block=block, hadamard=hb, seed_hash=seed)
  assert float(jnp.mean(se[:, :: block[0]].T == rs)) > 0.9999
  d = jnp.abs(v.astype(jnp.float32) - rv.astype(jnp.float32))
  assert float(jnp.mean(d == 0)) > 0.999
  if hb is None:
    assert float(jnp.max(d)) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(512, 2048, 65536), (256, 512, 16384)])
def test_gpu_split_k_matmul(m, n, k):
  """Compiled split-K at the weight-gradient shapes (contractions of
  16,384 and 65,536) against one run over the whole contraction: the same
  products, summed in another order."""
  a = _data(jax.random.key(60), (m, k), jnp.bfloat16)
  b = _data(jax.random.key(61), (n, k), jnp.bfloat16)
  av, as_ = ref.quantize_reference(a, block=(1, 128))
  bv, bs_ = ref.quantize_reference(b, block=(1, 128))
  # The tile and runs primitives.py takes (`split_k_plan`; per-row scales
  # on both sides), and the default tile.
  plan_bs, plan_splits = mosaic_gpu_matmul.split_k_plan(
    m, n, k, 128, uniform=False
  )
  bs = mosaic_gpu_matmul.default_block_sizes(128, jnp.float32)
  outs = [
    mosaic_gpu_matmul.scaled_matmul_mgpu(
      av, as_.T, bv, bs_.T, kb=128, block_sizes=b, splits=splits
    )
    for b, splits in [
      (bs, 1),
      (plan_bs, plan_splits),
      (bs, mosaic_gpu_matmul.k_splits(m, n, k, bs)),
    ]
  ]
  _close_bf16(outs[2], outs[0])
  _close_bf16(outs[1], outs[0])
  want = ref.scaled_matmul_reference(av, as_, (1, 128), bv, bs_, (1, 128))
  _close_bf16(outs[1], want)


@pytest.mark.gpu
@pytest.mark.parametrize("form", TRANSPOSE_FORMS)
@pytest.mark.parametrize(
  "r,c,num_sms",
  [(6144, 2048, 132), (65536, 512, 132), (640, 384, 132), (6144, 2048, 8)],
)
def test_gpu_transpose_quantize_kernel(r, c, num_sms, form):
  """Compiled: `x^T` quantized (or requantized) in one pass equals the
  quantize kernel on the transposed (dequantized) matrix, bit for bit,
  and from bf16 (`rows_too`) the quantize kernel on `x` itself too; with
  `num_sms=8`, programs of 48 tiles."""
  x = _data(jax.random.key(54), (r, c), jnp.bfloat16)
  src, sx = x, None
  if form == "e4m3":
    src, sx = mosaic_gpu_quantize.quantize_mgpu(x, block=(1, 128))
    x = (src.astype(jnp.float32) * jnp.repeat(sx, 128, axis=0).T).astype(
      jnp.bfloat16
    )
  rows_too = form == "bf16 rows_too"
  v, se, *rows = mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
    src, sx, num_sms=num_sms, rows_too=rows_too
  )
  rv, rse = mosaic_gpu_quantize.quantize_mgpu(x.T, block=(1, 128))
  np.testing.assert_array_equal(np.asarray(se), np.asarray(rse))
  np.testing.assert_array_equal(
    np.asarray(v, np.float32), np.asarray(rv, np.float32)
  )
  assert len(rows) == (2 if rows_too else 0)
  if rows_too:
    wv, wse = mosaic_gpu_quantize.quantize_mgpu(x, block=(1, 128))
    np.testing.assert_array_equal(np.asarray(rows[1]), np.asarray(wse))
    np.testing.assert_array_equal(
      np.asarray(rows[0], np.float32), np.asarray(wv, np.float32)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("format", ["mxfp8", "deepseek"])
@pytest.mark.parametrize("m,k,n", [(4096, 2048, 1024), (8192, 512, 2048)])
@pytest.mark.parametrize("grad_rhs_fp8", [False, True])
def test_gpu_dot_general_matches_reference(format, m, k, n, grad_rhs_fp8):
  """The op compiled at model shapes (4096-8192 rows) against XLA's."""
  x = _data(jax.random.key(35), (m, k), jnp.bfloat16, spread=0.5)
  w = _data(jax.random.key(36), (k, n), jnp.bfloat16, spread=0.5)
  g = _data(jax.random.key(37), (m, n), jnp.bfloat16, spread=0.5)
  res = {}
  for impl in ("xla", "mosaic"):
    f = jax.jit(
      functools.partial(
        fp8.fp8_dot_general,
        dimension_numbers=DN,
        format=format,
        grad_rhs_fp8=grad_rhs_fp8,
        implementation=impl,
      )
    )
    res[impl] = _grads(f, x, w, g)
  rel = lambda a, b: float(
    jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32))
    / jnp.linalg.norm(b.astype(jnp.float32))
  )
  (o1, (dx1, dw1)), (o2, (dx2, dw2)) = res["xla"], res["mosaic"]
  assert rel(o2, o1) < 1e-2 and rel(dx2, dx1) < 1e-2 and rel(dw2, dw1) < 1e-2
  exact = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  assert rel(o2, exact) < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(8000, 2048, 512), (4096, 640, 300)])
def test_gpu_quantizing_gemm_equals_quantize_first(m, k, n):
  """The forward's in-GEMM quantization (n <= 512) against quantizing x
  first, at model shapes: the same values and scales, the same sums, bit
  for bit."""
  x = _data(jax.random.key(48), (m, k), jnp.bfloat16, spread=0.5)
  w = _data(jax.random.key(49), (k, n), jnp.bfloat16, spread=0.5)
  wq = fp8.quantize(w, axis=0, kind="weight").detach()
  got = jax.jit(lambda x, wq: fp8.fp8_dot_general(x, wq, DN))(x, wq)
  want = jax.jit(
    lambda x, wq: fp8.fp8_dot_general(fp8.quantize(x, axis=1).detach(), wq, DN)
  )(x, wq)
  np.testing.assert_array_equal(
    np.asarray(got, np.float32), np.asarray(want, np.float32)
  )


def test_dispatch_picks_xla_on_cpu():
  assert (
    fp8_op._pick(None)
    is fp8_op.IMPLEMENTATIONS["mosaic" if dispatch.hopper() else "xla"]
  )
  with pytest.raises(ValueError, match="unknown implementation"):
    fp8_op._pick("triton")
