"""Plain-`jnp` GDPA: the oracle and the `implementation="xla"` path.

Shapes (legend): `t` packed query rows, `s` packed key/value rows, `b`
sequences, `l` max query length, `m` max key length, `n` query heads, `k`
KV heads (`n % k == 0`, GQA), `h` head dim.

Generalized dot-product attention (G2) replaces softmax by a pointwise
activation, so a query row is a plain weighted sum of the values of its
sequence with no normalization across keys:

    out_p = sum_x act(scale * q_p . k_x) * v_x        (x: keys of p's sequence)

`act` is GELU (`"gelu"`, exact, with erf), its tanh form (`"gelu_tanh"`),
or SiLU (`"silu"`); `normalize="hstu"` divides by the sequence's number of
keys `N` (HSTU's `silu(x) / N`, which keeps the sum bounded as histories
grow). Every activation here has `act(0) = 0`, which the kernels use: a
zero-filled key row adds exactly nothing, so sequence boundaries need no
mask and no correction (unlike softmax, G1).

Rows past `q_offsets[-1]` and rows of sequences without keys are zero. The
reference gathers into a padded `[b, l]` / `[b, m]` layout (static
`max_len_q` / `max_len_kv`), computes in f32 and scatters back.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.jagged import from_padded, to_padded
from pallas_kernels.jagged_attention.reference import check_offsets

ACTIVATIONS = ("gelu", "gelu_tanh", "silu")
NORMALIZE = (None, "hstu")


def apply_activation(x, name: str):
  """The exact activation (f32 in, f32 out): the reference's definition."""
  if name == "gelu":
    return jax.nn.gelu(x, approximate=False)
  if name == "gelu_tanh":
    return jax.nn.gelu(x, approximate=True)
  if name == "silu":
    return jax.nn.silu(x)
  raise ValueError(f"activation {name!r}: one of {ACTIVATIONS}")


def check_settings(activation_name: str, normalize) -> None:
  if activation_name not in ACTIVATIONS:
    raise ValueError(f"activation {activation_name!r}: one of {ACTIVATIONS}")
  if normalize not in NORMALIZE:
    raise ValueError(f"normalize {normalize!r}: one of {NORMALIZE}")


def gdpa_reference(
  q_tnh,
  k_skh,
  v_skh,
  q_offsets,
  kv_offsets,
  *,
  activation: str = "gelu",
  normalize: str | None = None,
  scale: float | None = None,
  max_len_q: int | None = None,
  max_len_kv: int | None = None,
):
  """`out = act(scale * Q K^T) V` per jagged sequence (module docstring)."""
  act_name = activation
  check_settings(act_name, normalize)
  t, n, h = q_tnh.shape
  s, kh, _ = k_skh.shape
  if n % kh:
    raise ValueError(f"query heads {n} must be a multiple of KV heads {kh}")
  max_len_q = t if max_len_q is None else max_len_q
  max_len_kv = s if max_len_kv is None else max_len_kv
  check_offsets(q_offsets, t, "q_offsets", max_len_q)
  check_offsets(kv_offsets, s, "kv_offsets", max_len_kv)
  scale = h**-0.5 if scale is None else scale
  q_off = jnp.asarray(q_offsets, jnp.int32)
  kv_off = jnp.asarray(kv_offsets, jnp.int32)

  q_blnh, _ = to_padded(q_tnh, q_off, max_len_q)
  k_bmkh, k_valid = to_padded(k_skh, kv_off, max_len_kv)
  v_bmkh, _ = to_padded(v_skh, kv_off, max_len_kv)
  b = q_blnh.shape[0]
  group = n // kh
  # [b, l, n, h] -> [b, l, k, g, h]: query head i uses KV head i // group.
  q_blkgh = q_blnh.reshape(b, max_len_q, kh, group, h).astype(jnp.float32)
  s_bkglm = scale * jnp.einsum(
    "blkgh,bmkh->bkglm", q_blkgh, k_bmkh.astype(jnp.float32)
  )
  p = apply_activation(s_bkglm, act_name)
  p = jnp.where(k_valid[:, None, None, None, :], p, 0.0)
  if normalize == "hstu":
    n_keys = (kv_off[1:] - kv_off[:-1]).astype(jnp.float32)
    p = p / jnp.maximum(n_keys, 1.0)[:, None, None, None, None]
  o_blkgh = jnp.einsum("bkglm,bmkh->blkgh", p, v_bmkh.astype(jnp.float32))
  o_blnh = o_blkgh.reshape(b, max_len_q, n, h).astype(q_tnh.dtype)
  return from_padded(o_blnh, q_off, t)
