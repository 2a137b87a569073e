"""Shared Mosaic GPU helpers (`pallas_kernels.mosaic`) on their own."""

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mosaic


def _exp2_tile(x, poly_cols: int, interpret):
  """`mosaic.exp2` of an f32 `[64, n]` tile inside a one-warpgroup kernel,
  the tile in registers in the wgmma accumulator's layout (as the
  attention kernels hold their scores)."""

  def body(x_gmem, o_gmem, x_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, x_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    scores = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA)
    o_smem[...] = mosaic.exp2(scores, poly_cols, interpret)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct(x.shape, jnp.float32),
    scratch_types=[
      plgpu.SMEM(x.shape, jnp.float32),
      plgpu.SMEM(x.shape, jnp.float32),
      plgpu.Barrier(num_barriers=1),
    ],
    interpret=interpret,
  )(x)


def _exponents(seed):
  """Softmax exponents (`<= 0`): random over [-130, 0] with the edges in
  the first row: -inf (a masked score), past the clamp at -125, 0,
  rounding ties, at the clamp, a tiny negative."""
  rng = np.random.default_rng(seed)
  x = -rng.uniform(0, 130, (64, 128)).astype(np.float32)
  edges = [-np.inf, -200, -125.3, 0, -0.5, -1.5, -2.5, -0.4999, -124.9]
  x[0, : len(edges) + 2] = edges + [-125, -1e-7]
  x[1:, 100:] = -rng.exponential(2.0, (63, 28))  # the likeliest range
  return x


def _check_exp2(got, x, poly_cols):
  want = np.exp2(x.astype(np.float64))
  poly, sfu = np.s_[:, :poly_cols], np.s_[:, poly_cols:]
  # The SFU's columns: exp2 as the compiler emits it (the GPU's approximate
  # instruction, XLA's on the CPU: 4e-6 at exponents near -125; results
  # under 2**-126 may flush to 0).
  xs, gs, ws = x[sfu], got[sfu], want[sfu]
  normal = xs >= -126
  np.testing.assert_allclose(gs[normal], ws[normal], rtol=1e-5)
  assert (gs[~normal] <= 2.0**-126).all()
  # The polynomial's: 7.5e-5 relative error down to 2**-125; below it and
  # at -inf, 2**-125 (not 0: a negligible term against the row maximum's
  # 1).
  xp, gp, wp = x[poly], got[poly], want[poly]
  kept = xp >= -125
  np.testing.assert_allclose(gp[kept], wp[kept], rtol=8e-5)
  np.testing.assert_allclose(gp[~kept], 2.0**-125, rtol=8e-5)
  assert poly_cols == 0 or np.isneginf(xp).any()


@pytest.mark.parametrize("poly_cols", [0, 8, 48, 128])
def test_exp2_polynomial_columns_interpret(poly_cols):
  # Interpret mode on the CPU rounds with `lax.round` (XLA's CPU compiler
  # folds the magic-number add and subtract); the compiled kernel's own
  # rounding runs under `-m gpu` below.
  x = _exponents(poly_cols)
  got = _exp2_tile(jnp.asarray(x), poly_cols, plgpu.InterpretGPUParams())
  _check_exp2(np.asarray(got), x, poly_cols)


def test_exp2_rejects_columns_off_the_layout_tiles():
  x = jnp.zeros((64, 128), jnp.float32)
  for cols in (12, 136, -8):
    with pytest.raises(ValueError, match=f"poly_cols={cols} must be"):
      mosaic.exp2(x, cols)


@pytest.mark.gpu
@pytest.mark.parametrize("poly_cols", [16, 128])
def test_exp2_polynomial_columns_gpu(poly_cols):
  x = _exponents(poly_cols + 1)
  got = _exp2_tile(jnp.asarray(x), poly_cols, None)
  _check_exp2(np.asarray(got), x, poly_cols)
