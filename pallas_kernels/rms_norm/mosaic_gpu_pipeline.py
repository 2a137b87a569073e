"""RMSNorm kernels' shared machinery: the persistent loop over tiles
(`pipeline`), register helpers for a tile in `_Config.layout`, and the
launch with the shared-memory ring (`launch`). The technique and the
shapes' legend are in `mosaic_gpu.py`.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic
from pallas_kernels.fp8 import format as fp8_format
from pallas_kernels.rms_norm.mosaic_gpu import _Config


def bcast(v, cfg: _Config, dims):
  """`v` (a tile's dimensions `dims`) -> a tile (`cfg.tile_shape`) in its
  layout."""
  return plgpu.layout_cast(
    lax.broadcast_in_dim(v, cfg.tile_shape, dims), cfg.layout
  )


def bcast_rows(v_m, cfg: _Config):
  """Per-row `[m]` values -> a tile."""
  return bcast(v_m, cfg, (0,))


def row_sum(v, cfg: _Config):
  """`[m]` sums of a tile's rows."""
  if cfg.quantize:
    return jnp.sum(jnp.sum(v, axis=2), axis=1)
  return jnp.sum(v, axis=1)


def bcast_cols(v_d, cfg: _Config):
  """Per-feature values (`cfg.tile_shape[1:]`) -> a tile."""
  return bcast(v_d, cfg, tuple(range(1, len(cfg.tile_shape))))


def _tiles(cfg: _Config):
  """This block's tiles `(first, steps, stride)`: tile = first + i·stride
  (block `b` takes tiles `b, b + g, ...`, so all blocks sweep one window
  of the arrays together)."""
  blk = lax.axis_index("blocks")
  n, g = cfg.num_tiles, cfg.num_blocks
  return blk, (n - blk + g - 1) // g, g


def prologue(cfg: _Config):
  """Programmatic dependent launch: wait for the previous kernel's memory
  before touching global memory, and let the next kernel launch now (its
  blocks take SMs as ours leave, and wait likewise)."""
  if cfg.pdl:
    plgpu.griddepcontrol_wait()
    plgpu.griddepcontrol_launch_dependents()


def pipeline(
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


def load_gamma(gamma_gmem, cfg: _Config):
  """gamma as f32 registers in the layout of one tile row."""
  layout = cfg.layout
  g = plgpu.load(gamma_gmem, layout=layout.reduce(0), optimized=False)
  return g.astype(jnp.float32)


def launch(kernel, cfg: _Config, out_type, n_in, n_out, extra_scratch, *args):
  """`kernel(cfg, *in_gmem, *out_gmem, in_smem, out_smem, barrier,
  *extra_scratch)` on `cfg.num_blocks` persistent blocks, `args` its
  inputs: the scratch `pipeline` takes (a ring of `cfg.stages` buffers for
  each of `n_in` inputs, `cfg.out_slots` for each of `n_out` outputs in
  x's dtype, and with `cfg.quantize` the FP8 values' and scales'), and a
  kernel name that spells the configuration (profiles tell them apart)."""
  d = cfg.d
  # Direct stores keep one buffer for the clamped ragged tile; direct loads
  # (never ragged) and their ring need none, but the kernels take the refs.
  slots = 1 if cfg.direct_stores else cfg.out_slots
  stages = 1 if cfg.direct_loads else cfg.stages
  tile = (1, d) if cfg.direct_loads else cfg.tile_shape
  out_bufs = [plgpu.SMEM((slots, *tile), cfg.dtype) for _ in range(n_out)]
  if cfg.quantize:  # the forward's FP8 output (`make_config`: only there)
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
