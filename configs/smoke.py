"""CPU-sized config: trains in minutes on 2 cores; `make train` runs it.

  make train
  python -m gemjax.train --config smoke --set train.steps=50   # run small

Same model family as `onetrans_v31` (GQA 8/2, QK-norm, RoPE, SwiGLU, shared
embedding slices, listwise candidates) at toy width, on synthetic histories of
median 48 events capped at 128.
"""

from gemjax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
    model=ModelConfig(
      d_model=64,
      num_layers=2,
      num_heads=8,
      num_kv_heads=2,
      emb_dim=32,
      head_hidden=(128, 64),
      cross_layers=2,  # candidates read the history twice: better UAUC
    ),
    data=DataConfig(
      num_items=5_000,
      num_categories=100,
      num_users=20_000,
      max_seq_len=128,
      len_median=48.0,
      requests_per_shard=32,
      token_capacity=2_048,
      cand_capacity=320,
      eval_requests=2_048,
    ),
    train=TrainConfig(steps=800, checkpoint_every=200, log_every=10),
  )
