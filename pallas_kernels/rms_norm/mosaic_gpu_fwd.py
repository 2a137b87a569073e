"""RMSNorm forward kernel (O11), with the fused FP8 output (G4).

`rms_norm_fwd`: load x (and residual) once, form h, the row sums of h²,
scale, store y (and h): one pass, nothing re-read. The technique, the
tiling and the shapes' legend are in `mosaic_gpu.py`.

Fused FP8 output (G4, `quantize=True`): the forward also writes `y`
quantized for an FP8 matmul, e4m3 values `q [t, d]` and one power-of-two
scale per 1x128 block `s [t, d/128]` (the "deepseek" activation format of
`pallas_kernels.fp8`), so the next matmul reads 8 bits per element instead
of re-reading `y` to quantize it. The kernel then sees every `[t, d]` array
as `[t, d/128, 128]` (a free reshape outside) and holds a tile in the block
layout (`mosaic_gpu._block_layout`): lanes still own 16 contiguous bytes,
and each 1x128 block lies inside one warp, so the row's sum of squares is
a reduction over axes 1 and 2 and a block's maximum one over axis 2, both
warp shuffles. From the `y` registers (rounded to the output dtype first,
so the result is bit-identical to `fp8.quantize` of the returned `y`):
`pow2_scale` of the block maxima, then the hardware conversion to e4m3
(round to nearest even, as `fp8.mosaic_gpu_quantize`). Values leave with
`y` and `h`; the scales, `[m, d/128]` per tile, go to an array of whole
tiles (a bulk copy moves a multiple of 16 bytes, which a ragged tail need
not be), transposed where `d/128` f32 are not a multiple of 16 bytes
(`_Config.scales_transposed`). The first form (the `[m, d]` row layout,
each block's maximum a masked reduction over the whole row, integer
rounding) cost `O(d/128)` work per element and ran 5x slower than the
plain norm followed by the quantize kernel. This one reaches 87-90% of
copy bandwidth, 1.2x the plain kernel followed by the quantize kernel and
1.7x XLA's reference with its quantization (docs/kernels/rms_norm.md).
"""

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8 import format as fp8_format
from pallas_kernels.rms_norm.mosaic_gpu import _Config
from pallas_kernels.rms_norm.mosaic_gpu_pipeline import (
  bcast,
  bcast_cols,
  bcast_rows,
  launch,
  load_gamma,
  pipeline,
  prologue,
  row_sum,
)


def _quantize_blocks(cfg: _Config, y):
  """`y [m, d/128, 128]` (f32 registers, block layout) -> e4m3 values and
  the `[m, d/128]` f32 scales: one power-of-two scale per 1x128 block
  (G4), as `fp8.quantize` computes it. A block's maximum is a reduction
  over axis 2 inside one warp; the rounding is the hardware conversion
  (round to nearest even; `|y / s| <= 448`, so saturation never acts),
  which equals the reference's integer rounding bit for bit (as in
  `fp8.mosaic_gpu_quantize`)."""
  scale, inv = fp8_format.pow2_scale(jnp.max(jnp.abs(y), axis=2))
  return (y * bcast(inv, cfg, (0, 1))).astype(fp8_format.E4M3), scale


def _fwd_kernel(cfg: _Config, *refs):
  it = iter(refs)
  x_gmem = next(it)
  r_gmem = next(it) if cfg.has_residual else None
  gamma_gmem = next(it) if cfg.gamma_dtype else None
  y_gmem = next(it)
  h_gmem = next(it) if cfg.has_residual else None
  q_gmem, s_gmem = (next(it), next(it)) if cfg.quantize else (None, None)
  in_smem, out_smem, barrier = next(it), next(it), next(it)
  in_gmem = [x_gmem] + ([r_gmem] if cfg.has_residual else [])
  out_gmem = [y_gmem] + ([h_gmem] if cfg.has_residual else [])
  transposed = [False] * len(out_gmem)
  if cfg.quantize:
    # The scales go to an array of whole tiles (a ragged tail's bytes need
    # not be a multiple of 16), `cfg.scales_tile` each.
    out_gmem += [q_gmem, s_gmem]
    transposed += [False, cfg.scales_transposed]
  prologue(cfg)
  gamma = load_gamma(gamma_gmem, cfg) if cfg.gamma_dtype else None
  inv_d = 1.0 / cfg.d

  def body(row0, load, store, carry):
    del row0
    h = load(0)
    if cfg.has_residual:
      h = h + load(1)  # in x's dtype, as the reference
    h32 = h.astype(jnp.float32)
    ms_m = row_sum(h32 * h32, cfg) * inv_d
    y = h32 * bcast_rows(lax.rsqrt(ms_m + cfg.eps), cfg)
    if gamma is not None:
      y = y * bcast_cols(gamma, cfg)
    outs = [y, h] if cfg.has_residual else [y]
    if cfg.quantize:
      # Quantize `y` as returned (rounded to its dtype), like the reference.
      y = y.astype(cfg.dtype)
      outs = [y, *outs[1:], *_quantize_blocks(cfg, y.astype(jnp.float32))]
    store(outs)
    return carry

  pipeline(cfg, in_gmem, in_smem, barrier, out_gmem, out_smem, transposed)(
    body, ()
  )


def rms_norm_fwd(x_td, gamma_d, residual_td, cfg: _Config):
  """`[t, d]` rows -> `y` (and `h = x + residual`), in x's dtype.

  With `cfg.quantize`, two more outputs: e4m3 values `[t, d]` and f32
  scales `[t, d/128]` of `y` in 1x128 blocks. The kernel then sees every
  `[t, d]` array as `[t, d/128, 128]` (and gamma as `[d/128, 128]`), the
  same bytes, and writes the scales in whole tiles (`scales_tile`),
  reordered and cut to `t` rows here.
  """
  t, d = x_td.shape
  rows = (t, *cfg.tile_shape[1:])
  sds = jax.ShapeDtypeStruct(rows, x_td.dtype)
  n_in = 1 + cfg.has_residual
  out_type = [sds, sds] if cfg.has_residual else [sds]
  n_out = len(out_type)
  if cfg.quantize:
    a, b = cfg.scales_tile
    out_type += [
      jax.ShapeDtypeStruct(rows, fp8_format.E4M3),
      jax.ShapeDtypeStruct((cfg.num_tiles * a, b), jnp.float32),
    ]
  args = [x_td.reshape(rows)]
  if cfg.has_residual:
    args.append(residual_td.reshape(rows))
  if cfg.gamma_dtype:
    args.append(gamma_d.reshape(cfg.tile_shape[1:]))
  outs = launch(_fwd_kernel, cfg, out_type, n_in, n_out, [], *args)
  n_td = len(outs) - cfg.quantize  # then the scales
  outs = [o.reshape(t, d) for o in outs[:n_td]] + list(outs[n_td:])
  if cfg.quantize:  # whole tiles -> `[t, d/128]`
    s = outs[-1].reshape(cfg.num_tiles, *cfg.scales_tile)
    if cfg.scales_transposed:
      s = s.transpose(0, 2, 1)
    outs[-1] = s.reshape(-1, cfg.q_blocks)[:t]
  return tuple(outs)
