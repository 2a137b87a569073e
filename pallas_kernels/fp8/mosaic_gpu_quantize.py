"""Fused FP8 quantization in one Pallas Mosaic GPU kernel (G4).

One pass over `x_rc` (bf16): optional random Hadamard transform, block maxima,
power-of-two scales, optional stochastic rounding, e4m3 cast; writes the
values `v_rc` and the scales. The work is split in `tile_r x 128` tiles of
`x` (`tile_r` = 64 or 128, processed as 64-row parts), walked by workers
(warpgroups) in one of two forms:

- ring (persistent; the default for 1x128 blocks): `num_sms * ctas_per_sm`
  CTAs of `warpgroups` warpgroups each; worker `p` of `P` takes tiles
  `p, p + P, ...` in row-major tile order (neighbouring workers read
  neighbouring 256-byte pieces of the same rows), through its own ring of
  `stages` input tiles and `out_slots` output tiles. A slot is refilled as
  soon as its tile is in registers (before the quantize math), and the
  Hadamard matrix is loaded once per CTA and shared by its warpgroups, so
  with a transform four workers share an SM in 193 KB instead of two
  programs in 2 x 81 KB. No per-program prologue or store drain.
- grid (the default for 32x32 blocks): one program (one warpgroup) per
  column of `steps` row tiles, enough programs for >= 4 per SM, each
  through `plgpu.emit_pipeline` with `stages` tiles in flight.

Per tile:

1. TMA brings the tile into shared memory.
2. Hadamard: one wgmma of the tile with `blockdiag(D H)` (+-1 entries, exact
   in bf16; f32 accumulation), times `1/sqrt(hb)`. `hb` in {32, 64, 128}.
   Without Hadamard the tile is read from shared memory into registers.
3. Block maxima. 1x128 blocks: a row reduction (inside each warp).
   32x32 blocks: a row maximum over each 32-column chunk (inside the warp),
   then the maximum over 32 rows, which spans two warps: the 64 row maxima go
   through shared memory and come back as a column vector, whose maximum
   along the row is again a reduction inside the warp. No atomics.
4. Scale and rounding. Round to nearest: the hardware conversion
   `cvt.rn.satfinite.e4m3x2.f32` (two elements per instruction), which is
   round-to-nearest-even onto the e4m3 grid, subnormals included; since
   `|x / s| <= 448` saturation never acts, so it equals the reference's
   integer emulation (`format.round_e4m3`) bit for bit, without its integer
   work. Stochastic rounding has no Hopper instruction: the
   reference's integer arithmetic with counter-based random bits from
   `hash32(row * c + col ^ seed)`. Kernel and reference agree bit for bit up
   to the order of the Hadamard sums.
5. Values and scales go back by TMA. Scales are written in the layout the
   matmul kernel reads, one per (column block, row): `se_Cr`, `[c/bc, r]`;
   the wrapper derives the compact `s_RC` from it.

`r` must be a multiple of 64 and `c` of 128 (the wrapper pads); 128-row
tiles need `r % 128 == 0` (else 64-row tiles are used). Shared memory:
`stages` input tiles (bf16), two output tiles (e4m3) and their scales, and
the Hadamard matrix only when one is applied (a smaller footprint lets more
programs share an SM, which is what hides the memory latency here).

These reach 0.74-0.89 of the copy bandwidth. The Hadamard forms gain most
from the ring, as their wgmma work (about a third of the memory time) is
spread over four workers instead of two programs; the narrowest input is
moved in ~28 us, where launch and ramp weigh. The runs behind this and the
defaults below: docs/kernels/fp8.md.

Transposed (`transpose_quantize_mgpu`, `x^T` quantized along the rows of
`x`): `mosaic_gpu_transpose_quantize.py`. The tile size and the scaling and
rounding of a tile (`quantize_chunk`), which that kernel and the quantizing
GEMM share: `mosaic_gpu.py`.
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
  ROW,
  TILE_C,
  TILE_R,
  bcast_rows,
  quantize_chunk,
  steps_per_program,
)

# Default configurations (see `quantize_mgpu`), the best of the H200 sweep
# at 16384 x 4096 (`benchmarks/fp8_matmul.py --quant-sweep`; fraction of
# the copy bandwidth):
#   1x128:        ring, 2 CTAs of 1 warpgroup per SM, 128-row tiles,
#                 2 stages: 0.82
#   1x128 + H128: ring, 1 CTA of 4 warpgroups sharing the Hadamard matrix,
#                 1 stage, 2 output slots: 0.82
#   32x32:        grid form, 64-row tiles, 2 stages (`_BASE`): 0.73
#   32x32 + H32:  as 1x128 + H128: 0.84
# `warpgroups=0` is the grid form.
_BASE = dict(warpgroups=0, ctas_per_sm=1, tile_r=64, stages=2, out_slots=2)
_HADAMARD_RING = dict(warpgroups=4, stages=1)
_DEFAULTS = {
  ((1, 128), False): dict(warpgroups=1, ctas_per_sm=2, tile_r=128),
  ((1, 128), True): _HADAMARD_RING,
  ((32, 32), True): _HADAMARD_RING,
}


def default_config(block, hadamard) -> dict:
  """The measured default keywords of `quantize_mgpu` for this format."""
  return {**_BASE, **_DEFAULTS.get((tuple(block), hadamard is not None), {})}


SUPPORTED_BLOCKS = ((32, 32), (1, 128))
SUPPORTED_HADAMARD = (None, 32, 64, 128)


def _tile_body(
  xh, seed, rm_smem, q_smem, s_smem, *, block, row0, col0, n_cols, sr
):
  """Quantize one `[64, 128]` f32 tile (already Hadamard-transformed)."""
  if block == (1, 128):
    amax = jnp.max(jnp.abs(xh), axis=1)  # [64]
    seed_b = bcast_rows(seed, xh.shape) if sr else None
    q, scale = quantize_chunk(
      xh, amax, sr=sr, seed_b=seed_b, row0=row0, col0=col0, n_cols=n_cols
    )
    q_smem[...] = q
    s_smem[0, :] = scale
    return
  # 32x32 blocks: four 32-column chunks.
  chunks = [xh[:, 32 * k : 32 * (k + 1)] for k in range(4)]
  for k, xc in enumerate(chunks):
    rm_smem[k, :] = jnp.max(jnp.abs(xc), axis=1)  # row maxima, [64]
  plgpu.commit_smem()  # all four warps' row maxima are visible
  row_ids = plgpu.broadcasted_iota(
    jnp.int32, (TILE_R, 32), 0, layout=plgpu.Layout.WGMMA
  )
  top_rows = row_ids < 32
  seed_b = bcast_rows(seed, (TILE_R, 32)) if sr else None
  qs = []
  for k, xc in enumerate(chunks):
    top = plgpu.load(rm_smem.at[k, pl.ds(0, 32)], layout=COL)  # [32]
    bot = plgpu.load(rm_smem.at[k, pl.ds(32, 32)], layout=COL)
    both = jnp.where(
      top_rows,
      lax.broadcast_in_dim(top, (TILE_R, 32), [1]),
      lax.broadcast_in_dim(bot, (TILE_R, 32), [1]),
    )
    amax = jnp.max(both, axis=1)  # [64]: the block maximum of each row
    q, scale = quantize_chunk(
      xc,
      amax,
      sr=sr,
      seed_b=seed_b,
      row0=row0,
      col0=col0 + 32 * k,
      n_cols=n_cols,
    )
    qs.append(q)
    s_smem[k, :] = scale
  q_smem[...] = jnp.concatenate(qs, axis=1)


def _kernel(
  x_gmem,
  h_gmem,
  seed_gmem,
  q_gmem,
  se_gmem,
  *scratch,
  block,
  hb,
  sr,
  n_cols,
  steps,
  tile_r,
  stages,
):
  if hb is None:
    h_smem = None
    seed_smem, rm_smem, qo_smem, so_smem, bar = scratch
  else:
    h_smem, seed_smem, rm_smem, qo_smem, so_smem, bar = scratch
  cb = TILE_C // block[1]  # scale rows per tile
  parts = tile_r // TILE_R
  ct, rt = lax.axis_index("c"), lax.axis_index("r")
  rows = pl.ds(rt * (steps * tile_r), steps * tile_r)
  if hb is not None:
    plgpu.copy_gmem_to_smem(h_gmem, h_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
  if sr:
    plgpu.copy_gmem_to_smem(seed_gmem, seed_smem, bar.at[1])
    plgpu.barrier_wait(bar.at[1])
  seed = plgpu.load(seed_smem, layout=ROW) if sr else None

  def body(idx, x_smem):
    (s,) = idx
    slot = lax.rem(s, 2)
    # The stores issued two steps ago read this slot: let them finish (each
    # step commits two bulk groups, values and scales).
    plgpu.wait_smem_to_gmem(2, wait_read_only=True)
    for part in range(parts):
      prow = pl.ds(part * TILE_R, TILE_R)
      if hb is None:
        xh = plgpu.load(x_smem.at[prow], layout=plgpu.Layout.WGMMA)
        xh = xh.astype(jnp.float32)
      else:

        def mm(acc_ref, prow=prow):
          plgpu.wgmma(acc_ref, x_smem.at[prow], h_smem)
          return acc_ref[...]

        xh = pl.run_scoped(mm, plgpu.ACC((TILE_R, TILE_C), jnp.float32))
        xh = xh * fmt.hadamard_norm(hb)
      _tile_body(
        xh,
        seed,
        rm_smem.at[slot, part],
        qo_smem.at[slot, prow],
        so_smem.at[slot, :, prow],
        block=block,
        row0=(rt * steps + s) * tile_r + part * TILE_R,
        col0=ct * TILE_C,
        n_cols=n_cols,
        sr=sr,
      )
    plgpu.commit_smem()
    tile_rows = pl.ds((rt * steps + s) * tile_r, tile_r)
    plgpu.copy_smem_to_gmem(
      qo_smem.at[slot], q_gmem.at[tile_rows, pl.ds(ct * TILE_C, TILE_C)]
    )
    plgpu.copy_smem_to_gmem(
      so_smem.at[slot], se_gmem.at[pl.ds(ct * cb, cb), tile_rows]
    )

  plgpu.emit_pipeline(
    body,
    grid=(steps,),
    in_specs=[
      plgpu.BlockSpec(
        (tile_r, TILE_C), lambda s: (s, 0), transforms=mosaic.TILES
      )
    ],
    max_concurrent_steps=stages,
  )(x_gmem.at[rows, pl.ds(ct * TILE_C, TILE_C)])
  plgpu.wait_smem_to_gmem(0)


def _ring_kernel(
  x_gmem,
  h_gmem,
  seed_gmem,
  q_gmem,
  se_gmem,
  *scratch,
  block,
  hb,
  sr,
  n_cols,
  col_tiles,
  n_tiles,
  tile_r,
  stages,
  slots,
  wgs,
  num_workers,
):
  """Persistent form: `wgs` warpgroups per CTA, each a worker with its own
  ring of `stages` input tiles and `slots` output tiles; the Hadamard matrix
  is loaded once per CTA and shared by its warpgroups. Worker `p` of `P`
  takes tiles `p, p + P, ...` in row-major tile order (neighbouring workers
  read neighbouring 256-byte pieces of the same rows)."""
  if hb is None:
    h_smem = None
    seed_smem, x_smem, rm_smem, qo_smem, so_smem, bar, in_bar = scratch
  else:
    h_smem, seed_smem, x_smem, rm_smem, qo_smem, so_smem, bar, in_bar = scratch
  cb = TILE_C // block[1]
  parts = tile_r // TILE_R
  wg = lax.axis_index("wg") if wgs > 1 else 0
  worker = lax.axis_index("p") * wgs + wg
  num_steps = (n_tiles - worker + num_workers - 1) // num_workers
  if hb is not None:

    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(h_gmem, h_smem, bar.at[0])

    plgpu.barrier_wait(bar.at[0])
  if sr:

    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(seed_gmem, seed_smem, bar.at[1])

    plgpu.barrier_wait(bar.at[1])
  seed = plgpu.load(seed_smem, layout=ROW) if sr else None

  def coords(step):
    t = worker + step * num_workers
    return t // col_tiles, lax.rem(t, col_tiles)

  def fetch(step, slot):
    rt, ct = coords(step)
    plgpu.copy_gmem_to_smem(
      x_gmem.at[pl.ds(rt * tile_r, tile_r), pl.ds(ct * TILE_C, TILE_C)],
      x_smem.at[wg, slot],
      in_bar.at[wg * stages + slot],
    )

  def step_fn(step, slot, refill, carry):
    out = lax.rem(step, slots)
    rt, ct = coords(step)
    plgpu.barrier_wait(in_bar.at[wg * stages + slot])
    xin = x_smem.at[wg, slot]
    xhs = []
    for part in range(parts):
      prow = pl.ds(part * TILE_R, TILE_R)
      if hb is None:
        xh = plgpu.load(xin.at[prow], layout=plgpu.Layout.WGMMA)
        xhs.append(xh)
      else:

        def mm(acc_ref, prow=prow):
          plgpu.wgmma(acc_ref, xin.at[prow], h_smem)
          return acc_ref[...]

        xhs.append(pl.run_scoped(mm, plgpu.ACC((TILE_R, TILE_C), jnp.float32)))
    # The slot is read (registers or a finished wgmma): once every thread
    # is past its reads, refill it with the tile `stages` steps ahead.
    plgpu.commit_smem()
    refill()

    # The stores issued `slots` steps ago from this output slot must have
    # read it (one bulk group per step).
    plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
    for part, xh in enumerate(xhs):
      prow = pl.ds(part * TILE_R, TILE_R)
      xh = xh.astype(jnp.float32)
      if hb is not None:
        xh = xh * fmt.hadamard_norm(hb)
      _tile_body(
        xh,
        seed,
        rm_smem.at[wg, part],
        qo_smem.at[wg, out, prow],
        so_smem.at[wg, out, :, prow],
        block=block,
        row0=rt * tile_r + part * TILE_R,
        col0=ct * TILE_C,
        n_cols=n_cols,
        sr=sr,
      )
    plgpu.commit_smem()
    tile_rows = pl.ds(rt * tile_r, tile_r)
    plgpu.copy_smem_to_gmem(
      qo_smem.at[wg, out],
      q_gmem.at[tile_rows, pl.ds(ct * TILE_C, TILE_C)],
      commit_group=False,
    )
    plgpu.copy_smem_to_gmem(
      so_smem.at[wg, out], se_gmem.at[pl.ds(ct * cb, cb), tile_rows]
    )
    return carry

  mosaic.tile_ring(num_steps, stages, fetch, step_fn)
  plgpu.wait_smem_to_gmem(0)


def _hadamard_tile(hb: int, seed: int):
  """`blockdiag(D H)` over one 128-column tile, bf16 (+-1 and 0: exact)."""
  import numpy as np

  m = fmt.hadamard_signed(hb, seed)
  t = np.zeros((TILE_C, TILE_C), np.float32)
  for b in range(TILE_C // hb):
    t[b * hb : (b + 1) * hb, b * hb : (b + 1) * hb] = m
  return jnp.asarray(t, jnp.bfloat16)


@functools.partial(
  jax.jit,
  static_argnames=(
    "block",
    "hadamard",
    "hadamard_seed",
    "sr",
    "interpret",
    "num_sms",
    "n_cols",
    "tile_r",
    "stages",
    "warpgroups",
    "ctas_per_sm",
    "out_slots",
  ),
)
def quantize_mgpu(
  x_rc,
  seed_hash=None,
  *,
  block,
  hadamard=None,
  hadamard_seed=0,
  sr=False,
  interpret=False,
  num_sms=None,
  n_cols=None,
  tile_r=None,
  stages=None,
  warpgroups=None,
  ctas_per_sm=None,
  out_slots=None,
):
  """`(v_rc, se_Cr)` for bf16 `x_rc` with `r % 64 == 0`, `c % 128 == 0`.

  `n_cols`: the unpadded column count, which indexes the random bits of
  stochastic rounding (so padding does not change them). `tile_r` (64 or
  128) rows per pipeline step, `stages` steps in flight. `warpgroups=0`:
  the grid form (programs of a few tiles each); `warpgroups >= 1`: the
  persistent ring form with that many warpgroups per CTA, `ctas_per_sm`
  CTAs per SM and `out_slots` output tiles per warpgroup. With
  `warpgroups=None` every `None` takes the measured default of the format
  (`default_config`); with an explicit form, 64-row tiles, 2 stages, 2
  output slots and 1 CTA per SM.
  """
  r, c = x_rc.shape
  block = tuple(block)
  if block not in SUPPORTED_BLOCKS or hadamard not in SUPPORTED_HADAMARD:
    raise NotImplementedError(f"quantize_mgpu: {block=} {hadamard=}")
  # An explicit form starts from the plain settings, not the format's.
  cfg = _BASE if warpgroups is not None else default_config(block, hadamard)
  cfg = dict(cfg)
  given = dict(
    tile_r=tile_r,
    stages=stages,
    warpgroups=warpgroups,
    ctas_per_sm=ctas_per_sm,
    out_slots=out_slots,
  )
  cfg.update({k: v for k, v in given.items() if v is not None})
  tile_r, stages = cfg["tile_r"], cfg["stages"]
  if r % TILE_R or c % TILE_C:
    raise ValueError(f"quantize_mgpu needs r % 64 == c % 128 == 0, {r=} {c=}")
  if tile_r not in (64, 128):
    raise ValueError(f"tile_r must be 64 or 128, got {tile_r}")
  if r % tile_r:
    tile_r = TILE_R
  x_rc = x_rc.astype(jnp.bfloat16)
  bc = block[1]
  h = _hadamard_tile(hadamard or 32, hadamard_seed)
  seed = jnp.full(
    (TILE_R,), 0 if seed_hash is None else seed_hash, dtype=jnp.int32
  )
  row_tiles, col_tiles = r // tile_r, c // TILE_C
  num_sms = mosaic.num_sms(num_sms)
  interp = mosaic.interpret_params(interpret)
  if cfg["warpgroups"]:
    return _ring_call(
      x_rc,
      h,
      seed,
      block=block,
      hb=hadamard,
      sr=sr,
      n_cols=n_cols or c,
      tile_r=tile_r,
      stages=stages,
      slots=cfg["out_slots"],
      wgs=cfg["warpgroups"],
      ctas=num_sms * cfg["ctas_per_sm"],
      interpret=interp,
    )
  # Enough programs to fill the chip several times over; each walks `steps`
  # row tiles of one column tile through a TMA pipeline.
  steps = steps_per_program(row_tiles, col_tiles, num_sms)
  kernel = functools.partial(
    _kernel,
    block=block,
    hb=hadamard,
    sr=sr,
    n_cols=n_cols or c,
    steps=steps,
    tile_r=tile_r,
    stages=min(steps, stages),
  )
  scratch = (
    plgpu.SMEM((TILE_R,), jnp.int32),
    plgpu.SMEM((2, tile_r // TILE_R, 4, TILE_R), jnp.float32),
    plgpu.SMEM((2, tile_r, TILE_C), fmt.E4M3),
    plgpu.SMEM((2, TILE_C // bc, tile_r), jnp.float32),
    plgpu.Barrier(num_barriers=2),
  )
  if hadamard is not None:
    h_smem = mosaic.smem_tile((TILE_C, TILE_C), jnp.bfloat16)
    scratch = (h_smem, *scratch)
  return plgpu.kernel(
    kernel,
    out_type=(
      jax.ShapeDtypeStruct((r, c), fmt.E4M3),
      jax.ShapeDtypeStruct((c // bc, r), jnp.float32),
    ),
    grid=(col_tiles, row_tiles // steps),
    grid_names=("c", "r"),
    scratch_types=scratch,
    interpret=interp,
    kernel_name="fp8_quantize",
  )(x_rc, h, seed)


def ring_smem_bytes(block, hb, tile_r, stages, slots, wgs) -> int:
  """Shared memory of one CTA of the persistent form."""
  per_wg = (
    stages * tile_r * TILE_C * 2
    + slots * tile_r * (TILE_C + 4 * (TILE_C // block[1]))
    + tile_r // TILE_R * 4 * TILE_R * 4
  )
  return wgs * per_wg + (TILE_C * TILE_C * 2 if hb else 0) + TILE_R * 4 + 64


def _ring_call(
  x_rc,
  h,
  seed,
  *,
  block,
  hb,
  sr,
  n_cols,
  tile_r,
  stages,
  slots,
  wgs,
  ctas,
  interpret,
):
  r, c = x_rc.shape
  bc = block[1]
  col_tiles = c // TILE_C
  n_tiles = (r // tile_r) * col_tiles
  smem = ring_smem_bytes(block, hb, tile_r, stages, slots, wgs)
  if smem > mosaic.SMEM_PER_BLOCK:
    raise ValueError(f"quantize_mgpu: {smem} B of shared memory per CTA")
  grid = min(ctas, pl.cdiv(n_tiles, wgs))
  kernel = functools.partial(
    _ring_kernel,
    block=block,
    hb=hb,
    sr=sr,
    n_cols=n_cols,
    col_tiles=col_tiles,
    n_tiles=n_tiles,
    tile_r=tile_r,
    stages=stages,
    slots=slots,
    wgs=wgs,
    num_workers=grid * wgs,
  )
  scratch = (
    plgpu.SMEM((TILE_R,), jnp.int32),
    mosaic.smem_tile((wgs, stages, tile_r, TILE_C), jnp.bfloat16),
    plgpu.SMEM((wgs, tile_r // TILE_R, 4, TILE_R), jnp.float32),
    plgpu.SMEM((wgs, slots, tile_r, TILE_C), fmt.E4M3),
    plgpu.SMEM((wgs, slots, TILE_C // bc, tile_r), jnp.float32),
    plgpu.Barrier(num_barriers=2),
    plgpu.Barrier(num_barriers=wgs * stages),
  )
  if hb is not None:
    h_smem = mosaic.smem_tile((TILE_C, TILE_C), jnp.bfloat16)
    scratch = (h_smem, *scratch)
  threads = dict(num_threads=wgs, thread_name="wg") if wgs > 1 else {}
  return plgpu.kernel(
    kernel,
    out_type=(
      jax.ShapeDtypeStruct((r, c), fmt.E4M3),
      jax.ShapeDtypeStruct((c // bc, r), jnp.float32),
    ),
    grid=(grid,),
    grid_names=("p",),
    scratch_types=scratch,
    interpret=interpret,
    kernel_name="fp8_quantize_ring",
    **threads,
  )(x_rc, h, seed)
