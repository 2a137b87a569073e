"""The ranking model: shared embeddings -> SeqFormer -> candidate attention ->
multi-task heads.

For one jagged batch (see `gemjax.data.jagged`):
1. every history event becomes a token: its feature embeddings side by side
   (O9 shared slices), projected to `d_model`; tokens past the data are zero;
2. stage 1, `SeqFormer`, runs once per request over its unpadded sequence
   (O10: no padding token is ever computed on);
3. stage 2: each candidate is a query token (its embeddings plus the
   request's dense features) that attends to its request's stage-1 outputs
   (O12: the sequence and its K/V are computed once per request, whatever the
   number of candidates);
4. heads (O14): a shared bottom and one tower per task (CTR, CVR) give one
   logit per candidate and task.

A request with an empty history still scores its candidates (its attention
output is zero); its sequence positions get zero gradients.

Attention options (`cfg.attention`, G2/G3): `seq` (softmax, block, sliding)
for stage 1, `cand` (softmax, gdpa) for stage 2; `cfg.pooled_queries > 0`
adds a GDPA summary of the history by learned queries
(`gemjax.model.pooling`) to each request's user vector.

FP8 (G4, `cfg.fp8`, an `Fp8Config`): which layers run in FP8 is decided by
`layers.fp8_for`; the cross blocks count after the SeqFormer blocks in the
depth, the input projections are family "input", the bottom MLP "heads";
the task towers always stay f32.

8-bit saved activations (G9, `cfg.saved_activations="fp8"`): the input
projections, the blocks' Q/K/V and SwiGLU, and the bottom MLP keep their
inputs for the backward in 8 bits (`layers`); the DHEN experts (on
candidates, a small share of the activations) and the f32 towers keep
theirs as they are.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.data.config import CAND_FEATURES, SEQ_FEATURES
from gemjax.data.jagged import segment_ids
from gemjax.model import remat
from gemjax.model.embeddings import Embeddings
from gemjax.model.experts import DHEN
from gemjax.model.layers import Dense, RMSNorm, dense, fp8_for
from gemjax.model.pooling import PooledAttention
from gemjax.model.seqformer import Block, SeqFormer


class CrossBlock(Block):
  """Candidates attend to their request's sequence, then an FFN."""

  def __call__(
    self, c_cd, seq_td, cand_offsets, offsets, *, max_cands, max_len, op=None
  ):
    c_cd = c_cd + self.attn(
      self.attn_norm(c_cd),
      seq_td,
      cand_offsets,
      offsets,
      max_len_q=max_cands,
      max_len_kv=max_len,
      op=op,
    )
    return c_cd + self.ffn(self.ffn_norm(c_cd))


class Heads(nnx.Module):
  """Shared bottom MLP, then one tower per task; returns logits `[c, tasks]`."""

  def __init__(
    self,
    d_in: int,
    hidden: tuple[int, ...],
    num_tasks: int,
    *,
    rngs,
    dtype,
    fp8=None,
    save8: bool = False,
  ):
    dims = (d_in, *hidden)
    self.bottom = nnx.List(
      [
        dense(
          a,
          b,
          ("mlp_in", "mlp"),
          rngs=rngs,
          use_bias=True,
          dtype=dtype,
          fp8=fp8,
          save8=save8,
        )
        for a, b in zip(dims[:-1], dims[1:], strict=True)
      ]
    )
    self.towers = nnx.List(
      [
        Dense(
          dims[-1],
          1,
          ("mlp", "task"),
          rngs=rngs,
          use_bias=True,
          dtype=jnp.float32,
        )
        for _ in range(num_tasks)
      ]
    )

  def __call__(self, x, *, dropout: float = 0.0, key=None):
    for layer in self.bottom:
      x = jax.nn.gelu(layer(x))
      if dropout and key is not None:
        key, sub = jax.random.split(key)
        keep = jax.random.bernoulli(sub, 1 - dropout, x.shape)
        x = jnp.where(keep, x / (1 - dropout), 0).astype(x.dtype)
    return jnp.concatenate([t(x.astype(jnp.float32)) for t in self.towers], -1)


class RankingModel(nnx.Module):
  def __init__(
    self, cfg, vocab_sizes: dict[str, int], num_dense: int, *, rngs: nnx.Rngs
  ):
    dtype = jnp.dtype(cfg.dtype)
    e = cfg.emb_dim
    self.cfg = cfg
    self.embeddings = Embeddings(vocab_sizes, e, rngs=rngs)
    input_fp8 = fp8_for(cfg, "input")
    save8 = cfg.saved_activations == "fp8"
    self.token_proj = dense(
      len(SEQ_FEATURES) * e,
      cfg.d_model,
      ("table_dim", "embed"),
      rngs=rngs,
      dtype=dtype,
      fp8=input_fp8,
      save8=save8,
    )
    self.seqformer = SeqFormer(cfg, rngs=rngs, dtype=dtype)
    self.cand_proj = dense(
      len(CAND_FEATURES) * e,
      cfg.d_model,
      ("table_dim", "embed"),
      rngs=rngs,
      dtype=dtype,
      fp8=input_fp8,
      save8=save8,
    )
    self.dense_proj = dense(
      max(num_dense, 1),
      cfg.d_model,
      ("dense", "embed"),
      rngs=rngs,
      use_bias=True,
      dtype=dtype,
      fp8=input_fp8,
      save8=save8,
    )
    self.cross = nnx.List(
      [
        CrossBlock(
          cfg, rngs=rngs, dtype=dtype, index=cfg.num_layers + j, stage="cand"
        )
        for j in range(cfg.cross_layers)
      ]
    )
    self.cand_norm = RMSNorm(cfg.d_model, "embed")
    self.heads = Heads(
      2 * cfg.d_model + e,
      cfg.head_hidden,
      len(cfg.tasks),
      rngs=rngs,
      dtype=dtype,
      fp8=fp8_for(cfg, "heads"),
      save8=save8,
    )
    self.num_dense = num_dense
    # G2 pooled attention: learned queries summarize the history (optional).
    self.pooling = (
      PooledAttention(cfg, rngs=rngs, dtype=dtype)
      if cfg.pooled_queries
      else None
    )
    # G6: optional DHEN expert stack between candidate features and heads.
    self.dhen = (
      DHEN(2 * cfg.d_model + e, cfg.dhen_layers, rngs=rngs, dtype=dtype)
      if cfg.dhen_layers
      else None
    )

  def __call__(
    self,
    batch,
    *,
    max_len: int,
    max_cands: int,
    key=None,
    cross_op=None,
    encoded=None,
  ):
    """One (unstacked) `JaggedBatch` -> logits `[c, tasks]` (f32)."""
    feats = self.features(
      batch,
      max_len=max_len,
      max_cands=max_cands,
      cross_op=cross_op,
      encoded=encoded,
    )
    if self.dhen is not None:
      feats = self.dhen(feats)
    return self.head(feats, key=key)

  def head(self, feats, *, key=None):
    """Candidate features `[c, 2*d_model + emb_dim]` -> logits `[c, tasks]`."""
    heads = lambda f, k: self.heads(f, dropout=self.cfg.dropout, key=k)
    return self._remat(heads, "heads")(feats, key)

  def _remat(self, fn, region: str):
    return remat.checkpoint(fn, remat.policy(self.cfg.remat, region))

  def encode(self, batch, *, max_len: int):
    """Stage 1 of one batch: (sequence outputs `[t, d_model]`, user vectors
    `[b, d_model]`), all that the candidates read of their request."""
    dtype = jnp.dtype(self.cfg.dtype)
    t = batch.token_capacity
    tok_valid = jnp.arange(t) < batch.offsets[-1]

    def tokens(seq):
      x_td = self.token_proj(self.embeddings.concat(seq, SEQ_FEATURES))
      return jnp.where(tok_valid[:, None], x_td, 0).astype(dtype)

    x_td = self._remat(tokens, "input")(batch.seq)
    seq_td = self.seqformer(x_td, batch.offsets, max_len=max_len)
    dense = (
      batch.dense
      if self.num_dense
      else jnp.zeros((batch.num_requests, 1), jnp.float32)
    )
    user_bd = self.dense_proj(dense)
    if self.pooling is not None:
      user_bd = user_bd + self.pooling(seq_td, batch.offsets, max_len=max_len)
    return seq_td, user_bd

  def features(
    self,
    batch,
    *,
    max_len: int,
    max_cands: int,
    cross_op=None,
    encoded=None,
  ):
    """One (unstacked) `JaggedBatch` -> candidate features `[c, D]`.

    `cross_op` replaces the cross blocks' attention op (`Attention`'s
    `op`); serving's per-candidate and padded baselines use it.
    `encoded`: `encode`'s output for this batch, computed earlier (serving's
    history cache); None runs stage 1 here.
    """
    dtype = jnp.dtype(self.cfg.dtype)
    c = batch.cand_capacity
    if encoded is None:
      encoded = self.encode(batch, max_len=max_len)
    seq_td, user_bd = encoded
    # Request of each candidate row; rows past the data read request 0 and
    # are masked out of the loss and metrics.
    req_c = jnp.minimum(
      segment_ids(batch.cand_offsets, c), batch.num_requests - 1
    )
    cand_emb = self.embeddings.concat(batch.cand, CAND_FEATURES)
    c_cd = (self.cand_proj(cand_emb) + user_bd[req_c]).astype(dtype)

    def cross(c_cd, seq_td):
      if self.cross:  # one 8-bit copy of the history for every block's K/V
        seq_td = self.cross[0].attn.k_proj.saved_input(seq_td)
      for blk in self.cross:
        c_cd = blk(
          c_cd,
          seq_td,
          batch.cand_offsets,
          batch.offsets,
          max_cands=max_cands,
          max_len=max_len,
          op=cross_op,
        )
      return c_cd

    c_cd = self._remat(cross, "cross")(c_cd, seq_td)
    c_cd = self.cand_norm(c_cd)
    item_emb = self.embeddings.lookup("item_id", batch.cand["item_id"])
    return jnp.concatenate([c_cd, user_bd[req_c], item_emb.astype(dtype)], -1)
