"""RMSNorm with a fused FP8 output (O11 + G4): kernel against the reference.

`rms_norm(..., quantize=...)` returns the normalized output `y` as an
`Fp8Tensor` whose `source` is `y`. Every kernel case runs twice from one
body (`conftest.py`'s `interpret`): in GPU interpret mode on the CPU at
small shapes (ragged tails, one row, several tiles per block, scales
leaving transposed or not, rows split over two warps), and compiled under
`-m gpu` on the H200, which adds the benchmark widths
(`test_gpu_real_shapes`). Checked:

- the fused kernel's values and scales are bit-identical to
  `fp8.quantize` of the `y` it returns (round to nearest even: the
  hardware conversion on the GPU, the reference's integer rounding);
- its `y` matches the reference `y` within the RMSNorm tolerance
  (`test_rms_norm.py`'s table), and its dequantized output is within the
  e4m3 bound of the reference `y`: `|deq - y| <= 2^-4 |y| + 2^-10 s`;
- gradients through an FP8 matmul that reads the quantized output equal
  the reference path's within tolerance (straight-through via `source`);
- settings the kernel does not fuse (32x32 blocks, Hadamard, widths not a
  multiple of 128) quantize the kernel's `y` afterwards, same result.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import fp8
from pallas_kernels.fp8 import format as fmt
from pallas_kernels.rms_norm import Fp8Output, mosaic_gpu
from pallas_kernels.rms_norm.op import rms_norm_mosaic
from pallas_kernels.rms_norm.reference import rms_norm_reference

# Same table as test_rms_norm.py: output-dtype rounding + f32 sums.
_TOL = {jnp.bfloat16: 6e-3, jnp.float32: 2e-6}


def _tol(dtype, reduction: int) -> float:
  return _TOL[dtype] + 1e-7 * math.sqrt(reduction)


def _rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite output"
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _f32(a):
  return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _inputs(key, shape, dtype, with_gamma, with_residual):
  kx, kr, kg = jax.random.split(key, 3)
  x = (2 * jax.random.normal(kx, shape)).astype(dtype)
  r = jax.random.normal(kr, shape).astype(dtype) if with_residual else None
  g = (1 + 0.5 * jax.random.normal(kg, (shape[-1],))).astype(dtype)
  return x, (g if with_gamma else None), r


def _small(block_rows):
  # Two persistent blocks, a ring of two stages: several tiles per block and
  # a ragged last tile when `t % block_rows`.
  return mosaic_gpu.BlockSizes(block_rows=block_rows, num_blocks=2, stages=2)


def _mosaic(bs, interpret, quantize="deepseek"):
  def fn(x, g, r):
    return rms_norm_mosaic(
      x,
      g,
      r,
      quantize=quantize,
      fwd_block_sizes=bs,
      bwd_block_sizes=bs,
      interpret=interpret,
    )

  return fn


def _split(out, with_residual):
  return out if with_residual else (out, None)


def _check_quantized_output(yq, y_ref, dtype, d):
  """`yq` is bit-consistent with its own `y`, and close to the reference."""
  assert isinstance(yq, fp8.Fp8Tensor)
  y = yq.source
  assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
  assert yq.values.dtype == fmt.E4M3 and yq.values.shape == y.shape
  assert _rel_err(y, y_ref) < _tol(dtype, d)
  again = fp8.quantize(y, axis=-1, block=yq.block, implementation="xla")
  np.testing.assert_array_equal(_f32(yq.values), _f32(again.values))
  np.testing.assert_array_equal(yq.scales, again.scales)
  # The e4m3 bound against the reference output (kernel y differs from it
  # by the RMSNorm tolerance, added as `slack`).
  deq = _f32(fp8.dequantize(yq, jnp.float32))
  yr = _f32(y_ref)
  s = np.asarray(
    jnp.repeat(yq.scales, yq.block[1], axis=1)[:, :d], np.float32
  ).reshape(y.shape)
  slack = np.abs(_f32(y) - yr)
  bound = fmt.RN_REL_ERR * np.abs(yr) + 2.0**-10 * s + 1.07 * slack + 1e-30
  assert np.all(np.abs(deq - yr) <= bound)


BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize(
  "t,d,block_rows,dtype,with_gamma,with_residual,wpr",
  [
    # ragged: 4 full tiles + 5 rows, 2 scale blocks per row; all variants
    (37, 256, 8, BF16, True, True, None),
    (37, 256, 8, BF16, False, True, None),
    (37, 256, 8, BF16, True, False, None),
    (37, 256, 8, BF16, False, False, None),
    (37, 256, 8, F32, True, True, None),
    (1, 128, None, BF16, True, True, None),  # a single row, one scale block
    (1, 128, None, F32, False, False, None),
    # whole tiles, 4 scale blocks per row
    (24, 512, 4, BF16, True, False, None),
    (24, 512, 4, F32, True, True, None),
    # ragged with scales leaving as [m, d/128] (d % 512 == 0)
    (37, 512, 4, BF16, True, True, None),
    # two warps per row split its blocks (as at d = 4096)
    (37, 512, 2, BF16, True, True, 2),
    (37, 1024, 2, F32, True, False, 2),
  ],
)
def test_fused_output_matches_reference(
  t, d, block_rows, dtype, with_gamma, with_residual, wpr, interpret
):
  key = jax.random.key(t * 1000 + d)
  x, g, r = _inputs(key, (t, d), dtype, with_gamma, with_residual)
  bs = _small(block_rows)
  if wpr:
    bs = dataclasses.replace(bs, warps_per_row=wpr)
    gamma_dtype = dtype if with_gamma else None
    cfg = mosaic_gpu.make_config(
      t, d, dtype, gamma_dtype, with_residual, 1e-6, bs, interpret,
      bwd=False, quantize=True,
    )  # fmt: skip
    assert cfg.warps_per_row == wpr and cfg.block_rows == block_rows
  fn = _mosaic(bs, interpret)
  yq, h = _split(fn(x, g, r), with_residual)
  y_ref, h_ref = _split(rms_norm_reference(x, g, r), with_residual)
  assert yq.block == (1, 128) and yq.scales.shape == (t, d // 128)
  _check_quantized_output(yq, y_ref, dtype, d)
  if with_residual:
    assert _rel_err(h, h_ref) < _tol(dtype, d)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_gradients_through_an_fp8_matmul(dtype, interpret):
  """norm -> FP8 matmul reading the quantized output -> loss: the VJP of
  x, gamma and residual match the reference path (norm + quantize by
  `fp8.quantize`, the same FP8 product)."""
  t, d, n = 37, 256, 64
  key = jax.random.key(5)
  x, g, r = _inputs(key, (t, d), dtype, True, True)
  w = jax.random.normal(jax.random.fold_in(key, 3), (d, n)).astype(dtype)
  c = jax.random.normal(jax.random.fold_in(key, 4), (t, n))
  c_h = jax.random.normal(jax.random.fold_in(key, 5), (t, d))
  dn = (((1,), (0,)), ((), ()))

  def loss(norm, x, g, r):
    yq, h = norm(x, g, r)
    out = pallas_kernels.fp8_dot_general_reference(
      yq, w, dn, preferred_element_type=jnp.float32
    )
    return jnp.sum(out * c) + jnp.sum(h.astype(jnp.float32) * c_h)

  fused = _mosaic(_small(8), interpret)

  def ref(x, g, r):
    return rms_norm_reference(x, g, r, quantize="deepseek")

  got = jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2))(x, g, r)
  want = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(x, g, r)
  for name, a, b, red in zip(
    ("dx", "dgamma", "dresidual"), got, want, (d, t, d), strict=True
  ):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    # d y = Q(c) . deq(Q(w))^T does not depend on the quantized `y`, so both
    # paths feed the same cotangent to the norm's backward.
    assert _rel_err(a, b) < _tol(dtype, red), name


@pytest.mark.parametrize(
  "quantize,d",
  [
    ("mxfp8", 256),  # 32x32 blocks span rows owned by different warps
    (Fp8Output(hadamard=128), 256),  # Hadamard needs a matmul
    ("deepseek", 64),  # narrower than one 1x128 block
  ],
)
def test_unfused_settings_quantize_the_kernel_output(quantize, d, interpret):
  t = 37
  x, g, r = _inputs(jax.random.key(d), (t, d), jnp.bfloat16, True, True)
  yq, h = _mosaic(_small(8 if d > 64 else 16), interpret, quantize)(x, g, r)
  q = Fp8Output(format=quantize) if isinstance(quantize, str) else quantize
  assert yq.block == q.activation_block and yq.hadamard == q.hadamard
  again = fp8.quantize(
    yq.source,
    axis=-1,
    block=q.activation_block,
    hadamard=q.hadamard,
    implementation="xla",
  )
  np.testing.assert_array_equal(_f32(yq.values), _f32(again.values))
  np.testing.assert_array_equal(yq.scales, again.scales)
  y_ref, h_ref = rms_norm_reference(x, g, r)
  assert _rel_err(yq.source, y_ref) < _tol(jnp.bfloat16, d)
  assert _rel_err(h, h_ref) < _tol(jnp.bfloat16, d)


def test_leading_axes(interpret):
  """`[b, t, d]` input: an `Fp8Tensor` of the logical shape."""
  x, g, _ = _inputs(jax.random.key(9), (2, 19, 256), jnp.bfloat16, True, False)
  yq = _mosaic(_small(8), interpret)(x, g, None)
  assert yq.shape == (2, 19, 256) and yq.scales.shape == (38, 2)
  _check_quantized_output(yq, rms_norm_reference(x, g), jnp.bfloat16, 256)


def test_public_dispatch_on_cpu():
  """`pallas_kernels.rms_norm` on CPU (the XLA reference): an `Fp8Tensor`
  of the logical shape, the old API unchanged."""
  x, g, _ = _inputs(jax.random.key(9), (2, 19, 256), jnp.bfloat16, True, False)
  public = pallas_kernels.rms_norm(x, g, quantize="deepseek")
  ref = rms_norm_reference(x, g, quantize="deepseek")
  np.testing.assert_array_equal(_f32(public.values), _f32(ref.values))
  y = pallas_kernels.rms_norm(x, g)
  assert isinstance(y, jax.Array) and y.shape == x.shape


def test_fused_config_and_errors():
  for d, dtype in [(512, BF16), (2048, BF16), (128, F32)]:
    cfg = mosaic_gpu.make_config(
      262_144, d, dtype, dtype, True, 1e-6, None, False, bwd=False,
      quantize=True,
    )  # fmt: skip
    assert cfg.quantize and not cfg.direct_stores
    assert mosaic_gpu.smem_bytes(cfg, bwd=False) <= 200 * 1024
  assert not mosaic_gpu.quantize_supported(64, jnp.bfloat16)
  with pytest.raises(ValueError, match="fused FP8"):
    mosaic_gpu.make_config(
      10, 256, jnp.bfloat16, None, False, 1e-6, None, False, bwd=True,
      quantize=True,
    )  # fmt: skip
  with pytest.raises(TypeError, match="quantize"):
    pallas_kernels.rms_norm(jnp.ones((2, 128)), quantize=3)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "shape", [(262_144 + 37, 512), (65_536 + 3, 2048), (16_384 + 5, 4096)]
)
def test_gpu_real_shapes(shape):
  """Compiled at the benchmark widths (up to 262,181 rows), far too slow to
  interpret, with the default settings."""
  key = jax.random.key(shape[0])
  x, g, r = _inputs(key, shape, jnp.bfloat16, True, True)

  def fn(x, g, r):
    return rms_norm_mosaic(x, g, r, quantize="deepseek", interpret=False)

  yq, _ = jax.jit(fn)(x, g, r)
  y_ref, _ = rms_norm_reference(x, g, r)
  _check_quantized_output(yq, y_ref, jnp.bfloat16, shape[-1])
