"""A tiny trained run shared by the serving tests (trained once, on one
device, for two steps: serving needs a real checkpoint and run log, not a
good model)."""

import jax
import pytest

from gemjax import config
from gemjax.train.loop import train

TINY = [
  "model.d_model=32",
  "model.num_layers=1",
  "model.num_heads=4",
  "model.num_kv_heads=2",
  "model.head_hidden=32",
  "model.cross_layers=2",
  "data.max_seq_len=32",
  "data.len_median=12",
  "data.requests_per_shard=4",
  "data.token_capacity=192",
  "data.cand_capacity=64",
  "data.max_cands=8",
  "data.eval_requests=16",
  "data.num_items=500",
  "data.num_categories=20",
  "data.num_users=400",
  "data.prefetch=0",
  "train.steps=2",
  "train.log_every=1",
  "train.checkpoint_every=2",
  "train.eval_batches=1",
  "train.progress=false",
  "mesh.node=1",
  "mesh.data_shards=1",
]

# Small buckets: every test compiles only what it uses.
SHAPES = ((1, 16), (4, 32))


def tiny_config():
  return config.load("smoke", TINY)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("serve_run")
  train(tiny_config(), d, devices=jax.devices()[:1])
  return d
