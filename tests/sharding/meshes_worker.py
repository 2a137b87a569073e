"""Worker of `test_meshes.py`, run in a fresh process with 16 CPU devices.

  python -m tests.sharding.meshes_worker fsdp fsdp_grouped ...

Trains the same few steps on one device and, per strategy, on an 8-device
(2x2x2) and a 16-device (2x2x4) mesh, and prints one JSON object: losses,
largest parameter differences from one device, and the collectives of the
16-device train step (kind, tiers spanned, bytes, group size).
"""

import dataclasses
import json
import os
import sys
import time

STEPS = 3
SHARDS = 16  # data shards per step, the same global batch on every mesh


def config(strategy="fsdp", mesh=(1, 1, 1)):
  from gemjax.config import (
    Config,
    DataConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
  )

  # Small enough to compile in ~15 s on CPU: one SeqFormer layer, one
  # stage-2 cross block (without it the sequence path is dead code), one
  # DHEN layer (G6), tables whose rows 16 devices divide (item, category,
  # ts, price; `action`'s 4 rows stay replicated).
  return Config(
    name="meshes",
    model=ModelConfig(
      d_model=32,
      num_layers=1,
      num_heads=4,
      num_kv_heads=2,
      emb_dim=32,
      head_hidden=(32,),
      dhen_layers=1,
    ),
    data=DataConfig(
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
      bbs_minibatch=2,
      bbs_pool_batches=2,
      prefetch=0,
      eval_requests=64,
    ),
    train=TrainConfig(steps=50, warmup_steps=1, progress=False),
    mesh=MeshConfig(*mesh, strategy=strategy),
  )


def batches(cfg, steps=STEPS):
  from gemjax.data import loader

  it = loader.Loader(
    cfg.data, num_shards=SHARDS, split="train", process_index=0, process_count=1
  )
  out = [next(it) for _ in range(steps)]
  it.close()
  return out


def run(cfg, devices, data, want_hlo=False):
  import jax
  import numpy as np

  from gemjax.train.loop import Trainer
  from sharding import hlo

  tr = Trainer.create(cfg, "/nonexistent", devices=devices)
  state = tr.init_state()
  t0 = time.perf_counter()
  step = tr.train_step.lower(state, tr.to_device(data[0])).compile()
  compile_s = time.perf_counter() - t0
  losses = []
  for b in data:
    state, m = step(state, tr.to_device(b))
    losses.append(float(m["loss"]))
  out = {
    "losses": losses,
    "params": jax.tree.map(np.asarray, jax.device_get(state["params"])),
    "compile_s": compile_s,
  }
  if want_hlo:
    mesh_shape = dict(tr.mesh.shape)
    out["collectives"] = [
      {
        "kind": c.kind,
        "tiers": list(hlo.tiers(c, mesh_shape)),
        "bytes": c.bytes,
        "group_size": c.group_size,
        "in_loop": c.in_loop,
      }
      for c in hlo.collectives(step.as_text(), tr.mesh.size)
    ]
    shard_bytes = 0
    for x in jax.tree.leaves(state["params"]):
      shard_bytes += x.addressable_shards[0].data.nbytes
    out["param_bytes_per_device"] = shard_bytes
  return out


def main(strategies):
  import jax
  import numpy as np

  cfg0 = config()
  data = batches(cfg0)
  devices = jax.devices()
  ref = run(cfg0, devices[:1], data)
  result = {"reference": ref["losses"], "runs": {}}
  for strategy in strategies:
    for mesh, n in (((2, 2, 2), 8), ((2, 2, 4), 16)):
      cfg = dataclasses.replace(cfg0, mesh=config(strategy, mesh).mesh)
      r = run(cfg, devices[:n], data, want_hlo=(n == 16))
      diffs = jax.tree.map(
        lambda a, b: float(np.max(np.abs(a - b))), r["params"], ref["params"]
      )
      flat = jax.tree_util.tree_flatten_with_path(diffs)[0]
      worst = max(flat, key=lambda kv: kv[1])
      r.pop("params")
      r["max_param_diff"] = worst[1]
      r["worst_param"] = jax.tree_util.keystr(worst[0])
      result["runs"][f"{strategy}/{n}"] = r
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=16 "
    # Compile speed over code speed: these programs run a few tiny steps.
    "--xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
  )
  main(sys.argv[1:])
