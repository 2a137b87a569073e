"""Fused RMSNorm (O11): Mosaic GPU kernels against the `jnp` reference.

Every kernel case runs twice from one body (`conftest.py`'s `interpret`):
under Pallas's GPU interpret mode on the CPU at small shapes, with small
tiles and few persistent blocks so that several tiles per block, the ring
of buffers and a ragged last tile are all exercised, and compiled under
`-m gpu` on the H200, which adds the benchmark's shapes
(`test_gpu_real_shapes`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import mosaic
from pallas_kernels.rms_norm import mosaic_gpu
from pallas_kernels.rms_norm.op import rms_norm_mosaic
from pallas_kernels.rms_norm.reference import rms_norm_reference

# Relative L2 error bound: the rounding of the output dtype, plus the f32
# accumulation error, which grows with √(reduction size) (row sums over d,
# dgamma sums over t).
_TOL = {jnp.bfloat16: 6e-3, jnp.float32: 2e-6}


def _tol(dtype, reduction: int) -> float:
  return _TOL[dtype] + 1e-7 * math.sqrt(reduction)


def _rel_err(a, b) -> float:
  if a.size > 1 << 20:  # the GPU tests' arrays: f32 on the device
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    assert bool(jnp.all(jnp.isfinite(a))), "non-finite output"
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite output"
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _inputs(key, shape, dtype, with_gamma, with_residual):
  kx, kr, kg = jax.random.split(key, 3)
  x = (2 * jax.random.normal(kx, shape)).astype(dtype)
  r = jax.random.normal(kr, shape).astype(dtype) if with_residual else None
  d = shape[-1]
  g = (1 + 0.5 * jax.random.normal(kg, (d,))).astype(dtype)
  return x, (g if with_gamma else None), r


def _check(fn, x, g, r, key, *, dtype):
  """Forward values and all VJPs of `fn` against the reference."""
  t = math.prod(x.shape[:-1])
  d = x.shape[-1]
  out, vjp = jax.vjp(fn, x, g, r)
  ref, vjp_ref = jax.vjp(
    lambda x, g, r: rms_norm_reference(x, g, r, eps=1e-6), x, g, r
  )
  leaves, ref_leaves = jax.tree.leaves(out), jax.tree.leaves(ref)
  assert len(leaves) == len(ref_leaves)
  for o, o_ref in zip(leaves, ref_leaves, strict=True):
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert _rel_err(o, o_ref) < _tol(dtype, d)
  keys = jax.random.split(key, len(leaves))
  ct = jax.tree.unflatten(
    jax.tree.structure(out),
    [
      jax.random.normal(k, o.shape).astype(o.dtype)
      for k, o in zip(keys, leaves, strict=True)
    ],
  )
  grads, grads_ref = vjp(ct), vjp_ref(ct)
  for name, gr, gr_ref, red in zip(
    ("dx", "dgamma", "dresidual"), grads, grads_ref, (d, t, d), strict=True
  ):
    if gr_ref is None:
      assert gr is None, name
      continue
    assert gr.shape == gr_ref.shape and gr.dtype == gr_ref.dtype, name
    assert _rel_err(gr, gr_ref) < _tol(dtype, red), name


def _small(block_rows=None, warps_per_row=None, direct_stores=False):
  """`BlockSizes` for interpret-mode tests."""
  # Two persistent blocks, small tiles: several tiles per block, the ring of
  # buffers wraps, and the last tile is ragged.
  return mosaic_gpu.BlockSizes(
    block_rows=block_rows,
    warps_per_row=warps_per_row,
    num_blocks=2,
    stages=2,
    direct_stores=direct_stores,
  )


VARIANTS = [(True, True), (False, True), (True, False), (False, False)]


@pytest.mark.parametrize("with_gamma,with_residual", VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
  "t,d,block_rows,warps_per_row,direct",
  [
    (37, 64, 16, 1, False),  # ragged: 2 full tiles + 5 rows, 4 rows/warp
    (1, 256, None, 1, False),  # a single row
    (24, 512, 4, 1, False),  # exact multiple of the tile, 2 vectors per lane
    (7, 512, 2, 2, False),  # a row split over 2 warps, ragged
    (37, 64, 16, 1, True),  # direct stores, bulk copy for the ragged tile
  ],
)
def test_matches_reference(
  t, d, block_rows, warps_per_row, direct, dtype, with_gamma, with_residual,
  interpret,
):  # fmt: skip
  key = jax.random.key(t * 1000 + d)
  x, g, r = _inputs(key, (t, d), dtype, with_gamma, with_residual)
  bs = _small(block_rows, warps_per_row, direct)

  def fn(x, g, r):
    return rms_norm_mosaic(
      x, g, r, fwd_block_sizes=bs, bwd_block_sizes=bs, interpret=interpret
    )

  _check(fn, x, g, r, jax.random.fold_in(key, 1), dtype=dtype)


@pytest.mark.parametrize("with_gamma,with_residual", [(True, True)])
@pytest.mark.parametrize(
  "t,d,extra",
  [
    # Registers straight from global memory, one tile ahead (fwd and bwd).
    (48, 64, dict(block_rows=16, direct_loads=True)),
    (16, 64, dict(block_rows=16, direct_loads=True)),  # one tile per block
    # Ragged: direct loads fall back to the ring.
    (37, 64, dict(block_rows=16, direct_loads=True)),
    # Three output buffers: stores drain over two later tiles.
    (101, 64, dict(block_rows=16, out_slots=3)),
  ],
)
def test_pipeline_variants(t, d, extra, with_gamma, with_residual, interpret):
  key = jax.random.key(t * 7 + d)
  dtype = jnp.float32
  x, g, r = _inputs(key, (t, d), dtype, with_gamma, with_residual)
  bs = dataclasses.replace(_small(), **extra)

  def fn(x, g, r):
    return rms_norm_mosaic(
      x, g, r, fwd_block_sizes=bs, bwd_block_sizes=bs, interpret=interpret
    )

  _check(fn, x, g, r, jax.random.fold_in(key, 1), dtype=dtype)


def test_balanced_rows_fill_the_last_wave():
  """The forward's default tile is the row count near 16 KiB whose busiest
  block has the fewest rows (T=262,144, D=512: 16384 tiles of 16 rows leave
  the 125th wave 12% full; tiles of 12 rows give 166 waves, 50% full)."""
  t, g = 262_144, 132

  def cfg(d, **kw):
    return mosaic_gpu.make_config(
      t,
      d,
      jnp.bfloat16,
      jnp.bfloat16,
      True,
      1e-6,
      mosaic_gpu.BlockSizes(**kw),
      False,
      bwd=False,
    )

  busiest = lambda c: math.ceil(math.ceil(t / c.block_rows) / g) * c.block_rows
  for d in (512, 2048):
    balanced, plain = cfg(d), cfg(d, balance=False)
    assert busiest(balanced) <= busiest(plain)
    assert balanced.stages >= 2
    assert mosaic_gpu.smem_bytes(balanced, bwd=False) <= 200 * 1024
  assert cfg(512).block_rows == 12 and busiest(cfg(512)) == 1992
  assert cfg(512, balance=False).block_rows == 16
  # Direct loads keep to tiles that divide t.
  assert t % cfg(512, direct_loads=True).block_rows == 0
  assert cfg(512, direct_loads=True).direct_loads


def test_default_pipeline_settings():
  """The measured defaults (H200, `benchmarks/rms_norm.py --variants`):
  the plain forward keeps 2 input stages and 4 output slots with PDL; the
  backward and the forward with FP8 output keep 4 stages and 2 slots, the
  backward without PDL."""

  def cfg(bwd, quantize=False):
    return mosaic_gpu.make_config(
      262_144,
      512,
      jnp.bfloat16,
      jnp.bfloat16,
      True,
      1e-6,
      None,
      False,
      bwd=bwd,
      quantize=quantize,
    )

  fwd, bwd, fp8_out = cfg(False), cfg(True), cfg(False, quantize=True)
  assert (fwd.stages, fwd.out_slots, fwd.pdl) == (2, 4, True)
  assert (bwd.stages, bwd.out_slots, bwd.pdl) == (4, 2, False)
  assert (fp8_out.stages, fp8_out.out_slots) == (4, 2)
  assert not (fwd.direct_loads or bwd.direct_loads)
  assert fwd.num_blocks == bwd.num_blocks == mosaic.num_sms()
  # Interpret mode drops what the interpreter lacks (PDL).
  bs = mosaic_gpu.BlockSizes(pdl=True)
  interp = mosaic_gpu.make_config(
    64, 64, jnp.float32, None, False, 1e-6, bs, True, bwd=False
  )
  assert not interp.pdl


@pytest.mark.parametrize("t,d", [(262_144, 2048), (262_144, 1024), (8, 1024)])
def test_wide_rows_default(t, d):
  """The plain forward over 16-bit rows of 2-4 KiB loads straight into
  registers, 2 warps per row, 8 KiB tiles, 2 blocks per SM (measured,
  `_wide_rows`); not where those tiles do not divide `t`, not in the
  backward, not for f32 or other widths, not where the caller says."""

  def cfg(t=t, d=d, dtype=jnp.bfloat16, bwd=False, **kw):
    bs = mosaic_gpu.BlockSizes(**kw) if kw else None
    return mosaic_gpu.make_config(
      t, d, dtype, dtype, True, 1e-6, bs, False, bwd=bwd
    )

  wide = cfg()
  rows = 8192 // (2 * d)
  assert (wide.direct_loads, wide.warps_per_row, wide.block_rows) == (
    True,
    2,
    rows,
  )
  assert wide.num_blocks == min(2 * mosaic.num_sms(), t // rows)
  assert not cfg(t=t + 1).direct_loads  # ragged: the ring
  assert not cfg(bwd=True).direct_loads
  assert not cfg(d=512).direct_loads and not cfg(d=4096).direct_loads
  assert not cfg(dtype=jnp.float32).direct_loads
  assert not cfg(direct_loads=False).direct_loads
  assert cfg(num_blocks=132).num_blocks == min(132, t // rows)


def test_wide_rows_default_matches_reference(interpret):
  """The wide-row default (direct loads, 2 warps per row) on bf16 rows of
  2 KiB, several tiles per block, against the reference."""
  key = jax.random.key(11)
  x, g, r = _inputs(key, (40, 1024), jnp.bfloat16, True, True)
  bs = mosaic_gpu.BlockSizes(num_blocks=3)
  cfg = mosaic_gpu.make_config(
    40, 1024, jnp.bfloat16, jnp.bfloat16, True, 1e-6, bs, interpret,
    bwd=False,
  )  # fmt: skip
  assert cfg.direct_loads and cfg.warps_per_row == 2

  def fn(x, g, r):
    return rms_norm_mosaic(x, g, r, fwd_block_sizes=bs, interpret=interpret)

  _check(fn, x, g, r, jax.random.fold_in(key, 1), dtype=jnp.bfloat16)


@pytest.mark.usefixtures("mode")  # "mosaic" interprets on the CPU only
def test_qk_norm_shape_under_grad():
  """QK-norm: `[t, n, h]`, gamma `[h]`, through the public op and jax.grad."""
  t, n, h = 19, 4, 128
  key = jax.random.key(7)
  q, g, _ = _inputs(key, (t, n, h), jnp.bfloat16, True, False)
  w = jax.random.normal(jax.random.fold_in(key, 1), (t, n, h))

  def loss(impl, q, g):
    y = pallas_kernels.rms_norm(q, g, implementation=impl)
    return jnp.sum(y.astype(jnp.float32) * w)

  got = jax.grad(lambda q, g: loss("mosaic", q, g), argnums=(0, 1))(q, g)
  want = jax.grad(lambda q, g: loss("xla", q, g), argnums=(0, 1))(q, g)
  assert _rel_err(got[0], want[0]) < _tol(jnp.bfloat16, h)
  assert _rel_err(got[1], want[1]) < _tol(jnp.bfloat16, t * n)


def test_f32_gamma_with_bf16_activations(interpret):
  """Parameters kept in f32, activations in bf16: dgamma comes back in f32."""
  t, d = 21, 512
  key = jax.random.key(11)
  x, _, r = _inputs(key, (t, d), jnp.bfloat16, False, True)
  g = 1 + 0.5 * jax.random.normal(jax.random.fold_in(key, 2), (d,))
  bs = _small(8)

  def fn(x, g, r):
    return rms_norm_mosaic(
      x, g, r, fwd_block_sizes=bs, bwd_block_sizes=bs, interpret=interpret
    )

  _check(fn, x, g, r, jax.random.fold_in(key, 1), dtype=jnp.bfloat16)


def test_vmap_over_shards_with_shared_gamma(interpret):
  """A leading shard axis under vmap; gamma shared, its gradient summed."""
  s, t, d = 2, 21, 64
  key = jax.random.key(3)
  x, g, r = _inputs(key, (s, t, d), jnp.float32, True, True)
  bs = _small(16)

  def fn(x, g, r):
    per_shard = jax.vmap(
      lambda x, r: rms_norm_mosaic(
        x,
        g,
        r,
        fwd_block_sizes=bs,
        bwd_block_sizes=bs,
        interpret=interpret,
      )  # fmt: skip
    )
    return per_shard(x, r)

  _check(fn, x, g, r, jax.random.fold_in(key, 1), dtype=jnp.float32)


def test_no_rows_and_unsupported_width_fall_back(interpret):
  x = jnp.zeros((0, 64), jnp.bfloat16)
  assert rms_norm_mosaic(x, interpret=interpret).shape == (0, 64)
  assert not mosaic_gpu.supported(96, jnp.bfloat16)
  x = jax.random.normal(jax.random.key(0), (5, 96))
  np.testing.assert_allclose(
    rms_norm_mosaic(x, interpret=interpret), rms_norm_reference(x), rtol=1e-6
  )


def test_wide_rows_take_fewer_output_slots_or_the_reference(interpret):
  """Rows too wide for the default buffers: fewer output slots (down to
  one) while one input stage fits, else the reference (`fits`). Before,
  such widths failed to compile on the GPU (over 227 KiB of SMEM)."""
  cfg = mosaic_gpu.make_config(
    4096, 8192, jnp.bfloat16, jnp.bfloat16, True, 1e-6, None, True, bwd=False
  )
  assert cfg.out_slots < 4 and mosaic_gpu.smem_bytes(cfg, bwd=False) < (
    227 * 1024
  )
  assert mosaic_gpu.fits(8192, jnp.bfloat16, jnp.bfloat16, True)
  assert mosaic_gpu.fits(4096, jnp.bfloat16, None, True, quantize=True)
  assert not mosaic_gpu.fits(8192, jnp.float32, jnp.float32, True)
  with pytest.raises(ValueError, match="8192 float32 .* shared memory"):
    mosaic_gpu.make_config(
      4096, 8192, jnp.float32, jnp.float32, True, 1e-6, None, True, bwd=True
    )
  # The kernels at 8192 bf16 (2 output slots forward, 1 backward), against
  # the reference; f32 at 8192 with gamma and residual is the reference.
  for bwd, slots in ((False, 2), (True, 1)):
    cfg = mosaic_gpu.make_config(
      5, 8192, jnp.bfloat16, jnp.bfloat16, True, 1e-6, None, True, bwd=bwd
    )
    assert cfg.out_slots == slots
  key = jax.random.key(7)
  x, g, r = _inputs(key, (5, 8192), jnp.bfloat16, True, True)
  fn = lambda x, g, r: rms_norm_mosaic(x, g, r, interpret=interpret)
  _check(fn, x, g, r, jax.random.fold_in(key, 1), dtype=jnp.bfloat16)
  x, g, r = _inputs(key, (3, 8192), jnp.float32, True, True)
  for a, b in zip(
    rms_norm_mosaic(x, g, r, interpret=interpret),
    rms_norm_reference(x, g, r, eps=1e-6),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)


def test_block_rows_follow_layout():
  for d, itemsize_dtype, unit in [
    (64, jnp.bfloat16, 16),
    (128, jnp.bfloat16, 8),
    (512, jnp.bfloat16, 4),
    (64, jnp.float32, 8),
  ]:
    assert mosaic_gpu.supported(d, itemsize_dtype)
    cfg = mosaic_gpu.make_config(
      10_000, d, itemsize_dtype, None, True, 1e-6, None, False, bwd=False
    )
    assert cfg.block_rows % unit == 0
    assert mosaic_gpu.smem_bytes(cfg, bwd=False) <= 200 * 1024
  with pytest.raises(ValueError, match="multiple"):
    mosaic_gpu.make_config(
      100,
      64,
      jnp.bfloat16,
      None,
      False,
      1e-6,
      mosaic_gpu.BlockSizes(block_rows=8),
      False,
      bwd=False,
    )


def test_default_dispatch_on_cpu_is_xla():
  x = jax.random.normal(jax.random.key(1), (3, 64))
  np.testing.assert_array_equal(
    pallas_kernels.rms_norm(x), rms_norm_reference(x)
  )


@pytest.mark.gpu
@pytest.mark.parametrize(
  "shape,with_gamma,with_residual,extra",
  [
    # Ragged tails on real hardware, where rows past `t` hold stale SMEM.
    *[((262_144 + 37, 512), g, r, None) for g, r in VARIANTS],
    ((65_536 + 3, 2048), True, True, None),  # bwd: rows over 2 warps
    ((65_536, 2048), True, True, None),  # fwd: wide rows, direct loads
    ((131_072, 1024), True, False, None),
    ((4_099, 8, 64), True, False, None),  # QK-norm: 4 rows per warp
    # Both store paths explicitly, ragged.
    ((262_144 + 37, 512), True, True, dict(direct_stores=True)),
    ((65_536 + 3, 2048), True, True, dict(direct_stores=True)),
    ((262_144 + 37, 512), True, True, dict(direct_stores=False)),
    # Pipeline variants (benchmarks/rms_norm.py --variants).
    ((262_144, 512), True, True, dict(direct_loads=True)),
    ((65_536, 2048), True, True, dict(direct_loads=True, num_blocks=264)),
    ((262_144 + 37, 512), True, True, dict(pdl=False)),
    ((65_536 + 3, 2048), True, True, dict(out_slots=4, stages=2)),
    # Wide rows: fewer output slots (they failed to compile before).
    ((16_384 + 5, 8192), True, True, None),
    ((16_384 + 5, 4096), True, True, "f32"),
  ],
)
def test_gpu_real_shapes(shape, with_gamma, with_residual, extra):
  """Compiled at the benchmark's shapes (up to 262,181 rows), far too slow
  to interpret, with the default settings (or the named pipeline
  variants): ragged tails where rows past `t` hold stale shared memory,
  every wide-row and store path the defaults pick at these widths."""
  key = jax.random.key(shape[0])
  dtype = jnp.float32 if extra == "f32" else jnp.bfloat16
  extra = None if extra == "f32" else extra
  x, g, r = _inputs(key, shape, dtype, with_gamma, with_residual)
  bs = None if extra is None else mosaic_gpu.BlockSizes(**extra)

  def fn(x, g, r):
    return rms_norm_mosaic(
      x, g, r, fwd_block_sizes=bs, bwd_block_sizes=bs, interpret=False
    )

  _check(jax.jit(fn), x, g, r, jax.random.fold_in(key, 1), dtype=dtype)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("t", [37, 5])
def test_stale_rows_of_last_tile_stay_out_of_dgamma(t, direct, interpret):
  """One block, two buffers: the ragged last tile reuses the buffer of tile
  0, so its rows past `t` hold real (stale) data that must not reach dgamma.
  """
  key = jax.random.key(t)
  x, g, r = _inputs(key, (t, 512), jnp.bfloat16, True, True)
  bs = mosaic_gpu.BlockSizes(
    block_rows=16, num_blocks=1, stages=2, direct_stores=direct
  )

  def fn(x, g, r):
    return rms_norm_mosaic(
      x, g, r, fwd_block_sizes=bs, bwd_block_sizes=bs, interpret=interpret
    )

  _check(jax.jit(fn), x, g, r, jax.random.fold_in(key, 1), dtype=jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_default_is_mosaic():
  """On a Hopper GPU the public op's default is the kernel (on the CPU it
  is the reference: `test_default_dispatch_on_cpu_is_xla`)."""
  x = jax.random.normal(jax.random.key(2), (1000, 512), jnp.bfloat16)
  hlo = jax.jit(pallas_kernels.rms_norm).lower(x).as_text()
  assert "mosaic_gpu" in hlo
