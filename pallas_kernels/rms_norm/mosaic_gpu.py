"""Fused RMSNorm, forward and backward, as Pallas Mosaic GPU kernels (O11).

Math, per row of `d` features (statistics in f32, outputs in the input dtype):

  h = x + residual                 (the new residual stream; h = x without it)
  r = 1 / sqrt(mean(h²) + eps)     (one scalar per row)
  y = h · r · gamma                (gamma optional)

Backward, with cotangents dy and (with a residual) dh_out for the returned h:

  g  = dy · gamma                  (g = dy without gamma)
  dh = r·g − h · r³ · mean(g·h) + dh_out
  dx = d residual = dh             (one array, returned twice)
  dgamma = Σ_rows dy · h · r

Shapes: `t` rows (tokens × heads for QK-norm: any leading axes are flattened),
`d` features, `m` rows of one tile; `g` persistent blocks (one per SM).

How the kernels work (the O11 recipe: vectorised loads, compile-time
variants, one pass from registers, two-stage dgamma):

- Rows are contiguous, so a tile of `m` whole rows is one contiguous run of
  `m·d` elements: it moves between global and shared memory with one bulk
  async copy (TMA `cp.async.bulk`), no tensor map and no 256-element box
  limit. Each of `g` persistent blocks walks tiles `b, b+g, b+2g, ...` with a
  ring of `stages` input buffers (copies for the next tiles are in flight
  while one tile is computed) and `out_slots` output buffers per output
  (the stores of the last `out_slots - 1` tiles drain while the next is
  computed). The forward keeps few loads ahead (2 stages): on the H200 a
  deeper read-ahead (3-4 stages) made the D=512 forward 3% slower, its loads
  crowding out the writes; 2 to 6 output slots measured alike.
- The forward's tile height is chosen for the last wave (`balance`): the
  busiest of the `g` blocks handles `ceil(ceil(t/m)/g)·m` rows, so among
  heights near the target it takes the one with the fewest (T=262,144,
  D=512: 12 rows, 1992 per block, against 16 rows and 2000).
- Registers hold a tile in a row layout: each warp owns whole rows, each
  lane 16 contiguous bytes of a row (8 bf16 / 4 f32), so shared-memory
  loads and stores are 16 bytes wide and conflict-free, and the row sums are
  warp shuffles, never shared memory. With `vec` elements in 16 bytes,
  `d / vec` must be a multiple of 32 or a power of two below 32 (`supported`
  says which shapes qualify; the others take the XLA path). Wide rows in the
  backward (d=2048) split each row over 2 warps, so a thread holds 32
  values instead of 64 (which spill); those row sums cross warps via SMEM.
- Forward: load x (and residual) once, form h, Σh² per row, scale, store y
  (and h). One pass, nothing re-read.
- Backward: load h, dy (and dh_out) once; both row sums Σh² and Σg·h come
  from the same registers, so r is recomputed instead of saved. dgamma is
  accumulated per block in registers over all its tiles (`[m, d]` f32),
  written once as a partial `[g·m, d]`, and summed by one small XLA
  reduction: a two-stage reduction, no atomics.
- Variants (residual or not, gamma or not) are Python-level switches at
  trace time: each combination is its own kernel, with no branch inside.
- Ragged tail (`t` not a multiple of `m`): the bulk copies are clamped to
  the array (loads read only valid rows, stores write only valid rows), so
  no padding and no masked loads or stores. The rows of the last tile past
  `t` hold stale shared memory; rows are independent, so they only reach
  dgamma, where a row mask drops them (compiled in only when `t % m != 0`:
  one compare and select per element). This is the seed's TMA zero-fill
  idea (G1) reached with clamped copies. (The GPU interpreter zero-fills
  instead, so the stale-row case is covered by the `gpu` tests.)

Against the device's copy bandwidth the backward runs at 96-99% and the
forward at about 91% (2.6-3.0x and 1.2x XLA's fused ops): the forward
writes as many bytes as it reads, and a written byte costs more (the same
pipeline copying x -> y without compute reaches 91% of XLA's copy). Over
rows of 2-4 KiB the forward's default is registers straight from global
memory, 2 warps per row and 2 blocks per SM instead (`_wide_rows`: 2-7%
faster). Tried and not kept: 2 blocks per SM and 32 KiB tiles elsewhere,
L2 evict_first bulk stores and contiguous tile runs per block (~1%
slower). The runs: docs/kernels/rms_norm.md.

Fused FP8 output (G4, `quantize=True`): the forward also writes `y`
quantized for an FP8 matmul, e4m3 values `q [t, d]` and one power-of-two
scale per 1x128 block `s [t, d/128]` (the "deepseek" activation format of
`pallas_kernels.fp8`), so the next matmul reads 8 bits per element instead
of re-reading `y` to quantize it. The kernel then sees every `[t, d]` array
as `[t, d/128, 128]` (a free reshape outside) and holds a tile in the block
layout (`_block_layout`): lanes still own 16 contiguous bytes, and each
1x128 block lies inside one warp, so the row's sum of squares is a
reduction over axes 1 and 2 and a block's maximum one over axis 2, both
warp shuffles. From the `y` registers (rounded to the output dtype first,
so the result is bit-identical to `fp8.quantize` of the returned `y`):
`pow2_scale` of the block maxima, then the hardware conversion to e4m3
(round to nearest even, as `fp8.mosaic_gpu_quantize`). Values leave with `y` and
`h`; the scales, `[m, d/128]` per tile, go to an array of whole tiles (a
bulk copy moves a multiple of 16 bytes, which a ragged tail need not be),
transposed where `d/128` f32 are not a multiple of 16 bytes
(`_Config.scales_transposed`). The first form (the `[m, d]` row layout,
each block's maximum a masked reduction over the whole row, integer
rounding) cost `O(d/128)` work per element and ran 5x slower than the
plain norm followed by the quantize kernel. This one reaches 87-90% of
copy bandwidth, 1.2x the plain kernel followed by the quantize kernel and
1.7x XLA's reference with its quantization (docs/kernels/rms_norm.md).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic
from pallas_kernels.fp8 import format as fp8_format

# The fused FP8 output's block: 1x128 ("deepseek" activations).
QUANT_BLOCK = 128
# Shared memory we let one block use (the H200 allows 227 KiB per block).
_SMEM_BUDGET = 200 * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of one kernel. Defaults tuned on H200 (benchmarks/rms_norm.py
  --sweep / --variants): the forward is flat within 1% over 8-32 rows and
  1-2 blocks per SM, but 3% faster at D=512 with 2 input stages than with
  3-4; the backward needs <= 32 values per thread (2 warps per row at
  d=2048: 1.03 ms, against 1.76 ms with 64 values and spills).

  block_rows: rows `m` of one tile; `None` = about `tile_bytes` of input
    (in the forward, with `balance`, the row count near it that evens out
    the tiles per block).
  warps_per_row: warps sharing one row (1 or 2); `None` = 1, or 2 when a
    thread would otherwise hold more than `max_elems` values of a tile.
  stages: input buffers in the ring; `None` = as many as fit, at most
    `max_stages` (`None` = 2 in the forward, 4 in the backward and the
    forward with FP8 output).
  num_blocks: persistent blocks `g`; `None` = one per SM (which fills the
    chip), or two with the wide-row direct loads below.
  tile_bytes: `None` = 16 KiB forward, 8 KiB backward (the backward holds
    more per element in registers: h, dy and the dgamma accumulator).
  direct_stores: outputs go from registers straight to global memory
    (16-byte stores per lane) instead of through SMEM and a bulk copy; the
    ragged last tile still takes the bulk copy, which is clamped. Measured
    on H200: the same time to within 1%, so the default stays the bulk copy.
  direct_loads: inputs come from global memory straight into registers
    (16-byte loads per lane, the next tile's loads issued before the
    current tile is computed) instead of through the SMEM ring; implies
    direct stores. Only for tiles that divide `t` (else the ring is used).
    `None` = on in the plain forward over 16-bit rows of 2-4 KiB (d = 1024
    to 2048 at bf16), with 2 warps per row, 8 KiB tiles and 2 blocks per SM
    unless set otherwise, where such tiles divide `t` (`_wide_rows`).
  balance: forward only, `block_rows=None`: among row counts within 2x of
    `tile_bytes` that keep >= 2 stages, take the one whose busiest block
    has the fewest rows (`ceil(ceil(t/m)/g)·m`): the last wave of tiles
    is then nearly full instead of leaving most blocks idle.
  pdl: programmatic dependent launch: the kernel may start while the
    previous kernel in the stream drains (`griddepcontrol.wait` before any
    global memory access), and lets the next one start early. `None` = on
    in the forward (within noise there), off in the backward (2% slower
  with it at D=512).
  out_slots: SMEM buffers per output for bulk stores (a store may drain
    while `out_slots - 1` later tiles are computed); `None` = 4 in the
    forward, 2 in the backward and the forward with FP8 output (2 to 6
  slots measured alike in the forward). Rows too
    wide for that many beside one input stage get fewer, down to one;
    wider still, `fits` is False and the op runs the reference.
  """

  block_rows: int | None = None
  warps_per_row: int | None = None
  stages: int | None = None
  num_blocks: int | None = None
  tile_bytes: int | None = None
  max_stages: int | None = None
  max_elems: int | None = None
  direct_stores: bool = False
  direct_loads: bool | None = None
  balance: bool = True
  pdl: bool | None = None
  out_slots: int | None = None


def _vec(itemsize: int) -> int:
  return 16 // itemsize


def supported(d: int, dtype) -> bool:
  """Whether the row layout covers rows of `d` elements of `dtype`."""
  itemsize = jnp.dtype(dtype).itemsize
  if itemsize not in (2, 4) or d % _vec(itemsize):
    return False
  chunks = d // _vec(itemsize)
  return chunks % 32 == 0 or (chunks < 32 and 32 % chunks == 0)


def _row_layout(d: int, itemsize: int, wpr: int) -> plgpu.Layout:
  """Warps own whole rows (or 2 warps one row); lanes own 16 bytes each.

  With `wpr=2` a row's sums cross two warps (a shared-memory step), but each
  thread holds half as many values: the choice for wide rows in the
  backward, where registers run out first.
  """
  vec = _vec(itemsize)
  lanes_per_row = min(32, d // vec)
  rows_per_warp = 32 // lanes_per_row
  tiled = functools.partial(plgpu.Layout.TILED, vector_dim=-1)
  if wpr == 2:
    # [m, d] -> [m/2, d/(64·vec), 2 rows, 2 warps, 32 lanes, vec]
    tiling = fa.Tiling(((2, 64 * vec), (32 * vec,), (vec,)))
    return tiled(tiling, warp_dims=(-4, -3), lane_dims=(-2,))
  if rows_per_warp == 1:
    # [m, d] -> [m/4, d/(32·vec), 4 warps, 32 lanes, vec]
    tiling = fa.Tiling(((4, 32 * vec), (vec,)))
    return tiled(tiling, warp_dims=(-3,), lane_dims=(-2,))
  # [m, d] -> [m/(4·rpw), 1, 4 warps, lanes_per_row, rpw, vec]
  tiling = fa.Tiling(
    ((4 * rows_per_warp, lanes_per_row * vec), (rows_per_warp, vec))
  )
  return tiled(tiling, warp_dims=(-4,), lane_dims=(-2, -3))


def _min_rows(d: int, itemsize: int, wpr: int = 1) -> int:
  return 4 * (32 // min(32, d // _vec(itemsize))) // wpr


def _block_split(q: int, itemsize: int, wpr: int):
  """How the block layout (`_block_layout`) spreads a tile `[m, q, 128]`
  over the 128 threads: its unit `(rows, blocks)` (tiles have a multiple
  of its rows), the 4 warps as `(rows, blocks)`, and the lanes that do not
  run along a block (`32 / (128 / vec)`) as `(rows, blocks)`."""
  lanes = 32 // (QUANT_BLOCK // _vec(itemsize))  # lanes not along a block
  wq = wpr  # warps sharing a row split its blocks
  lq = lanes if q % (wq * lanes) == 0 else 1
  lr = lanes // lq
  wr = 4 // wq
  return (wr * lr, wq * lq), (wr, wq), (lr, lq)


def _block_layout(q: int, itemsize: int, wpr: int) -> plgpu.Layout:
  """Registers of a tile viewed as `[m, q, 128]` (row, 1x128 block of the
  row, column in the block): lanes own 16 contiguous bytes as in
  `_row_layout` (a warp reads 512 contiguous bytes), and a block lies in
  one warp (16 lanes of 8 bf16, or 32 of 4 f32), so its maximum is a
  reduction over axis 2 (shuffles inside the warp) and the row's sum over
  axes 1 and 2. With `wpr = 2` two warps split a row's blocks.

  Tiled shape `[m/tr, q/tq, 1, wr, wq, 128/vec, lr, lq, vec]`."""
  vec = _vec(itemsize)
  (tr, tq), (wr, wq), (lr, lq) = _block_split(q, itemsize, wpr)
  tiling = fa.Tiling(((tr, tq, QUANT_BLOCK), (lr, lq, vec)))
  warp_dims = (-6,) + ((-5,) if wq > 1 else ())
  lane_dims = ((-3,) if lr > 1 else ()) + ((-2,) if lq > 1 else ()) + (-4,)
  # Mosaic takes the form without the unit dimensions.
  c = fa.TiledLayout(
    tiling, warp_dims, lane_dims, vector_dim=-1, _check_canonical=False
  ).canonicalize()
  return plgpu.Layout.TILED(
    c.tiling, warp_dims=c.warp_dims, lane_dims=c.lane_dims, vector_dim=-1
  )


def _scales_transposed(q: int) -> bool:
  """Whether the fused output's scales leave a tile as `[q, m]` instead of
  `[m, q]` (`q = d/128`): a bulk copy moves rows of 16-byte multiples,
  which `q` f32 are only when `q % 4 == 0`; transposed, `m % 4 == 0`
  (`make_config`)."""
  return q % 4 != 0


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static settings of one kernel instance (hashable)."""

  t: int
  d: int
  dtype: jnp.dtype
  gamma_dtype: jnp.dtype | None
  has_residual: bool
  eps: float
  block_rows: int
  warps_per_row: int
  stages: int
  num_blocks: int
  interpret: plgpu.InterpretGPUParams | None  # `mosaic.interpret_params`
  direct_stores: bool = False
  quantize: bool = False  # forward: also e4m3 values + 1x128 block scales
  direct_loads: bool = False
  pdl: bool = False
  out_slots: int = 2

  @property
  def q_blocks(self) -> int:
    """Scale blocks per row of the fused FP8 output."""
    return self.d // QUANT_BLOCK

  @property
  def scales_transposed(self) -> bool:
    return _scales_transposed(self.q_blocks)

  @property
  def scales_tile(self) -> tuple[int, int]:
    """One tile's scales as they leave: `[m, d/128]` or transposed."""
    m, q = self.block_rows, self.q_blocks
    return (q, m) if self.scales_transposed else (m, q)

  @property
  def num_tiles(self) -> int:
    return pl.cdiv(self.t, self.block_rows)

  @property
  def ragged(self) -> bool:
    return self.t % self.block_rows != 0

  @property
  def tile_shape(self) -> tuple[int, ...]:
    """A tile in registers and shared memory: `[m, d]` rows, or with the
    fused FP8 output `[m, d/128, 128]` (`_block_layout`); the arrays are
    viewed the same way outside the kernel (a free reshape)."""
    if self.quantize:
      return (self.block_rows, self.q_blocks, QUANT_BLOCK)
    return (self.block_rows, self.d)

  @property
  def layout(self):
    itemsize = jnp.dtype(self.dtype).itemsize
    if self.quantize:
      return _block_layout(self.q_blocks, itemsize, self.warps_per_row)
    return _row_layout(self.d, itemsize, self.warps_per_row)


def quantize_supported(d: int, dtype) -> bool:
  """Whether the forward can fuse the 1x128 FP8 output for rows of `d`."""
  return supported(d, dtype) and d % QUANT_BLOCK == 0


def _stages(bs: BlockSizes, rows, d, itemsize, n_in, n_out, *, acc, quantize):
  """`(stages, smem bytes)`: input stages that fit the SMEM budget next to
  the output buffers (or `bs.stages`), and the bytes they all take."""
  tile = rows * d * itemsize
  out_slots = 0 if bs.direct_loads else 1 if bs.direct_stores else bs.out_slots
  fixed = out_slots * n_out * tile + (rows * d * 4 if acc else 0)
  if quantize:  # e4m3 values and f32 scales, one buffer per slot
    fixed += out_slots * (rows * d + rows * (d // QUANT_BLOCK) * 4)
  stages = bs.stages
  if stages is None:
    stages = max(1, min(bs.max_stages, (_SMEM_BUDGET - fixed) // (n_in * tile)))
  if bs.direct_loads:
    return stages, fixed
  return stages, fixed + stages * n_in * tile


# The plain forward's tiles over rows of 2-4 KiB (`_wide_rows`).
_WIDE_ROWS_TILE_BYTES = 8 * 1024


def _wide_rows(bs: BlockSizes, t: int, d: int, itemsize: int) -> BlockSizes:
  """The plain forward's default over 16-bit rows of 2-4 KiB: registers
  straight from global memory (direct loads and stores), 2 warps per row,
  8 KiB tiles, 2 blocks per SM, where those tiles divide `t` (else `bs`
  unchanged: the ring). 2% faster than the ring at d=2048, 7% at d=1024,
  the same at d=512 and d=4096; deeper lookahead, other block counts and
  4-row tiles were slower (docs/kernels/rms_norm.md)."""
  row_bytes = d * itemsize
  rows = _WIDE_ROWS_TILE_BYTES // row_bytes
  if (
    itemsize != 2
    or not 2048 <= row_bytes <= 4096
    or d // _vec(itemsize) % 64  # 2 warps per row
    or t % (bs.block_rows or rows)
  ):
    return bs
  return dataclasses.replace(
    bs,
    direct_loads=True,
    warps_per_row=bs.warps_per_row or 2,
    block_rows=bs.block_rows or rows,
    num_blocks=bs.num_blocks or 2 * mosaic.num_sms(),
  )


def _busiest_rows(t: int, rows: int, g: int) -> int:
  """Rows of the block with the most tiles (`g` blocks, `rows` per tile)."""
  return pl.cdiv(pl.cdiv(t, rows), g) * rows


def make_config(
  t,
  d,
  dtype,
  gamma_dtype,
  has_residual,
  eps,
  block_sizes,
  interpret,
  *,
  bwd,
  quantize: bool = False,
) -> _Config:
  itemsize = jnp.dtype(dtype).itemsize
  bs = block_sizes or BlockSizes()
  if quantize:
    if bwd or not quantize_supported(d, dtype):
      raise ValueError(f"no fused FP8 output for {d=} {dtype=} {bwd=}")
    # Tiles in the block layout go through shared memory (the ring).
    bs = dataclasses.replace(bs, direct_stores=False, direct_loads=False)
  # The plain forward: 2 stages (measured), 4 output slots (measured alike).
  plain_fwd = not bwd and not quantize
  if plain_fwd and bs.direct_loads is None:
    bs = _wide_rows(bs, t, d, itemsize)
  bs = dataclasses.replace(
    bs,
    direct_loads=bool(bs.direct_loads),
    num_blocks=bs.num_blocks or mosaic.num_sms(),
    out_slots=bs.out_slots or (4 if plain_fwd else 2),
    max_stages=bs.max_stages or (2 if plain_fwd else 4),
  )
  tile_bytes = bs.tile_bytes or (8 if bwd else 16) * 1024
  max_elems = bs.max_elems or (32 if bwd else 64)
  wpr = bs.warps_per_row
  if wpr is None:
    wpr = 1
    if (
      _min_rows(d, itemsize) * d > 128 * max_elems
      and d // _vec(itemsize) % 64 == 0
    ):
      wpr = 2
  if wpr not in (1, 2) or (wpr > 1 and d // _vec(itemsize) % (32 * wpr)):
    raise ValueError(f"warps_per_row={wpr} does not divide rows of {d}")
  unit = _min_rows(d, itemsize, wpr)
  if quantize:
    # Whole tiles of the block layout; and `m % 4 == 0` where the scales
    # leave as `[d/128, m]` (`_scales_transposed`).
    q = d // QUANT_BLOCK
    unit = _block_split(q, itemsize, wpr)[0][0]
    if _scales_transposed(q):
      unit = math.lcm(unit, 4)
  n_in = 2 + has_residual if bwd else 1 + has_residual
  n_out = 1 if bwd else 1 + has_residual
  stages_of = functools.partial(
    _stages,
    bs,
    d=d,
    itemsize=itemsize,
    n_in=n_in,
    n_out=n_out,
    acc=bwd and gamma_dtype is not None,
    quantize=quantize,
  )
  # Keep small problems on few tiles: no tile taller than needed.
  tallest = pl.cdiv(t, unit) * unit
  if bs.block_rows is None:
    rows = max(unit, tile_bytes // (d * itemsize) // unit * unit)
    if bs.balance and not bwd and rows < tallest:
      # Rows near the target whose last wave of tiles is nearly full; no
      # more than 128 values of a tile per thread (the forward's measured
      # range), and a ring of >= 2 stages (1 stage measured 2% slower).
      g = min(bs.num_blocks, pl.cdiv(t, rows))
      # Direct loads need tiles that divide `t`.
      cands = [
        r
        for r in range(unit, 2 * rows + 1, unit)
        if 2 * r >= rows
        and r * d <= 128 * 128
        and (
          t % r == 0
          if bs.direct_loads
          else stages_of(r)[0] >= 2 and stages_of(r)[1] <= _SMEM_BUDGET
        )
      ]
      if cands:
        rows = min(
          cands,
          key=lambda r: (_busiest_rows(t, r, g), abs(r - rows), -r),
        )
  else:
    rows = bs.block_rows
  if rows % unit:
    raise ValueError(f"block_rows={rows} must be a multiple of {unit}")
  rows = min(rows, tallest)
  num_tiles = pl.cdiv(t, rows)
  direct_loads = bs.direct_loads and t % rows == 0
  # Wide rows (d = 8192 at 16 bits, 4096 at 32 with a residual): fewer
  # output slots, down to one, until one input stage fits beside them.
  bs = dataclasses.replace(bs, direct_loads=direct_loads)

  def fit(b):
    return stages_of.func(b, rows, **stages_of.keywords)

  while bs.out_slots > 1 and fit(bs)[1] > mosaic.SMEM_LIMIT:
    bs = dataclasses.replace(bs, out_slots=bs.out_slots - 1)
  stages, smem = fit(bs)
  if smem > mosaic.SMEM_LIMIT:
    raise ValueError(
      f"rms_norm: a tile of {rows} rows of {d} {jnp.dtype(dtype).name} "
      f"({'backward' if bwd else 'forward'}, residual={has_residual}) "
      f"needs {smem} B of shared memory, over {mosaic.SMEM_LIMIT}; `fits` says "
      "which shapes the kernels take"
    )
  return _Config(
    t=t,
    d=d,
    dtype=jnp.dtype(dtype),
    gamma_dtype=None if gamma_dtype is None else jnp.dtype(gamma_dtype),
    has_residual=has_residual,
    eps=float(eps),
    block_rows=rows,
    warps_per_row=wpr,
    stages=stages,
    num_blocks=min(bs.num_blocks, num_tiles),
    interpret=interpret,
    direct_stores=bs.direct_stores or direct_loads,
    quantize=quantize,
    direct_loads=direct_loads,
    pdl=(not bwd if bs.pdl is None else bs.pdl) and not interpret,
    out_slots=bs.out_slots,
  )


def fits(d, dtype, gamma_dtype, has_residual, *, quantize=False) -> bool:
  """Whether the kernels take rows of `d` elements of `dtype` (the row
  layout, `supported`) and both passes' tiles fit in shared memory with
  the default block sizes (the forward also with the fused FP8 output when
  `quantize`); the op runs the reference where not."""
  if not supported(d, dtype) or (quantize and not quantize_supported(d, dtype)):
    return False
  t = 1 << 20  # tall enough for the largest tile
  try:
    for bwd in (False, True):
      make_config(
        t, d, dtype, gamma_dtype, has_residual, 1e-6, None, True,
        bwd=bwd, quantize=quantize and not bwd,
      )  # fmt: skip
  except ValueError:
    return False
  return True


def _bcast(v, cfg: _Config, dims):
  """`v` (a tile's dimensions `dims`) -> a tile (`cfg.tile_shape`) in its
  layout."""
  return plgpu.layout_cast(
    lax.broadcast_in_dim(v, cfg.tile_shape, dims), cfg.layout
  )


def _bcast_rows(v_m, cfg: _Config):
  """Per-row `[m]` values -> a tile."""
  return _bcast(v_m, cfg, (0,))


def _row_sum(v, cfg: _Config):
  """`[m]` sums of a tile's rows."""
  if cfg.quantize:
    return jnp.sum(jnp.sum(v, axis=2), axis=1)
  return jnp.sum(v, axis=1)


def _bcast_cols(v_d, cfg: _Config):
  """Per-feature values (`cfg.tile_shape[1:]`) -> a tile."""
  return _bcast(v_d, cfg, tuple(range(1, len(cfg.tile_shape))))


def _tiles(cfg: _Config):
  """This block's tiles `(first, steps, stride)`: tile = first + i·stride
  (block `b` takes tiles `b, b + g, ...`, so all blocks sweep one window
  of the arrays together)."""
  blk = lax.axis_index("blocks")
  n, g = cfg.num_tiles, cfg.num_blocks
  return blk, (n - blk + g - 1) // g, g


def _prologue(cfg: _Config):
  """Programmatic dependent launch: wait for the previous kernel's memory
  before touching global memory, and let the next kernel launch now (its
  blocks take SMs as ours leave, and wait likewise)."""
  if cfg.pdl:
    plgpu.griddepcontrol_wait()
    plgpu.griddepcontrol_launch_dependents()


def _pipeline(
  cfg: _Config,
  in_gmem,
  in_smem,
  barrier,
  out_gmem,
  out_smem,
  out_transposed=None,
):
  """Persistent loop over this block's tiles.

  Returns a function `run(body, carry)`: `body(row0, load, store, carry)
  -> carry` reads input `i` of the current tile as `load(i)` (a
  `cfg.tile_shape` array in `cfg.layout`) and calls `store(values)` once
  with one array per output. Tile `i` of an output goes to its rows
  `[i·k, i·k + k)`, `k` its shared-memory buffer's rows (`m`, or another
  count for an array of whole tiles). `out_transposed[i]`: output `i`'s
  `[m, k]` values go into its `[k, m]` buffer transposed.

  Inputs arrive through a ring of `cfg.stages` SMEM buffers filled by bulk
  copies (`fetch` of tile `i + stages` is issued once tile `i` is read),
  or with `cfg.direct_loads` straight into registers, one tile ahead.
  """
  m = cfg.block_rows
  first, num_steps, stride = _tiles(cfg)
  out_transposed = out_transposed or [False] * len(out_gmem)
  layout = cfg.layout

  def rows(step, k=m):
    return pl.ds((first + step * stride) * k, k)

  def fetch(step, slot):
    for src, dst in zip(in_gmem, in_smem, strict=True):
      plgpu.copy_gmem_to_smem(
        src.at[rows(step)],
        dst.at[slot],
        barrier.at[slot],
        oob_mode=plgpu.OOBFillMode.UNDEFINED,
      )

  def store_async(step, values):
    slots = out_smem[0].shape[0]
    out_slot = lax.rem(step, slots)
    # The store issued `slots` steps ago from this buffer must have read
    # it; later ones may still be in flight.
    plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
    bufs = [buf.at[out_slot] for buf in out_smem]
    for v, buf, tr in zip(values, bufs, out_transposed, strict=True):
      (buf.T if tr else buf)[...] = v.astype(buf.dtype)
    plgpu.commit_smem()
    for i, (buf, dst) in enumerate(zip(bufs, out_gmem, strict=True)):
      plgpu.copy_smem_to_gmem(
        buf,
        dst.at[rows(step, buf.shape[0])],
        commit_group=i == len(out_smem) - 1,
      )

  def store_direct(step, values):
    # 16-byte st.global per lane, straight from registers.
    for v, dst in zip(values, out_gmem, strict=True):
      dst.at[rows(step)][...] = v.astype(dst.dtype)

  def store_fn(step, row0):
    def store(values):
      if not cfg.direct_stores:
        store_async(step, values)
      elif not cfg.ragged:
        store_direct(step, values)
      else:
        # Only the last tile is ragged: there the clamped bulk copy keeps
        # the stores inside the array.
        full = row0 + m <= cfg.t
        pl.when(full)(lambda: store_direct(step, values))
        pl.when(jnp.logical_not(full))(lambda: store_async(step, values))

    return store

  def row0_of(step):
    return (first + step * stride) * m

  def run_ring(body, carry):
    def step_fn(step, slot, refill, carry):
      plgpu.barrier_wait(barrier.at[slot])
      ins = [r.at[slot] for r in in_smem]

      def load(i):
        return plgpu.load(ins[i], layout=layout)

      row0 = row0_of(step)
      carry = body(row0, load, store_fn(step, row0), carry)
      refill()
      return carry

    carry = mosaic.tile_ring(num_steps, cfg.stages, fetch, step_fn, carry)
    plgpu.wait_smem_to_gmem(0)
    return carry

  def run_direct(body, carry):
    # No ragged tiles here (make_config): every tile is in bounds.
    def load_tile(step):
      return [
        plgpu.load(src.at[rows(step)], layout=layout, optimized=False)
        for src in in_gmem
      ]

    def step(step, vals, carry):
      row0 = row0_of(step)
      return body(row0, lambda i: vals[i], store_fn(step, row0), carry)

    def step_fn(i, state):
      vals, carry = state
      nxt = load_tile(i + 1)  # in flight while tile i is computed
      return nxt, step(i, vals, carry)

    vals, carry = lax.fori_loop(
      0, num_steps - 1, step_fn, (load_tile(0), carry)
    )
    return step(num_steps - 1, vals, carry)

  return run_direct if cfg.direct_loads else run_ring


def _load_gamma(gamma_gmem, cfg: _Config):
  layout = cfg.layout
  g = plgpu.load(gamma_gmem, layout=layout.reduce(0), optimized=False)
  return g.astype(jnp.float32)


def _quantize_blocks(cfg: _Config, y):
  """`y [m, d/128, 128]` (f32 registers, block layout) -> e4m3 values and
  the `[m, d/128]` f32 scales: one power-of-two scale per 1x128 block
  (G4), as `fp8.quantize` computes it. A block's maximum is a reduction
  over axis 2 inside one warp; the rounding is the hardware conversion
  (round to nearest even; `|y / s| <= 448`, so saturation never acts),
  which equals the reference's integer rounding bit for bit (as in
  `fp8.mosaic_gpu_quantize`)."""
  scale, inv = fp8_format.pow2_scale(jnp.max(jnp.abs(y), axis=2))
  return (y * _bcast(inv, cfg, (0, 1))).astype(fp8_format.E4M3), scale


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
  _prologue(cfg)
  gamma = _load_gamma(gamma_gmem, cfg) if cfg.gamma_dtype else None
  inv_d = 1.0 / cfg.d

  def body(row0, load, store, carry):
    del row0
    h = load(0)
    if cfg.has_residual:
      h = h + load(1)  # in x's dtype, as the reference
    h32 = h.astype(jnp.float32)
    ms_m = _row_sum(h32 * h32, cfg) * inv_d
    y = h32 * _bcast_rows(lax.rsqrt(ms_m + cfg.eps), cfg)
    if gamma is not None:
      y = y * _bcast_cols(gamma, cfg)
    outs = [y, h] if cfg.has_residual else [y]
    if cfg.quantize:
      # Quantize `y` as returned (rounded to its dtype), like the reference.
      y = y.astype(cfg.dtype)
      outs = [y, *outs[1:], *_quantize_blocks(cfg, y.astype(jnp.float32))]
    store(outs)
    return carry

  _pipeline(cfg, in_gmem, in_smem, barrier, out_gmem, out_smem, transposed)(
    body, ()
  )


def _bwd_kernel(cfg: _Config, *refs):
  it = iter(refs)
  h_gmem, dy_gmem = next(it), next(it)
  dh_out_gmem = next(it) if cfg.has_residual else None
  gamma_gmem = next(it) if cfg.gamma_dtype else None
  dh_gmem = next(it)
  dgamma_gmem = next(it) if cfg.gamma_dtype else None
  in_smem, out_smem, barrier = next(it), next(it), next(it)
  acc_smem = next(it) if cfg.gamma_dtype else None
  in_gmem = [h_gmem, dy_gmem] + ([dh_out_gmem] if cfg.has_residual else [])
  layout = cfg.layout
  m, d = cfg.block_rows, cfg.d
  _prologue(cfg)
  gamma = _load_gamma(gamma_gmem, cfg) if cfg.gamma_dtype else None
  inv_d = 1.0 / d

  def body(row0, load, store, acc):
    h = load(0).astype(jnp.float32)
    dy = load(1).astype(jnp.float32)
    g = dy if gamma is None else dy * _bcast_cols(gamma, cfg)
    r_m = lax.rsqrt(jnp.sum(h * h, axis=1) * inv_d + cfg.eps)
    c_m = r_m * r_m * r_m * (jnp.sum(g * h, axis=1) * inv_d)
    dh = g * _bcast_rows(r_m, cfg) - h * _bcast_rows(c_m, cfg)
    if cfg.has_residual:
      dh = dh + load(2).astype(jnp.float32)
    store([dh])
    if gamma is None:
      return acc
    contrib = dy * h * _bcast_rows(r_m, cfg)
    if cfg.ragged:
      # Rows past `t` in the last tile hold stale shared memory.
      row = plgpu.broadcasted_iota(jnp.int32, (m, d), 0, layout=layout)
      contrib = jnp.where(row + row0 < cfg.t, contrib, 0.0)
    return acc + contrib

  run = _pipeline(cfg, in_gmem, in_smem, barrier, [dh_gmem], out_smem)
  if gamma is None:
    run(body, ())
    return
  acc0 = plgpu.layout_cast(jnp.zeros((m, d), jnp.float32), layout)
  acc = run(body, acc0)
  acc_smem[...] = acc
  plgpu.commit_smem()
  blk = lax.axis_index("blocks")
  plgpu.copy_smem_to_gmem(acc_smem, dgamma_gmem.at[pl.ds(blk * m, m)])
  plgpu.wait_smem_to_gmem(0)


def _call(kernel, cfg: _Config, out_type, n_in, n_out, extra_scratch, *args):
  d = cfg.d
  # Direct stores keep one buffer for the clamped ragged tile; direct loads
  # (never ragged) and their ring need none, but the kernels take the refs.
  slots = 1 if cfg.direct_stores else cfg.out_slots
  stages = 1 if cfg.direct_loads else cfg.stages
  tile = (1, d) if cfg.direct_loads else cfg.tile_shape
  out_bufs = [plgpu.SMEM((slots, *tile), cfg.dtype) for _ in range(n_out)]
  if cfg.quantize and kernel is _fwd_kernel:
    out_bufs += [
      plgpu.SMEM((slots, *tile), fp8_format.E4M3),
      plgpu.SMEM((slots, *cfg.scales_tile), jnp.float32),
    ]
  scratch = [
    [plgpu.SMEM((stages, *tile), cfg.dtype) for _ in range(n_in)],
    out_bufs,
    plgpu.Barrier(num_arrivals=n_in, num_barriers=stages),
    *extra_scratch,
  ]
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
  fn = plgpu.kernel(
    functools.partial(kernel, cfg),
    out_type=out_type,
    scratch_types=scratch,
    compiler_params=params,
    grid=(cfg.num_blocks,),
    grid_names=("blocks",),
    kernel_name=(
      f"rms_norm{kernel.__name__}_d{cfg.d}_m{cfg.block_rows}"
      f"_w{cfg.warps_per_row}_s{cfg.stages}_r{cfg.has_residual:d}"
      f"_g{cfg.gamma_dtype is not None:d}_q{cfg.quantize:d}"
      f"_b{cfg.num_blocks}_o{cfg.out_slots}"
      f"{'_dl' if cfg.direct_loads else '_ds' if cfg.direct_stores else ''}"
      f"{'_pdl' if cfg.pdl else ''}"
    ),
    interpret=mosaic.interpret_params(cfg.interpret),
  )
  return fn(*args)


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
  outs = _call(_fwd_kernel, cfg, out_type, n_in, n_out, [], *args)
  n_td = len(outs) - cfg.quantize  # then the scales
  outs = [o.reshape(t, d) for o in outs[:n_td]] + list(outs[n_td:])
  if cfg.quantize:  # whole tiles -> `[t, d/128]`
    s = outs[-1].reshape(cfg.num_tiles, *cfg.scales_tile)
    if cfg.scales_transposed:
      s = s.transpose(0, 2, 1)
    outs[-1] = s.reshape(-1, cfg.q_blocks)[:t]
  return tuple(outs)


def rms_norm_bwd(h_td, dy_td, dh_out_td, gamma_d, cfg: _Config):
  """Returns `dh` (`[t, d]`, x's dtype) and `dgamma` (`[d]` f32 or None)."""
  t, d = h_td.shape
  m = cfg.block_rows
  out_type = [jax.ShapeDtypeStruct((t, d), h_td.dtype)]
  extra = []
  if cfg.gamma_dtype:
    out_type.append(jax.ShapeDtypeStruct((cfg.num_blocks * m, d), jnp.float32))
    extra.append(plgpu.SMEM((m, d), jnp.float32))
  args = [h_td, dy_td]
  if cfg.has_residual:
    args.append(dh_out_td)
  if cfg.gamma_dtype:
    args.append(gamma_d)
  n_in = 2 + cfg.has_residual
  outs = _call(_bwd_kernel, cfg, out_type, n_in, 1, extra, *args)
  dh = outs[0]
  # Second stage of the dgamma reduction: `[g·m, d]` partials -> `[d]`.
  dgamma = jnp.sum(outs[1], axis=0) if cfg.gamma_dtype else None
  return dh, dgamma


def smem_bytes(cfg: _Config, *, bwd: bool) -> int:
  itemsize = jnp.dtype(cfg.dtype).itemsize
  m, d = cfg.block_rows, cfg.d
  tile = m * d * itemsize
  n_in = 2 + cfg.has_residual if bwd else 1 + cfg.has_residual
  n_out = 1 if bwd else 1 + cfg.has_residual
  acc = m * d * 4 if bwd and cfg.gamma_dtype else 0
  if cfg.direct_loads:
    return (n_in + n_out) * d * itemsize + acc
  out_slots = 1 if cfg.direct_stores else cfg.out_slots
  quant = 0
  if cfg.quantize and not bwd:
    quant = out_slots * m * (d + cfg.q_blocks * 4)
  return cfg.stages * n_in * tile + out_slots * n_out * tile + acc + quant


__all__ = [
  "BlockSizes",
  "fits",
  "make_config",
  "quantize_supported",
  "rms_norm_bwd",
  "rms_norm_fwd",
  "smem_bytes",
  "supported",
]
