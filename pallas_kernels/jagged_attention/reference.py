"""Plain-`jnp` jagged attention: the oracle and the `implementation="xla"` path.

Shapes (legend): `t` packed query tokens, `s` packed key/value tokens, `b`
sequences, `l` max query length, `m` max key length, `n` query heads, `k` KV
heads, `h` head dim.

Each sequence `i` owns query rows `q_offsets[i]:q_offsets[i+1]` and key/value
rows `kv_offsets[i]:kv_offsets[i+1]` of the packed buffers. Query row `p` (its
position inside its sequence) sees key row `j` of the same sequence, and with
`causal=True` only `j <= p`, with `window=w` only `|p - j| <= w` (a sliding
window: positions of the query and key sequences, counted from each one's
first row). Rows past `q_offsets[-1]` (buffer tail) and rows
that see no key (zero-length key sequence) get zeros and zero gradients.

The reference gathers each sequence into a padded `[b, l, ...]` layout (the
static `max_len_q` / `max_len_kv` bound it), runs masked softmax attention in
f32 and scatters back. It costs `b·l·m`, not `t·s`, so it stays usable on CPU.
A sequence longer than the bound is an error, checked on the host when the
offsets are concrete; under `jit` the caller promises the bound.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.jagged import from_padded, to_padded


def check_offsets(offsets, capacity: int, name: str, max_len: int | None):
  """Host-side validation of concrete offsets; a no-op while tracing."""
  if isinstance(offsets, jax.core.Tracer):
    return
  o = np.asarray(offsets)
  if o.ndim != 1 or o.shape[0] < 2:
    raise ValueError(f"{name} must be int[B+1] with B >= 1, got {o.shape}")
  if o[0] != 0:
    raise ValueError(f"{name}[0] must be 0, got {o[0]}")
  bad = np.nonzero(np.diff(o) < 0)[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(
      f"{name} must be non-decreasing: {name}[{i}]={o[i]} > "
      f"{name}[{i + 1}]={o[i + 1]}"
    )
  if o[-1] > capacity:
    raise ValueError(
      f"{name}[-1]={o[-1]} exceeds the packed buffer's {capacity} rows"
    )
  if max_len is not None and o.shape[0] > 1:
    longest = int(np.max(np.diff(o)))
    if longest > max_len:
      raise ValueError(
        f"a sequence in {name} has {longest} rows, more than the static "
        f"bound {max_len}"
      )


def check_window(window):
  """A sliding window is a static count of positions, `>= 0` (0: a row
  sees only its own position)."""
  if window is None:
    return
  if isinstance(window, bool) or not isinstance(window, int) or window < 0:
    raise ValueError(f"window must be an int >= 0 or None, got {window!r}")


def jagged_attention_reference(
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
):
  """Softmax attention over packed jagged sequences (see module docstring)."""
  check_window(window)
  t, n, h = q_tnh.shape
  s, kh, _ = k_skh.shape
  if n % kh:
    raise ValueError(f"query heads {n} must be a multiple of KV heads {kh}")
  if kv_offsets is None:
    kv_offsets = q_offsets
  max_len_q = t if max_len_q is None else max_len_q
  max_len_kv = s if max_len_kv is None else max_len_kv
  check_offsets(q_offsets, t, "q_offsets", max_len_q)
  check_offsets(kv_offsets, s, "kv_offsets", max_len_kv)
  scale = h**-0.5 if scale is None else scale
  q_offsets = jnp.asarray(q_offsets, jnp.int32)
  kv_offsets = jnp.asarray(kv_offsets, jnp.int32)

  q_blnh, q_valid = to_padded(q_tnh, q_offsets, max_len_q)
  k_bmkh, k_valid = to_padded(k_skh, kv_offsets, max_len_kv)
  v_bmkh, _ = to_padded(v_skh, kv_offsets, max_len_kv)
  b = q_blnh.shape[0]
  group = n // kh
  # [b, l, n, h] -> [b, l, k, g, h]: query head i uses KV head i // group.
  q_blkgh = q_blnh.reshape(b, max_len_q, kh, group, h)
  s_bkglm = (
    jnp.einsum(
      "blkgh,bmkh->bkglm",
      q_blkgh.astype(jnp.float32),
      k_bmkh.astype(jnp.float32),
    )
    * scale
  )
  mask_blm = q_valid[:, :, None] & k_valid[:, None, :]
  dist_lm = jnp.arange(max_len_q)[:, None] - jnp.arange(max_len_kv)  # p - j
  if causal:
    mask_blm &= dist_lm >= 0
  if window is not None:
    mask_blm &= jnp.abs(dist_lm) <= window
  mask = mask_blm[:, None, None]
  s_bkglm = jnp.where(mask, s_bkglm, -jnp.inf)
  m = jnp.max(s_bkglm, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # rows that see no key
  p = jnp.where(mask, jnp.exp(s_bkglm - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  o_blkgh = jnp.einsum("bkglm,bmkh->blkgh", p, v_bmkh.astype(jnp.float32))
  o_blnh = o_blkgh.reshape(b, max_len_q, n, h).astype(q_tnh.dtype)
  return from_padded(o_blnh, q_offsets, t)
