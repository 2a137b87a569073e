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

Files: the forward kernel and its fused FP8 output (G4: `y` also as e4m3
values with 1x128 block scales, for the next FP8 matmul) in
`mosaic_gpu_fwd.py`, the backward kernel in `mosaic_gpu_bwd.py`, the
persistent tile loop and launch both share in `mosaic_gpu_pipeline.py`;
here the tiling (`BlockSizes`, `make_config`) and which shapes it takes
(`supported`, `fits`, `smem_bytes`).
"""

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic

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
  "smem_bytes",
  "supported",
]
