"""Pooled attention: `k` learned queries compress each user history (G2).

GEM's third GDPA shape: a handful of learned query vectors (1-32) attend to
a request's whole behaviour history (up to 2K events) with activation
attention instead of softmax, giving `k` summary vectors per request. Here
they are concatenated, projected to `d_model` and added to the request's
user vector, which every candidate of the request sees (beside its own
cross-attention, stage 2).

Shapes (legend): `b` requests, `t` packed history tokens, `p` pooled
queries per request, `n` query heads, `k` KV heads, `h` head dim, `d`
d_model. The queries are shared by all requests, so the packed query side
is `[b * p, n, h]` with offsets `0, p, 2p, ...`; a request with an empty
history gets zeros (GDPA of no keys), so its summary is the projection's
zero.
"""

import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from gemjax.model.layers import RMSNorm, dense, param


class PooledAttention(nnx.Module):
  """`[t, d]` history tokens -> `[b, d]` per-request summary."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, dtype):
    p, n, kh = cfg.pooled_queries, cfg.num_heads, cfg.num_kv_heads
    h = cfg.attn_head_dim
    self.p, self.n, self.kh, self.h = p, n, kh, h
    self.queries = param(rngs, (p, n * h), ("pooled_queries", "heads"))
    kw = dict(rngs=rngs, dtype=dtype)
    # 8-bit saved inputs (G9) for K and V; O's input, the GDPA output, is
    # kept by the GDPA kernel anyway.
    kv = dict(kw, save8=cfg.saved_activations == "fp8")
    self.k_proj = dense(cfg.d_model, kh * h, ("embed", "kv_heads"), **kv)
    self.v_proj = dense(cfg.d_model, kh * h, ("embed", "kv_heads"), **kv)
    self.o = dense(p * n * h, cfg.d_model, ("heads", "embed"), **kw)
    self.q_norm = RMSNorm(h, "head_dim") if cfg.qk_norm else None
    self.k_norm = RMSNorm(h, "head_dim") if cfg.qk_norm else None
    self.activation = cfg.attention.gdpa_activation
    self.normalize = cfg.attention.gdpa_normalize
    self.implementation = cfg.attention.implementation
    self.dtype = dtype

  def __call__(self, seq_td, offsets_b, *, max_len: int):
    t = seq_td.shape[0]
    b = offsets_b.shape[0] - 1
    q_pnh = self.queries[...].astype(self.dtype).reshape(self.p, self.n, self.h)
    seq_td = self.k_proj.saved_input(seq_td)  # one 8-bit copy for K and V
    k_tkh = self.k_proj(seq_td).reshape(t, self.kh, self.h)
    v_tkh = self.v_proj(seq_td).reshape(t, self.kh, self.h)
    if self.q_norm is not None:
      q_pnh, k_tkh = self.q_norm(q_pnh), self.k_norm(k_tkh)
    # Every request asks the same p queries: [b * p, n, h], offsets p apart.
    q_tnh = jnp.broadcast_to(q_pnh, (b, self.p, self.n, self.h))
    q_tnh = q_tnh.reshape(b * self.p, self.n, self.h)
    q_offsets = jnp.arange(b + 1, dtype=jnp.int32) * self.p
    o_tnh = pallas_kernels.gdpa(
      q_tnh,
      k_tkh,
      v_tkh,
      q_offsets,
      offsets_b,
      activation=self.activation,
      normalize=self.normalize,
      max_len_q=self.p,
      max_len_kv=max_len,
      implementation=self.implementation,
    )
    return self.o(o_tnh.reshape(b, self.p * self.n * self.h))
