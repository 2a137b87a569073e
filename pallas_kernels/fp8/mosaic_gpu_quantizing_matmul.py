"""Block-scaled FP8 matmul with `a` quantized in the kernel (Hopper, G4).

Quantizing `a` in the kernel (`quantizing_matmul_mgpu`): `a` arrives as
bf16 and is quantized in 1 x 128 blocks on its way to the wgmma, so it is
read once instead of read, written as e4m3 and read again. Two quantizer
warpgroups take the k-steps in turn: each waits for its bf16 tile (TMA),
loads it into registers, takes the row maxima and power-of-two scales,
writes e4m3 values and scales to shared memory
(`mosaic_gpu.quantize_rows`), and signals the two compute
warpgroups, which multiply as `scaled_matmul_mgpu` does
(`mosaic_gpu_matmul.py`). It pays only for narrow outputs: every 256
output columns quantize their `a` tile again, and one quantizer
warpgroup alone was slower than the wgmmas (two are 27% faster; the
bf16 tiles and the hand-off cost too). Its results equal
`scaled_matmul_mgpu`'s on the quantized `a` bit for bit. L2 bandwidth
does not bound it: clusters of CTAs along M that TMA-multicast the
weight tile (`cluster_m`), which cut a CTA's L2 reads per 64 x 256 x 128
step from 48 to 32 KiB, measured no faster, so the default has none.
`primitives.py` uses the kernel for products with at most
512 output columns and a 16-bit output whose quantized `a` nothing else
reads: the forward (unless the weight gradient is FP8) and `dx = g w^T`.

Quantizing in the compute warpgroups themselves, with `a` in registers
(an 8-bit wgmma takes `a` from registers, in `Layout.WGMMA_8BIT`), was
slower: each warpgroup loads its 64 x 128 bf16 block of the stage,
quantizes it and issues the wgmma on the registers, with no hand-off,
but every block is then quantized once per 128 output columns, twice as
often as here, by the warpgroups that also promote: its best tile ran
at 524-569 TFLOP/s at every shape, 6% behind this kernel at 65536 x 2048
x 512.

Why the quantizing kernel stays short of the 1.3x forward goal at the
narrow shapes (arithmetic on the GEMM's figures, not a measurement). The
GEMM's speed comes from its third compute warpgroup (1032 against 895
TFLOP/s for two at 65536 x 2048 x 512). Each compute warpgroup holds a 64
x 128 f32 accumulator and a fresh block product, 160 registers a thread;
three take 480 of the 512 a thread slot has (65,536 per SM over 128
threads), and the memory warpgroup 24 of the rest, which leaves 8 for a
quantizer that needs 32 just to hold its 64 x 128 bf16 tile as packed
bf16, before any maxima or addresses (the quantizers here run on 96).
Even without the memory warpgroup, 32 would not do. So this kernel
has two compute warpgroups, and even with quantization free it could not
beat the two-warpgroup GEMM: 895 TFLOP/s, 0.154 ms at 65536 x 2048 x 512,
about 1.22x cuBLAS bf16. The fresh block product is what DeepSeek's recipe
calls promotion: accumulating the k-blocks in the wgmma's own accumulator,
rescaled between blocks, would free its registers but leave the sum at the
tensor cores' reduced FP8 accumulation precision.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic
from pallas_kernels.fp8.mosaic_gpu import (
  F8_TILES,
  ROW,
  Dim,
  epilogue_smem,
  promote_block,
  quantize_rows,
  store_tile,
)


@dataclasses.dataclass(frozen=True)
class QuantizingBlockSizes:
  """Tiles and rings of `quantizing_matmul_mgpu`; the defaults are the
  H200 sweep's best (a development sweep). The CTA tile is
  `tile_m x 2 tile_n` (the two compute warpgroups side by side along N,
  sharing the quantized `a` tile), one k-block of 128 per step.
  `stages_a`: bf16 `a` tiles in flight per quantizer (TMA -> quantizer),
  `stages_b`: weight tiles in flight (TMA -> wgmma, a multiple of
  `quantizers`); each quantizer has two slots of quantized tiles, so it
  can work ahead of the wgmmas."""

  tile_m: int = 64
  tile_n: int = 128
  stages_a: int = 2
  stages_b: int = 2
  grid_minor_dim: Dim = Dim.N
  grid_tile_width: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  # Registers per thread (compute, quantizer) by setmaxnreg, or None. The
  # launch gives each thread 65536 / threads (168 for 3 warpgroups, 128
  # for 4); an increase waits until the decreases have freed enough, so
  # the wrapper refuses a split that would hang.
  registers: tuple[int, int] | None = (160, 96)
  # Quantizer warpgroups, taking steps in turn: one alone quantizes slower
  # than two compute warpgroups multiply (0.33 vs 0.24 ms at 65536 x 2048
  # x 512 on the H200).
  quantizers: int = 2
  # CTAs stacked along M in a cluster (1, 2 or 4): they TMA-multicast the
  # weight tile they share, so each reads 1 / cluster_m of it from L2; no
  # faster on the H200 (see "Quantizing `a` in the kernel").
  cluster_m: int = 1

  def __post_init__(self):
    if self.cluster_m not in (1, 2, 4):
      raise ValueError(f"cluster_m={self.cluster_m}: 1, 2 or 4")

  def cta_rows(self) -> int:
    """Rows of `a` per cluster (per CTA without one)."""
    return self.tile_m * self.cluster_m


def _quantizing_scratch(bs: QuantizingBlockSizes, out_dtype):
  """Shared memory of `quantizing_matmul_mgpu`: rings, epilogue, barriers."""
  nq, kb = bs.quantizers, 128
  cta_m, cta_n = bs.tile_m, 2 * bs.tile_n
  f8 = jnp.float8_e4m3fn
  return [
    mosaic.smem_tile((nq * bs.stages_a, cta_m, kb), jnp.bfloat16),
    plgpu.SMEM((bs.stages_b, cta_n, kb), f8, transforms=F8_TILES),
    plgpu.SMEM((bs.stages_b, cta_n), jnp.float32),
    plgpu.SMEM((2 * nq, cta_m, kb), f8, transforms=F8_TILES),
    plgpu.SMEM((2 * nq, cta_m), jnp.float32),
    epilogue_smem(bs, out_dtype),
    plgpu.Barrier(num_barriers=nq * bs.stages_a),  # a_full: 1 copy
    plgpu.Barrier(num_arrivals=2, num_barriers=bs.stages_b),  # b_full
    # b_free: both compute warpgroups (of both CTAs when multicast).
    plgpu.ClusterBarrier(
      collective_axes=("cluster",), num_arrivals=2, num_barriers=bs.stages_b
    )
    if bs.cluster_m > 1
    else plgpu.Barrier(num_arrivals=2, num_barriers=bs.stages_b),
    plgpu.Barrier(num_barriers=2 * nq),  # q_full: a quantizer
    plgpu.Barrier(num_arrivals=2, num_barriers=2 * nq),  # q_free: both
  ]


def quantizing_fits(
  out_dtype, block_sizes: QuantizingBlockSizes = QuantizingBlockSizes()
) -> bool:
  """Whether `quantizing_matmul_mgpu` with these block sizes and output
  dtype fits in shared memory (with the defaults: 16-bit outputs do, f32
  does not)."""
  buffers = [
    r for r in _quantizing_scratch(block_sizes, out_dtype)
    if not isinstance(r, (plgpu.Barrier, plgpu.ClusterBarrier))
  ]  # fmt: skip
  nbytes = sum(
    math.prod(r.shape) * jnp.dtype(r.dtype).itemsize for r in buffers
  )
  return nbytes <= mosaic.SMEM_LIMIT


def _quantizing_kernel(
  a_gmem,
  b_gmem,
  sb_gmem,
  out_gmem,
  a_ring,
  b_ring,
  sb_ring,
  qa_ring,
  sa_ring,
  out_smem,
  a_full,
  b_full,
  b_free,
  q_full,
  q_free,
  *,
  bs: QuantizingBlockSizes,
  b_scale_uniform: bool,
  num_programs: int,
):
  m, k = a_gmem.shape
  n = b_gmem.shape[0]
  kb = 128
  tile_m, tile_n = bs.tile_m, bs.tile_n
  cta_n = 2 * tile_n
  m_iters, n_iters, k_iters = m // bs.cta_rows(), n // cta_n, k // kb
  pid = lax.axis_index("sm")  # the cluster's (the CTA's without one)
  wg = lax.axis_index("wg")
  clustered = bs.cluster_m > 1
  cta_idx = lax.axis_index("cluster") if clustered else 0
  share_b = ("cluster",) if clustered else None
  # This CTA's output tiles: pid, pid + P, ... (at least one: P <= tiles).
  my_tiles = (m_iters * n_iters - 1 - pid) // num_programs + 1
  steps = my_tiles * k_iters  # (tile, k-block) steps, in order

  def tile_coords(t):
    """This CTA's row tile and column tile of its `t`-th tile."""
    m_idx, n_idx = plgpu.planar_snake(
      pid + t * num_programs,
      (m_iters, n_iters),
      bs.grid_minor_dim,
      bs.grid_tile_width,
    )
    return m_idx * bs.cluster_m + cta_idx, n_idx

  # Quantizer `qi` takes steps `qi, qi + nq, ...` (its local steps j):
  # their `a` tiles in its own ring of `stages_a` slots, their weight tiles
  # in its `stages_b / nq` slots of the weight ring, and two quantized-tile
  # slots. So every barrier slot has one producer and one waiter.
  nq = bs.quantizers
  per_b = bs.stages_b // nq

  def owner_slots(s):
    """Step `s`'s quantized-tile and weight-ring slots."""
    qi, j = lax.rem(s, nq), s // nq
    return 2 * qi + lax.rem(j, 2), qi * per_b + lax.rem(j, per_b)

  def load_a(s, slot):
    m_idx, _ = tile_coords(s // k_iters)
    plgpu.copy_gmem_to_smem(
      a_gmem.at[pl.ds(m_idx * tile_m, tile_m), pl.ds((s % k_iters) * kb, kb)],
      a_ring.at[slot],
      a_full.at[slot],
    )

  def load_b(s, slot):
    _, n_idx = tile_coords(s // k_iters)
    kk = s % k_iters
    cols = pl.ds(n_idx * cta_n, cta_n)
    plgpu.copy_gmem_to_smem(
      b_gmem.at[cols, pl.ds(kk * kb, kb)],
      b_ring.at[slot],
      b_full.at[slot],
      collective_axes=share_b,
    )
    plgpu.copy_gmem_to_smem(
      sb_gmem.at[kk, cols], sb_ring.at[slot], b_full.at[slot]
    )

  @pl.when(wg >= 2)
  def _quantizer():
    qi = wg - 2
    if bs.registers:
      plgpu.set_max_registers(bs.registers[1], action="decrease")
    my_steps = (steps - 1 - qi) // nq + 1  # may be <= 0
    step = lambda j: qi + nq * j
    a0, b0 = qi * bs.stages_a, qi * per_b  # its first a / weight slots
    for j in range(per_b):

      @pl.when(j < my_steps)
      def _(j=j):
        load_b(step(j), b0 + j)

    def body(j, slot, refill, carry):
      s = step(j)
      qs, _ = owner_slots(s)
      plgpu.barrier_wait(a_full.at[a0 + slot])

      @pl.when(j >= 2)
      def _():
        plgpu.barrier_wait(q_free.at[qs])  # its step j - 2's wgmmas are done

      q, scale = quantize_rows(a_ring.at[a0 + slot])
      qa_ring[qs] = q
      sa_ring[qs] = scale
      plgpu.commit_smem()  # (with a warpgroup barrier: every thread's)
      plgpu.barrier_arrive(q_full.at[qs])
      refill()  # the bf16 slot's reads are committed

      # Step j - 1's weights are replaced by those of step j - 1 + per_b
      # once its wgmmas are done (step j is quantized meanwhile).
      @pl.when((j >= 1) & (j - 1 + per_b < my_steps))
      def _():
        b_slot = b0 + lax.rem(j - 1, per_b)
        plgpu.barrier_wait(b_free.at[b_slot])
        load_b(step(j - 1 + per_b), b_slot)

      return carry

    mosaic.tile_ring(
      my_steps,
      bs.stages_a,
      lambda j, slot: load_a(step(j), a0 + slot),
      body,
    )
    mosaic.observe_releases(my_steps, per_b, b_free, base=b0)
    mosaic.observe_releases(my_steps, 2, q_free, base=2 * qi)

  @pl.when(wg < 2)
  def _compute():
    if bs.registers:
      plgpu.set_max_registers(bs.registers[0], action="increase")
    wg_n = pl.ds(wg * tile_n, tile_n)

    @pl.loop(0, my_tiles)
    def _tile(t):
      def k_step(kk, acc):
        s = t * k_iters + kk
        qs, slot = owner_slots(s)
        plgpu.barrier_wait(q_full.at[qs])
        plgpu.barrier_wait(b_full.at[slot])

        def mma(p_ref):
          plgpu.wgmma(
            p_ref, qa_ring.at[qs], b_ring.at[slot, wg_n].transpose((1, 0))
          )
          return p_ref[...]

        p = pl.run_scoped(mma, plgpu.ACC((tile_m, tile_n), jnp.float32))
        ra = plgpu.load(sa_ring.at[qs], layout=ROW)
        acc = promote_block(
          acc,
          p,
          ra,
          sb_ring.at[slot],
          wg * tile_n,
          tile_m,
          tile_n,
          b_scale_uniform,
        )
        plgpu.commit_smem()  # reads before the quantizer's / TMA's writes
        plgpu.barrier_arrive(q_free.at[qs])
        plgpu.barrier_arrive(b_free.at[slot])
        return acc

      acc0 = plgpu.layout_cast(
        jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA
      )
      acc = lax.fori_loop(0, k_iters, k_step, acc0)
      m_idx, n_idx = tile_coords(t)
      store_tile(
        acc,
        out_smem.at[wg],
        out_gmem.at[
          pl.ds(m_idx * tile_m, tile_m),
          pl.ds(n_idx * cta_n + wg * tile_n, tile_n),
        ],
        bs,
      )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(
  jax.jit,
  static_argnames=(
    "out_dtype",
    "block_sizes",
    "num_sms",
    "interpret",
    "b_scale_uniform",
  ),
)
def quantizing_matmul_mgpu(
  a_mk,
  b_nk,
  sb_Jn,
  *,
  out_dtype=jnp.bfloat16,
  block_sizes: QuantizingBlockSizes = QuantizingBlockSizes(),
  num_sms: int | None = None,
  interpret=False,
  b_scale_uniform: bool = False,
):
  """`scaled_matmul_mgpu` with `a` bf16, quantized in the kernel in 1 x 128
  blocks (the values and scales of `fp8.quantize`): `a` is read once, as
  bf16, instead of quantized by a pass of its own. See "Quantizing `a` in
  the kernel" in the module docstring. `b_nk` e4m3 and `sb_Jn` as in
  `scaled_matmul_mgpu` with `kb = 128`."""
  m, k = a_mk.shape
  n, k2 = b_nk.shape
  bs = block_sizes
  kb = 128
  cta_m, cta_n = bs.cta_rows(), 2 * bs.tile_n
  if a_mk.dtype != jnp.bfloat16:
    raise TypeError(f"quantizing_matmul_mgpu: a must be bf16, got {a_mk.dtype}")
  if not interpret and not quantizing_fits(out_dtype, bs):
    # (The GPU interpreter has no such limit: tests check f32 outputs.)
    raise ValueError(
      f"quantizing_matmul_mgpu: {bs} with a {jnp.dtype(out_dtype).name}"
      " output does not fit in shared memory (`quantizing_fits`)"
    )
  if k != k2 or m % cta_m or n % cta_n or k % kb:
    raise ValueError(
      f"quantizing_matmul_mgpu: a {a_mk.shape}, b {b_nk.shape} do not fit"
      f" the tiles {cta_m}x{cta_n}x{kb}"
    )
  if sb_Jn.shape != (k // kb, n):
    raise ValueError(f"scale shape {sb_Jn.shape}, want {(k // kb, n)}")
  nq = bs.quantizers
  if bs.stages_b % nq:
    raise ValueError(f"stages_b={bs.stages_b} must be a multiple of {nq=}")
  launch = 65536 // (128 * (2 + nq)) // 8 * 8  # registers per thread
  c, q = bs.registers or (launch, launch)
  if 2 * (c - launch) > nq * (launch - q):
    raise ValueError(
      f"registers {bs.registers}: the compute warpgroups' increase would wait"
      " forever for registers the quantizers' decrease does not free"
    )
  # A persistent grid of clusters (of CTAs without them): no more
  # programs than output tiles.
  num_sms = min(
    mosaic.num_sms(num_sms) // bs.cluster_m, (m // cta_m) * (n // cta_n)
  )
  cluster = {}
  if bs.cluster_m > 1:
    cluster = dict(cluster=(bs.cluster_m,), cluster_names=("cluster",))
  scratch = _quantizing_scratch(bs, out_dtype)
  kernel = functools.partial(
    _quantizing_kernel,
    bs=bs,
    b_scale_uniform=b_scale_uniform,
    num_programs=num_sms,
  )
  return plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
    scratch_types=scratch,
    grid=(num_sms,),
    grid_names=("sm",),
    num_threads=2 + nq,
    thread_name="wg",
    kernel_name="fp8_gemm_quantizing",
    compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup
    ),
    interpret=mosaic.interpret_params(interpret),
    **cluster,
  )(a_mk, b_nk.astype(jnp.float8_e4m3fn), sb_Jn.astype(jnp.float32))
