"""What surrounds the training steps: the run directory and its lock,
SIGTERM, `metrics.jsonl`, and small JSON exchanges between processes.

With several processes, the exchanges (`allgather_json` and its users),
`RunDir` and `StopSignal.requested` are collective: every process calls
them at the same point of the run.
"""

import fcntl
import json
import os
import pathlib
import signal
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from gemjax.train.checkpoint import CannotResume


class Preempted(Exception):
  """SIGTERM (a scheduler's stop or preemption) ended the run early; a
  checkpoint of `step` was saved first."""

  def __init__(self, step: int):
    super().__init__(f"stopped by SIGTERM at step {step}, checkpoint saved")
    self.step = step


def allgather_json(obj) -> list:
  """`obj` (JSON-serializable) of every process, in process order."""
  if jax.process_count() == 1:
    return [obj]
  raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.array([raw.size], np.int64))
  sizes = np.asarray(sizes).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: raw.size] = raw
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [
    json.loads(bytes(row[: int(n)]).decode())
    for row, n in zip(rows, sizes, strict=True)
  ]


def gathered_by_process(obj) -> dict:
  return {str(i): x for i, x in enumerate(allgather_json(obj))}


def sum_counters(per_process: list[dict]) -> dict:
  """Loader counters of the whole run (every process's shards)."""
  out: dict = {}
  for counters in per_process:
    for k, v in counters.items():
      out[k] = out.get(k, 0) + v
  return out


class RunDir:
  """The run directory, held for one run: an exclusive lock (`lock`,
  fcntl) makes a second run on the same directory fail at once instead of
  interleaving its checkpoints and records.

  Shared (the default): process 0 takes the lock, and every process must
  see the same directory (Orbax writes each checkpoint from all processes
  into one place), which a token written by process 0 and read by all
  checks before any checkpoint is touched. Per process (`per_process`, a
  run directory naming `{process}`): each process locks its own.
  """

  def __init__(self, path, per_process: bool = False):
    self.path = pathlib.Path(path)
    self.per_process = per_process
    self.lock = None

  def __enter__(self):
    self.path.mkdir(parents=True, exist_ok=True)
    error = ""
    token = ""
    if self.per_process or jax.process_index() == 0:
      error = self._lock()
      if not (error or self.per_process) and jax.process_count() > 1:
        token = f"{os.getpid()}.{time.time_ns()}"
        (self.path / "shared").write_text(token)
    if jax.process_count() > 1:
      token = allgather_json(token)[0]
      shared = self.path / "shared"
      if token and not (shared.exists() and shared.read_text() == token):
        error = (
          f"process {jax.process_index()} does not see process 0's files in "
          f"run directory {self.path}: a multi-process run needs one run "
          "directory on a file system shared by all processes, or one per "
          "process: put {process} in --run-dir (train.run_dir)"
        )
      error = next((e for e in allgather_json(error) if e), "")
    if error:
      self.__exit__()
      raise CannotResume(error)
    return self

  def _lock(self) -> str:
    """Take the lock: "" or why not."""
    self.lock = open(self.path / "lock", "a+")  # noqa: SIM115
    try:
      fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self.lock.seek(0)
      holder = self.lock.read().strip() or "?"
      self.lock.close()
      self.lock = None
      return (
        f"{self.path} is in use by another run (pid {holder} holds "
        f"{self.path / 'lock'}): wait for it, or use another --run-dir"
      )
    self.lock.truncate(0)
    self.lock.write(f"{os.getpid()}\n")
    self.lock.flush()
    return ""

  def __exit__(self, *exc):
    if self.lock is not None:
      self.lock.close()  # releases the lock
      self.lock = None


class StopSignal:
  """SIGTERM as a request to stop at a step boundary with a checkpoint.

  With several processes, `jax.distributed` already catches SIGTERM (its
  preemption notifier) and agrees on a step at which every process stops:
  `multihost_utils.reached_preemption_sync_point`, asked every step. One
  process has no such service: a handler sets a flag instead (and the
  previous handler comes back when the run ends).
  """

  def __init__(self):
    self.flag = False
    self.previous = None

  def __enter__(self):
    single = jax.process_count() == 1
    if single and threading.current_thread() is threading.main_thread():
      self.previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    self.flag = True

  def requested(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.flag

  def __exit__(self, *exc):
    if self.previous is not None:
      signal.signal(signal.SIGTERM, self.previous)
      self.previous = None


class RunLog:
  """`metrics.jsonl`: one JSON record per line, written by process 0 only.

  A resumed run redoes the steps after its checkpoint: on opening, records
  of steps after `after` (and, with `redo_eval`, the evaluation at `after`)
  are dropped, the file rewritten atomically (a temporary file renamed over
  it), so each step has one record however often the run was stopped.
  """

  def __init__(self, path, enabled=True, after: int = 0, redo_eval=False):
    self.f = None
    if not enabled:
      return
    path = pathlib.Path(path)
    if path.exists():
      with open(path) as f:
        lines = f.read().splitlines(keepends=True)
      # A kill in the middle of a write leaves a last line without its
      # newline: that record is lost (its step is redone), not an error.
      if lines and not lines[-1].endswith("\n"):
        lines.pop()
      redone = lambda r: (
        r["step"] > after
        or (redo_eval and r["step"] == after and r["event"] == "eval")
      )
      kept = [x for x in lines if x.strip() and not redone(json.loads(x))]
      tmp = path.with_name(path.name + ".tmp")
      tmp.write_text("".join(kept))
      os.replace(tmp, path)
    self.f = open(path, "a")  # noqa: SIM115

  def write(self, **record) -> None:
    if self.f is not None:
      self.f.write(json.dumps(record, default=json_default) + "\n")
      self.f.flush()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.f is not None:
      self.f.close()


def json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)
