"""`gem_base`: sized for one H200; its small variant trains on a simulated
16-device CPU mesh with FSDP, sharded tables and DHEN experts."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from gemjax import config
from gemjax.train import remat
from gemjax.train.loop import Trainer

H200_BYTES = 139 * 2**30


def test_gem_base_fits_one_h200():
  """The training state (parameters, AdamW moments, Adagrad accumulators)
  plus the estimated activations kept for the backward (every region
  `all`, `gemjax.train.remat`) and one gradient per parameter leave most
  of an H200 to XLA's working memory; and the width is where FP8 GEMMs
  pay (`docs/kernels/fp8.md`: 2048-deep products and wider)."""
  cfg = config.load("gem_base")
  assert cfg.model.d_model >= 1024 and cfg.model.ffn_mult == 4
  assert cfg.model.dhen_layers >= 1 and cfg.mesh.strategy.startswith("fsdp")
  tr = Trainer.create(cfg, "/nonexistent", devices=jax.devices()[:1])
  nbytes = lambda tree: sum(
    x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
  )
  state = nbytes(tr.abstract_state)
  grads = nbytes(tr.abstract_state["params"])
  acts = sum(v["all"][0] for v in remat.estimates(cfg).values())
  total = state + grads + acts
  print(f"state {state / 2**30:.1f} GiB, gradients {grads / 2**30:.1f}, "
        f"activations ~{acts / 2**30:.1f}")  # fmt: skip
  assert total < 0.5 * H200_BYTES


STEPS = 16


def _worker() -> dict:
  """In a process with 16 CPU devices: place `gem_base_small` and take
  `STEPS` training steps; what the test checks, as JSON."""
  from sharding import experts

  cfg = config.load("gem_base_small")
  tr = Trainer.create(cfg, "/nonexistent")
  shardings = tr.state_shardings["params"]
  specs = {
    "ffn": shardings["seqformer"]["blocks"][0]["ffn"]["gate"]["w"].spec,
    "items": shardings["embeddings"]["tables"]["item"].spec,
  }
  dhen = shardings["dhen"]["layers"][0]["w"]
  em = experts.expert_mesh(tr.mesh, cfg.mesh.strategy, 2)
  state = tr.init_state()
  params0 = jax.device_get(state["params"])
  loader = tr.loader()
  losses = []
  for _ in range(STEPS):
    state, m = tr.train_step(state, tr.to_device(next(loader)))
    losses.append(float(m["loss"]))
  loader.close()
  moved = jax.tree.map(
    lambda a, b: float(np.max(np.abs(a - b))),
    params0,
    jax.device_get(state["params"]),
  )
  return {
    "mesh": dict(tr.mesh.shape),
    "specs": {k: [list(a) if isinstance(a, tuple) else a for a in v]
              for k, v in specs.items()},  # fmt: skip
    "dhen_mesh_axes": list(dhen.mesh.axis_names),
    "expert_mesh": None if em is None else dict(em.shape),
    "losses": losses,
    "unmoved": [jax.tree_util.keystr(k) for k, v in
                jax.tree_util.tree_flatten_with_path(moved)[0] if v == 0],
  }  # fmt: skip


@pytest.mark.slow
def test_gem_base_small_trains_on_16_devices():
  """16 steps of `gem_base_small` on 2 x 2 x 4 simulated devices: dense
  weights FSDP-sharded inside a cluster (`zone`, `node`), the item table
  split by rows, the two DHEN experts on node pairs; the loss is finite
  and falls, and every parameter moves."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=16 "
    "--xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
  )
  code = (
    "import json, sys\n"
    "from tests.gemjax.train.test_gem_base import _worker\n"
    "print('RESULT ' + json.dumps(_worker()))"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code],
    cwd=pathlib.Path(__file__).parents[3],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  r = json.loads(line[len("RESULT ") :])
  print({k: v for k, v in r.items() if k != "losses"}, r["losses"])
  assert r["mesh"] == {"cluster": 2, "zone": 2, "node": 4}
  assert r["specs"]["ffn"] == [["zone", "node"], None]  # FSDP in the group
  assert r["specs"]["items"] == [["zone", "node"], None]  # rows split
  assert "expert" in r["dhen_mesh_axes"]  # one expert per GPU of a pair
  assert r["expert_mesh"]["expert"] == 2
  losses = np.asarray(r["losses"])
  assert len(losses) == STEPS and np.all(np.isfinite(losses))
  assert losses[-4:].mean() < losses[:4].mean(), losses
  assert r["unmoved"] == []
