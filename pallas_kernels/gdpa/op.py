"""Public GDPA op: `custom_vjp` over the Mosaic GPU kernels, and dispatch.

`gdpa(..., implementation=None)` runs the Mosaic GPU kernels
(`mosaic_gpu.py`) on a GPU for the shapes they cover (bf16/fp16, head dim
64 or 128) and the plain-`jnp` reference elsewhere; `implementation=
"mosaic"` on CPU runs the same kernels under Pallas's GPU interpret mode
(slow; tests only). See `mosaic_gpu.py` for the technique (G2).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch, mosaic, schedule
from pallas_kernels.gdpa import mosaic_gpu as mg
from pallas_kernels.gdpa import mosaic_gpu_bwd_dkv as bwd_dkv
from pallas_kernels.gdpa import mosaic_gpu_bwd_dq as bwd_dq
from pallas_kernels.gdpa import mosaic_gpu_fwd as fwd
from pallas_kernels.gdpa.reference import check_settings, gdpa_reference
from pallas_kernels.jagged_attention.reference import check_offsets

BlockSizes = mg.BlockSizes
TANH_MODES = ("poly", "poly_unchecked", "exact")


def _query_side(static, q, k, v, do, q_off, kv_off):
  """Forward (`do is None`) or dQ on row-padded buffers."""
  bs = static.block_sizes
  bkv = bs.block_kv or mg.kv_block(
    static.max_len_kv, dq=do is not None, kv_stages=bs.kv_stages
  )
  if do is not None:
    bkv = max(bkv, 64)  # see `fwd.query_kernel`
  if bkv != bs.block_kv:
    bs = dataclasses.replace(bs, block_kv=bkv)
    static = dataclasses.replace(static, block_sizes=bs)
  items, sched = schedule.query_items(
    q_off,
    kv_off,
    q.shape[0],
    block_q=bs.block_q,
    block_kv=bs.block_kv,
    causal=False,
  )
  k_side = schedule.side_tiles(k, kv_off, bs.block_kv)
  v_side = schedule.side_tiles(v, kv_off, bs.block_kv)
  return fwd.query_kernel(
    q, k, v, k_side, v_side, do, items, sched.num_items, static
  )


def _fwd(static, q, k, v, q_off, kv_off):
  t = q.shape[0]
  o = _query_side(
    static,
    mosaic.pad_rows(q),
    mosaic.pad_rows(k),
    mosaic.pad_rows(v),
    None,
    q_off,
    kv_off,
  )
  return o[:t], (q, k, v, q_off, kv_off)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa(static, q, k, v, q_off, kv_off):
  return _fwd(static, q, k, v, q_off, kv_off)[0]


def _bwd(static, res, do):
  q, k, v, q_off, kv_off = res
  t, s = q.shape[0], k.shape[0]
  q, k, v, do = (
    mosaic.pad_rows(q),
    mosaic.pad_rows(k),
    mosaic.pad_rows(v),
    mosaic.pad_rows(do),
  )
  bs = static.block_sizes
  path = mg.dq_path(bs, static.max_len_kv)
  if path == "fused":
    q_start = None
  elif path == "ds":
    q_items, q_sched = schedule.query_items(
      q_off,
      kv_off,
      q.shape[0],
      block_q=bs.block_q,
      block_kv=mg.DS_ROWS,
      causal=False,
    )
    q_start = q_sched.tile_start_b
  else:
    dq = _query_side(static, q, k, v, do, q_off, kv_off)
    q_start = None
  parts = mg.dkv_parts(bs, q_off.shape[0] - 1, k.shape[0], k.shape[1])
  items = bwd_dkv.key_items(
    q_off,
    kv_off,
    k.shape[0],
    block_q=bs.block_q,
    block_kv=mg.DKV_ROWS,
    parts=parts,
    q_tile_start=q_start,
  )
  q_side = schedule.side_tiles(q, q_off, bs.block_q)
  do_side = schedule.side_tiles(do, q_off, bs.block_q)
  if path == "fused":
    dq, dk, dv = bwd_dkv.backward_dkv_dq(
      q, k, v, do, q_side, do_side, items, static, parts
    )
  elif path == "ds":
    ds_tiles = (mg.ds_key_tiles(static.max_len_kv), q_items.shape[0])
    dk, dv, ds = bwd_dkv.backward_dkv(
      q, k, v, do, q_side, do_side, items, static, parts, ds_tiles
    )
    k_side = schedule.side_tiles(k, kv_off, mg.DS_ROWS)
    dq = bwd_dq.dq_from_ds(
      k, k_side, ds, q_items, q_sched.num_items, static, q.shape[0]
    )
  else:
    dk, dv = bwd_dkv.backward_dkv(
      q, k, v, do, q_side, do_side, items, static, parts
    )
  return dq[:t], dk[:s], dv[:s], None, None


_gdpa.defvjp(_fwd, _bwd)
_gdpa = mosaic.trace_once(_gdpa, static_argnums=0)


def supported(q_tnh, k_skh, v_skh) -> str | None:
  """Why the Mosaic kernels cannot take these inputs (None: they can)."""
  t, n, h = q_tnh.shape
  if h not in (64, 128):
    return f"head dim {h} is not 64 or 128"
  dtype = q_tnh.dtype
  if dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {dtype} is not bf16/fp16"
  if k_skh.dtype != dtype or v_skh.dtype != dtype:
    return "q, k and v must share one dtype"
  return None


def gdpa_mosaic(
  q_tnh,
  k_skh,
  v_skh,
  q_offsets,
  kv_offsets,
  *,
  activation: str = "gelu",
  normalize: str | None = None,
  scale: float | None = None,
  tanh: str = "exact",
  max_len_q: int | None = None,
  max_len_kv: int | None = None,
  block_sizes: BlockSizes | None = None,
  interpret=None,
):
  """Mosaic GPU GDPA (Hopper); same contract as the reference.

  `tanh`: `"exact"` (default), `"poly"` (polynomial on its valid range,
  exact tanh outside) or `"poly_unchecked"` (polynomial only: the caller
  guarantees the range); only `activation="gelu_tanh"` uses it.
  `max_len_kv` also picks the key tiles when `block_sizes.block_kv` is
  None (`mosaic_gpu.kv_block`); `max_len_q` below 64 folds heads into rows
  (`schedule.fold_factor`). `interpret=None`
  compiles on a GPU and runs GPU interpret mode elsewhere; `False` always
  compiles (cross-lowering checks).
  """
  check_settings(activation, normalize)
  if tanh not in TANH_MODES:
    raise ValueError(f"tanh {tanh!r}: one of {TANH_MODES}")
  t, n, h = q_tnh.shape
  s, kh, _ = k_skh.shape
  if n % kh:
    raise ValueError(f"query heads {n} must be a multiple of KV heads {kh}")
  why = supported(q_tnh, k_skh, v_skh)
  if why:
    raise ValueError(f"mosaic gdpa: {why}")
  check_offsets(q_offsets, t, "q_offsets", max_len_q)
  check_offsets(kv_offsets, s, "kv_offsets", max_len_kv)
  interpret = mosaic.resolve_interpret(interpret)
  bs = block_sizes or BlockSizes()
  static = mg._Static(
    activation=activation,
    normalize=normalize,
    tanh=tanh,
    scale=float(h**-0.5 if scale is None else scale),
    block_sizes=bs,
    interpret=interpret,
    max_len_kv=max_len_kv,
  )
  q_off = jnp.asarray(q_offsets, jnp.int32)
  kv_off = jnp.asarray(kv_offsets, jnp.int32)
  return schedule.with_folded_heads(
    lambda q, q_off: _gdpa(static, q, k_skh, v_skh, q_off, kv_off),
    q_tnh,
    q_off,
    kh,
    max_len_q=max_len_q,
    block_q=bs.block_q,
    enabled=bs.fold_heads,
  )


def _reference(q, k, v, q_off, kv_off, *, tanh="exact", **kw):
  del tanh  # the reference is exact
  return gdpa_reference(q, k, v, q_off, kv_off, **kw)


IMPLEMENTATIONS = {"xla": _reference, "mosaic": gdpa_mosaic}


def gdpa(
  q_tnh,
  k_skh,
  v_skh,
  q_offsets,
  kv_offsets,
  *,
  activation: str = "gelu",
  normalize: str | None = None,
  scale: float | None = None,
  tanh: str = "exact",
  max_len_q: int | None = None,
  max_len_kv: int | None = None,
  implementation: str | None = None,
):
  """Generalized dot-product attention over packed jagged sequences (G2).

  `out = act(scale * Q K^T) V` per sequence, no softmax.

  Args:
    q_tnh: queries `[t, n, h]`, packed over sequences.
    k_skh, v_skh: keys and values `[s, k, h]`, `n % k == 0` (GQA).
    q_offsets, kv_offsets: `int32[b+1]` cumulative query / key lengths
      (separate: cross and pooled attention have different sides).
    activation: "gelu" (erf), "gelu_tanh" or "silu".
    normalize: None, or "hstu" (divide by the sequence's number of keys).
    scale: score scale, default `h ** -0.5`.
    tanh: "exact" (the special function unit's tanh: fastest on the
      H200, see `mosaic_gpu`), "poly" (degree-6 polynomial where accurate,
      exact tanh outside) or "poly_unchecked" (polynomial only; the caller
      bounds the scores); kernels only (the reference is exact).
    max_len_q, max_len_kv: static bounds on one sequence's length (the
      reference pads to them). The kernels check them on concrete offsets
      and tune by them: a short `max_len_q` folds a KV group's query
      heads into rows (`schedule.fold_factor`), `max_len_kv` picks the key
      tile and the dQ path.
    implementation: None (Mosaic GPU on a GPU when the shape is supported,
      else "xla"), "mosaic" or "xla".

  Returns `[t, n, h]`; rows past `q_offsets[-1]` and rows of sequences
  without keys are zero.
  """
  if implementation is None and supported(q_tnh, k_skh, v_skh):
    implementation = "xla"
  fn = dispatch.pick("gdpa", IMPLEMENTATIONS, implementation, "mosaic")
  return fn(
    q_tnh,
    k_skh,
    v_skh,
    q_offsets,
    kv_offsets,
    activation=activation,
    normalize=normalize,
    scale=scale,
    tanh=tanh,
    max_len_q=max_len_q,
    max_len_kv=max_len_kv,
  )
