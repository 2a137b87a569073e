"""Public block-attention op: `custom_vjp` over the Mosaic GPU kernels,
dispatch, and the sliding-window baseline (G3).

`block_attention(..., implementation=None)` runs the Mosaic GPU kernels
on a GPU for the shapes they cover (bf16/fp16, head dim 64 or 128) and the
plain-`jnp` reference elsewhere; `implementation="mosaic"` on CPU runs the
same kernels under Pallas's GPU interpret mode (slow; tests only).

- Blocks of 32 and 64: the block kernels (`mosaic_gpu.py`), one 64-row
  tile a block or two, RoPE fused for head dim 128 (applied by XLA before
  the kernel at head dim 64, at positions inside the block:
  `rope_in_blocks`).
- Blocks of 128: the jagged-attention kernel (G1) on the blocks as
  sequences of their own (`block_offsets`: every block of every sequence,
  over the same packed rows), with RoPE applied by XLA first
  (`rope_in_blocks`). That kernel
  is built for long sequences, and blocks cost it more than the block
  kernels pay per row: its tiles sit on an 8-row grid, so a block that
  starts off it spans three 64-row query tiles, each reading keys past
  the block; it runs the online softmax and writes the logsumexp; and
  every key tile of a block is its sequence's first or last, which the
  kernel reads from zero-filled side buffers gathered beforehand (about
  as many rows as K and V, with the 64-key steps of `jagged_block_sizes`).
  Counted on the benchmark's log-normal batch (35,108 tokens in 288
  blocks): 795 query tiles reading 144,448 key rows in 64-key steps
  (188,672 in 128-key steps), where blocks that all started on the grid
  would take 565 tiles and 71,616 rows. So it trails cuDNN on the batch
  cut into blocks in the forward (0.6-0.8x) and leads it in
  forward+backward (docs/kernels/block_attention.md has the runs).
  The block kernels' design for 128 rows (two query tiles sharing two
  key tiles, a 64 x 128 score tile per warpgroup, a 128-row RoPE table)
  is not built.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch, mosaic, schedule
from pallas_kernels.block_attention import mosaic_gpu as mg
from pallas_kernels.block_attention import mosaic_gpu_bwd as bwd
from pallas_kernels.block_attention import mosaic_gpu_fwd as fwd
from pallas_kernels.block_attention.reference import (
  BLOCKS,
  block_attention_reference,
  positions,
  prepare,
  rope_constants,
  rope_rotate,
  sliding_window_reference,
)
from pallas_kernels.jagged_attention.op import BlockSizes as JaggedBlockSizes
from pallas_kernels.jagged_attention.op import (
  jagged_attention,
  jagged_attention_mosaic,
)

BlockSizes = mg.BlockSizes


def _fwd(static, q, k, v, offsets, cs):
  items, num_real = mg.work_items(offsets, q.shape[0])
  o = fwd.forward(q, k, v, cs, items, num_real, static)
  return o, (q, k, v, offsets, cs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_attention(static, q, k, v, offsets, cs):
  return _fwd(static, q, k, v, offsets, cs)[0]


def _bwd(static, res, do):
  q, k, v, offsets, cs = res
  items, num_real = mg.work_items(offsets, q.shape[0])
  dq, dk, dv = bwd.backward(q, k, v, do, cs, items, num_real, static)
  return dq, dk, dv, None, None


_block_attention.defvjp(_fwd, _bwd)
_block_attention = mosaic.trace_once(_block_attention, static_argnums=0)


def supported(q_tnh, k_tkh, v_tkh, block: int) -> str | None:
  """Why the Mosaic kernels cannot take these inputs (None: they can)."""
  h = q_tnh.shape[-1]
  if block not in BLOCKS:
    return f"block {block} is not one of {BLOCKS}"
  if h not in (64, 128):
    return f"head dim {h} is not 64 or 128"
  dtype = q_tnh.dtype
  if dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {dtype} is not bf16/fp16"
  if k_tkh.dtype != dtype or v_tkh.dtype != dtype:
    return "q, k and v must share one dtype"
  return None


def jagged_block_sizes(h: int) -> JaggedBlockSizes:
  """The jagged kernel's settings for blocks of 128: its defaults, with
  64-key forward steps at head dim 128, which halve the side buffers and
  the keys a block's off-grid tiles fetch past it: 13% faster forward,
  5% forward+backward than 128-key steps; the forward's other settings
  (one-shot CTAs, no intra-warpgroup overlap) were slower or the same
  (docs/kernels/block_attention.md).
  Head dim 64 keeps the defaults (not measured; its dQ kernel's 128-key
  steps need 128-key forward steps)."""
  bs = JaggedBlockSizes.default(h)
  return dataclasses.replace(bs, block_kv=64) if h == 128 else bs


def rope_in_blocks(offsets, block: int, theta: float, *xs_tnh):
  """RoPE at each row's position inside its block (`p % block`), in XLA:
  every `[t, heads, h]` array of `xs_tnh` (Q and K) rotated with one
  gather of the table.

  A score depends on its two rows' positions only through their
  difference, and both rows of every block-attention score sit in one
  block, so this gives the outputs and gradients of RoPE at in-sequence
  positions (the reference's). The cos and sin of the `block` positions
  are a constant table (numpy, float64, rounded to f32), so no row
  evaluates trigonometry. Math as `rope_reference` (f32, results in the
  input dtype). It is 6% faster than RoPE at in-sequence positions, and
  what is left is mostly moving Q and K in and out
  (docs/kernels/block_attention.md).
  """
  t, _, h = xs_tnh[0].shape
  pos = positions(offsets, t) % block
  cos, sin = (
    jnp.asarray(c, jnp.float32)[pos][:, None, :]
    for c in rope_constants(block, h, theta)
  )
  return [rope_rotate(x, cos, sin) for x in xs_tnh]


def _prepare(q_tnh, k_tkh, v_tkh, offsets, block, rope, max_len):
  """`prepare`'s checks, and RoPE (if `rope`) at block positions."""
  q_tnh, k_tkh, offsets, max_len = prepare(
    q_tnh, k_tkh, v_tkh, offsets, None, max_len, "block attention"
  )
  if rope is not None:
    q_tnh, k_tkh = rope_in_blocks(offsets, block, rope, q_tnh, k_tkh)
  return q_tnh, k_tkh, offsets, max_len


def block_offsets(offsets, block: int, t: int, max_len: int):
  """Every `block`-position block of every sequence as a sequence of its
  own: cumulative offsets `int32[nb + 1]` over the same packed rows.

  Sequence `i` has `ceil(len_i / block)` blocks, the last one partial;
  empty sequences have none. `nb = min(b ceil(max_len / block), b +
  ceil(t / block))` is a static bound on the count (`sum ceil(len_i /
  block) < t / block + b`); the entries past the last block repeat
  `offsets[-1]` (empty sequences).
  """
  offsets = jnp.asarray(offsets, jnp.int32)
  b = offsets.shape[0] - 1
  nb = min(b * -(-max_len // block), b + -(-t // block))
  seq, tile, valid, _ = schedule.enumerate_tiles(offsets, block, 1, nb)
  start = jnp.where(valid, offsets[seq] + tile * block, offsets[-1])
  return jnp.concatenate([start, offsets[-1:]]).astype(jnp.int32)


def block_attention_mosaic(
  q_tnh,
  k_tkh,
  v_tkh,
  offsets,
  *,
  block: int = 64,
  rope: float | None = None,
  causal: bool = False,
  scale: float | None = None,
  max_len: int | None = None,
  block_sizes: BlockSizes | None = None,
  interpret=None,
):
  """Mosaic GPU block attention (Hopper); same contract as the reference.

  `max_len` (default the buffer capacity) is checked on concrete offsets.
  `interpret=None` compiles on a GPU and runs GPU interpret mode
  elsewhere; `False` always compiles.
  """
  t, _, h = q_tnh.shape
  why = supported(q_tnh, k_tkh, v_tkh, block)
  if why:
    raise ValueError(f"mosaic block attention: {why}")
  if block > mg.TILE:  # the block kernels' blocks fit in one tile
    if block_sizes is not None:
      raise ValueError(
        f"block attention over blocks of {block} runs the jagged-attention"
        " kernel; block_sizes are the block kernels' settings (blocks of 32"
        " and 64)"
      )
    q_tnh, k_tkh, offsets, max_len = _prepare(
      q_tnh, k_tkh, v_tkh, offsets, block, rope, max_len
    )
    blocks = block_offsets(offsets, block, t, max_len)
    return jagged_attention_mosaic(
      q_tnh,
      k_tkh,
      v_tkh,
      blocks,
      causal=causal,
      scale=scale,
      max_len_q=min(block, max_len),
      max_len_kv=min(block, max_len),
      block_sizes=jagged_block_sizes(h),
      interpret=interpret,
    )
  interpret = mosaic.resolve_interpret(interpret)
  # Head dim 64: the kernels rotate halves of 64 columns; rotate in XLA.
  fused_rope = rope is not None and h == 2 * mg.PART
  q_tnh, k_tkh, offsets, _ = _prepare(
    q_tnh, k_tkh, v_tkh, offsets, block, None if fused_rope else rope,
    max_len,
  )  # fmt: skip
  static = mg._Static(
    block=block,
    causal=causal,
    rope=fused_rope,
    scale=float(h**-0.5 if scale is None else scale),
    block_sizes=block_sizes or BlockSizes(),
    interpret=interpret,
  )
  cs = mg.rope_table(h, rope) if fused_rope else None
  return _block_attention(static, q_tnh, k_tkh, v_tkh, offsets, cs)


IMPLEMENTATIONS = {
  "xla": block_attention_reference,
  "mosaic": block_attention_mosaic,
}


def block_attention(
  q_tnh,
  k_tkh,
  v_tkh,
  offsets,
  *,
  block: int = 64,
  rope: float | None = None,
  causal: bool = False,
  scale: float | None = None,
  max_len: int | None = None,
  implementation: str | None = None,
):
  """Self-attention inside fixed blocks of each jagged sequence (G3).

  Args:
    q_tnh: queries `[t, n, h]`, packed over sequences.
    k_tkh, v_tkh: keys and values `[t, k, h]` (same rows), `n % k == 0`.
    offsets: `int32[b+1]` cumulative sequence lengths.
    block: positions per block: 32, 64 (the block kernels) or 128 (the
      jagged-attention kernel over the blocks; see the module docstring).
    rope: RoPE base `theta` applied to Q and K at their in-sequence
      positions inside the op (fused in the kernels), or None.
    causal: position `p` sees positions `<= p` of its block.
    scale: score scale, default `h ** -0.5`.
    max_len: static bound on one sequence's length.
    implementation: None (Mosaic GPU on a GPU when supported, else "xla"),
      "mosaic" or "xla".

  Returns `[t, n, h]`; rows past `offsets[-1]` are zero.
  """
  if block not in BLOCKS:
    raise ValueError(f"block={block}: one of {BLOCKS}")
  if implementation is None and supported(q_tnh, k_tkh, v_tkh, block):
    implementation = "xla"
  fn = dispatch.pick(
    "block_attention", IMPLEMENTATIONS, implementation, "mosaic"
  )
  return fn(
    q_tnh,
    k_tkh,
    v_tkh,
    offsets,
    block=block,
    rope=rope,
    causal=causal,
    scale=scale,
    max_len=max_len,
  )


def sliding_window_attention(
  q_tnh,
  k_tkh,
  v_tkh,
  offsets,
  *,
  window: int = 64,
  rope: float | None = None,
  causal: bool = False,
  scale: float | None = None,
  max_len: int | None = None,
  implementation: str | None = None,
):
  """Sliding-window self-attention (`|p - j| <= window`), the seed's
  intermediate step and block attention's baseline: RoPE (if `rope`) at
  in-sequence positions in XLA, then `jagged_attention` with its `window`
  (the Mosaic kernel on a GPU visits only the key tiles each query tile's
  windows reach). `implementation="xla"` is the banded XLA formulation,
  `sliding_window_reference`."""
  if implementation == "xla":
    return sliding_window_reference(
      q_tnh,
      k_tkh,
      v_tkh,
      offsets,
      window=window,
      rope=rope,
      causal=causal,
      scale=scale,
      max_len=max_len,
    )
  q_tnh, k_tkh, offsets, max_len = prepare(
    q_tnh, k_tkh, v_tkh, offsets, rope, max_len, "sliding_window"
  )
  return jagged_attention(
    q_tnh,
    k_tkh,
    v_tkh,
    offsets,
    causal=causal,
    window=window,
    scale=scale,
    max_len_q=max_len,
    max_len_kv=max_len,
    implementation=implementation,
  )
