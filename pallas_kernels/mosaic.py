"""Hopper (Mosaic GPU) building blocks shared by the attention kernels.

The jagged flash attention (G1), GDPA (G2) and block attention (G3) kernels
are written from the same pieces: wgmma into a live or fresh accumulator,
`where` with explicit broadcasts (Mosaic's warpgroup lowering does not
broadcast), row iotas in the wgmma layout, tiled + swizzled shared-memory
tiles, TMA stores of a dynamic row count, and the 8-row alignment of packed
buffers that tiled TMA needs. One definition of each lives here; the kernels
import them rather than copying.
"""

import contextlib
import os

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

ALIGN = 8  # packed tiles start on multiples of 8 rows (tiled TMA)
# Shared memory per block on the H100 / H200 (232,448 B).
SMEM_PER_BLOCK = 227 * 1024
# What a sum of a kernel's buffer sizes may reach: the block's shared
# memory less room for barriers and each buffer's alignment, which such a
# sum leaves out. Lowered for CUDA, buffers summing to 230,400 B (an
# RMSNorm forward with FP8 output) took 232,456 B and 232,448 B (the
# quantizing FP8 matmul with an f32 output) took 234,624 B.
SMEM_LIMIT = SMEM_PER_BLOCK - 4 * 1024
# SMs of the H100 / H200 SXM: the CTA count persistent kernels assume where
# no GPU says otherwise (interpret mode, lowering for CUDA on a CPU host).
HOPPER_SMS = 132

# Registers of a warp-specialized CTA (`plgpu.set_max_registers`). An SM
# has 65,536 registers; a CTA of three warpgroups (384 threads) starts with
# 168 a thread (65,536 / 384 rounded down to a multiple of 8), and
# `set_max_registers` only moves registers between its warpgroups, so a
# thread's three warpgroups share `REGISTER_BUDGET` = 3 x 168. The producer
# only issues TMA copies and waits on barriers: it gives all but
# `PRODUCER_REGISTERS` to the two consumers, 232 each, which hold the
# accumulators (FlashAttention-3 splits 24 / 240 / 240, which measured no
# better here). A single consumer beside the producer has room to spare and
# takes `ONE_CONSUMER_REGISTERS`.
REGISTER_BUDGET = 504
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = (REGISTER_BUDGET - PRODUCER_REGISTERS) // 2  # 232
ONE_CONSUMER_REGISTERS = 240


def consumer_registers(consumers: int, each: int = CONSUMER_REGISTERS) -> int:
  """Registers a consumer warpgroup asks for: `each` beside a second
  consumer (232 by default, 240 with FlashAttention-3's 24-register
  producer), `ONE_CONSUMER_REGISTERS` alone."""
  return each if consumers == 2 else ONE_CONSUMER_REGISTERS


def producer_registers(consumers: int, each: int = CONSUMER_REGISTERS) -> int:
  """What the producer warpgroup keeps: `REGISTER_BUDGET` less two
  consumers' `each`, or `PRODUCER_REGISTERS` beside one consumer."""
  return REGISTER_BUDGET - 2 * each if consumers == 2 else PRODUCER_REGISTERS


def resolve_interpret(interpret=None):
  """The `interpret=` setting of every op, as `plgpu.kernel` takes it
  (`InterpretGPUParams`, or None to compile). `None` (the default):
  compile on a GPU, GPU interpret mode elsewhere; `False`: always compile
  (lowering for CUDA on a CPU host); `True`: interpret with the default
  params; an `InterpretGPUParams`: interpret with those."""
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return interpret_params(interpret)


def trace_once(op, static_argnums):
  """`op` (an op's `custom_vjp` over its kernels) under `jax.jit`, so that
  calls with equal shapes and settings, such as the same op in every layer
  of a model, share one trace and one lowering of its kernels: JAX caches
  a jitted function's jaxpr, its JVP, transpose and batched forms, and
  lowers each once per module, where a plain call traces and lowers every
  kernel again (lowering a kernel to Mosaic GPU is Python work, tenths of
  a second each). XLA inlines the calls, so the program is the same."""
  return jax.jit(op, static_argnums=static_argnums)


def interpret_params(interpret):
  """A kernel launcher's `interpret` (bool, `InterpretGPUParams` or None)
  as `plgpu.kernel` takes it: True -> default params, False / None ->
  None (compile), params as given."""
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or None


def num_sms(given: int | None = None) -> int:
  """`given`, else the SM count of this process's first device if it is a
  GPU, else `HOPPER_SMS`. Persistent kernels launch about this many CTAs,
  each with its share of the work; a fixed 132 on a Hopper with fewer SMs
  (an H100 PCIe has 114, an H20 78) leaves the CTAs past the SM count to a
  second wave, which made jagged attention 1.6x slower in the converse
  run on the H200 (a grid sized for 150 SMs on its 132;
  docs/kernels/jagged_attention.md)."""
  if given is not None:
    return given
  dev = jax.local_devices()[0]
  count = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
  return int(count) if count else HOPPER_SMS


def pad_rows(x, multiple=ALIGN):
  """Mosaic's tiled TMA wants the packed row count a multiple of 8; buffers
  whose capacity is one (the usual case) pass through without a copy."""
  extra = -x.shape[0] % multiple
  if not extra:
    return x
  return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def accumulate(acc, a, b, interpret, then=None):
  """`acc + a @ b` with wgmma into the live accumulator; `then()` runs while
  the wgmma is in flight (`accumulate_many` of one term)."""
  return accumulate_many([(acc, a, b)], interpret, then)[0]


def accumulate_many(terms, interpret, then=None):
  """`[acc + a @ b for acc, a, b in terms]`, one wgmma per term into its
  live accumulator, all in flight together (one wait); `then()` runs while
  they are. `interpret`: None when compiling, else the GPU interpreter
  params (its wgmma takes register operands badly: those become
  `jnp.dot`)."""
  if interpret is None:

    def body(refs):
      for ref, (_, a, b) in zip(refs, terms, strict=True):
        plgpu.wgmma(ref, a, b)
      if then is not None:
        then()

    init = tuple(plgpu.ACC.init(acc) for acc, _, _ in terms)
    return list(pl.run_state(body)(init))
  out = [
    acc + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
    if in_registers(a)
    else acc + matmul(a, b, acc.shape)  # shared-memory operands: its wgmma
    for acc, a, b in terms
  ]
  if then is not None:
    then()
  return out


def in_registers(x) -> bool:
  """A value (not a shared-memory ref, transformed or not)."""
  return isinstance(x, jax.Array) and not isinstance(
    jax.typeof(x), jax.ref.AbstractRef
  )


def matmul(a, b, shape):
  """`a @ b` into a fresh f32 accumulator (waits for the result)."""

  def scoped(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32))


def select(cond, x, y):
  """`jnp.where` with scalars spelled out as full arrays (Mosaic's warpgroup
  lowering does not broadcast implicitly)."""
  shape = next(jnp.shape(a) for a in (cond, x, y) if jnp.ndim(a))

  def full(a, dtype):
    return a if jnp.ndim(a) else jnp.full(shape, a, dtype)

  dtype = next(a.dtype for a in (x, y) if jnp.ndim(a))
  return jnp.where(full(cond, jnp.bool_), full(x, dtype), full(y, dtype))


def release(barrier):
  """Hand a shared-memory buffer back to its producer warpgroup.

  A proxy fence first, so the consumer's reads (generic `plgpu.load`s and
  wgmma operands alike) are ordered before the producer's next TMA write
  into the buffer, then the arrival. The interpreter's race detector
  (`InterpretGPUParams(detect_races=True)`) asks for it.
  """
  plgpu.commit_smem()
  plgpu.barrier_arrive(barrier)


def meet(barrier):
  """A rendezvous of the warpgroups that share `barrier` (one arrival
  each): none goes on until all have arrived."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def staged_add(stage, value, dst, interpret):
  """`dst += value` (registers) by TMA reduce-add, staged through the
  shared-memory `stage` once the previous store from it has read it. The
  GPU interpreter (`interpret` not None) has no TMA reduction: there it
  is a plain store, so `dst` must be a slice of the caller's own, which
  the caller sums afterwards."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  stage[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(
    stage, dst, reduction_op="add" if interpret is None else None
  )


def shared_ds_dq(ds16, ds_smem, k_smem2, barrier, step, wg, emit):
  """One step's dQ in a fused attention backward (two consumer warpgroups,
  each owning half of a key tile): both put their `dS^T` (their keys x
  the query tile, `ds16`) in the double-buffered `ds_smem[step % 2, wg]`
  and meet at `barrier`; then dQ's 64-column blocks go to them in turn
  (block `b` to warpgroup `(step + b) % 2`: one each with head dim 128,
  alternating steps with 64), each formed over all the tile's keys,
  `sum_w dS^T[w]^T K[w][:, block]` (`k_smem2[w]`: warpgroup w's keys), in
  f32 and handed to `emit(part, cols)`. The meet of the next step orders
  this step's reads of `ds_smem` before its slot is written again."""
  wgs, rows = ds_smem.shape[1], ds_smem.shape[-1]
  buf = lax.rem(step, 2)
  ds_smem.at[buf, wg][...] = ds16
  plgpu.commit_smem()
  meet(barrier)
  for blk in range(k_smem2.shape[-1] // 64):
    cols = pl.ds(blk * 64, 64)

    @pl.when(lax.rem(step + blk, 2) == wg)
    def _(cols=cols):
      def scoped(acc_ref):
        for w in range(wgs):
          plgpu.wgmma(
            acc_ref,
            ds_smem.at[buf, w].transpose((1, 0)),
            k_smem2.at[w].at[:, cols],
          )
        return acc_ref[...]

      emit(pl.run_scoped(scoped, plgpu.ACC((rows, 64), jnp.float32)), cols)


def produce_ring(total, stages: int, free, issue):
  """A producer's loop over `total` (dynamic) loads through a ring of
  `stages` slots: `issue(j, slot)` starts load `j` into `slot` once the
  consumers released the slot's previous load (`free.at[slot]`); the first
  `stages` loads need no wait. Ends by observing the last releases, so
  every barrier phase is consumed before the kernel exits."""
  for j in range(stages):

    @pl.when(j < total)
    def _(j=j):
      issue(j, j)

  @pl.loop(0, total - stages)
  def _(j):
    slot = lax.rem(j, stages)
    plgpu.barrier_wait(free.at[slot])
    issue(j + stages, slot)

  observe_releases(total, stages, free)


def observe_releases(total, stages: int, *frees, base=0):
  """A producer waits out the consumers' releases of the last `stages` of
  its `total` (dynamic) loads through a ring of `stages` slots (`frees`:
  one barrier array per ring, slot `i` at index `base + i`), so every
  barrier phase is consumed before the CTA exits (the interpreter checks
  this; on the GPU it costs nothing)."""

  @pl.loop(jnp.maximum(total - stages, 0), total)
  def _(j):
    slot = base + lax.rem(j, stages)
    for free in frees:
      plgpu.barrier_wait(free.at[slot])


def tile_ring(num_steps, stages: int, fetch, body, carry=()):
  """A warpgroup's own TMA ring over `num_steps` (dynamic) tiles, with no
  producer warpgroup (compare `produce_ring`): the first `stages` fetches
  are issued up front, then step `j` runs `body(j, slot, refill, carry)`,
  which waits for its tile (the barrier is the caller's) and calls
  `refill()` once it has read the slot; that issues fetch `j + stages`
  into the same slot, if there is one. `fetch(j, slot)` starts the TMA of
  tile `j`. Returns the carry."""
  for j in range(stages):

    @pl.when(j < num_steps)
    def _(j=j):
      fetch(j, j)

  def step(j, carry):
    slot = lax.rem(j, stages)

    def refill():
      @pl.when(j + stages < num_steps)
      def _():
        fetch(j + stages, slot)

    return body(j, slot, refill, carry)

  return lax.fori_loop(0, num_steps, step, carry)


def aligned(row):
  """Tell Mosaic a packed row index is a multiple of 8 (tiled TMA)."""
  return pl.multiple_of(row, ALIGN)


def iota(shape, dim):
  return plgpu.broadcasted_iota(
    jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA
  )


def row_iota(n):
  """`[0..n)` laid out like the rows of a wgmma accumulator."""
  return iota((n, 64), 0).max(axis=1)


def ladder_store(src_smem, dst_rows, start, count, max_rows: int):
  """Store rows `[start, start + count)` (dynamic) of `src_smem` with TMA.

  TMA box sizes are static, so the rows go out as one store per set bit of
  `count` (64, 32, ..., 1): `dst_rows(offset, size)` is the destination
  window of `size` rows for source rows `[offset, offset + size)`.
  """
  size = 1 << (max_rows.bit_length() - 1)
  while size >= 1:

    @pl.when((count & size) != 0)
    def _(start=start, size=size):
      plgpu.copy_smem_to_gmem(
        src_smem.at[pl.ds(start, size)], dst_rows(start, size)
      )

    start = start + (count & size)
    size //= 2


TILING = plgpu.TilingTransform((8, 64))
SWIZZLE = plgpu.SwizzleTransform(128)
TILES = (TILING, SWIZZLE)  # 16-bit tiles as wgmma reads them


def smem_tile(shape, dtype):
  return plgpu.SMEM(shape, dtype, transforms=TILES)


def smem_swizzled(shape, dtype):
  """Row-major shared memory with the 128-byte swizzle and no tiling, for
  `[..., 64]` 16-bit tiles (one swizzle atom per row).

  Unlike `smem_tile`, TMA fills it from any packed row (tiling makes Mosaic
  split the row index by 8), and unlike plain memory, the wgmma-layout
  register loads and stores of a warp hit 32 distinct banks: a warp touches
  8 rows at the same columns, which in plain memory (128-byte rows) are one
  bank quartet, an 8-way conflict. Row windows must start on multiples of 8
  rows (the swizzle repeats every 1,024 bytes), so partial-tile stores of
  any row count still need plain memory (`ladder_store`).
  """
  return plgpu.SMEM(shape, dtype, transforms=(SWIZZLE,))


# Settings of `profiling` while it is active (empty: no profiler).
_PROFILE: dict = {}


@contextlib.contextmanager
def profiling(directory, regions: int = 48):
  """Intra-kernel profiles. While this is active, kernels built by
  `warp_specialized` record the named regions of each warpgroup (a
  `jax.named_scope` or `jax.named_call` in the kernel body; the jagged
  attention kernels mark each work item "item") with the Mosaic GPU
  profiler, up to `regions` per warpgroup (the profiler's own "Init"
  included; each costs 16 B of shared memory per warpgroup, and 48 is
  what ran on the H200 beside the fused backward's buffers), and each
  writes a Perfetto trace into `directory/<kernel name>/`, read by
  `benchmarks/common.kernel_profile`.

  It acts where a kernel is traced (a jitted function's first call), and
  a compiled kernel writes its trace once, on its first run, so warm the
  GPU with another program before that run (a cold chip runs slower)."""
  old = dict(_PROFILE)
  _PROFILE.update(regions=regions, directory=str(directory))
  try:
    yield
  finally:
    _PROFILE.clear()
    _PROFILE.update(old)


def warp_specialized(
  kernel,
  *,
  out_type,
  scratch,
  grid,
  consumers,
  interpret,
  items="workers",
  name="kernel",
  family="attention",
):
  """`plgpu.kernel` as every attention kernel launches it: a `(heads,
  items)` grid (`items`: "workers" for persistent CTAs, "items" for one
  CTA per work item), `consumers` compute warpgroups plus one producer on
  the "wg" axis, approximate math (`exp2`, `tanh`). `name`: the kernel's
  folder under `profiling`; the GPU kernel is named `{family}_{name}`, so
  that traces attribute its time to its op."""
  params = {}
  if _PROFILE and interpret is None:
    directory = os.path.join(_PROFILE["directory"], name)
    os.makedirs(directory, exist_ok=True)
    params = dict(profile_space=_PROFILE["regions"], profile_dir=directory)
  return plgpu.kernel(
    kernel,
    out_type=out_type,
    scratch_types=scratch,
    grid=grid,
    grid_names=("heads", items),
    num_threads=consumers + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(approx_math=True, **params),
    interpret=interpret,
    kernel_name=f"{family}_{name}",
  )
