"""The packed (jagged) layout the kernels share, and its padded view.

Sequences lie back to back in one `[t, ...]` buffer: sequence `i` owns rows
`offsets[i]:offsets[i+1]` (`offsets [b+1]`), and rows past `offsets[-1]`
are the buffer's unused tail. The references gather a batch into a padded
`[b, l, ...]` layout, compute there and scatter back; so does code that
hands the batch to a padded op (`jax.nn.dot_product_attention`). Both
directions are `jnp` gathers that run under `jit` (`max_len` and
`num_rows` static).
"""

import jax.numpy as jnp


def to_padded(x_t, offsets_b, max_len: int):
  """Packed `[t, ...]` -> (`[b, l, ...]` zero-padded, valid mask `[b, l]`)."""
  starts = offsets_b[:-1]
  lengths = offsets_b[1:] - starts
  pos = jnp.arange(max_len)
  valid_bl = pos[None, :] < lengths[:, None]
  idx_bl = jnp.where(valid_bl, starts[:, None] + pos[None, :], 0)
  x_bl = jnp.where(
    valid_bl.reshape(valid_bl.shape + (1,) * (x_t.ndim - 1)), x_t[idx_bl], 0
  )
  return x_bl, valid_bl


def from_padded(x_bl, offsets_b, num_rows: int):
  """Padded `[b, l, ...]` -> packed `[num_rows, ...]`; rows past data are 0."""
  b, max_len = x_bl.shape[:2]
  rows = jnp.arange(num_rows)
  # Sequence of each packed row, and the row's position inside it.
  seq_t = jnp.clip(
    jnp.searchsorted(offsets_b, rows, side="right") - 1, 0, b - 1
  )
  pos_t = rows - offsets_b[seq_t]
  valid_t = (rows < offsets_b[-1]) & (pos_t < max_len)
  out = x_bl[seq_t, jnp.clip(pos_t, 0, max_len - 1)]
  return jnp.where(valid_t.reshape((-1,) + (1,) * (out.ndim - 1)), out, 0)
