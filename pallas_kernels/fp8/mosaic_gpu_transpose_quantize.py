"""Transposed FP8 quantization for Hopper in Pallas Mosaic GPU (G4).

Transposed (`transpose_quantize_mgpu`, the FP8 weight gradient's operands
with 1x128 activations: `x^T` quantized along the rows of `x`): the tile
is transposed by the tensor cores (the identity times the tile read
transposed, exact), from bf16 or from e4m3 values with their scales:
1.4-2.4x faster than an XLA transpose then `quantize_mgpu`, or than
dequantize, transpose, quantize.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic
from pallas_kernels.fp8 import format as fmt
from pallas_kernels.fp8.mosaic_gpu import (
  COL,
  F8_TILES,
  TILE_C,
  TILE_R,
  quantize_chunk,
  quantize_rows,
  steps_per_program,
)


def _transpose_kernel(
  x_gmem,
  eye_gmem,
  sx_gmem,
  *refs,
  steps,
  stages,
  scaled,
  rows_too,
  wgs,
):
  """Program `(c, r)`: column tile `c` of `x` (row tile of `x^T`) over
  `steps` row tiles. Per `[128, 128]` tile and 64-row half, a wgmma with
  those rows of the identity as the left operand and the tile read
  transposed as the right one puts the half's rows of `x^T` in registers
  (exact: every product is `1 * x` or `0 * x`, summed in f32), times `x`'s
  own scales where it arrives quantized; then the 1 x 128 block maxima are
  row maxima, as in `quantize_mgpu`. `rows_too`: the half's rows of the
  tile as it is are quantized along their rows as well, into a second pair
  of outputs (`quantize_mgpu`'s values and scales).

  `wgs` 1: one warpgroup fetches (`emit_pipeline`) and does both halves;
  2: a memory warpgroup streams the tiles and each of two compute
  warpgroups does one half (`emit_pipeline_warp_specialized`). A
  warpgroup's outputs are its `span` rows of each tile's two slots."""
  if rows_too:
    q_gmem, se_gmem, qr_gmem, ser_gmem, eye_smem, q_smem, s_smem = refs[:7]
    qr_smem, sr_smem, bar = refs[7:]
  else:
    q_gmem, se_gmem, eye_smem, q_smem, s_smem, bar = refs
  ct, rt = lax.axis_index("c"), lax.axis_index("r")
  wg = lax.axis_index("wg") if wgs > 1 else 0
  span = TILE_C // wgs  # rows of x^T (and of x, rows_too) per warpgroup
  first = wg * span

  @pl.when(wg == 0)
  def _():
    plgpu.copy_gmem_to_smem(eye_gmem, eye_smem, bar.at[0])

  plgpu.barrier_wait(bar.at[0])

  def body(idx, x_smem, *sx):
    (s,) = idx
    slot = lax.rem(s, 2)
    tile = rt * steps + s  # row tile of x: column tile of x^T
    # The stores this warpgroup issued two steps ago read this slot (two
    # groups a step, four with the rows' outputs).
    plgpu.wait_smem_to_gmem(4 if rows_too else 2, wait_read_only=True)
    for j in range(span // TILE_R):
      rows = pl.ds(first + j * TILE_R, TILE_R)  # of the tile
      mine = pl.ds(j * TILE_R, TILE_R)  # of this warpgroup's slot
      y = mosaic.matmul(
        eye_smem.at[rows], x_smem.transpose((1, 0)), (TILE_R, TILE_C)
      )
      if scaled:
        cs = plgpu.load(sx[0].at[0], layout=COL)  # x's row scales
        y = y * lax.broadcast_in_dim(cs, y.shape, [1])
      q, scale = quantize_chunk(y, jnp.max(jnp.abs(y), axis=1))
      q_smem.at[wg, slot, mine][...] = q
      s_smem.at[wg, slot, :, mine][0, :] = scale
      if rows_too:
        q, scale = quantize_rows(x_smem.at[rows])
        qr_smem.at[wg, slot, mine][...] = q
        sr_smem.at[wg, slot, :, mine][0, :] = scale
    plgpu.commit_smem()
    xt_rows = pl.ds(ct * TILE_C + first, span)
    plgpu.copy_smem_to_gmem(
      q_smem.at[wg, slot], q_gmem.at[xt_rows, pl.ds(tile * TILE_C, TILE_C)]
    )
    plgpu.copy_smem_to_gmem(
      s_smem.at[wg, slot], se_gmem.at[pl.ds(tile, 1), xt_rows]
    )
    if rows_too:
      x_rows = pl.ds(tile * TILE_C + first, span)
      plgpu.copy_smem_to_gmem(
        qr_smem.at[wg, slot], qr_gmem.at[x_rows, pl.ds(ct * TILE_C, TILE_C)]
      )
      plgpu.copy_smem_to_gmem(
        sr_smem.at[wg, slot], ser_gmem.at[pl.ds(ct, 1), x_rows]
      )

  run = pl.ds(rt * steps * TILE_C, steps * TILE_C)
  in_specs = [
    plgpu.BlockSpec(
      (TILE_C, TILE_C),
      lambda s: (s, 0),
      transforms=F8_TILES if scaled else mosaic.TILES,
    )
  ]
  args = [x_gmem.at[run, pl.ds(ct * TILE_C, TILE_C)]]
  if scaled:
    in_specs.append(plgpu.BlockSpec((1, TILE_C), lambda s: (0, s)))
    args.append(sx_gmem.at[pl.ds(ct, 1), run])
  if wgs > 1:
    pipeline = plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(steps,),
      in_specs=in_specs,
      max_concurrent_steps=stages,
      wg_axis="wg",
      num_compute_wgs=wgs,
      memory_registers=40,
    )
  else:
    pipeline = plgpu.emit_pipeline(
      body, grid=(steps,), in_specs=in_specs, max_concurrent_steps=stages
    )
  pipeline(*args)
  plgpu.wait_smem_to_gmem(0)


@functools.partial(
  jax.jit, static_argnames=("interpret", "num_sms", "rows_too")
)
def transpose_quantize_mgpu(
  x_rc,
  sx_Cr=None,
  *,
  interpret=False,
  num_sms=None,
  rows_too=False,
):
  """`(v_cr, se_Rc)`: `x^T` quantized round to nearest in 1 x 128 blocks
  (along `r`), the values and scales `quantize_mgpu(x.T, block=(1, 128))`
  gives, without writing `x.T` first. `x_rc` is bf16, or e4m3 values with
  their scales `sx_Cr` (one per 128-column block and row, `[c / 128, r]`,
  as `quantize_mgpu` writes them): then `x^T` is dequantized in registers
  and quantized again, as `quantize_mgpu(dequantize(x).T)` would. `r` and
  `c` must be multiples of 128. Grid form: programs of `steps` tiles of one
  column tile.

  `rows_too` (bf16 `x`): also `x` quantized along its rows, as
  `quantize_mgpu(x, block=(1, 128))` gives it (`v_rc`, `se_Cr`), from the
  same read of `x`: returns `(v_cr, se_Rc, v_rc, se_Cr)`. The FP8
  backward quantizes `g` both ways (for dX and for dW)."""
  r, c = x_rc.shape
  if r % TILE_C or c % TILE_C:
    raise ValueError(f"transpose_quantize_mgpu needs 128 | r, c: {r=} {c=}")
  scaled = sx_Cr is not None
  if scaled != (x_rc.dtype == fmt.E4M3):
    raise ValueError("scales go with e4m3 values, and only with them")
  if scaled and sx_Cr.shape != (c // TILE_C, r):
    raise ValueError(f"scales {sx_Cr.shape} for x {x_rc.shape}")
  if not scaled and x_rc.dtype != jnp.bfloat16:
    raise ValueError(f"x must be bf16 (or e4m3 with scales): {x_rc.dtype}")
  if rows_too and scaled:
    raise ValueError("rows_too quantizes a bf16 x, not e4m3 values")
  dtype = x_rc.dtype
  row_tiles, col_tiles = r // TILE_C, c // TILE_C
  # About one program per SM: a program's pipeline starts and drains once,
  # and one CTA fills an SM's shared memory anyway (the identity, two
  # stages, two output slots: 129 KiB with bf16 input); up to 19% faster
  # than four programs per SM.
  steps = steps_per_program(
    row_tiles, col_tiles, mosaic.num_sms(num_sms), per_sm=1
  )
  # Quantizing each tile both ways (rows_too), two compute warpgroups take
  # a half each, behind a memory warpgroup, with three tiles in flight; a
  # transposed quantization alone is lighter work and keeps one warpgroup
  # with two (timed for e4m3 input, below; bf16 input without rows_too,
  # which the op takes under stochastic rounding or without dX, was not):
  # with rows_too two warpgroups are 9-11% faster than one, for e4m3 input
  # one is 5-8% faster than two.
  wgs, stages = (2, 3) if rows_too else (1, 2)
  kernel = functools.partial(
    _transpose_kernel,
    steps=steps,
    stages=min(steps, stages),
    scaled=scaled,
    rows_too=rows_too,
    wgs=wgs,
  )
  eye = jnp.eye(TILE_C, dtype=dtype)
  sx = sx_Cr.astype(jnp.float32) if scaled else jnp.zeros((1, 1), jnp.float32)
  tiles = F8_TILES if scaled else mosaic.TILES
  outputs = [
    jax.ShapeDtypeStruct((c, r), fmt.E4M3),
    jax.ShapeDtypeStruct((r // TILE_C, c), jnp.float32),
  ]
  # Values and scales of each warpgroup's rows of a tile, two slots (the
  # rows' pair with rows_too).
  slots = [
    plgpu.SMEM((wgs, 2, TILE_C // wgs, TILE_C), fmt.E4M3),
    plgpu.SMEM((wgs, 2, 1, TILE_C // wgs), jnp.float32),
  ]
  if rows_too:
    outputs += [
      jax.ShapeDtypeStruct((r, c), fmt.E4M3),
      jax.ShapeDtypeStruct((c // TILE_C, r), jnp.float32),
    ]
    slots += slots
  threads = dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}
  return plgpu.kernel(
    kernel,
    out_type=tuple(outputs),
    grid=(col_tiles, row_tiles // steps),
    grid_names=("c", "r"),
    kernel_name="fp8_quantize_transpose",
    scratch_types=(
      plgpu.SMEM((TILE_C, TILE_C), dtype, transforms=tiles),
      *slots,
      plgpu.Barrier(num_barriers=1),
    ),
    interpret=mosaic.interpret_params(interpret),
    **threads,
  )(x_rc, eye, sx)
