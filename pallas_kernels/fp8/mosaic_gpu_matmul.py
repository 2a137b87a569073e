"""Block-scaled FP8 matmul for Hopper in Pallas Mosaic GPU (G4).

Computes, with `kb` the scale block along the contraction `k`:

  out[m, n] = sum_j  sa[j, m] * sb[j, n] * sum_{k in block j} a[m, k] b[n, k]

`a_mk`, `b_nk` e4m3 (both with `k` contiguous: Hopper's 8-bit wgmma reads
only k-major operands), `sa_Jm`, `sb_Jn` float32 scales, one per k-block `j`
and row of `a` (column of `out`). This is the product of the dequantized
operands for both formats: MXFP8 32x32 blocks (`kb = 32`, the scale of a row
changes every 32 rows) and DeepSeek-style 1x128 / 128x128 (`kb = 128`).

Hopper has no block-scaled MMA (Blackwell's `tcgen05.mma` with scale factors
has). So every k-block is one wgmma into a fresh f32 accumulator, and the
warpgroup then folds it into the running sum with its scales:

  acc += p * (sa[j] (x) sb[j])       (2 FP32 ops per accumulator element)

That is the cost of block scaling on Hopper: for `kb = 32` one wgmma of
`64 x 128 x 32` (~140 tensor-core cycles) is followed by 64 fp32 FMAs per
thread; for `kb = 128` the same epilogue comes once per four times the MMA
work. The compute warpgroups (`compute_wgs`, two or three) take turns,
so one's promotion overlaps the others' wgmmas.

Three compute warpgroups (the default at `kb = 128`). With two, a
warpgroup's promotion leaves only the other's wgmma on the tensor cores;
with three, two can be queued. And a 192 x 128 CTA tile reads 320
operand rows per k-step for 24,576 outputs instead of 16,384 at 64 x 256,
a third fewer bytes per FLOP from L2. The registers allow it: the
memory warpgroup keeps 24 (`memory_registers`), which leaves each
compute warpgroup 160 for its 64 x 128 accumulator and block product
(128 floats). Against the two-warpgroup 64 x 256 CTA tile in 2-CTA
clusters this runs 15-36% faster, ahead of cuBLAS's per-tensor FP8 GEMM
at the wide shape (the runs of this file: docs/kernels/fp8.md).

With 128 x 128 weight blocks (`b_scale_uniform`) `sb[j]` is one number per
warpgroup tile, so it is folded into the row scales first and the promotion
is one FMA per element, `acc += p * (sa[j] sb[j])`: on the H200 that alone
took the kernel from 876 to 1061 TFLOP/s (the multiply per element was what
kept the tensor cores waiting). Where `b`'s scales are per row too (FP8
weight gradients) that multiply stays, and the product runs on two
warpgroups with two block products in flight each
(`PER_ROW_B_BLOCK_SIZES`), each promoting one block while the other runs.

Bandwidth: an fp8 GEMM with 128 x 128 CTA tiles reads 1/128 B of operands
from L2 per FLOP, about 6.8 TB/s at 873 TFLOP/s, near what we take the
H200's L2 rate to be (an inference, not measured here). Two
CTAs in a cluster (`cluster_dimension`) share one operand tile by TMA
multicast, as a 128 x 256 tile would: 3/512 B per FLOP.

Structure (after JAX's `hopper_matmul_mgpu`): a persistent grid of one CTA
per SM (or 2-CTA cluster per two SMs) walks the output tiles in a planar
snake; in each CTA a memory
warpgroup streams `a`, `b` and the two scale slices through a TMA pipeline of
`max_concurrent_steps` stages, and `compute_wgs` compute warpgroups each
own a `tile_m x tile_n` accumulator in registers (the CTA tile is those
stacked along `m` or `n`). The epilogue casts, stages in shared memory
and stores by TMA.

Shapes: `n` a multiple of the cluster tile and `k` of `tile_k` (the
wrapper pads them); `m` any multiple of 8 that is at least one CTA tile:
a last partial row tile overlaps the one before it (`row_start`), so
192-row tiles need no padded copy of `a` or sliced copy of the output
(at 16384 x 4096 x 4096 those copies cost more than the third
warpgroup gained).

Split-K (`splits`, `k_splits`): a product with too few output tiles to
fill the chip, such as a weight gradient `[2048, 512]` over 65,536
tokens (64 CTAs for 132 SMs, each 512 k-steps long), cuts the contraction
into runs whose f32 partial tiles are summed afterwards (about 15%
faster there with 128 x 128 CTA tiles). Since the default
became 192 x 128, the same product has 44 tiles, two runs of which
leave a third of the SMs idle, so split-K products take whichever tile
fills the chip better (`split_k_plan`).

Quantizing `a` in the kernel (`quantizing_matmul_mgpu`, the same product
with `a` arriving as bf16): `mosaic_gpu_quantizing_matmul.py`. The
promotion, the epilogue and `row_start`, which the two GEMMs share:
`mosaic_gpu.py`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic
from pallas_kernels.fp8.mosaic_gpu import (
  ROW,
  Dim,
  epilogue_smem,
  promote_block,
  row_start,
  store_tile,
)

# Longest per-tile k loop whose pipeline is chained to the next tile's.
_CHAIN_MAX_K_STEPS = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles per compute warpgroup and the schedule. The sweep's winners per
  scale block are `DEFAULT_BLOCK_SIZES` below; these field defaults are the
  plain 128 x 128 CTA tile.

  The accumulator and the per-block products live in registers
  (`(1 + in_flight) * tile_m * tile_n / 128` floats per thread), which caps
  `tile_m * tile_n` at 64 x 128. `compute_wgs` (2 or 3) warpgroups
  compute, stacked along `wg_dimension`; the memory warpgroup keeps
  `memory_registers` and the compute warpgroups share the rest.

  `tile_k = 2 * kb` puts two block products in flight per warpgroup: both
  wgmmas are issued, then block 0 is promoted while block 1 still runs on
  the tensor cores (DeepGEMM's schedule). `cluster_dimension`: two CTAs
  side by side along M (or N) form a cluster and TMA-multicast the operand
  they share, which halves its L2 reads (fp8 at 128 x 128 CTA tiles is
  otherwise bound by L2 bandwidth).
  """

  tile_m: int = 64
  tile_n: int = 128
  tile_k: int = 128
  max_concurrent_steps: int = 4
  wg_dimension: Dim = Dim.M
  grid_minor_dim: Dim = Dim.N
  grid_tile_width: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  cluster_dimension: Dim | None = None
  compute_wgs: int = 2
  memory_registers: int = 40

  def cta_tile(self) -> tuple[int, int]:
    w = self.compute_wgs
    return (
      self.tile_m * (w if self.wg_dimension == Dim.M else 1),
      self.tile_n * (w if self.wg_dimension == Dim.N else 1),
    )

  def cluster_tile(self) -> tuple[int, int]:
    cm, cn = self.cta_tile()
    return (
      cm * (1 + (self.cluster_dimension == Dim.M)),
      cn * (1 + (self.cluster_dimension == Dim.N)),
    )


# The configuration `primitives.py` uses, per scale block `kb` (H200 sweep at
# 16384 x 4096 x 4096, `benchmarks/fp8_matmul.py --sweep-only`): for kb =
# 128, three compute warpgroups stacked along M (a 192 x 128 CTA tile; see
# the module docstring), no cluster (with three warpgroups 2-CTA clusters
# measured no better), the grid walked in bands 8 tiles wide, the memory
# warpgroup on 24 registers: 4% faster than 40 registers, 5-6% than bands
# 4 or 16 wide, 8-12% than clusters, ahead of cuBLAS's per-tensor FP8
# GEMM. For kb = 32 the cluster lost: the promotion, not L2, bounds it.
# (The sweep: docs/kernels/fp8.md.)
DEFAULT_BLOCK_SIZES = {
  128: BlockSizes(compute_wgs=3, grid_tile_width=8, memory_registers=24),
  64: BlockSizes(),
  32: BlockSizes(),
}

# With per-row scales on both sides (FP8 weight gradients: `g` and `x` in
# 1 x 128 blocks along the tokens) the promotion takes a column scale per
# element, not one FMA: two warpgroups with two block products in flight
# each (the promotion of one overlaps the other's wgmma) beat the three of
# `DEFAULT_BLOCK_SIZES` (7-16% faster, also in split-K runs against the
# plain 128 x 128 tile); 2-CTA clusters measured no better. Two stages of
# 256-deep k-steps
# are what fit beside the epilogue buffers.
PER_ROW_B_BLOCK_SIZES = {128: BlockSizes(tile_k=256, max_concurrent_steps=2)}

# Shared memory a CTA may take on Hopper (227 KiB).
SMEM_BYTES = 227 * 1024


def smem_bytes(bs: BlockSizes, kb: int, out_dtype) -> int:
  """Shared memory of `scaled_matmul_mgpu`'s buffers (barriers aside): the
  operand and scale ring, and the epilogue's staging slots."""
  cm, cn = bs.cta_tile()
  stage = (cm + cn) * bs.tile_k + (bs.tile_k // kb) * (cm + cn) * 4
  slots = min(2, bs.tile_m * bs.tile_n // (bs.epi_tile_m * bs.epi_tile_n))
  epi = bs.epi_tile_m * bs.epi_tile_n * jnp.dtype(out_dtype).itemsize
  return bs.max_concurrent_steps * stage + bs.compute_wgs * slots * epi


def default_block_sizes(
  kb: int, out_dtype=jnp.bfloat16, uniform: bool = True
) -> BlockSizes:
  """`DEFAULT_BLOCK_SIZES[kb]` (`PER_ROW_B_BLOCK_SIZES[kb]` for `b` scales
  that are not `uniform`, see `scaled_matmul_mgpu`) with as many stages as
  fit beside the epilogue buffers of `out_dtype` (f32 split-K partials take
  twice bf16's)."""
  table = DEFAULT_BLOCK_SIZES if uniform else PER_ROW_B_BLOCK_SIZES
  return _fit_stages(table.get(kb, BlockSizes()), kb, out_dtype)


def _fit_stages(bs: BlockSizes, kb: int, out_dtype) -> BlockSizes:
  """`bs` with fewer stages until its buffers fit in shared memory."""
  while smem_bytes(bs, kb, out_dtype) > SMEM_BYTES:
    if bs.max_concurrent_steps <= 2:
      raise ValueError(f"{bs} with {out_dtype} outputs: no room for 2 stages")
    bs = dataclasses.replace(
      bs, max_concurrent_steps=bs.max_concurrent_steps - 1
    )
  return bs


# Fewest k-steps a split-K run keeps (`k_splits`).
_SPLIT_MIN_K_STEPS = 64


def _ctas(m: int, n: int, bs: BlockSizes) -> int:
  """CTAs of one run over an `[m, n]` output (a last partial row tile
  counts; clusters count each of their CTAs)."""
  clu_m, clu_n = bs.cluster_tile()
  return (
    -(-m // clu_m) * (n // clu_n) * (1 + (bs.cluster_dimension is not None))
  )


def k_splits(
  m: int, n: int, k: int, bs: BlockSizes, num_sms: int | None = None
):
  """Runs to cut the contraction into (`scaled_matmul_mgpu`'s `splits`):
  doubled while the product's CTAs (output tiles, times the runs) fill no
  more than the chip and each run keeps >= `_SPLIT_MIN_K_STEPS` k-steps;
  1 for products whose tiles fill the chip. A weight gradient such as
  `dW [2048, 512]` over 65,536 tokens has 64 CTA tiles of 128 x 128 for
  132 SMs: two runs of 32,768."""
  ctas = _ctas(m, n, bs)
  steps, splits = k // bs.tile_k, 1
  num_sms = mosaic.num_sms(num_sms)
  while (
    2 * splits * ctas <= num_sms
    and steps % (2 * splits) == 0
    and steps // (2 * splits) >= _SPLIT_MIN_K_STEPS
  ):
    splits *= 2
  return splits


def split_k_plan(
  m: int,
  n: int,
  k: int,
  kb: int,
  num_sms: int | None = None,
  uniform: bool = True,
) -> tuple[BlockSizes, int]:
  """Block sizes and runs (`k_splits`, > 1) for a product computed as f32
  split-K partials: of the default tile (`default_block_sizes(kb, float32,
  uniform)`) and the plain two-warpgroup 128 x 128 one, among those that
  split, the one whose CTAs, times its runs, fill more of the chip's SMs in
  their last wave (the default unless the other fills at least a tenth
  more); `(default, 1)` where neither splits (the product runs whole, in
  its own output's tile).

  With uniform `b` scales, a product `[2048, 512]` over 65,536 has 44 CTA
  tiles of 192 x 128 (two runs: 88 CTAs for 132 SMs) and 64 of 128 x 128
  (128 CTAs): the 128 x 128 tile in two runs is 29% faster there, and
  192 x 128 tiles in more runs did not catch up. The FP8 weight
  gradient's scales are per row (not uniform):
  its default tile is 128 x 128 already (`PER_ROW_B_BLOCK_SIZES`)."""
  num_sms = mosaic.num_sms(num_sms)
  default = default_block_sizes(kb, jnp.float32, uniform)
  plans, fits = [], False
  for bs in (default, _fit_stages(BlockSizes(), kb, jnp.float32)):
    if n % bs.cluster_tile()[1] or m < bs.cta_tile()[0]:
      continue
    fits = True
    splits = k_splits(m, n, k, bs, num_sms)
    if splits > 1:
      ctas = splits * _ctas(m, n, bs)
      plans.append((bs, splits, ctas / (-(-ctas // num_sms) * num_sms)))
  if not fits:
    raise ValueError(f"split_k_plan: [{m}, {n}] fits neither tile")
  if not plans:
    return default, 1
  best = plans[0]
  for plan in plans[1:]:
    if plan[2] >= 1.1 * best[2]:
      best = plan
  return best[0], best[1]


def _kernel(
  a_gmem,
  b_gmem,
  sa_gmem,
  sb_gmem,
  out_gmem,
  *,
  kb,
  bs,
  b_scale_uniform,
  num_programs,
  splits,
):
  m, k = a_gmem.shape
  n = b_gmem.shape[0]
  out_dtype = out_gmem.dtype
  tile_m, tile_n, tile_k = bs.tile_m, bs.tile_n, bs.tile_k
  subs = tile_k // kb
  cta_m, cta_n = bs.cta_tile()
  clu_m, clu_n = bs.cluster_tile()
  # With `splits` > 1 the contraction is cut into that many runs, each an
  # output tile of its own (`out_gmem[split]`), summed by the caller.
  # A last partial row tile overlaps the one before it (`row_start`).
  m_iters, n_iters = -(-m // clu_m), n // clu_n
  k_iters = k // tile_k // splits
  # An 8-bit wgmma consumes k in groups of `swizzle` bytes; one k-block per
  # wgmma means swizzle == kb.
  swizzle = kb
  in_transforms = (
    plgpu.TilingTransform((8, swizzle)),
    plgpu.SwizzleTransform(swizzle),
  )
  # The operand both CTAs of a cluster read: multicast.
  share_b = ("cluster",) if bs.cluster_dimension == Dim.M else ()
  share_a = ("cluster",) if bs.cluster_dimension == Dim.N else ()

  # Chained pipelines: the memory warpgroup starts fetching a CTA's next
  # output tile while its compute warpgroups still work on this one (JAX's
  # "pipeline of pipelines"); otherwise each tile's pipeline drains and
  # refills. That pays at short k (5-20% faster at 4-16 k-steps a tile)
  # and is slower at 32 steps (`_CHAIN_MAX_K_STEPS`). It needs whole rings
  # per tile, and every program must own at least two tiles (one tile would
  # be both the first and the last).
  tiles = m_iters * n_iters
  chained = (
    k_iters <= _CHAIN_MAX_K_STEPS
    and k_iters % bs.max_concurrent_steps == 0
    and splits * tiles >= 2 * num_programs
  )

  def get_pipeline(body, compute_context, state=None):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_iters,),
      memory_registers=bs.memory_registers,
      in_specs=[
        plgpu.BlockSpec(
          (cta_m, tile_k),
          lambda kk: (0, kk),
          transforms=in_transforms,
          collective_axes=share_a,
        ),
        plgpu.BlockSpec(
          (cta_n, tile_k),
          lambda kk: (0, kk),
          transforms=in_transforms,
          collective_axes=share_b,
        ),
        plgpu.BlockSpec((subs, cta_m), lambda kk: (kk, 0)),
        plgpu.BlockSpec((subs, cta_n), lambda kk: (kk, 0)),
      ],
      wg_axis="wg",
      num_compute_wgs=bs.compute_wgs,
      max_concurrent_steps=bs.max_concurrent_steps,
      compute_context=compute_context,
      pipeline_state=state,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
    pl.run_scoped,
    pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
      a_gmem, b_gmem, sa_gmem, sb_gmem
    ),
    out_smem=epilogue_smem(bs, out_dtype, bs.compute_wgs),
    collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg_idx = lax.axis_index("wg")
    cta_idx = 0 if bs.cluster_dimension is None else lax.axis_index("cluster")

    @plgpu.nd_loop((splits * tiles,), collective_axes="sm")
    def _mn_loop(info: plgpu.NDLoopInfo):
      (lin,) = info.index
      split, lin = lax.div(lin, tiles), lax.rem(lin, tiles)
      out = out_gmem.at[split] if splits > 1 else out_gmem
      k_run = pl.ds(split * (k_iters * tile_k), k_iters * tile_k)
      j_run = pl.ds(split * (k_iters * subs), k_iters * subs)
      m_idx, n_idx = plgpu.planar_snake(
        lin, (m_iters, n_iters), bs.grid_minor_dim, bs.grid_tile_width
      )
      if bs.cluster_dimension == Dim.M:
        m_idx = m_idx * 2 + cta_idx
      elif bs.cluster_dimension == Dim.N:
        n_idx = n_idx * 2 + cta_idx
      cta_m_slice = pl.ds(row_start(m_idx, cta_m, m), cta_m)
      cta_n_slice = pl.ds(n_idx * cta_n, cta_n)
      if bs.wg_dimension == Dim.M:
        wg_m = pl.ds(wg_idx * tile_m, tile_m)
        wg_n = pl.ds(0, tile_n)
        wg_n0 = 0
      else:
        wg_m = pl.ds(0, tile_m)
        wg_n = pl.ds(wg_idx * tile_n, tile_n)
        wg_n0 = wg_idx * tile_n

      def compute_context(eval_pipeline):
        acc0 = plgpu.layout_cast(
          jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA
        )
        acc = eval_pipeline(acc0)
        store_tile(
          acc,
          out_smem.at[wg_idx],
          out.at[cta_m_slice, cta_n_slice].at[wg_m, wg_n],
          bs,
        )

      def promote(acc, p, j, sa_smem, sb_smem):
        ra = plgpu.load(sa_smem.at[j, wg_m], layout=ROW)
        return promote_block(
          acc, p, ra, sb_smem.at[j], wg_n0, tile_m, tile_n, b_scale_uniform
        )

      def mma_body(_, a_smem, b_smem, sa_smem, sb_smem, acc):
        def product(p_ref, j):
          ks = pl.ds(j * kb, kb)
          plgpu.wgmma(
            p_ref,
            a_smem.at[wg_m, ks],
            b_smem.at[wg_n, ks].transpose((1, 0)),
          )

        if subs == 2:
          # Both block products in flight; promote block 0 while block 1
          # runs on the tensor cores.
          def both(p0, p1):
            product(p0, 0)
            product(p1, 1)
            out = promote(
              acc,
              plgpu.wgmma_accumulator_load(p0, wait_n=1),
              0,
              sa_smem,
              sb_smem,
            )
            return promote(out, p1[...], 1, sa_smem, sb_smem)

          acc_t = plgpu.ACC((tile_m, tile_n), jnp.float32)
          return pl.run_scoped(both, acc_t, acc_t)
        for j in range(subs):

          def one(p_ref, j=j):
            product(p_ref, j)
            return p_ref[...]

          p = pl.run_scoped(one, plgpu.ACC((tile_m, tile_n), jnp.float32))
          acc = promote(acc, p, j, sa_smem, sb_smem)
        return acc

      state = None
      if chained:
        state = jnp.where(
          info.local_index == 0,
          plgpu.PipelinePipeline.START,
          jnp.where(
            info.local_index == info.num_local_steps - 1,
            plgpu.PipelinePipeline.STOP,
            plgpu.PipelinePipeline.STEADY,
          ),
        )
      get_pipeline(mma_body, compute_context, state)(
        a_gmem.at[cta_m_slice, k_run],
        b_gmem.at[cta_n_slice, k_run],
        sa_gmem.at[j_run, cta_m_slice],
        sb_gmem.at[j_run, cta_n_slice],
        allocations=pipeline_allocs,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(
  jax.jit,
  static_argnames=(
    "kb",
    "out_dtype",
    "block_sizes",
    "num_sms",
    "interpret",
    "b_scale_uniform",
    "splits",
  ),
)
def scaled_matmul_mgpu(
  a_mk,
  sa_Jm,
  b_nk,
  sb_Jn,
  *,
  kb: int,
  out_dtype=jnp.bfloat16,
  block_sizes: BlockSizes = BlockSizes(),
  num_sms: int | None = None,
  interpret: bool = False,
  b_scale_uniform: bool = False,
  splits: int = 1,
):
  """`out_mn`; see the module docstring. Shapes must fit the tiles.

  `b_scale_uniform`: the caller guarantees that `sb_Jn` is constant over
  every aligned group of `tile_n` columns (128 x 128 weight blocks): the
  kernel then folds it into the row scales. `splits` > 1 (split-K, for
  products with too few output tiles to fill the chip): the contraction
  is cut into that many runs of `k / splits`, each computed as an output
  tile of its own in f32, and the runs are summed here.
  """
  m, k = a_mk.shape
  n, k2 = b_nk.shape
  bs = block_sizes
  clu_m, clu_n = bs.cluster_tile()
  if (
    k != k2
    or m % 8
    or m < bs.cta_tile()[0]
    or n % clu_n
    or k % (bs.tile_k * splits)
    or bs.tile_k % kb
  ):
    raise ValueError(
      f"scaled_matmul_mgpu: a {a_mk.shape}, b {b_nk.shape} do not fit the"
      f" tiles {clu_m}x{clu_n}x{bs.tile_k} (kb={kb}, {splits=}): rows of a"
      f" must be a multiple of 8 and at least {bs.cta_tile()[0]}, rows of b"
      f" a multiple of {clu_n}, k of {bs.tile_k * splits}"
    )
  if kb not in (32, 64, 128):
    raise NotImplementedError(f"scale block along k must be 32/64/128: {kb}")
  if sa_Jm.shape != (k // kb, m) or sb_Jn.shape != (k // kb, n):
    raise ValueError(f"scale shapes {sa_Jm.shape}, {sb_Jn.shape}")
  # A persistent grid of clusters (one CTA each unless `cluster_dimension`):
  # no more programs than output tiles.
  csize = 1 + (bs.cluster_dimension is not None)
  num_sms = min(
    mosaic.num_sms(num_sms) // csize, splits * -(-m // clu_m) * (n // clu_n)
  )
  kernel = functools.partial(
    _kernel,
    kb=kb,
    bs=bs,
    b_scale_uniform=b_scale_uniform,
    num_programs=num_sms,
    splits=splits,
  )
  cluster = {}
  if bs.cluster_dimension is not None:
    cluster = dict(cluster=(2,), cluster_names=("cluster",))
  out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
  if splits > 1:
    out_type = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
  out = plgpu.kernel(
    kernel,
    out_type=out_type,
    grid=(num_sms,),
    grid_names=("sm",),
    num_threads=bs.compute_wgs + 1,
    thread_name="wg",
    kernel_name="fp8_gemm",
    compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup
    ),
    interpret=mosaic.interpret_params(interpret),
    **cluster,
  )(
    a_mk.astype(jnp.float8_e4m3fn),
    b_nk.astype(jnp.float8_e4m3fn),
    sa_Jm.astype(jnp.float32),
    sb_Jn.astype(jnp.float32),
  )
  return out.sum(axis=0).astype(out_dtype) if splits > 1 else out
