"""Public jagged-attention op: `custom_vjp` over Mosaic GPU kernels, dispatch.

`jagged_attention(..., implementation=None)` runs the Mosaic GPU kernels
(`mosaic_gpu.py`) on a GPU and the plain-`jnp` reference elsewhere;
`implementation="mosaic"` on CPU runs the same kernels under Pallas's GPU
interpret mode (slow; tests only). See `mosaic_gpu.py` for the technique.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch, mosaic, schedule
from pallas_kernels.jagged_attention import mosaic_gpu as mg
from pallas_kernels.jagged_attention import mosaic_gpu_bwd_dkv as bwd_dkv
from pallas_kernels.jagged_attention import mosaic_gpu_bwd_dq as bwd_dq
from pallas_kernels.jagged_attention import mosaic_gpu_fwd as fwd
from pallas_kernels.jagged_attention.reference import (
  check_offsets,
  check_window,
  jagged_attention_reference,
)

BlockSizes = mg.BlockSizes


def _fwd(static, q, k, v, q_off, kv_off):
  bs = static.block_sizes
  res_qkv = (q, k, v)
  t = q.shape[0]
  q, k, v = mosaic.pad_rows(q), mosaic.pad_rows(k), mosaic.pad_rows(v)
  items, sched = schedule.query_items(
    q_off,
    kv_off,
    q.shape[0],
    block_q=bs.block_q,
    block_kv=bs.block_kv,
    causal=static.causal,
    window=static.window,
  )
  k_side = schedule.side_tiles(k, kv_off, bs.block_kv)
  v_side = schedule.side_tiles(v, kv_off, bs.block_kv)
  o, lse = fwd.forward(q, k, v, k_side, v_side, items, static)
  # The dQ kernel's too (any block_kv_dq), or the fused backward's (which
  # reads no V side tiles: none kept alive for it).
  fwd_tables = (items, k_side, None if bs.fused_bwd else v_side)
  res = (*res_qkv, o, lse, q_off, kv_off, sched.tile_start_b, fwd_tables)
  return o[:t], res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, q_off, kv_off):
  return _fwd(static, q, k, v, q_off, kv_off)[0]


def _bwd(static, res, do):
  q, k, v, o, lse, q_off, kv_off, tile_start_b, fwd_tables = res
  bs = static.block_sizes
  t_in, s_in = q.shape[0], k.shape[0]
  q, k, v, do = (
    mosaic.pad_rows(q),
    mosaic.pad_rows(k),
    mosaic.pad_rows(v),
    mosaic.pad_rows(do),
  )
  s = k.shape[0]
  items_kv = schedule.key_items(
    q_off,
    kv_off,
    s,
    tile_start_b,
    block_q=bs.block_q,
    block_kv=2 * bs.block_kv_dkv,
    causal=static.causal,
    window=static.window,
  )
  if bs.fused_bwd:
    # The delta kernel, then dQ, dK, dV in one kernel (dQ by TMA
    # reduce-add; `backward_dkv_dq` says in what dtype).
    items, k_side, _ = fwd_tables
    delta = bwd_dkv.backward_delta(o, do, items, static)
    dq, dk, dv = bwd_dkv.backward_dkv_dq(
      q, k, v, do, lse, delta, items_kv, static, k_side
    )
    return dq[:t_in], dk[:s_in], dv[:s_in], None, None
  items_q, k_side, v_side = fwd_tables
  dq, delta = bwd_dq.backward_dq(
    q, k, v, k_side, v_side, o, do, lse, items_q, static
  )
  dk, dv = bwd_dkv.backward_dkv(q, k, v, do, lse, delta, items_kv, static)
  return dq[:t_in], dk[:s_in], dv[:s_in], None, None


_attention.defvjp(_fwd, _bwd)
_attention = mosaic.trace_once(_attention, static_argnums=0)


def jagged_attention_mosaic(
  q_tnh,
  k_skh,
  v_skh,
  q_offsets,
  kv_offsets=None,
  *,
  causal: bool = False,
  window: int | None = None,
  scale: float | None = None,
  max_len_q: int | None = None,
  max_len_kv: int | None = None,
  block_sizes: BlockSizes | None = None,
  interpret=None,
):
  """Mosaic GPU jagged attention (Hopper); same contract as the reference.

  `max_len_q` / `max_len_kv` are checked on concrete offsets (the work list is
  bounded by the buffer capacity); without `causal`, a `max_len_q` below one
  query tile folds a KV group's heads into rows (`schedule.fold_factor`).
  `window`: each query tile visits only the key tiles its rows' windows reach,
  all with the window's mask. `interpret=None` compiles on a GPU and runs GPU
  interpret mode elsewhere; `False` always compiles.
  """
  t, n, h = q_tnh.shape
  s, kh, _ = k_skh.shape
  if n % kh:
    raise ValueError(f"query heads {n} must be a multiple of KV heads {kh}")
  if h not in (64, 128):
    # Wider heads do not fit: 298,072 B of shared memory at 192 (lowered
    # for CUDA), over the 232,448 B limit.
    raise ValueError(
      f"mosaic jagged attention takes head dim 64 or 128, got {h}; "
      "implementation='xla' takes any"
    )
  dtype = q_tnh.dtype
  if dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"mosaic jagged attention takes bf16/fp16, got {dtype}")
  if k_skh.dtype != dtype or v_skh.dtype != dtype:
    raise ValueError("q, k and v must share one dtype")
  if kv_offsets is None:
    kv_offsets = q_offsets
  check_offsets(q_offsets, t, "q_offsets", max_len_q)
  check_offsets(kv_offsets, s, "kv_offsets", max_len_kv)
  check_window(window)
  interpret = mosaic.resolve_interpret(interpret)
  bs = block_sizes or BlockSizes.default(h)
  static = mg._Static(
    causal=causal,
    scale=float(h**-0.5 if scale is None else scale),
    block_sizes=bs,
    interpret=interpret,
    window=window,
  )
  q_off = jnp.asarray(q_offsets, jnp.int32)
  kv_off = jnp.asarray(kv_offsets, jnp.int32)
  return schedule.with_folded_heads(
    lambda q, q_off: _attention(static, q, k_skh, v_skh, q_off, kv_off),
    q_tnh,
    q_off,
    kh,
    max_len_q=max_len_q,
    block_q=bs.block_q,
    # Rows are independent without the causal mask or the window (which
    # read positions).
    enabled=bs.fold_heads and not causal and window is None,
  )


def mosaic_supports(q_tnh, k_skh) -> bool:
  """Shapes/dtypes the Mosaic kernels are built and tuned for."""
  return (
    q_tnh.dtype in (jnp.bfloat16, jnp.float16)
    and k_skh.dtype == q_tnh.dtype
    and q_tnh.shape[-1] in (64, 128)
    and q_tnh.shape[1] % k_skh.shape[1] == 0
  )


IMPLEMENTATIONS = {
  "xla": jagged_attention_reference,
  "mosaic": jagged_attention_mosaic,
}


def jagged_attention(
  q_tnh,
  k_skh,
  v_skh,
  q_offsets,
  kv_offsets=None,
  *,
  causal: bool = False,
  window: int | None = None,
  scale: float | None = None,
  max_len_q: int | None = None,
  max_len_kv: int | None = None,
  implementation: str | None = None,
):
  """Softmax attention over packed jagged sequences.

  Args:
    q_tnh: queries `[t, n, h]`, packed over sequences.
    k_skh, v_skh: keys and values `[s, k, h]`, `n % k == 0` (GQA).
    q_offsets: `int32[b+1]` cumulative query lengths.
    kv_offsets: `int32[b+1]` cumulative key lengths; `None` = self-attention.
    causal: query position `p` sees key positions `<= p` of its sequence.
    window: sliding window: position `p` sees key positions `j` with
      `|p - j| <= window` (and `j <= p` if causal); None = all.
    scale: score scale, default `h ** -0.5`.
    max_len_q, max_len_kv: static upper bounds on one sequence's length.
    implementation: `None` (Mosaic GPU on a GPU for bf16/fp16 and head dim
      64 or 128, else "xla"), "mosaic" or "xla" (the plain-`jnp` reference).

  Returns `[t, n, h]`; rows past `q_offsets[-1]` and rows with no visible key
  are zero.
  """
  gpu_default = "mosaic"
  if implementation is None and not mosaic_supports(q_tnh, k_skh):
    gpu_default = "xla"  # e.g. f32 activations or an unusual head dim
  fn = dispatch.pick(
    "jagged_attention", IMPLEMENTATIONS, implementation, gpu_default
  )
  return functools.partial(
    fn,
    causal=causal,
    window=window,
    scale=scale,
    max_len_q=max_len_q,
    max_len_kv=max_len_kv,
  )(q_tnh, k_skh, v_skh, q_offsets, kv_offsets)
