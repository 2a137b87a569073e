"""Resuming a run directory: a corrupt checkpoint is skipped, another config
is refused, `train.steps` extends or only evaluates, `metrics.jsonl` keeps
one record per step, one run at a time, SIGTERM stops with a checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from gemjax.train.checkpoint import CannotResume
from gemjax.train.loop import Trainer, train
from gemjax.train.runtime import RunDir, RunLog
from tests.gemjax.train.test_train import TINY, final_state, tiny

ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)


ONE = jax.devices()[:1]


def tiny1(*more):
  """`tiny` on one device: the resume checks read the run directory, not
  the mesh, and one device compiles several times faster than eight."""
  return tiny("mesh.node=1", *more)


def records(run_dir, event):
  with open(run_dir / "metrics.jsonl") as f:
    return [r for r in map(json.loads, f) if r["event"] == event]


@pytest.mark.slow
def test_corrupt_latest_checkpoint_is_skipped_in_one_line(
  tmp_path, capsys, subtests
):
  """Checkpoint 3's data files cut in half: the resume says so in one line,
  restarts from checkpoint 2, redoes step 3 (saving it again), and ends
  bit-identical to a run that never stopped, with one metrics record per
  step; in either layout (a subtest each; a run directory per process: one
  process here)."""
  cfg = tiny1()
  train(cfg, tmp_path / "straight", devices=ONE)
  for layout in ("shared", "per_process"):
    with subtests.test(layout=layout):
      _skips_corrupt_checkpoint(tmp_path, capsys, cfg, layout)


def _skips_corrupt_checkpoint(tmp_path, capsys, cfg, layout):
  if layout == "per_process":
    template, run = tmp_path / "{process}", tmp_path / "0"
    files = [run / "checkpoints" / "step_3" / "arrays.bin"]
  else:
    template = run = tmp_path / "resumed"
    files = (run / "checkpoints" / "3" / "state").glob("ocdbt.process_*/d/*")
  assert train(cfg, template, stop_at=3, devices=ONE) == {}
  # Every data file of the state cut in half (a copy or a write cut short).
  for path in files:
    with open(path, "r+b") as f:
      f.truncate(path.stat().st_size // 2)
  capsys.readouterr()
  # Checkpoints at every step now: step 3 is written again.
  train(tiny1("train.checkpoint_every=1"), template, devices=ONE)
  err = capsys.readouterr().err.splitlines()
  assert err[0].startswith("skipped checkpoint step 3: ")
  assert err[1:] == [f"resumed {run} at step 2"]
  # The bad step 3 went at the resume, and its new save reads (Orbax
  # skips a step that exists, silently).
  tr = Trainer.create(cfg, template, devices=ONE)
  ckpt = tr.checkpointer()
  assert int(ckpt.restore(3, tr.abstract_state)[0]["step"]) == 3
  ckpt.close()
  a, data_a = final_state(tmp_path / "straight", cfg, devices=ONE)
  b, data_b = final_state(template, cfg, devices=ONE)
  assert data_a == data_b
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)
  straight = records(tmp_path / "straight", "train")
  resumed = records(run, "train")
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]
  assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
  assert len(records(run, "eval")) == 1


@pytest.mark.slow
def test_resume_checks_config_and_steps(tmp_path, capsys):
  run = tmp_path / "run"
  train(tiny1("train.steps=2"), run, devices=ONE)
  for change, says in [
    ("data.seed=1", "data.seed 0 -> 1"),
    ("model.d_model=64", "model.d_model 32 -> 64"),
    ("model.tasks=ctr", r'model.tasks \["ctr", "cvr"\] -> \["ctr"\]'),
  ]:
    with pytest.raises(CannotResume, match=says) as e:
      train(tiny1("train.steps=2", change), run, devices=ONE)
    assert "use a new --run-dir, or --allow-config-change" in str(e.value)
  # Knobs that change how, not what, are no change.
  capsys.readouterr()
  result = train(tiny1("train.steps=2", "data.prefetch=1"), run, devices=ONE)
  assert "already at step 2 (train.steps=2)" in capsys.readouterr().err
  assert set(result) == {"ctr", "cvr"}
  # Fewer steps: evaluate the checkpoint, no training; one eval record.
  train(
    tiny1("train.steps=1", "data.seed=1", "train.allow_config_change=1"),
    run,
    devices=ONE,
  )
  assert [r["step"] for r in records(run, "eval")] == [2]
  # More steps: the run goes on from its checkpoint.
  train(tiny1("train.steps=3"), run, devices=ONE)
  assert [r["step"] for r in records(run, "train")] == [1, 2, 3]
  assert [r["step"] for r in records(run, "eval")] == [2, 3]


def test_run_log_drops_what_a_resume_redoes(tmp_path):
  path = tmp_path / "metrics.jsonl"
  old = [
    {"event": "start", "step": 0},
    *({"event": "train", "step": s} for s in (1, 2, 3)),
    {"event": "eval", "step": 3},
  ]
  lines = "".join(json.dumps(r) + "\n" for r in old)
  path.write_text(lines + '{"event": "train", "st')  # a write cut short
  with RunLog(path, after=2) as log:
    log.write(event="train", step=3)
  read = lambda: [json.loads(x) for x in path.read_text().splitlines()]
  assert [(r["event"], r["step"]) for r in read()] == [
    ("start", 0),
    ("train", 1),
    ("train", 2),
    ("train", 3),
  ]
  path.write_text(lines)
  with RunLog(path, after=3, redo_eval=True) as log:
    log.write(event="eval", step=3)
  assert [r["event"] for r in read()].count("eval") == 1
  assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_a_run_directory_holds_one_run(tmp_path):
  with RunDir(tmp_path):
    with pytest.raises(CannotResume, match=f"pid {os.getpid()} holds"):
      with RunDir(tmp_path):
        pass
  with RunDir(tmp_path):  # free again
    pass


@pytest.mark.slow
def test_cli_refuses_a_changed_config_in_one_line(tmp_path, capsys):
  from gemjax.train.__main__ import main

  run = tmp_path / "run"
  sets = [x for o in [*TINY, "train.steps=1"] for x in ("--set", o)]
  assert main(["--run-dir", str(run), *sets]) == 0
  capsys.readouterr()
  assert main(["--run-dir", str(run), *sets, "--set", "data.seed=3"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "data.seed 0 -> 3" in err


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits(tmp_path):
  """The CLI, sent SIGTERM mid-run, checkpoints the step it is at and exits
  with 143 within a bounded time; running it again resumes there."""
  run = tmp_path / "run"
  sets = [
    x
    for o in TINY + ["train.steps=100000", "train.checkpoint_every=100000"]
    for x in ("--set", o)
  ]
  cmd = [sys.executable, "-m", "gemjax.train", "--run-dir", str(run), *sets]
  env = dict(os.environ, PYTHONPATH=ROOT)
  with open(tmp_path / "err", "w") as err:
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=err)
  try:
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or not records(run, "train"):
      assert p.poll() is None, (tmp_path / "err").read_text()[-2000:]
      assert time.monotonic() < deadline
      time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  err = (tmp_path / "err").read_text()
  assert "checkpoint saved" in err and "Traceback" not in err
  step = int(err.split("stopped by SIGTERM at step ")[1].split(",")[0])
  assert step >= records(run, "train")[-1]["step"]
  assert sorted(os.listdir(run / "checkpoints")) == [str(step)]
