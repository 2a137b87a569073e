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

Runs of `train` on two processes (`train_worker`) are killed with SIGKILL
and stopped with SIGTERM, restarted, and must end bit-identical to a run
that was never interrupted, with one shared run directory (Orbax) and with a
run directory per process (`{process}` in its name, as on hosts without a
shared disk). Run directories that differ per process without saying so
are refused at start with one line.

The workers are this file run as a module:
  python -m tests.gemjax.train.test_multihost worker
  python -m tests.gemjax.train.test_multihost train RUN_DIR
(`{pid}` in RUN_DIR: each process's own literal path, as if the hosts did
not share a disk; `{process}` is left to `train`.)
"""

import json
import os
import pathlib
import signal
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


def _xla_flags() -> None:
  os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=4 "
    "--xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
  )


def worker() -> None:
  _xla_flags()
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


def _launch(tmp_path, name, args, **more_env) -> list:
  """Start 2 worker processes; their output goes to tmp_path/name{pid}.*."""
  port = _free_port()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.update(
    more_env,
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
      open(tmp_path / f"{name}{pid}.out", "w") as out,
      open(tmp_path / f"{name}{pid}.err", "w") as err,
    ):
      procs.append(
        subprocess.Popen(
          [sys.executable, "-m", "tests.gemjax.train.test_multihost", *args],
          cwd=ROOT,
          env=dict(env),
          stdout=out,
          stderr=err,
        )
      )
  return procs


def _wait(procs, tmp_path, name, timeout=300) -> list[int]:
  """Return codes of `procs`, killing them all if one is late."""
  deadline = time.monotonic() + timeout
  try:
    for p in procs:
      p.wait(timeout=max(deadline - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    errs = [(tmp_path / f"{name}{i}.err").read_text() for i in range(2)]
    raise AssertionError(f"{name} hung: {errs[0][-2000:]}") from None
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [p.returncode for p in procs]


@pytest.mark.slow
def test_two_processes_train_like_one_device(tmp_path):
  procs = _launch(tmp_path, "worker", ["worker"])
  ref_losses, ref_params = _reference()  # while the workers compile
  codes = _wait(procs, tmp_path, "worker")
  outs = []
  for pid in range(2):
    err = (tmp_path / f"worker{pid}.err").read_text()
    assert codes[pid] == 0, err[-4000:]
    out = (tmp_path / f"worker{pid}.out").read_text()
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    outs.append(json.loads(line[len("RESULT ") :]))
  assert sorted(o["process"] for o in outs) == [0, 1]
  for o in outs:
    np.testing.assert_allclose(o["losses"], ref_losses, rtol=1e-5)
    np.testing.assert_allclose(o["params"], ref_params, rtol=1e-5)


# -- train(): kills, SIGTERM, run directories --------------------------------

TRAIN_STEPS = 8


def _train_config():
  import dataclasses

  cfg = _config()
  return dataclasses.replace(
    cfg,
    train=dataclasses.replace(
      cfg.train, steps=TRAIN_STEPS, checkpoint_every=2, log_every=1
    ),
  )


def train_worker(run_dir: str) -> None:
  """`train` on this process's part; with GEMJAX_TEST_STEP_S, each step
  takes at least that long (so a test can stop the run mid-way)."""
  _xla_flags()
  from gemjax.train.__main__ import _maybe_init_distributed

  _maybe_init_distributed()
  from gemjax.train import loop
  from gemjax.train.checkpoint import CannotResume
  from gemjax.train.runtime import Preempted

  pause = float(os.environ.get("GEMJAX_TEST_STEP_S", "0"))
  if pause:
    fast = loop.Trainer.train_step

    def slow(self):
      def step(*args):
        time.sleep(pause)
        return fast.fget(self)(*args)

      return step

    loop.Trainer.train_step = property(slow)
  try:
    loop.train(_train_config(), run_dir)
  except Preempted as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(143)
  except CannotResume as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def _records(run_dir, event="train"):
  path = run_dir / "metrics.jsonl"
  if not path.exists():
    return []
  with open(path) as f:
    return [r for r in map(json.loads, f) if r["event"] == event]


def _until(cond, procs, what, timeout=240):
  deadline = time.monotonic() + timeout
  while not cond():
    assert all(p.poll() is None for p in procs), f"exited before {what}"
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.1)


def _final(run_dir):
  """Final checkpoint's state (read onto one device, host arrays) and data
  position."""
  import dataclasses

  import jax

  from gemjax.train.checkpoint import Checkpointer
  from gemjax.train.loop import Trainer

  cfg = _train_config()
  one = dataclasses.replace(
    cfg, mesh=dataclasses.replace(cfg.mesh, zone=1, node=1)
  )
  tr = Trainer.create(one, run_dir, jax.devices()[:1])
  ckpt = Checkpointer(run_dir / "checkpoints")
  state, data = ckpt.restore(ckpt.latest_step(), tr.abstract_state)
  ckpt.close()
  return jax.device_get(state), data


def _same_as_shards(state, data, template, step):
  """Every shard each process saved at `step` in its own run directory
  equals that part of `state` (host arrays), bit for bit; its data position
  is `data`."""
  import jax

  from gemjax.train.checkpoint import ProcessCheckpointer

  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  full = {jax.tree_util.keystr(path): x for path, x in leaves}
  for pid in range(2):
    run_dir = pathlib.Path(str(template).replace("{process}", str(pid)))
    ckpt = ProcessCheckpointer(run_dir / "checkpoints", process=(pid, 2))
    shards, saved_data = ckpt.shards(step)
    assert saved_data == data
    assert sorted(shards) == sorted(full)
    for name, parts in shards.items():
      for index, part in parts.items():
        np.testing.assert_array_equal(
          part, full[name][tuple(slice(*ab) for ab in index)]
        )


def _straight(tmp_path):
  """An uninterrupted 2-process run in a shared run directory."""
  a = tmp_path / "a"
  assert _wait(_launch(tmp_path, "a", ["train", str(a)]), tmp_path, "a") == [
    0,
    0,
  ], (tmp_path / "a0.err").read_text()[-3000:]
  return a


@pytest.mark.slow
def test_killed_and_stopped_two_process_run_resumes_exactly(tmp_path, subtests):
  """Run B is SIGKILLed (both processes) after its step-4 checkpoint,
  restarted, stopped by SIGTERM (a checkpoint, exit 143 within 60 s),
  restarted again, and ends bit-identical to run A, which never stopped
  (in a shared directory): parameters, optimizer state, every process's
  data position, losses, with one record per step and data counters over
  both processes. B's run directory is shared, or one per process (each
  a subtest, both against the one run A)."""
  a = _straight(tmp_path)
  for layout in ("shared", "per_process"):
    with subtests.test(layout=layout):
      _resumes_exactly(tmp_path / layout, a, layout)


def _resumes_exactly(tmp_path, a, layout):
  import jax

  from gemjax.data import loader as data_loader

  tmp_path.mkdir()
  if layout == "shared":
    b = main = tmp_path / "b"
    saved = lambda step: (b / "checkpoints" / str(step)).exists()
    committed = [b / "checkpoints" / "4" / "commit_success.txt"]
  else:
    b, main = tmp_path / "b" / "{process}", tmp_path / "b" / "0"
    saved = lambda step: (main / "checkpoints" / f"step_{step}").exists()
    committed = [
      tmp_path / "b" / str(pid) / "checkpoints" / "step_4" / "committed"
      for pid in range(2)
    ]
  slow = {"GEMJAX_TEST_STEP_S": "0.5"}
  procs = _launch(tmp_path, "b", ["train", str(b)], **slow)
  _until(
    lambda: all(path.exists() for path in committed), procs, "checkpoint 4"
  )
  for p in procs:
    p.kill()
  _wait(procs, tmp_path, "b")
  assert not _records(main, "eval")
  start = len(_records(main))
  procs = _launch(tmp_path, "c", ["train", str(b)], **slow)
  _until(lambda: len(_records(main)) > start, procs, "a step after resuming")
  t0 = time.monotonic()
  for p in procs:
    p.send_signal(signal.SIGTERM)
  codes = _wait(procs, tmp_path, "c", timeout=60)
  assert time.monotonic() - t0 < 60
  err = (tmp_path / "c0.err").read_text()
  assert codes == [143, 143], err[-3000:]
  assert "stopped by SIGTERM at step" in err
  assert f"resumed {main} at step 4" in err
  stopped = int(err.split("stopped by SIGTERM at step ")[1].split(",")[0])
  assert saved(stopped)
  assert _wait(_launch(tmp_path, "d", ["train", str(b)]), tmp_path, "d") == [
    0,
    0,
  ], (tmp_path / "d0.err").read_text()[-3000:]

  sa, da = _final(a)
  assert int(sa["step"]) == TRAIN_STEPS and sorted(da["processes"]) == [
    "0",
    "1",
  ]
  if layout == "shared":
    sb, db = _final(b)
    assert da == db
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
      np.testing.assert_array_equal(x, y)
  else:
    _same_as_shards(sa, da, b, TRAIN_STEPS)
  ra, rb = _records(a), _records(main)
  assert [r["step"] for r in rb] == list(range(1, TRAIN_STEPS + 1))
  assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
  assert len(_records(main, "eval")) == 1
  # The counters cover both processes' shards: those of one loader of all.
  cfg = _train_config()
  it = data_loader.Loader(cfg.data, num_shards=8, split="train")
  for _ in range(TRAIN_STEPS):
    next(it)
  assert ra[-1]["data"] == it.counters
  it.close()


@pytest.mark.slow
def test_unshared_run_directories_without_process_are_refused(tmp_path):
  """Orbax writes one checkpoint from all processes into one directory: a
  run directory that each process sees on its own disk, but that does not
  name `{process}`, stops both processes at start in one line saying what
  to do, before any checkpoint could hang them."""
  procs = _launch(tmp_path, "p", ["train", str(tmp_path / "run{pid}")])
  assert _wait(procs, tmp_path, "p", timeout=120) == [2, 2]
  err = (tmp_path / "p1.err").read_text()
  assert err.count("\n") == 1, err
  assert err.startswith("error: process 1 does not see process 0's files")
  assert err.endswith(
    "needs one run directory on a file system shared by all processes, or "
    "one per process: put {process} in --run-dir (train.run_dir)\n"
  )


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
  worker()
elif __name__ == "__main__" and sys.argv[1:2] == ["train"]:
  train_worker(sys.argv[2].replace("{pid}", os.environ["GEMJAX_PROCESS_ID"]))
