"""SeqFormer: the stage-1 transformer over packed user sequences.

Pre-RMSNorm blocks (`h += attn(norm(h))`, `h += ffn(norm(h))`), with the
residual add fused into the next norm (`rms_norm(x, residual=h)` returns the
normalized input of the next sub-layer and the new residual stream, O11).

Depth (O6): the stack owns `num_layers` distinct blocks and applies them in
`layer_order`. `range(num_layers)` is a plain stack; an order that repeats a
block (e.g. `0,1,2,2,3,3,4`) is the looped-layer control (shared weights,
more nested depth); copy-and-stack up-scaling (`0,1,2,3,2,3,4`: 5 -> 7
distinct blocks) is done on the checkpoint by `gemjax.train.upscale`.

FP8 (G4): a block whose attention / FFN runs in FP8 (`layers.fp8_for`) gets
a norm that returns its output quantized, so the projections read 8 bits.
"""

import functools

from flax import nnx

from gemjax.model import remat
from gemjax.model.attention import Attention, attention_options, positions
from gemjax.model.layers import RMSNorm, SwiGLU, fp8_for, swiglu_hidden


class Block(nnx.Module):
  """Parameters of one pre-norm block: attention and SwiGLU FFN.

  `index`: the block's depth index, which decides FP8 (`layers.fp8_for`).
  `stage`: "seq" (SeqFormer) or "cand" (candidate cross-attention) picks
  the attention kind (`attention.attention_options`).
  """

  def __init__(
    self,
    cfg,
    *,
    rngs: nnx.Rngs,
    dtype,
    index: int | None = None,
    stage: str = "seq",
  ):
    attn_fp8 = fp8_for(cfg, "attn", index)
    ffn_fp8 = fp8_for(cfg, "ffn", index)
    save8 = cfg.saved_activations == "fp8"
    self.attn_norm = RMSNorm(cfg.d_model, "embed", quantize=attn_fp8)
    self.attn = Attention(
      cfg.d_model,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.attn_head_dim,
      qk_norm=cfg.qk_norm,
      rngs=rngs,
      dtype=dtype,
      implementation=cfg.attention.implementation,
      fp8=attn_fp8,
      save8=save8,
      **attention_options(cfg, stage),
    )
    self.ffn_norm = RMSNorm(cfg.d_model, "embed", quantize=ffn_fp8)
    self.ffn = SwiGLU(
      cfg.d_model,
      swiglu_hidden(cfg.d_model, cfg.ffn_mult),
      rngs=rngs,
      dtype=dtype,
      fp8=ffn_fp8,
      save8=save8,
    )


class SeqFormer(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs, dtype):
    self.blocks = nnx.List(
      [
        Block(cfg, rngs=rngs, dtype=dtype, index=i)
        for i in range(cfg.num_layers)
      ]
    )
    self.final_norm = RMSNorm(cfg.d_model, "embed")
    self.order = tuple(cfg.layer_order or range(cfg.num_layers))
    if any(not 0 <= i < cfg.num_layers for i in self.order):
      raise ValueError(
        f"layer_order {self.order} names blocks outside 0..{cfg.num_layers - 1}"
      )
    self.causal = cfg.attention.causal
    self.rope_theta = cfg.attention.rope_theta if cfg.attention.rope else None
    # G9: the checkpoint policy of each block application.
    self.remat = tuple(
      remat.policy(cfg.remat, f"seq{j}") for j in range(len(self.order))
    )

  def __call__(self, x_td, offsets_b, *, max_len: int):
    pos_t = (
      positions(offsets_b, x_td.shape[0])
      if self.rope_theta is not None
      else None
    )
    h, delta = x_td, None
    for j, i in enumerate(self.order):
      apply = functools.partial(
        self._block, self.blocks[i], offsets_b, pos_t, max_len
      )
      h, delta = remat.checkpoint(apply, self.remat[j])(h, delta)
    if delta is None:
      return self.final_norm(h)
    return self.final_norm(delta, residual=h)[0]

  def _block(self, blk, offsets_b, pos_t, max_len, h, delta):
    """One block: (residual stream, pending delta) -> the same after it."""
    y, h = (
      (blk.attn_norm(h), h)
      if delta is None
      else blk.attn_norm(delta, residual=h)
    )
    delta = blk.attn(
      y,
      y,
      offsets_b,
      offsets_b,
      max_len_q=max_len,
      max_len_kv=max_len,
      causal=self.causal,
      q_pos=pos_t,
      kv_pos=pos_t,
      rope_theta=self.rope_theta or 1.0,
    )
    y, h = blk.ffn_norm(delta, residual=h)
    return h, blk.ffn(y)
