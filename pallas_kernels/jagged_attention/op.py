"""Public jagged-attention op: dispatch between implementations."""

import functools

from pallas_kernels import dispatch
from pallas_kernels.jagged_attention.reference import (
  jagged_attention_reference,
)

IMPLEMENTATIONS = {"xla": jagged_attention_reference}


def jagged_attention(
  q_tnh,
  k_skh,
  v_skh,
  q_offsets,
  kv_offsets=None,
  *,
  causal: bool = False,
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
    scale: score scale, default `h ** -0.5`.
    max_len_q, max_len_kv: static upper bounds on one sequence's length.
    implementation: `None` (best for the platform) or one of
      `IMPLEMENTATIONS`.

  Returns `[t, n, h]`; rows past `q_offsets[-1]` and rows with no visible key
  are zero.
  """
  fn = dispatch.pick(
    "jagged_attention", IMPLEMENTATIONS, implementation, gpu_default="mosaic"
  )
  return functools.partial(
    fn,
    causal=causal,
    scale=scale,
    max_len_q=max_len_q,
    max_len_kv=max_len_kv,
  )(q_tnh, k_skh, v_skh, q_offsets, kv_offsets)
