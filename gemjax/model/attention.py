"""GQA attention with QK-norm and RoPE over packed jagged sequences.

One module serves both stages:
- stage 1 (self-attention over the user sequence): queries and keys are the
  same packed tokens, `q_offsets == kv_offsets`, RoPE on in-sequence positions;
- stage 2 (candidates over their request's sequence, O12 listwise squeeze):
  queries are the packed candidates, keys/values are the stage-1 outputs. Each
  request's K/V is computed once from its sequence and shared by all of its
  candidates, so memory does not grow with candidates per request; no
  candidate attends to another.

GQA (O7): `n` query heads share `k` KV heads (default 8/2, KV memory / 4).
QK-norm (O8): RMSNorm over the head dim on Q and K after projection.
All attention goes through `pallas_kernels` ops, so the Pallas kernels
replace the references without model changes. `kind` picks the op
(`attention_options` reads it from the config): "softmax"
(`jagged_attention`, G1), "gdpa" (activation attention, G2: no softmax, for
candidates over a short or long history), "block" (softmax inside fixed
blocks, G3; RoPE applied inside the op) or "sliding" (a window of positions,
the seed's intermediate step: the jagged kernel's `window`). "block" and
"sliding" are self-attention only.
FP8 (G4, `fp8=` settings): the Q/K/V/O projections are `Fp8Dense`; `x_q`
and `x_kv` may then be `Fp8Tensor`s from a quantizing norm (quantized once,
read by all three input projections).
8-bit saved activations (G9, `save8`): Q, K and V keep one 8-bit copy of
their input for their weight gradients; O keeps its input as it is, since
the attention kernel keeps that same output for its own backward.
"""

import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from gemjax.data.jagged import segment_ids
from gemjax.model.layers import Fp8Settings, RMSNorm, dense

KINDS = ("softmax", "gdpa", "block", "sliding")


def attention_options(cfg, stage: str) -> dict:
  """`Attention` settings of a SeqFormer ("seq") or candidate ("cand")
  block from the `ModelConfig`'s `attention`."""
  a = cfg.attention
  if stage == "seq":
    return dict(kind=a.seq, block_size=a.block_size, window=a.sliding_window)
  return dict(
    kind=a.cand, activation=a.gdpa_activation, normalize=a.gdpa_normalize
  )


class Attention(nnx.Module):
  def __init__(
    self,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    qk_norm: bool,
    rngs: nnx.Rngs,
    dtype,
    implementation: str | None = None,
    fp8: Fp8Settings | None = None,
    kind: str = "softmax",
    block_size: int = 64,
    window: int = 64,
    activation: str = "gelu_tanh",
    normalize: str | None = None,
    save8: bool = False,
  ):
    if kind not in KINDS:
      raise ValueError(f"attention kind {kind!r}: one of {KINDS}")
    self.kind, self.block_size, self.window = kind, block_size, window
    self.activation, self.normalize = activation, normalize
    if num_heads % num_kv_heads:
      raise ValueError(
        f"num_heads={num_heads} must be a multiple of num_kv_heads="
        f"{num_kv_heads}"
      )
    self.n, self.k, self.h = num_heads, num_kv_heads, head_dim
    kw = dict(rngs=rngs, dtype=dtype, fp8=fp8)
    qkv = dict(kw, save8=save8)
    self.q = dense(d_model, num_heads * head_dim, ("embed", "heads"), **qkv)
    self.k_proj = dense(
      d_model, num_kv_heads * head_dim, ("embed", "kv_heads"), **qkv
    )
    self.v_proj = dense(
      d_model, num_kv_heads * head_dim, ("embed", "kv_heads"), **qkv
    )
    self.o = dense(num_heads * head_dim, d_model, ("heads", "embed"), **kw)
    self.q_norm = RMSNorm(head_dim, "head_dim") if qk_norm else None
    self.k_norm = RMSNorm(head_dim, "head_dim") if qk_norm else None
    self.implementation = implementation

  def __call__(
    self,
    x_q,
    x_kv,
    q_offsets,
    kv_offsets,
    *,
    max_len_q: int,
    max_len_kv: int,
    causal: bool = False,
    q_pos=None,
    kv_pos=None,
    rope_theta: float = 10_000.0,
    op=None,
  ):
    """`x_q [t, d]`, `x_kv [s, d]` -> `[t, d]`; positions enable RoPE.

    `op`: a softmax attention with `jagged_attention`'s signature that
    replaces the configured one (serving compares the per-candidate and
    padded paths with M-Falcon through it, same weights, same projections).
    """
    t, s = x_q.shape[0], x_kv.shape[0]
    # One 8-bit copy of each input for the projections that read it.
    same = x_q is x_kv
    x_kv = self.k_proj.saved_input(x_kv)
    x_q = x_kv if same else self.q.saved_input(x_q)
    q_tnh = self.q(x_q).reshape(t, self.n, self.h)
    k_skh = self.k_proj(x_kv).reshape(s, self.k, self.h)
    v_skh = self.v_proj(x_kv).reshape(s, self.k, self.h)
    if self.q_norm is not None:
      q_tnh, k_skh = self.q_norm(q_tnh), self.k_norm(k_skh)
    if self.kind in ("block", "sliding"):
      # Self-attention; RoPE at in-sequence positions inside the op (fused
      # into the block kernel), so `q_pos` only says whether to apply it.
      kw = dict(
        rope=None if q_pos is None else rope_theta,
        causal=causal,
        max_len=max_len_q,
      )
      if self.kind == "block":
        o_tnh = pallas_kernels.block_attention(
          q_tnh,
          k_skh,
          v_skh,
          q_offsets,
          block=self.block_size,
          implementation=self.implementation,
          **kw,
        )
      else:
        o_tnh = pallas_kernels.sliding_window_attention(
          q_tnh,
          k_skh,
          v_skh,
          q_offsets,
          window=self.window,
          implementation=self.implementation,
          **kw,
        )
      return self.o(o_tnh.reshape(t, self.n * self.h))
    if q_pos is not None:
      q_tnh, k_skh = (
        pallas_kernels.rope_reference(q_tnh, q_pos, rope_theta),
        pallas_kernels.rope_reference(k_skh, kv_pos, rope_theta),
      )
    if op is not None:
      if self.kind != "softmax":
        raise ValueError(f"an attention op replaces softmax, not {self.kind}")
      o_tnh = op(
        q_tnh,
        k_skh,
        v_skh,
        q_offsets,
        kv_offsets,
        causal=causal,
        max_len_q=max_len_q,
        max_len_kv=max_len_kv,
      )
    elif self.kind == "gdpa":
      if causal:
        raise ValueError("gdpa attention is not causal")
      o_tnh = pallas_kernels.gdpa(
        q_tnh,
        k_skh,
        v_skh,
        q_offsets,
        kv_offsets,
        activation=self.activation,
        normalize=self.normalize,
        max_len_q=max_len_q,
        max_len_kv=max_len_kv,
        implementation=self.implementation,
      )
    else:
      o_tnh = pallas_kernels.jagged_attention(
        q_tnh,
        k_skh,
        v_skh,
        q_offsets,
        kv_offsets,
        causal=causal,
        max_len_q=max_len_q,
        max_len_kv=max_len_kv,
        implementation=self.implementation,
      )
    return self.o(o_tnh.reshape(t, self.n * self.h))


def positions(offsets_b, capacity: int):
  """Position of every packed row inside its sequence (0 past the data)."""
  offsets_b = jnp.asarray(offsets_b)
  rows = jnp.arange(capacity)
  seg = jnp.minimum(segment_ids(offsets_b, capacity), offsets_b.shape[0] - 2)
  return jnp.where(rows < offsets_b[-1], rows - offsets_b[seg], 0)
