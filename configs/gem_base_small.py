"""`gem_base` at toy width on a simulated 16-device CPU mesh.

  XLA_FLAGS=--xla_force_host_platform_device_count=16 \\
      python -m gemjax.train --config gem_base_small

The same model family (SwiGLU 4x, a cross block, DHEN experts, bf16) and
the same placement (`fsdp_grouped_split`) as `gem_base`, small enough to
train in minutes on CPU. The mesh is 2 clusters x 2 zones x the rest
(4 simulated devices a host for 16): dense weights FSDP-sharded inside a
cluster, tables split by rows with the exchange over `zone`, the two DHEN
experts on node pairs (`tests/gemjax/train/test_gem_base.py` checks each).
"""

import dataclasses
import pathlib

from gemjax import config as config_lib


def get_config():
  # By path, as the CLI loads every config: this folder is not a package
  # the library imports.
  cfg = config_lib.load(pathlib.Path(__file__).with_name("gem_base.py"))
  return dataclasses.replace(
    cfg,
    model=dataclasses.replace(
      cfg.model,
      d_model=64,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      emb_dim=32,
      head_hidden=(64,),
      dhen_layers=1,
    ),
    data=dataclasses.replace(
      cfg.data,
      num_items=512,
      num_categories=64,
      num_users=256,
      max_seq_len=32,
      len_median=12.0,
      requests_per_shard=4,
      token_capacity=96,
      cand_capacity=24,
      min_cands=2,
      max_cands=6,
      eval_requests=64,
      workers=0,
    ),
    mesh=dataclasses.replace(cfg.mesh, cluster=2, zone=2),
    train=dataclasses.replace(
      cfg.train,
      steps=200,
      learning_rate=2e-3,
      warmup_steps=10,
      checkpoint_every=100,
      log_every=10,
    ),
  )
