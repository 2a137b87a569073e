"""The two 2-D primitives under the FP8 ops, per implementation (G4).

`op.py` maps N-D tensors and `dot_general` dimension numbers onto matrices
and picks an implementation (`IMPLEMENTATIONS`); each provides, on the
matrix view of `reference.py` (`x_rc` quantized along `c`):

- `quantize_2d`: `x_rc` -> e4m3 values and block scales;
- `matmul`: the product of two quantized matrices, both contracted along
  their last axis;
- optionally `quantizing_matmul` (the product with a raw bf16 left operand
  quantized in the GEMM kernel), `quantize_t` (`x^T` quantized, from `x`
  raw or quantized) and `quantize_both` (`x` and `x^T` from one pass).

"xla" is the plain-`jnp` reference. "mosaic" calls the kernels
(`mosaic_gpu_quantize.py`, `mosaic_gpu_transpose_quantize.py`,
`mosaic_gpu_matmul.py`, `mosaic_gpu_quantizing_matmul.py`): it pads the
operands to their tiles, expands compact scales to the kernels' one per
row, picks their block sizes (split-K where the output has too few tiles
for the chip), batches them (`jax.custom_batching.custom_vmap`: folded
into rows where blocks allow, else `lax.map`), and falls back to the
reference for what no kernel covers.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic
from pallas_kernels.fp8 import format as fmt
from pallas_kernels.fp8 import (
  mosaic_gpu,
  mosaic_gpu_matmul,
  mosaic_gpu_quantize,
  mosaic_gpu_quantizing_matmul,
  mosaic_gpu_transpose_quantize,
)
from pallas_kernels.fp8 import reference as ref


def _quantize_2d_xla(x_rc, block, hadamard, hadamard_seed, seed_hash):
  return ref.quantize_reference(
    x_rc,
    block=block,
    hadamard=hadamard,
    hadamard_seed=hadamard_seed,
    seed_hash=seed_hash,
  )


def _bf16_source(x, scales, x_block):
  """`x` as bf16: itself if raw (`scales` None), else dequantized (bf16
  holds every e4m3 value times a power-of-two scale exactly, down to
  2^-133, and the quantize kernel reads bf16)."""
  if scales is None:
    return x
  return ref.dequantize_reference(x, scales, block=x_block, dtype=jnp.bfloat16)


def _quantize_t_of_source(quantize_2d, x, scales, x_block, block, seed_hash):
  """`x^T` quantized in `block`s by `quantize_2d`: `x` raw, or values with
  `scales` in `x_block`s (dequantized first)."""
  return quantize_2d(
    _bf16_source(x, scales, x_block).T, block, None, 0, seed_hash
  )


_quantize_t_xla = functools.partial(_quantize_t_of_source, _quantize_2d_xla)


def _matmul_xla(a, b, out_dtype):
  (a_v, a_s, a_block), (b_v, b_s, b_block) = a, b
  return ref.scaled_matmul_reference(
    a_v, a_s, a_block, b_v, b_s, b_block, out_dtype=out_dtype
  )


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _map_batch(fn, axis_size, in_batched, args):
  """`fn` over a batch one entry at a time (`lax.map`), the arguments
  without a batch axis broadcast to one: a kernel call's vmap rule where
  the batch cannot be folded into its rows."""
  args = tuple(
    a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
    for a, batched in zip(args, in_batched, strict=True)
  )
  return lax.map(lambda t: fn(*t), args)


@functools.cache
def _quantize_kernel_fn(block, hadamard, hadamard_seed, sr, r, c):
  """The kernel call on one `[r, c]` matrix, batched by folding into rows."""
  cp = _round_up(c, mosaic_gpu.TILE_C)
  br, bc = block

  def one(x_rc, seed_hash):
    rows = x_rc.shape[0]
    x = jnp.pad(
      x_rc.astype(jnp.bfloat16),
      ((0, _round_up(rows, mosaic_gpu.TILE_R) - rows), (0, cp - c)),
    )
    v, se = mosaic_gpu_quantize.quantize_mgpu(
      x,
      seed_hash,
      block=block,
      hadamard=hadamard,
      hadamard_seed=hadamard_seed,
      sr=sr,
      interpret=mosaic.resolve_interpret(),
      n_cols=c,
    )
    s = se[:, ::br].T  # [rows_p / br, cp / bc]
    return v[:rows, :c], s[: -(-rows // br), : -(-c // bc)]

  @jax.custom_batching.custom_vmap
  def f(x_rc, seed_hash):
    return one(x_rc, seed_hash)

  @f.def_vmap
  def _rule(axis_size, in_batched, x_vrc, seed_hash):
    x_batched, seed_batched = in_batched
    if r % br == 0 and not seed_batched:
      # Blocks never straddle two batch entries: fold the batch into rows.
      if not x_batched:
        x_vrc = jnp.broadcast_to(x_vrc, (axis_size, r, c))
      v, s = one(x_vrc.reshape(axis_size * r, c), seed_hash)
      return (
        v.reshape(axis_size, r, c),
        s.reshape(axis_size, r // br, -1),
      ), (True, True)
    out = _map_batch(one, axis_size, in_batched, (x_vrc, seed_hash))
    return out, (True, True)

  return f


def _quantize_2d_mosaic(x_rc, block, hadamard, hadamard_seed, seed_hash):
  r, c = x_rc.shape
  if (
    tuple(block) not in mosaic_gpu_quantize.SUPPORTED_BLOCKS
    or hadamard not in mosaic_gpu_quantize.SUPPORTED_HADAMARD
    or r == 0
    or c == 0
    # The kernel reads bf16; other inputs would be rounded to bf16 first and
    # so differ from the reference.
    or x_rc.dtype != jnp.bfloat16
  ):
    return _quantize_2d_xla(x_rc, block, hadamard, hadamard_seed, seed_hash)
  sr = seed_hash is not None
  seed = jnp.asarray(seed_hash if sr else 0, jnp.int32)
  f = _quantize_kernel_fn(tuple(block), hadamard, hadamard_seed, sr, r, c)
  return f(x_rc, seed)


@functools.cache
def _transpose_quantize_fn(r: int, c: int, rows_too: bool = False):
  """The transposing kernel on one `[r, c]` matrix (padded to tiles), bf16
  or e4m3 with its compact scales; batched with `lax.map`. Returns the
  values and compact scales of `x^T`, and with `rows_too` (bf16) those of
  `x` quantized along its rows too."""
  tile = mosaic_gpu.TILE_C
  rp, cp = _round_up(r, tile), _round_up(c, tile)

  def one(x, *scales):
    x = jnp.pad(x, ((0, rp - r), (0, cp - c)))
    # The scales one per (128-column block, row); padded rows are zeros,
    # which any scale (1) keeps zero.
    sx = [
      jnp.pad(_expand(s, 1, r), ((0, 0), (0, rp - r)), constant_values=1)
      for s in scales
    ]
    v, se, *rows = mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
      x, *sx, interpret=mosaic.resolve_interpret(), rows_too=rows_too
    )
    out = (v[:c, :r], se.T[:c, : -(-r // tile)])
    if rows_too:
      vr, ser = rows
      out += (vr[:r, :c], ser.T[:r, : -(-c // tile)])
    return out

  @jax.custom_batching.custom_vmap
  def f(*args):
    return one(*args)

  @f.def_vmap
  def _rule(axis_size, in_batched, *args):
    out = _map_batch(one, axis_size, in_batched, args)
    return out, (True,) * len(out)

  return f


def _quantize_t_mosaic(x, scales, x_block, block, seed_hash):
  """`_quantize_t_xla` by the transposing kernel where it applies (1 x 128
  blocks, round to nearest, bf16 `x` or e4m3 `x` in 1 x 128 blocks), else
  by the quantize kernel on the transposed bf16 source."""
  r, c = x.shape
  raw = scales is None
  if (
    tuple(block) == (1, 128)
    and seed_hash is None
    and 0 not in (r, c)
    and (
      (raw and x.dtype == jnp.bfloat16)
      or (not raw and x.dtype == fmt.E4M3 and tuple(x_block) == (1, 128))
    )
  ):
    f = _transpose_quantize_fn(r, c)
    return f(x) if raw else f(x, scales)
  return _quantize_t_of_source(
    _quantize_2d_mosaic, x, scales, x_block, block, seed_hash
  )


def _quantize_both_mosaic(x, block):
  """`x` quantized along its rows and, transposed, along its columns, from
  one read of `x` (the transposing kernel's `rows_too`): `(quantize_2d's
  values and scales, quantize_t's)`, where that applies (bf16 `x`, 1 x 128
  blocks, round to nearest); None elsewhere."""
  r, c = x.shape
  if tuple(block) != (1, 128) or x.dtype != jnp.bfloat16 or 0 in (r, c):
    return None
  v_t, s_t, v, s = _transpose_quantize_fn(r, c, rows_too=True)(x)
  return (v, s), (v_t, s_t)


def _expand(s_RC, br: int, rows: int):
  """Compact scales `[R, J]` to the kernel's `[J, rows]` (one per row)."""
  return jnp.repeat(s_RC.T, br, axis=1)[:, :rows]


@functools.cache
def _matmul_kernel_fn(kb, out_dtype, m, n, k, b_rows, quantize_a):
  """The kernel on one product; `quantize_a`: `a` raw bf16 (no `sa` arg),
  quantized in the kernel. Batched by folding into rows of `a`."""

  def uniform(bs) -> bool:
    """`b_scale_uniform` for a kernel in tiles `bs`: one column scale per
    warpgroup tile and k-block (128 x 128 weight blocks)."""
    return b_rows % bs.tile_n == 0

  if quantize_a:
    bs = mosaic_gpu_quantizing_matmul.QuantizingBlockSizes()
    cta_m, cta_n = bs.cta_rows(), 2 * bs.tile_n
    tile_k = kb
  else:
    # Per-row weight scales (FP8 weight gradients) have tiles of their own.
    bs = mosaic_gpu_matmul.default_block_sizes(
      kb, out_dtype, uniform(mosaic_gpu_matmul.BlockSizes())
    )
    cta_n, tile_k = bs.cluster_tile()[1], bs.tile_k
  kp = _round_up(k, tile_k)

  def one(a_mk, sa_Jm, b_nk, sb_Jn):
    rows = a_mk.shape[0]
    if quantize_a:
      mp = _round_up(rows, cta_m)
    else:
      # Any multiple of 8 rows, at least one tile
      # (`mosaic_gpu.row_start`).
      mp = max(_round_up(rows, 8), bs.cta_tile()[0])
    np_ = _round_up(n, cta_n)
    jp = kp // kb
    # Zero padding (quantized to zeros with scale 2^-126) adds nothing.
    a = jnp.pad(a_mk, ((0, mp - rows), (0, kp - k)))
    b = jnp.pad(b_nk, ((0, np_ - n), (0, kp - k)))
    sb = jnp.pad(sb_Jn, ((0, jp - sb_Jn.shape[0]), (0, 0)))
    # Padded columns repeat the last scale: a 128-column group's scale
    # stays uniform (`b_scale_uniform` reads it from the group's first 64
    # entries, which zeros past n would break for n % 128 < 64).
    sb = jnp.pad(sb, ((0, 0), (0, np_ - n)), mode="edge")
    kw = dict(
      out_dtype=out_dtype,
      block_sizes=bs,
      interpret=mosaic.resolve_interpret(),
      b_scale_uniform=uniform(bs),
    )
    if quantize_a:
      out = mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu(a, b, sb, **kw)
    else:
      sa = jnp.pad(sa_Jm, ((0, jp - sa_Jm.shape[0]), (0, mp - rows)))
      # Too few output tiles for the chip (weight gradients): split-K,
      # with f32 partial tiles (and the epilogue buffers for them), in
      # the tile that fills the chip better.
      split_bs, splits = mosaic_gpu_matmul.split_k_plan(
        mp, np_, kp, kb, uniform=uniform(bs)
      )
      if splits > 1:
        kw.update(block_sizes=split_bs, b_scale_uniform=uniform(split_bs))
      out = mosaic_gpu_matmul.scaled_matmul_mgpu(
        a, sa, b, sb, kb=kb, splits=splits, **kw
      )
    return out[:rows, :n]

  def split(args):
    """`f`'s arguments as (a, sa, b, sb); sa None when quantized here."""
    return (args[0], None, *args[1:]) if quantize_a else tuple(args)

  @jax.custom_batching.custom_vmap
  def f(*args):
    return one(*split(args))

  @f.def_vmap
  def _rule(axis_size, in_batched, *args):
    a, sa, b, sb = split(args)
    ab, sab, bb, sbb = split(in_batched)
    if ab and sab in (None, True) and not bb and not sbb:
      # Shared right operand: fold the batch into rows of the left one.
      if sa is not None:
        sa = jnp.moveaxis(sa, 0, 1).reshape(sa.shape[1], axis_size * m)
      out = one(a.reshape(axis_size * m, k), sa, b, sb)
      return out.reshape(axis_size, m, n), True
    one_of = lambda *t: one(*split(t))
    return _map_batch(one_of, axis_size, in_batched, args), True

  return f


def _matmul_mosaic(a, b, out_dtype):
  (a_v, a_s, a_block), (b_v, b_s, b_block) = a, b
  m, k = a_v.shape
  n = b_v.shape[0]
  kb = a_block[1]
  if kb != b_block[1] or kb not in (32, 64, 128) or 0 in (m, n, k):
    return _matmul_xla(a, b, out_dtype)
  f = _matmul_kernel_fn(kb, jnp.dtype(out_dtype), m, n, k, b_block[0], False)
  return f(a_v, _expand(a_s, a_block[0], m), b_v, _expand(b_s, b_block[0], n))


# Widest product whose forward quantizes `a` in its kernel. That kernel
# quantizes each `a` tile once per 256 output columns, the separate pass
# once in all: 9% faster than quantize + GEMM at 512 output columns,
# slower at 1024 and wider (docs/kernels/fp8.md).
QUANTIZE_IN_GEMM_MAX_N = 512


def _quantizing_matmul_mosaic(a_rc, a_block, b, out_dtype):
  """The product with raw `a` quantized in its kernel, where that is
  faster (bf16 `a` in 1 x 128 blocks, 128 x 128 weight blocks, `n <=
  QUANTIZE_IN_GEMM_MAX_N`) and fits
  (`mosaic_gpu_quantizing_matmul.quantizing_fits`); None elsewhere (the
  caller quantizes first)."""
  b_v, b_s, b_block = b
  (m, k), n = a_rc.shape, b_v.shape[0]
  if (
    a_block != (1, 128)
    or b_block != (128, 128)
    or a_rc.dtype != jnp.bfloat16
    or not mosaic_gpu_quantizing_matmul.quantizing_fits(out_dtype)
    or not 0 < n <= QUANTIZE_IN_GEMM_MAX_N
    or 0 in (m, k)
  ):
    return None
  f = _matmul_kernel_fn(128, jnp.dtype(out_dtype), m, n, k, 128, True)
  return f(a_rc, b_v, _expand(b_s, 128, n))


@dataclasses.dataclass(frozen=True)
class _Impl:
  quantize_2d: object
  matmul: object
  # `(a_rc, a_block, b, out_dtype)`: the product with a raw left operand
  # quantized in the kernel (round to nearest, no Hadamard), or None where
  # it does not apply. None: never.
  quantizing_matmul: object = None
  # `(x, scales, x_block, block, seed_hash)`: `x^T` quantized in `block`s
  # (no Hadamard), `x` raw (`scales` None) or quantized in `x_block`s.
  quantize_t: object = _quantize_t_xla
  # `(x, block)`: `(quantize_2d(x), quantize_t(x))` from one pass over a
  # raw `x` (round to nearest), or None where it does not apply. None:
  # never (the two separately).
  quantize_both: object = None


IMPLEMENTATIONS = {
  "xla": _Impl(_quantize_2d_xla, _matmul_xla),
  "mosaic": _Impl(
    _quantize_2d_mosaic,
    _matmul_mosaic,
    _quantizing_matmul_mosaic,
    _quantize_t_mosaic,
    _quantize_both_mosaic,
  ),
}
