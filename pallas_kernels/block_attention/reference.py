"""Plain-`jnp` block attention and sliding-window attention (oracle, baseline).

Shapes (legend): `t` packed tokens, `b` sequences, `l` max length, `n`
query heads, `k` KV heads (`n % k == 0`, GQA), `h` head dim, `c` blocks of
a sequence, `z` block size.

Block attention (G3) is self-attention restricted to fixed blocks of `z`
positions (64 by default) of each jagged sequence: the query at position
`p` sees exactly the keys at positions `j` with `p // z == j // z` (and, if
`causal`, `j <= p`). Blocks start at each sequence's first token and never
cross a sequence boundary; a sequence's last block is partial when its
length is not a multiple of `z`. The cost is `t * z`, not `sum len^2`.

RoPE (`rope=theta`): Q and K are rotated by their position inside the
sequence before the scores, by `rope_reference`, the RoPE the model's
other attention layers apply too (pairs split in halves, angles `p *
theta^(-2i/h)` in f32, result cast back to the input dtype).

Sliding-window attention (the seed's intermediate step, our baseline): the
query at `p` sees the keys with `|p - j| <= window` of its sequence (and
`j <= p` if causal). The reference computes it blockwise: queries in blocks
of `window` rows against the previous, own and next key blocks, with the
band mask, so it costs `3 t window` scores, not `t l`.
"""

import jax.numpy as jnp
import numpy as np

from pallas_kernels.jagged import from_padded, to_padded
from pallas_kernels.jagged_attention.reference import (
  check_offsets,
  check_window,
)

BLOCKS = (32, 64, 128)


def positions(offsets, capacity: int):
  """Position of every packed row inside its sequence (0 past the data)."""
  offsets = jnp.asarray(offsets, jnp.int32)
  rows = jnp.arange(capacity)
  seg = jnp.searchsorted(offsets, rows, side="right") - 1
  seg = jnp.clip(seg, 0, offsets.shape[0] - 2)
  return jnp.where(rows < offsets[-1], rows - offsets[seg], 0)


def rope_angles(pos, h: int, theta: float):
  """`f32[..., h/2]` rotation angles of positions `pos`."""
  freq = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
  return pos.astype(jnp.float32)[..., None] * freq


def rope_constants(n: int, h: int, theta: float):
  """cos and sin `float64[n, h/2]` of positions `0..n)` (numpy): constant
  tables, built at trace time, of the ops that rotate at positions
  inside a tile or a block."""
  freq = float(theta) ** (-np.arange(0, h // 2, dtype=np.float64) * 2 / h)
  ang = np.arange(n, dtype=np.float64)[:, None] * freq
  return np.cos(ang), np.sin(ang)


def rope_rotate(x_tnh, cos, sin):
  """The halves of `x` rotated by `cos`, `sin` (`[t, 1, h/2]`), in f32;
  the result in the input dtype."""
  x1, x2 = jnp.split(x_tnh.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return out.astype(x_tnh.dtype)


def rope_reference(x_tnh, pos_t, theta: float):
  """RoPE on the last axis, pairs split in halves (f32 math, input dtype)."""
  h = x_tnh.shape[-1]
  ang = rope_angles(pos_t, h, theta)[:, None, :]
  return rope_rotate(x_tnh, jnp.cos(ang), jnp.sin(ang))


def prepare(q_tnh, k_tkh, v_tkh, offsets, rope, max_len, name):
  """The checks of a self-attention op over `offsets` (GQA heads, the
  same rows in Q, K and V, `max_len` on concrete offsets) and RoPE (if
  `rope`) at in-sequence positions: (q, k, int32 offsets, max_len)."""
  t, n, h = q_tnh.shape
  _, kh, _ = k_tkh.shape
  if n % kh:
    raise ValueError(f"query heads {n} must be a multiple of KV heads {kh}")
  if k_tkh.shape[0] != t or v_tkh.shape[0] != t:
    raise ValueError(f"{name} is self-attention: q, k, v need the same rows")
  max_len = t if max_len is None else max_len
  check_offsets(offsets, t, "offsets", max_len)
  offsets = jnp.asarray(offsets, jnp.int32)
  if rope is not None:
    pos = positions(offsets, t)
    q_tnh = rope_reference(q_tnh, pos, rope)
    k_tkh = rope_reference(k_tkh, pos, rope)
  return q_tnh, k_tkh, offsets, max_len


def _masked_softmax(s, mask):
  """Softmax over the last axis where `mask` (rows without keys -> 0)."""
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom == 0, 1.0, denom)


def block_attention_reference(
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
):
  """Softmax attention inside fixed `block`-position blocks (docstring)."""
  if block not in BLOCKS:
    raise ValueError(f"block={block}: one of {BLOCKS}")
  q_tnh, k_tkh, offsets, max_len = prepare(
    q_tnh, k_tkh, v_tkh, offsets, rope, max_len, "block_attention"
  )
  t, n, h = q_tnh.shape
  kh = k_tkh.shape[1]
  scale = h**-0.5 if scale is None else scale
  lp = -(-max_len // block) * block  # padded length, whole blocks
  q_bl, valid_bl = to_padded(q_tnh, offsets, lp)
  k_bl, _ = to_padded(k_tkh, offsets, lp)
  v_bl, _ = to_padded(v_tkh, offsets, lp)
  b = q_bl.shape[0]
  c, g = lp // block, n // kh
  # [b, l, n, h] -> [b, c, z, k, g, h]: blocks, and query heads by KV head.
  q_b = q_bl.reshape(b, c, block, kh, g, h).astype(jnp.float32)
  k_b = k_bl.reshape(b, c, block, kh, h).astype(jnp.float32)
  v_b = v_bl.reshape(b, c, block, kh, h).astype(jnp.float32)
  s = scale * jnp.einsum("bcqkgh,bcjkh->bckgqj", q_b, k_b)
  key_ok = valid_bl.reshape(b, c, 1, 1, 1, block)
  mask = key_ok
  if causal:
    mask = mask & (jnp.arange(block)[:, None] >= jnp.arange(block))
  p = _masked_softmax(s, mask)
  o = jnp.einsum("bckgqj,bcjkh->bcqkgh", p, v_b)
  o_bl = o.reshape(b, lp, n, h).astype(v_tkh.dtype)
  return from_padded(o_bl, offsets, t)


def sliding_window_reference(
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
):
  """Softmax attention to the keys within `window` positions (docstring)."""
  check_window(window)
  q_tnh, k_tkh, offsets, max_len = prepare(
    q_tnh, k_tkh, v_tkh, offsets, rope, max_len, "sliding_window"
  )
  t, n, h = q_tnh.shape
  kh = k_tkh.shape[1]
  scale = h**-0.5 if scale is None else scale
  w = max(window, 1)  # blocks of w rows; each sees its neighbours
  lp = -(-max_len // w) * w
  q_bl, valid_bl = to_padded(q_tnh, offsets, lp)
  k_bl, _ = to_padded(k_tkh, offsets, lp)
  v_bl, _ = to_padded(v_tkh, offsets, lp)
  b = q_bl.shape[0]
  c, g = lp // w, n // kh

  def neighbours(x_bl):
    """`[b, l, ...]` -> `[b, c, 3w, ...]`: key blocks c-1, c, c+1."""
    x = x_bl.reshape(b, c, w, *x_bl.shape[2:])
    pad = [(0, 0), (1, 1)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad)
    return jnp.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)

  q_b = q_bl.reshape(b, c, w, kh, g, h).astype(jnp.float32)
  k_n = neighbours(k_bl).astype(jnp.float32)  # [b, c, 3w, k, h]
  v_n = neighbours(v_bl).astype(jnp.float32)
  ok_n = neighbours(valid_bl)  # [b, c, 3w]
  s = scale * jnp.einsum("bcqkgh,bcjkh->bckgqj", q_b, k_n)
  dist = (jnp.arange(3 * w) - w)[None, :] - jnp.arange(w)[:, None]  # j - p
  band = jnp.abs(dist) <= window
  if causal:
    band = band & (dist <= 0)
  mask = ok_n[:, :, None, None, None, :] & band
  p = _masked_softmax(s, mask)
  o = jnp.einsum("bckgqj,bcjkh->bcqkgh", p, v_n)
  o_bl = o.reshape(b, lp, n, h).astype(v_tkh.dtype)
  return from_padded(o_bl, offsets, t)
