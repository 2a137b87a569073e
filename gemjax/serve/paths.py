"""The three ways to run the candidate cross-attention when serving.

Every candidate of a request attends to the request's whole encoded history
and to nothing else (no candidate sees another). The model's weights and
projections are the same in all three; only the attention op differs
(`RankingModel.features(cross_op=...)`):

- "m_falcon" (O13, the default): all candidates of a request are one
  flattened query set beside the request's K/V, one jagged attention call
  over the whole batch (`pallas_kernels.jagged_attention`: the Mosaic GPU
  kernel on a GPU, which folds the heads of a KV group into rows when a
  request has fewer candidates than a query tile, and its reference on
  CPU). K/V are read once per request.
- "per_candidate" (the seed's "before", xmatmul): each candidate's
  attention is its own small computation over its own copy of the
  request's K/V window (gathered per candidate, so K/V cross memory once
  per candidate), run `chunk` candidates at a time (`lax.map`).
- "padded": what a JAX user would write: queries and K/V padded to
  `[requests, max length, heads, head dim]`, `jax.nn.dot_product_attention`
  with sequence lengths (cuDNN on a GPU for bf16/fp16, XLA otherwise), then
  packed back.

All three compute softmax attention in f32 from the same inputs, so their
probabilities agree to float tolerance (tested).
"""

import functools

import jax
import jax.numpy as jnp

from gemjax.data.jagged import segment_ids
from pallas_kernels import jagged_from_padded, jagged_to_padded

PATHS = ("m_falcon", "per_candidate", "padded")


def per_candidate_attention(
  q_tnh,
  k_skh,
  v_skh,
  q_offsets,
  kv_offsets,
  *,
  causal=False,
  max_len_q=None,
  max_len_kv,
  chunk: int = 128,
):
  """`jagged_attention`'s contract, one candidate (query row) at a time."""
  if causal:
    raise ValueError("candidate attention is not causal")
  t, n, h = q_tnh.shape
  kh = k_skh.shape[1]
  g, m = n // kh, max_len_kv
  req_t = jnp.minimum(segment_ids(q_offsets, t), q_offsets.shape[0] - 2)
  valid_t = jnp.arange(t) < q_offsets[-1]
  start_t = kv_offsets[req_t]
  len_t = jnp.where(valid_t, kv_offsets[req_t + 1] - start_t, 0)
  # `m` zero rows past the end: a window slice never runs off the buffer.
  k_pad = jnp.pad(k_skh, ((0, m), (0, 0), (0, 0)))
  v_pad = jnp.pad(v_skh, ((0, m), (0, 0), (0, 0)))

  def one(args):
    q_nh, start, length = args
    k_mkh = jax.lax.dynamic_slice_in_dim(k_pad, start, m)
    v_mkh = jax.lax.dynamic_slice_in_dim(v_pad, start, m)
    q_kgh = q_nh.reshape(kh, g, h).astype(jnp.float32)
    s_kgm = jnp.einsum("kgh,mkh->kgm", q_kgh, k_mkh.astype(jnp.float32))
    s_kgm = s_kgm * h**-0.5
    seen = jnp.arange(m) < length
    s_kgm = jnp.where(seen, s_kgm, -jnp.inf)
    p_kgm = jax.nn.softmax(jnp.where(length > 0, s_kgm, 0.0), axis=-1)
    o_kgh = jnp.einsum("kgm,mkh->kgh", p_kgm, v_mkh.astype(jnp.float32))
    o_kgh = jnp.where(length > 0, o_kgh, 0.0)
    return o_kgh.reshape(n, h).astype(q_nh.dtype)

  return jax.lax.map(one, (q_tnh, start_t, len_t), batch_size=chunk)


def padded_attention(
  q_tnh,
  k_skh,
  v_skh,
  q_offsets,
  kv_offsets,
  *,
  causal=False,
  max_len_q,
  max_len_kv,
  implementation=None,
):
  """`jagged_attention`'s contract through padded `dot_product_attention`."""
  if causal:
    raise ValueError("candidate attention is not causal")
  t = q_tnh.shape[0]
  q_blnh, _ = jagged_to_padded(q_tnh, q_offsets, max_len_q)
  k_bmkh, _ = jagged_to_padded(k_skh, kv_offsets, max_len_kv)
  v_bmkh, _ = jagged_to_padded(v_skh, kv_offsets, max_len_kv)
  lq = (q_offsets[1:] - q_offsets[:-1]).astype(jnp.int32)
  lk = (kv_offsets[1:] - kv_offsets[:-1]).astype(jnp.int32)
  if implementation is None:
    on_gpu = jax.default_backend() == "gpu"
    half = q_tnh.dtype in (jnp.bfloat16, jnp.float16)
    implementation = "cudnn" if on_gpu and half else "xla"
  # A request without history attends to nothing: give it one (masked
  # out below) key so that no row of the softmax is empty.
  o_blnh = jax.nn.dot_product_attention(
    q_blnh,
    k_bmkh,
    v_bmkh,
    query_seq_lengths=jnp.maximum(lq, 1),
    key_value_seq_lengths=jnp.maximum(lk, 1),
    implementation=implementation,
  )
  o_blnh = jnp.where((lk > 0)[:, None, None, None], o_blnh, 0)
  return jagged_from_padded(o_blnh, q_offsets, t).astype(q_tnh.dtype)


def cross_op(path: str, chunk: int = 128):
  """The `cross_op` of `RankingModel.features` for a path name."""
  if path not in PATHS:
    raise ValueError(f"attention path {path!r}: one of {PATHS}")
  if path == "per_candidate":
    return functools.partial(per_candidate_attention, chunk=chunk)
  if path == "padded":
    return padded_attention
  return None
