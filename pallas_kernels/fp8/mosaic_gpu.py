"""What the FP8 Mosaic GPU kernels share (G4).

The kernels live one to a file beside this one:

- `mosaic_gpu_quantize.py`: `quantize_mgpu`, `x_rc` -> e4m3 values and
  block scales in one pass;
- `mosaic_gpu_transpose_quantize.py`: `transpose_quantize_mgpu`, `x^T`
  quantized along the rows of `x`;
- `mosaic_gpu_matmul.py`: `scaled_matmul_mgpu`, the block-scaled GEMM;
- `mosaic_gpu_quantizing_matmul.py`: `quantizing_matmul_mgpu`, the same
  product with `a` quantized in the kernel.

This module holds the pieces more than one of them uses: the quantizer of
one 64-row tile (`quantize_chunk`, `quantize_rows`: the quantize kernels
and the quantizing GEMM), the programs of a grid over row tiles
(`steps_per_program`), and the GEMMs' promotion of a block product
(`promote_block`), their epilogue (`epilogue_smem`, `store_tile`) and their
last partial row tile (`row_start`).
"""

import enum

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic
from pallas_kernels.fp8 import format as fmt

# The quantize kernels' tile of `x`: 64 rows (a warpgroup's wgmma rows) by
# 128 columns (one 1x128 block, four 32x32 ones).
TILE_R = 64
TILE_C = 128
# e4m3 tiles as an 8-bit wgmma reads them (also the FP8 matmul's).
F8_TILES = (plgpu.TilingTransform((8, 128)), mosaic.SWIZZLE)

ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)


class Dim(enum.IntEnum):
  M = 0
  N = 1


def bcast_rows(v, shape):
  return lax.broadcast_in_dim(v, shape, [0])


def quantize_chunk(
  y, amax, *, sr: bool = False, seed_b=None, row0=0, col0=0, n_cols=0
):
  """Scale, round and cast one `[64, w]` f32 chunk in a wgmma layout (the
  16-bit one, or the 8-bit one of `quantize_rows`) whose blocks' maxima
  are `amax` (one per row); returns (e4m3, scale). With `sr` (16-bit
  layout only: the positions' iotas are built in it), stochastic rounding
  by the bits of each element's `(row, col)` position (offset by `row0`,
  `col0`) in an `n_cols`-wide matrix and the hashed seed `seed_b`."""
  scale, inv = fmt.pow2_scale(amax)
  y = y * bcast_rows(inv, y.shape)
  if sr:
    rows = plgpu.broadcasted_iota(
      jnp.int32, y.shape, 0, layout=plgpu.Layout.WGMMA
    )
    cols = plgpu.broadcasted_iota(
      jnp.int32, y.shape, 1, layout=plgpu.Layout.WGMMA
    )
    bits = fmt.random_bits(seed_b, rows + row0, cols + col0, n_cols)
    return fmt.round_e4m3(y, bits).astype(fmt.E4M3), scale
  # Round to nearest even: the hardware cvt, which equals the reference's
  # integer rounding bit for bit (`mosaic_gpu_quantize.py`'s docstring).
  return y.astype(fmt.E4M3), scale


def quantize_rows(x_smem):
  """A `[64, 128]` bf16 tile in shared memory -> (e4m3 values, float32 row
  scales) in 1 x 128 blocks (`quantize_chunk`: the values and power-of-two
  scales of `fp8.quantize`). The fp8 matmul quantizes its `a` tiles with
  it, the transposing kernel its tiles' rows (`rows_too`).

  The tile is loaded in the 8-bit wgmma layout, whose register groups hold
  four adjacent columns (so the e4m3 values are stored 32 bits at a time,
  not 16), and the row maxima are taken on the bf16 values (exact: |x| and
  max lose nothing in bf16): up to 6% faster than the 16-bit wgmma layout
  with f32 maxima, outputs bit-identical."""
  x = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA_8BIT)
  amax = jnp.max(jnp.abs(x), axis=1).astype(jnp.float32)
  return quantize_chunk(x.astype(jnp.float32), amax)


def steps_per_program(
  row_tiles: int, col_tiles: int, num_sms: int, per_sm: int = 4
) -> int:
  """Largest divisor of `row_tiles` leaving >= `per_sm` programs per SM."""
  best = 1
  for d in range(1, row_tiles + 1):
    if row_tiles % d == 0 and col_tiles * (row_tiles // d) >= per_sm * num_sms:
      best = d
  return best


def promote_block(
  acc, p, ra, sb_cols, n0, tile_m: int, tile_n: int, uniform: bool
):
  """`acc` plus one k-block's product `p` (`[tile_m, tile_n]`, wgmma
  layout) scaled by the row scales `ra` (wgmma row layout) times the
  weight scales of columns `n0 ..` of `sb_cols` (a 1-D smem ref).
  `uniform` (128 x 128 weight blocks: one scale for all of a warpgroup's
  columns) folds that scale into the row scales, so the promotion is one
  FMA per element; the first `tile_m` entries are read as a row vector,
  which needs `tile_m <= tile_n`."""
  if uniform and tile_m <= tile_n:
    cs = plgpu.load(sb_cols.at[pl.ds(n0, tile_m)], layout=ROW)
    return acc + p * lax.broadcast_in_dim(ra * cs, (tile_m, tile_n), [0])
  cb = plgpu.load(sb_cols.at[pl.ds(n0, tile_n)], layout=COL)
  scale = lax.broadcast_in_dim(
    ra, (tile_m, tile_n), [0]
  ) * lax.broadcast_in_dim(cb, (tile_m, tile_n), [1])
  return acc + p * scale


def row_start(m_idx, cta_m: int, m: int):
  """First row of row tile `m_idx`: `m_idx * cta_m`, except that a tile
  that would run past `m` (a multiple of 8, at least `cta_m`) ends at `m`
  instead, overlapping the tile before it. Its overlapping rows are
  computed twice, in the same order, and stored twice with the same
  values; no operand is padded and nothing is sliced off the output."""
  return pl.multiple_of(jnp.minimum(m_idx * cta_m, m - cta_m), 8)


def store_tile(acc, out_smem, out_gmem, bs):
  """A warpgroup's `tile_m x tile_n` f32 accumulator to `out_gmem` (its
  tile's window) through `out_smem` (`[slots, epi_m, epi_n]`), by TMA.
  `bs`: the GEMM's block sizes (`tile_m`, `tile_n`, `epi_tile_m`,
  `epi_tile_n`)."""
  acc = acc.astype(out_gmem.dtype)
  epi_m, epi_n = bs.epi_tile_m, bs.epi_tile_n
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for mi in range(bs.tile_m // epi_m):
    for ni in range(bs.tile_n // epi_n):
      ms = slice(mi * epi_m, (mi + 1) * epi_m)
      ns = slice(ni * epi_n, (ni + 1) * epi_n)
      slot = (mi * (bs.tile_n // epi_n) + ni) % out_smem.shape[0]
      # This slot's previous store must have read it.
      plgpu.wait_smem_to_gmem(out_smem.shape[0] - 1, wait_read_only=True)
      out_smem[slot] = acc[ms, ns]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[slot], out_gmem.at[ms, ns])


def epilogue_smem(bs, out_dtype, wgs: int = 2):
  """Epilogue staging: two slots for each of `wgs` compute warpgroups (one
  if a tile is a single epilogue tile), swizzled for the TMA store."""
  epi_m, epi_n = bs.epi_tile_m, bs.epi_tile_n
  itemsize = jnp.dtype(out_dtype).itemsize
  swizzle = plgpu.find_swizzle(epi_n * itemsize * 8)
  transforms = (
    plgpu.TilingTransform((8, swizzle // itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )
  slots = min(2, bs.tile_m * bs.tile_n // (epi_m * epi_n))
  return plgpu.SMEM(
    (wgs, slots, epi_m, epi_n), out_dtype, transforms=transforms
  )
