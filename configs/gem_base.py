"""A GEM-style wide dense model for one H200, FP8 where it pays.

  python -m gemjax.train --config gem_base
  python -m gemjax.train --config gem_base --set model.fp8.format=deepseek
  PYTHONPATH=. python benchmarks/train_step.py --config gem_base \\
      --variants ours,fp8 --out "$OUT"             # bf16 against FP8
  XLA_FLAGS=--xla_force_host_platform_device_count=16 \\
      python -m gemjax.train --config gem_base_small  # run small, CPU mesh

GEM's dense towers at the width where FP8 GEMMs beat bf16: d_model 2048,
8 SeqFormer layers of GQA 16 query / 4 KV heads (head dim 128), QK-norm,
SwiGLU 4x (8192 wide), so the step's GEMMs are 2048- and 8192-deep
products over ~39K tokens; a candidate cross block; a DHEN expert layer
(G6: an MLP and a DCN cross expert) between the candidate features and
the heads; 128-wide embedding slices over 1M items; bf16 compute, the
same 2K-event log-normal traffic as `onetrans_v31`, 32 requests a step.

Scale-out (`gem_base_small` trains it on 16 simulated devices): FSDP for
the dense weights inside a group, embedding tables split by rows with the
gen-3 exchange (`fsdp_grouped_split`: all-to-all over `zone`, rows
gathered over NVLink), and one DHEN expert per GPU of a node pair. On one
GPU all three are the local paths.
"""

from gemjax.config import (
  Config,
  DataConfig,
  MeshConfig,
  ModelConfig,
  TrainConfig,
)


def get_config() -> Config:
  return Config(
    model=ModelConfig(
      d_model=2048,
      num_layers=8,
      num_heads=16,
      num_kv_heads=4,
      ffn_mult=4.0,
      cross_layers=1,
      emb_dim=128,
      head_hidden=(1024, 512),
      # One layer: its experts run on candidates only (a small share of the
      # FLOPs), but hold ~140M parameters at this width.
      dhen_layers=1,
      dtype="bfloat16",
    ),
    # Power-of-two tables: any power-of-two device count splits them.
    data=DataConfig(
      num_items=1 << 20,
      num_categories=1 << 14,
      max_seq_len=2048,
      requests_per_shard=32,
      token_capacity=38_912,
      workers=4,
    ),
    mesh=MeshConfig(strategy="fsdp_grouped_split"),
    train=TrainConfig(
      steps=20_000,
      # A lower AdamW peak than `onetrans_v31`'s 1e-3 for 4x the width.
      learning_rate=5e-4,
      warmup_steps=1_000,
      checkpoint_every=1_000,
      log_every=50,
    ),
  )
