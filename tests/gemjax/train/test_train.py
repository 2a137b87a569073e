"""Training end to end at toy size: device-count equivalence, exact resume,
every named config, and depth up-scaling."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from gemjax import config
from gemjax.train.loop import Trainer, train
from gemjax.train.upscale import upscaled_start

TINY = [
  "model.d_model=32",
  "model.num_layers=2",
  "model.num_heads=4",
  "model.num_kv_heads=2",
  "model.head_hidden=32",
  "data.max_seq_len=32",
  "data.len_median=12",
  "data.requests_per_shard=4",
  "data.token_capacity=192",
  "data.cand_capacity=64",
  "data.max_cands=8",
  "data.eval_requests=64",
  "data.num_items=500",
  "data.num_categories=20",
  "data.num_users=400",
  "data.prefetch=0",
  "train.steps=4",
  "train.log_every=1",
  "train.checkpoint_every=2",
  "train.progress=false",
  "mesh.data_shards=8",
]


def tiny(*more):
  return config.load("smoke", TINY + list(more))


def final_state(run_dir, cfg, devices=None):
  tr = Trainer.create(cfg, run_dir, devices=devices)
  ckpt = tr.checkpointer()
  state, data = ckpt.restore(ckpt.latest_step(), tr.abstract_state)
  ckpt.close()
  return jax.device_get(state), data


def losses(run_dir):
  with open(f"{run_dir}/metrics.jsonl") as f:
    return [r["loss"] for r in map(json.loads, f) if r["event"] == "train"]


@pytest.mark.slow
def test_one_device_equals_eight(tmp_path):
  """Same global batch on 1 and on 8 devices: same losses and parameters."""
  cfg = tiny()
  one = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, node=1))
  train(one, tmp_path / "one", devices=jax.devices()[:1])
  train(cfg, tmp_path / "eight")
  np.testing.assert_allclose(
    losses(tmp_path / "one"), losses(tmp_path / "eight"), rtol=2e-5
  )
  s1, _ = final_state(tmp_path / "one", one, jax.devices()[:1])
  s8, _ = final_state(tmp_path / "eight", cfg)
  for a, b in zip(
    jax.tree.leaves(s1["params"]), jax.tree.leaves(s8["params"]), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path):
  """Killed after step 2 and resumed == never stopped, bit for bit."""
  cfg = tiny()
  train(cfg, tmp_path / "straight")
  assert train(cfg, tmp_path / "resumed", stop_at=2) == {}
  train(cfg, tmp_path / "resumed")
  a, data_a = final_state(tmp_path / "straight", cfg)
  b, data_b = final_state(tmp_path / "resumed", cfg)
  assert int(a["step"]) == int(b["step"]) == 4
  assert data_a == data_b
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)
  assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")


@pytest.mark.slow
@pytest.mark.parametrize(
  "name",
  # Real-log configs train in tests/gemjax/train/test_real_logs.py;
  # gem_base (~830M parameters) is sized for an H200, and its small
  # variant trains here and on 16 devices (test_gem_base.py).
  [
    n
    for n in config.available_configs()
    if n not in ("movielens", "taobao", "gem_base")
  ],
)
def test_every_config_runs_one_step(name, tmp_path):
  """The full model of every config builds and takes a step (small data, one
  device: the multi-device path is tested above)."""
  cfg = config.load(
    name,
    [o for o in TINY if o.startswith(("data.", "train."))]
    + ["train.steps=1", "mesh.data_shards=1", "data.workers=0"]
    + ["mesh.cluster=1", "mesh.zone=1", "mesh.node=-1"],
  )
  result = train(cfg, tmp_path, devices=jax.devices()[:1])
  assert set(result) == set(cfg.model.tasks)
  assert losses(tmp_path) and np.isfinite(losses(tmp_path)[0])


@pytest.mark.slow
def test_upscale_copies_blocks_by_layer_map(tmp_path):
  one = jax.devices()[:1]  # copying blocks is the same on any mesh
  shallow = tiny("model.num_layers=3", "train.steps=2", "mesh.node=1")
  train(shallow, tmp_path / "shallow", devices=one)
  deep = tiny("model.num_layers=5", "train.steps=1", "mesh.node=1")
  layer_map = (0, 1, 2, 1, 2)
  upscaled_start(
    Trainer.create(shallow, tmp_path / "shallow", devices=one),
    Trainer.create(deep, tmp_path / "deep", devices=one),
    layer_map,
  )
  src, _ = final_state(tmp_path / "shallow", shallow, devices=one)
  dst, _ = final_state(tmp_path / "deep", deep, devices=one)
  assert int(dst["step"]) == 0
  old = src["params"]["seqformer"]["blocks"]
  new = dst["params"]["seqformer"]["blocks"]
  for i, j in enumerate(layer_map):
    for x, y in zip(
      jax.tree.leaves(new[i]), jax.tree.leaves(old[j]), strict=True
    ):
      np.testing.assert_array_equal(x, y)
  train(deep, tmp_path / "deep", devices=one)  # and it trains on from there
  assert len(losses(tmp_path / "deep")) == 1


def test_equal_configs_share_compiled_steps(tmp_path):
  """Trainers of equal configs on one mesh share the jitted steps (a resume
  or a rerun in the same process compiles nothing); another config, or the
  same one on other devices, gets its own."""
  a = Trainer.create(tiny(), tmp_path / "a")
  b = Trainer.create(tiny(), tmp_path / "b")
  assert a.train_step is b.train_step and a.eval_step is b.eval_step
  other = Trainer.create(tiny("train.learning_rate=1e-2"), tmp_path / "c")
  assert other.train_step is not a.train_step
  fewer = Trainer.create(tiny(), tmp_path / "d", devices=jax.devices()[:4])
  assert fewer.train_step is not a.train_step

  # Four kept, the least recently used dropped first. Now kept, oldest
  # first: tiny() on 8 devices, lr 1e-2, tiny() on 4 devices (whatever
  # earlier tests in this process left is older, and gone by the fourth).
  def steps(cfg):
    return Trainer.create(cfg, tmp_path / "x").train_step

  steps(tiny("train.learning_rate=1e-3"))  # a fourth
  assert steps(tiny()) is a.train_step  # used again: now the newest
  steps(tiny("train.learning_rate=5e-4"))  # a fifth: lr 1e-2 is dropped
  assert steps(tiny()) is a.train_step
  assert steps(tiny("train.learning_rate=1e-2")) is not other.train_step


def test_a_subset_of_tasks_trains_and_evaluates(tmp_path):
  """`model.tasks=cvr`: one head, trained on and scored against the CVR
  labels column (not broadcast against every column)."""
  cfg = tiny("model.tasks=cvr", "train.steps=1", "mesh.data_shards=1")
  result = train(cfg, tmp_path, devices=jax.devices()[:1])
  assert set(result) == {"cvr"}
  with open(tmp_path / "metrics.jsonl") as f:
    (rec,) = [r for r in map(json.loads, f) if r["event"] == "train"]
  assert len(rec["task_loss"]) == 1
  tr = Trainer.create(cfg, tmp_path, devices=jax.devices()[:1])
  assert tr.model_def.label_columns == (1,)
