"""Block attention with fused RoPE for Hopper in Pallas Mosaic GPU (G3).

Shapes (legend): `t` packed tokens, `b` sequences, `n` query heads, `k` KV
heads (`g = n // k`), `h` head dim, `z` block size (32 or 64 here), `i`
work items (64-row tiles), `w` workers (persistent CTAs per KV head).

Math. Tile `f` of a sequence covers its positions `[64 f, 64 f + 64)`; with
`z = 64` it is one block, with `z = 32` two (a block-diagonal mask inside
the tile). Per query head, with `c = scale * log2(e)` and RoPE `R_p`:

    x = c (R q)(R k)^T        one 64 x 64 tile, the whole softmax row
    m = max_j x,   P = 2^(x - m) / l,   l = sum_j 2^(x - m),   O = P V

There is no online softmax (a row sees one key tile), and the forward
writes nothing but O: the backward recomputes `x`, `m` and `l` from Q and
K (one tile, cheaper than a round trip of the logsumexp), then

    dP = dO V^T,  delta = rowsum(P * dP),  dX = P * (dP - delta)
    dV = P^T dO,  d(Rq) = scale dX (Rk),  d(Rk) = scale dX^T (Rq)

and the RoPE backward (`dq = R^T d(Rq)`, a rotation by `-angle`) runs in
the epilogue on the f32 accumulators, before the one store of dQ and dK.

Sequence-aligned tiles without a copy. A block starts at a sequence's first
token, which sits at any packed row, while Mosaic's TMA into the swizzled,
(8, 64)-tiled shared memory that wgmma reads needs rows that are multiples
of 8. So tiles are loaded with TMA into swizzled row-major shared memory
without the tiling (`mosaic.smem_swizzled`), which takes any row, and the
consumer warpgroups read them into registers (free of bank conflicts, which
plain row-major memory would have 8-way). K and V go on into the tiled
layout; Q stays in registers as wgmma's A operand, so its ring slot is
free again before any math. That pass is where RoPE is applied to Q and K
(rotation of the two halves by `cos`/`sin` of the rows' positions inside
the tile, see "RoPE at tile positions") and where the zero-fill
happens, so it costs no extra trip: only V (and dO) move without other
work. Outputs leave the same way back: a whole tile through a
swizzled buffer, a sequence's last partial tile through a plain one (the
ladder of TMA stores starts rows anywhere; `_store_tile`). The two are
aliased views of one buffer (`plgpu.RefUnion`). (A ring of two such
buffers per forward warpgroup measured the same: stores do not wait on
their staging buffer.)

RoPE at tile positions. RoPE makes a score depend on the two positions
only through their difference (`(R_m q) . (R_n k) = q . R_(n-m) k`), and
both rows of every score sit in one 64-row tile, so rotating by the
position inside the tile (`r < 64`) instead of the one in the sequence
(`64 f + r`) gives the same scores, outputs and gradients. So one 64-row
table (`rope_table`) serves every tile: it is loaded into shared memory
once per CTA (its f16 high terms alone, unless `BlockSizes.rope_f32`
sums both terms in f32), and the forward keeps its cos and sin (in the
input dtype by default) in registers for the whole kernel (the backward,
whose registers hold the gradients, reads the table's high terms from
shared memory where it rotates). Rotating at sequence positions cost a
per-tile angle addition and table load (see below).

Last partial block by zero-fill (as G1): rows of K and V past the sequence
end are zeroed in that relayout (a select on the tile's rows). A zero key
gives score 0, so each of the `zf` zero keys a row sees adds `2^(0 - m)` to
`l`; it is subtracted after the row sum (`l - zf 2^(-m)`), and a zero value
row adds nothing to O, so no score is masked for sequence ends. (Causal
rows never see keys past the end; `z = 32` tiles mask the other block.) In
the backward, dO rows past the end are zeroed too, which makes `dP`,
`delta` and `dX` of those query rows zero, so they add nothing to dK/dV.
Query rows past the end are computed and never written (ladder of TMA
stores).

Column parts. Every tile of Q, K, V and dO is kept as `h / 64` contiguous
`[64, 64]` parts, stacked by rows in one buffer (`[parts * 64, 64]`; TMA
loads each part from its own column window of HBM), and the
matmuls over the head dim are sums over the parts (`QK^T = sum_p Qp Kp^T`)
or run per part (`Op = P Vp`). No shared-memory buffer is ever sliced by
column: loads, stores and wgmma operands all see whole `[64, 64]` tiles
(one swizzle atom wide). At head dim 128 the two parts are the two halves
that RoPE pairs (column `c` with `c + 64`), which is why fused RoPE needs
head dim 128.

Persistent CTAs and the pipeline. The work list (from
`pallas_kernels.schedule`: only non-empty 64-row tiles, the buffer tail as
one more sequence) is dealt zig-zag over `w` CTAs per KV head (tiles of one
block attention are equal work). Each CTA walks its tiles; a producer
warpgroup streams each tile's K, V, RoPE rows and the query tiles of the
`g` query heads, and since every buffer is released as soon as its
relayout (or load into registers) is done, the next tile's loads overlap
the current tile's math.
Forward: two consumer warpgroups split the query heads (and the K / V
relayout). Backward: two consumer warpgroups walk the `g` heads of each
tile together, one keeping dV and the other dK in registers (the GQA
reduction stays in the kernel, O7), with the next head's Q and dO
landing meanwhile (see `backward`).

Rows of the buffer tail get zeros (their tiles are computed like any other,
on finite inputs, and multiplied by 0).

Where the forward's time goes: RoPE is the kernel's main cost over an XLA
op moving the same bytes (a rotation is about 3.5 instructions an element
on the consumers' critical path), hence rotating in the input dtype
(`BlockSizes.rope_f32`). Two fixed costs take the log-normal forward's
last tenth: a warpgroup's first item takes twice a later one (every CTA
asks for its first tiles at once), and the last items are not cheaper
(latency-bound once the chip is not saturated). Tried and not kept: a
fourth warpgroup doing every register pass (it starves the two that wait
on it), programmatic dependent launch, and fewer persistent CTAs to even
out the deal. The runs: docs/kernels/block_attention.md.

Files: this one holds the settings (`BlockSizes`), the work list, the RoPE
table and the pieces both kernels use; the forward kernel is
`mosaic_gpu_fwd.py`, the backward `mosaic_gpu_bwd.py`; `op.py` is the
public op and the blocks-of-128 path.
"""

import dataclasses
import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import mosaic, schedule
from pallas_kernels.block_attention.reference import rope_constants

TILE = 64
PART = 64  # columns of one part of a tile (see "Column parts")
LOG2E = math.log2(math.e)
_L = plgpu.Layout.WGMMA


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Settings; defaults measured on the H200.

  `q_stages`: query tiles in flight per forward consumer. A slot is free
  again as soon as its tile is in registers, so one suffices: two ran the
  forward 3-18% slower, also with the output buffers aliased, so shared
  memory capacity was not the reason.

  `rope_f32`: the RoPE rotation of Q and K in f32 with the table's two
  terms, or (default) in the input dtype with its high terms, with no
  conversions to and from f32 around the arithmetic. The backward rotates
  with the high terms alone (it keeps only those in shared memory), in
  the same dtype: by default exactly as the forward did, so the scores it
  recomputes are the forward's; under `rope_f32` they differ from the
  forward's by the high terms' error (`< 2^-12` of each factor). Its
  un-rotation of the f32 dQ and dK stays f32. The input dtype runs the
  forward 7-20% faster (forward+backward the same), with relative errors
  O 0.0038 against 0.0032, dQ / dK 0.0043 against 0.0036 (the rotated
  rows are rounded twice instead of once). The runs:
  docs/kernels/block_attention.md.
  """

  num_sms: int | None = None  # persistent CTAs = about this many (None:
  # the GPU's SMs, `mosaic.num_sms`)
  q_stages: int = 1
  rope_f32: bool = False  # rotate Q and K in f32 (default: input dtype)

  def __post_init__(self):
    if (self.num_sms is not None and self.num_sms < 1) or self.q_stages < 1:
      raise ValueError("num_sms and q_stages must be >= 1")


@dataclasses.dataclass(frozen=True)
class _Static:
  block: int  # 32 or 64
  causal: bool
  rope: bool
  scale: float
  block_sizes: BlockSizes
  interpret: object  # None (compile) or plgpu.InterpretGPUParams


def work_items(offsets, t: int):
  """64-row tiles of every sequence (and of the buffer tail).

  Returns (`int32[i, 3]`, number of real items). Columns: 0 first packed
  row, 1 rows of the tile inside the sequence, 2 whether it is the buffer
  tail.
  """
  offsets = jnp.asarray(offsets, jnp.int32)
  sched = schedule.jagged_tile_schedule(offsets, t, TILE)
  off_e = schedule.extend_offsets(offsets, t)
  seq, tile, ok = sched.seq_i, sched.tile_i, sched.valid_i
  length = off_e[seq + 1] - off_e[seq]
  pos0 = tile * TILE
  valid = jnp.where(ok, jnp.clip(length - pos0, 0, TILE), 0)
  tail = seq == offsets.shape[0] - 1
  table = jnp.stack([off_e[seq] + pos0, valid, tail], axis=1)
  return table.astype(jnp.int32), sched.num_items


def rope_table(h: int, theta: float):
  """RoPE constants `f16[4, 64, h/2]`: cos and sin of positions `0..64)`
  inside a tile (see "RoPE at tile positions"), each as two f16 terms
  (`cos = [0] + [2]`, `sin = [1] + [3]`): the high terms first, so a
  kernel that rotates with them alone loads `[:2]` (`_cs_planes`).

  Why two f16 terms: a `[64, 64]` plane of 16-bit values has 128-byte
  rows, one swizzle atom, so it loads into registers without bank
  conflicts (`mosaic.smem_swizzled`); f32 planes (256-byte rows) cannot.
  The pair keeps f32-like accuracy (`|cos - hi - lo| < 2^-22`). Built
  with numpy at trace time: constants, no trigonometry per call.
  """
  exact = rope_constants(TILE, h, theta)
  hi = [x.astype(np.float16) for x in exact]
  lo = [
    (x - y.astype(np.float64)).astype(np.float16) for x, y in zip(exact, hi)
  ]
  return jnp.asarray(np.stack(hi + lo))


def _cs_planes(f32: bool) -> int:
  """Planes of the RoPE table a kernel loads (`table[:planes]`): all four
  for a rotation in f32 (both terms summed), else the two high terms
  (`_cos_sin`)."""
  return 4 if f32 else 2


def _cs_bytes(h, rope, f32):
  return _cs_planes(f32) * TILE * (h // 2) * 2 if rope else 0  # f16 planes


BWD_QD_STAGES = 1  # raw (Q, dO) slots (warpgroup 1 frees a slot right
# after its relayouts, so the next head's load has a head's time)


# Shared-memory bytes of the kernels (16-bit inputs: bf16 or fp16).


def _fwd_smem(h, nwg, stages, rope, rope_f32):
  tile = TILE * h * 2
  return (
    4 * tile  # K, V raw and tiled
    + _cs_bytes(h, rope, rope_f32)
    + nwg * stages * tile  # query ring
    + nwg * tile  # output staging (swizzled or plain, aliased)
  )


def _bwd_smem(h, rope):
  tile = TILE * h * 2
  return (
    4 * tile  # K, V raw and tiled
    + _cs_bytes(h, rope, f32=False)  # the high terms only
    + 2 * BWD_QD_STAGES * tile  # Q, dO raw (a ring)
    + 2 * 2 * tile  # Q, dO tiled, two heads' worth
    # P and dS, aliased with dK's staging (swizzled or plain)
    + max(tile, 2 * TILE * TILE * 2)
    + tile  # dQ's and dV's staging (swizzled or plain)
  )


def fits(h: int, rope: bool) -> bool:
  """Whether both kernels fit shared memory at this head dim."""
  return (
    _fwd_smem(h, 2, 1, rope, rope_f32=True) <= mosaic.SMEM_LIMIT
    and _bwd_smem(h, rope) <= mosaic.SMEM_LIMIT
  )


# --------------------------------------------------------------------------
# Shared pieces.


def _zeros(shape):
  return plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), _L)


def _cos_sin(cs, dtype=jnp.float32):
  """cos and sin `[64, 64]` of a tile's RoPE rows, as `dtype`, from the
  table planes `cs` holds (`_cs_planes`): all four, each value's two f16
  terms summed in f32; or the high terms alone (`|error| < 2^-12`), with
  half the registers and shared memory. Rounded to a 16-bit input dtype
  (the default rotation) the high terms are within one unit of that
  dtype of the exact values."""
  if cs.shape[0] == _cs_planes(f32=False):
    return tuple(plgpu.load(cs.at[i], layout=_L).astype(dtype) for i in (0, 1))
  f32 = [plgpu.load(cs.at[i], layout=_L).astype(jnp.float32) for i in range(4)]
  return (f32[0] + f32[2]).astype(dtype), (f32[1] + f32[3]).astype(dtype)


def _load_parts(raw, rot=None):
  """The parts of a swizzled `[parts * 64, 64]` tile in registers, rotated
  by RoPE (`rot`: cos and sin of the tile's positions, f32 or the input
  dtype; the result in theirs) if given."""
  xs = [plgpu.load(part, layout=_L) for part in _all_parts(raw)]
  if rot is None:
    return xs
  cos, sin = rot
  x1, x2 = (x.astype(cos.dtype) for x in xs)  # the halves RoPE pairs
  return [x1 * cos - x2 * sin, x2 * cos + x1 * sin]


def _relayout(raw, dst, *, rot=None, keep_rows=None):
  """Swizzled row-major `[parts * 64, 64]` -> tiled `dst` (same shape),
  rotating the two halves by RoPE (`rot`, see `_load_parts`) and zeroing
  rows `>= keep_rows` (None: keep all)."""
  for p, x in enumerate(_load_parts(raw, rot)):
    if keep_rows is not None:
      x = mosaic.select(mosaic.iota(x.shape, 0) < keep_rows, x, 0)
    _part(dst, p)[...] = x.astype(dst.dtype)


def _parts(ref) -> int:
  return ref.shape[-2] // TILE


def _part(ref, p: int):
  """Part `p` (`[64, 64]`) of a `[parts * 64, 64]` buffer: a static row
  window (a static slice, which wgmma operands inside `run_state` take)."""
  return ref.at[pl.ds(p * TILE, TILE)]


def _all_parts(ref):
  return [_part(ref, p) for p in range(_parts(ref))]


def _cols(p, parts, h):
  """Column window of part `p` in a `[..., h]` HBM array."""
  return pl.ds(p * (h // parts), h // parts)


def _load_tile(src_ref, rows, head, dst, barrier):
  """TMA one `[64, h]` tile into the parts of `dst` (one arrival on
  `barrier` per part)."""
  parts, h = _parts(dst), src_ref.shape[-1]
  for p in range(parts):
    plgpu.copy_gmem_to_smem(
      src_ref.at[rows, head, _cols(p, parts, h)], _part(dst, p), barrier
    )


def _unrope(a, b, rot):
  """RoPE backward on the two f32 halves of a gradient: rotate by -angle."""
  cos, sin = rot
  return a * cos + b * sin, b * cos - a * sin


def _probs(x, valid, static):
  """Softmax of one tile of scores `x` (log2 units), zero-fill corrected.

  Returns normalized `P` (f32, rows that see no real key are 0).
  """
  block, causal = static.block, static.causal
  cond = None
  if block < TILE:
    cond = (mosaic.iota(x.shape, 0) >= block) == (
      mosaic.iota(x.shape, 1) >= block
    )
  if causal:
    c2 = mosaic.iota(x.shape, 1) <= mosaic.iota(x.shape, 0)
    cond = c2 if cond is None else cond & c2
  if cond is not None:
    x = mosaic.select(cond, x, -jnp.inf)
  m = x.max(axis=1)
  p = jnp.exp2(x - lax.broadcast_in_dim(m, x.shape, [0]))
  row_sum = p.sum(axis=1)
  if not causal:
    # Zero-filled keys of the row's block: each added 2^(0 - m) to the sum.
    rows = mosaic.row_iota(TILE)
    if block < TILE:
      first = rows < block
      seen = jnp.where(first, 0, block) + rows * 0
      in_block = jnp.clip(valid - seen, 0, block)
    else:
      in_block = jnp.minimum(valid, TILE) + rows * 0
    zf = (block - in_block).astype(jnp.float32)
    row_sum = row_sum - zf * jnp.exp2(-m)
  ok = row_sum > 0
  inv = mosaic.select(ok, 1.0 / mosaic.select(ok, row_sum, 1.0), 0.0)
  return p * lax.broadcast_in_dim(inv, p.shape, [0])


def _load_kv(j, rows, kv_head, refs, buffers):
  """The producer's K and V loads of tile `j` into the raw buffers, once
  the consumers released the previous tile's (both kernels)."""
  k_ref, v_ref = refs
  k_raw, v_raw, kv_bar, raw_free = buffers

  @pl.when(j > 0)
  def _():
    plgpu.barrier_wait(raw_free)

  _load_tile(k_ref, rows, kv_head, k_raw, kv_bar)
  _load_tile(v_ref, rows, kv_head, v_raw, kv_bar)


def _store_rows(src, dst_ref, row, head, count):
  """Rows `[0, count)` of plain `src` (`[parts * 64, 64]`) to packed rows
  `row...` of `head`."""
  parts, h = _parts(src), dst_ref.shape[-1]
  for p in range(parts):
    cols = _cols(p, parts, h)
    mosaic.ladder_store(
      _part(src, p),
      lambda r, size, cols=cols: dst_ref.at[pl.ds(row + r, size), head, cols],
      0,
      count,
      TILE,
    )


def _store_tile(xs, staging, dst_ref, row, head, count):
  """Register parts `xs` (dtype of the buffers) to packed rows
  `[row, row + count)` of `head`, after the previous store read the
  staging buffer (a pair of aliased views, swizzled and plain). A whole
  tile goes through the swizzled view (conflict-free stores, one TMA per
  part); a partial one through the plain view, whose rows the ladder of
  TMA stores can start anywhere (`mosaic.smem_swizzled`)."""
  swizzled, plain = staging
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  parts, h = len(xs), dst_ref.shape[-1]

  @pl.when(count == TILE)
  def _():
    for p, x in enumerate(xs):
      _part(swizzled, p)[...] = x
    plgpu.commit_smem()
    for p in range(parts):
      plgpu.copy_smem_to_gmem(
        _part(swizzled, p),
        dst_ref.at[pl.ds(row, TILE), head, _cols(p, parts, h)],
      )

  @pl.when(count < TILE)
  def _():
    for p, x in enumerate(xs):
      _part(plain, p)[...] = x
    plgpu.commit_smem()
    _store_rows(plain, dst_ref, row, head, count)


def _scores(qs, k_t, static):
  """`Q K^T` `[64, 64]` f32: one accumulator, a wgmma per column part.
  `qs`: Q's parts, in shared memory or in registers (wgmma's A operand)."""
  if static.interpret is not None and mosaic.in_registers(qs[0]):
    # See `mosaic.accumulate`.
    return sum(
      jnp.dot(q, _part(k_t, p)[...].T, preferred_element_type=jnp.float32)
      for p, q in enumerate(qs)
    )

  def scoped(acc_ref):
    for p, q in enumerate(qs):
      plgpu.wgmma(acc_ref, q, _part(k_t, p).transpose((1, 0)))
    return acc_ref[...]

  return pl.run_scoped(scoped, plgpu.ACC((TILE, TILE), jnp.float32))


def _pv(p, v_t, static):
  """`P V` as f32 column parts."""
  vs = _all_parts(v_t)
  if static.interpret is not None:  # see `mosaic.accumulate`
    return [jnp.dot(p, v[...], preferred_element_type=jnp.float32) for v in vs]

  def scoped(*accs):
    for acc, v in zip(accs, vs, strict=True):
      plgpu.wgmma(acc, p, v)
    return [acc[...] for acc in accs]

  acc = plgpu.ACC((TILE, v_t.shape[-1]), jnp.float32)
  return pl.run_scoped(scoped, *[acc] * len(vs))


def _scores_and_dp(q_t, k_t, do_t, v_t, mid, static):
  """`(mid(Q K^T), dO V^T)`, `[64, 64]` f32 each: both products' wgmmas
  issued back to back and `mid` (the softmax) run while the second is in
  flight. Interpret mode: one after the other."""
  if static.interpret is not None:
    return mid(_scores(_all_parts(q_t), k_t, static)), _scores(
      _all_parts(do_t), v_t, static
    )

  def scoped(acc1, acc2):
    for p, q in enumerate(_all_parts(q_t)):
      plgpu.wgmma(acc1, q, _part(k_t, p).transpose((1, 0)))
    for p, d in enumerate(_all_parts(do_t)):
      plgpu.wgmma(acc2, d, _part(v_t, p).transpose((1, 0)))
    # One committed group per wgmma: Q K^T is done once dO V^T's remain.
    x = mid(plgpu.wgmma_accumulator_load(acc1, wait_n=_parts(do_t)))
    return x, plgpu.wgmma_accumulator_load(acc2, wait_n=0)

  acc = plgpu.ACC((TILE, TILE), jnp.float32)
  return pl.run_scoped(scoped, acc, acc)


def _grads_vq(dv, p_s, ds_s, do_t, k_t, static):
  """`(dV + P^T dO, dS K)` as column parts, every wgmma in flight together
  (one wait)."""
  parts = len(dv)
  terms = [(a, p_s.transpose((1, 0)), _part(do_t, i)) for i, a in enumerate(dv)]
  terms += [(_zeros(dv[0].shape), ds_s, _part(k_t, i)) for i in range(parts)]
  out = mosaic.accumulate_many(terms, static.interpret)
  return tuple(out[:parts]), out[parts:]


def _grad_k(dk, ds_s, q_t, static):
  """`dK + dS^T Q` as column parts (one wait)."""
  terms = [(a, ds_s.transpose((1, 0)), _part(q_t, i)) for i, a in enumerate(dk)]
  return tuple(mosaic.accumulate_many(terms, static.interpret))


def _deal(items, num_real, kh, static):
  """(CTAs per KV head, `int32[w, j]` tile of each CTA's j-th turn,
  `int32[w]` turns per CTA): about one CTA per SM over the `kh` KV heads,
  the tiles (equal work) dealt zig-zag."""
  num_items = items.shape[0]
  workers = schedule.persistent_workers(
    kh, mosaic.num_sms(static.block_sizes.num_sms), num_items
  )
  dealt, counts = schedule.deal(num_items, num_real, workers, 1)
  return workers, dealt, counts


def _heads_of(wg, group, nwg):
  return [g for g in range(group) if g % nwg == wg]


def _launch(kernel, scratch, out_type, grid, nwg, static, args, name):
  """`plgpu.kernel` with `None` scratch entries dropped (and passed as
  None to the kernel body at their place); `name` as `mosaic.profiling`
  files its traces."""
  present = [s is not None for s in scratch]
  real = [s for s in scratch if s is not None]

  def body(*refs):
    n_in = len(args)
    n_out = len(out_type) if isinstance(out_type, list) else 1
    head = refs[: n_in + n_out]
    it = iter(refs[n_in + n_out :])
    full = [next(it) if p else None for p in present]
    return kernel(*head, *full)

  return mosaic.warp_specialized(
    body,
    out_type=out_type,
    scratch=real,
    grid=grid,
    consumers=nwg,
    interpret=static.interpret,
    name=name,
    family="block_attention",
  )(*args)
