"""Multi-host training: 2 local CPU processes x 4 devices, real train steps.

The processes join through `jax.distributed.initialize`, driven by the
environment variables the train entry point reads (`GEMJAX_COORDINATOR`,
`GEMJAX_NUM_PROCESSES`, `GEMJAX_PROCESS_ID`), on a free local port. The
mesh is 1 x 2 x 4: `zone` spans the two processes (hosts), `node` the 4
devices of each, so under `fsdp_grouped_split` the embedding all-to-all and
the experts' FSDP all-gathers cross the process boundary while row
re-assembly and the expert pair exchange stay inside a process. Each
process loads only its own 4 data shards. The losses and parameters must
equal one device training on all 8 shards.

The worker is this file run as a module:
  python -m tests.gemjax.train.test_multihost worker
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

STEPS = 3
STRATEGY = "fsdp_grouped_split"
MESH = (1, 2, 4)
ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)


def _config(mesh=MESH):
  from tests.sharding.meshes_worker import config

  return config(STRATEGY, mesh)


def _summary(params) -> list[float]:
  """Per-leaf sums of squares, as host floats (global arrays allowed)."""
  import jax
  import jax.numpy as jnp

  sums = jax.jit(lambda p: [jnp.sum(x * x) for x in jax.tree.leaves(p)])
  return [float(x) for x in sums(params)]


def worker() -> None:
  os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=4 "
    "--xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
  )
  from gemjax.train.__main__ import _maybe_init_distributed

  _maybe_init_distributed()
  import jax

  import sharding
  from gemjax.train.loop import Trainer

  pid = jax.process_index()
  assert jax.process_count() == 2 and len(jax.local_devices()) == 4
  cfg = _config()
  tr = Trainer.create(cfg, "/nonexistent")
  # `zone` = hosts: each zone index holds exactly one process's devices.
  for z in range(2):
    assert {d.process_index for d in tr.mesh.devices[0, z]} == {z}
  # Hosts grouped into zones by id: process 1 in zone 0 comes first.
  m = sharding.make_mesh(2, 1, 4, zone_of_process=[1, 0])
  assert {d.process_index for d in m.devices[0].flat} == {1}
  loader = tr.loader()
  state = tr.init_state()
  losses = []
  for _ in range(STEPS):
    batch = next(loader)
    assert batch.offsets.shape[0] == 4  # this process's shards only
    state, metrics = tr.train_step(state, tr.to_device(batch))
    losses.append(float(metrics["loss"]))
  loader.close()
  out = {"process": pid, "losses": losses, "params": _summary(state["params"])}
  print("RESULT " + json.dumps(out), flush=True)
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _reference():
  """One device, all 8 shards, the same steps."""
  import jax

  from gemjax.data import loader as data_loader
  from gemjax.train.loop import Trainer

  cfg = _config((1, 1, 1))
  tr = Trainer.create(cfg, "/nonexistent", devices=jax.devices()[:1])
  it = data_loader.Loader(
    cfg.data, num_shards=8, split="train", process_index=0, process_count=1
  )
  state = tr.init_state()
  losses = []
  for _ in range(STEPS):
    state, metrics = tr.train_step(state, tr.to_device(next(it)))
    losses.append(float(metrics["loss"]))
  it.close()
  return losses, _summary(state["params"])


@pytest.mark.slow
def test_two_processes_train_like_one_device(tmp_path):
  port = _free_port()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.update(
    GEMJAX_COORDINATOR=f"127.0.0.1:{port}",
    GEMJAX_NUM_PROCESSES="2",
    PYTHONPATH=ROOT,
  )
  # Output goes to files, not pipes: a worker blocked on a full pipe that
  # nobody drains would stall its peer in the next collective.
  procs = []
  for pid in range(2):
    env["GEMJAX_PROCESS_ID"] = str(pid)
    with (
      open(tmp_path / f"worker{pid}.out", "w") as out,
      open(tmp_path / f"worker{pid}.err", "w") as err,
    ):
      procs.append(
        subprocess.Popen(
          [sys.executable, "-m", "tests.gemjax.train.test_multihost", "worker"],
          cwd=ROOT,
          env=dict(env),
          stdout=out,
          stderr=err,
        )
      )
  ref_losses, ref_params = _reference()  # while the workers compile
  deadline = time.monotonic() + 300
  outs = []
  try:
    for pid, p in enumerate(procs):
      p.wait(timeout=max(deadline - time.monotonic(), 1))
      err = (tmp_path / f"worker{pid}.err").read_text()
      assert p.returncode == 0, err[-4000:]
      out = (tmp_path / f"worker{pid}.out").read_text()
      line = next(x for x in out.splitlines() if x.startswith("RESULT "))
      outs.append(json.loads(line[len("RESULT ") :]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert sorted(o["process"] for o in outs) == [0, 1]
  for o in outs:
    np.testing.assert_allclose(o["losses"], ref_losses, rtol=1e-5)
    np.testing.assert_allclose(o["params"], ref_params, rtol=1e-5)


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
  worker()
