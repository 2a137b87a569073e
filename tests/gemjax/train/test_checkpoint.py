"""Checkpoints in a run directory per process (`ProcessCheckpointer`): the
shards round-trip bit for bit onto the same placement, and `restore_latest`
picks the newest step every process holds, skipping damaged ones and
refusing other processes or meshes in one line.

Two processes are played by two threads of this one, each with its own
directory and an all-gather through a barrier; both hold every device, so
each writes every shard. The loop's own use, on two real processes, is in
`test_multihost.py`.
"""

import json
import shutil
import threading
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gemjax.train.checkpoint import (
  CannotResume,
  Checkpointer,
  ProcessCheckpointer,
)

CONFIG = {"model": {"d_model": 8}, "data": {"seed": 0}}


def _mesh(shape=(2, 4)):
  return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("a", "b"))


def _state(mesh, step=1):
  """A state with a sharded, a bf16, a replicated and a scalar leaf."""
  at = lambda spec: NamedSharding(mesh, spec)
  w = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) * step
  return {
    "params": {
      "w": jax.device_put(w, at(P("a", "b"))),
      "v": jax.device_put(jnp.arange(16, dtype=jnp.bfloat16), at(P("b"))),
    },
    "rng": jax.device_put(jax.random.PRNGKey(step), at(P())),
    "step": jax.device_put(jnp.int32(step), at(P())),
  }


def _like(state):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    state,
  )


def _data(step, count=1):
  return {"processes": {str(i): {"at": step} for i in range(count)}}


def _accept(saved):
  assert saved == CONFIG


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.sharding == y.sharding
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_keeps_bits_and_placement(tmp_path):
  ckpt = ProcessCheckpointer(tmp_path, keep=2)
  mesh = _mesh()
  for step in (1, 2, 3):
    ckpt.save(step, _state(mesh, step), _data(step), CONFIG)
  # The newest two are kept, complete and committed; nothing half-written.
  names = sorted(p.name for p in tmp_path.iterdir())
  assert names == ["step_2", "step_3"]
  assert (tmp_path / "step_3" / "committed").exists()
  step, state, data, saved = ckpt.restore_latest(_like(_state(mesh)), _accept)
  assert (step, data, saved) == (3, _data(3), CONFIG)
  _equal(state, _state(mesh, 3))
  # Each distinct shard once: `w` in 8 blocks, `v` in 4, the rest whole.
  shards, data = ckpt.shards(3)
  assert data == _data(3)
  assert [len(shards[k]) for k in sorted(shards)] == [4, 8, 1, 1]
  np.testing.assert_array_equal(
    shards["['params']['w']"][((4, 8), (12, 16))],
    np.asarray(_state(mesh, 3)["params"]["w"])[4:8, 12:16],
  )


def test_a_corrupt_step_is_skipped_and_later_steps_discarded(tmp_path):
  ckpt = ProcessCheckpointer(tmp_path)
  mesh = _mesh()
  for step in (2, 4):
    ckpt.save(step, _state(mesh, step), _data(step), CONFIG)
  path = tmp_path / "step_4" / "arrays.bin"
  raw = bytearray(path.read_bytes())
  raw[5] ^= 1  # one bit flipped
  path.write_bytes(bytes(raw))
  said = []
  step, state, _, _ = ckpt.restore_latest(
    _like(_state(mesh)), _accept, log=said.append
  )
  assert step == 2
  assert said == [
    f"skipped checkpoint step 4: ValueError: {path}: ['params']['v'] fails "
    "its CRC32 check"
  ]
  _equal(state, _state(mesh, 2))
  # Step 4 will be written again by the resumed run.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


class _Processes:
  """`count` processes played by threads: `run(fn)` calls `fn(i, gather)`
  in each and returns their results (or exceptions), in process order."""

  def __init__(self, count=2):
    self.count = count
    self.barrier = threading.Barrier(count, timeout=60)
    self.slots = [None] * count

  def _gather(self, i):
    def gather(obj):
      self.slots[i] = obj
      self.barrier.wait()
      out = list(self.slots)
      self.barrier.wait()  # every process has read the slots
      return out

    return gather

  def run(self, fn) -> list:
    with futures.ThreadPoolExecutor(self.count) as pool:
      runs = [pool.submit(fn, i, self._gather(i)) for i in range(self.count)]
      return [f.exception() or f.result() for f in runs]


def _resume(tmp_path, like, said=None):
  """restore_latest in both processes: [(step or None, ...) or error]."""

  def one(i, gather):
    ckpt = ProcessCheckpointer(tmp_path / str(i), gather=gather, process=(i, 2))
    log = said.append if (said is not None and i == 0) else lambda _: None
    found = ckpt.restore_latest(like, _accept, log=log)
    return None if found is None else found[0]

  return _Processes().run(one)


def _save_both(tmp_path, mesh, steps):
  def one(i, gather):
    ckpt = ProcessCheckpointer(tmp_path / str(i), gather=gather, process=(i, 2))
    for step in steps:
      ckpt.save(step, _state(mesh, step), _data(step, 2), CONFIG)

  assert _Processes().run(one) == [None, None]


def test_processes_resume_at_the_newest_step_all_hold(tmp_path):
  mesh = _mesh()
  like = _like(_state(mesh))
  _save_both(tmp_path, mesh, [2, 4])
  # Process 0 finished step 6 and process 1 was killed before: step 6 is
  # not committed, so a save cut short, not a loss.
  alone = ProcessCheckpointer(
    tmp_path / "0", keep=3, gather=lambda x: [x, x], process=(0, 2)
  )
  alone.save(6, _state(mesh, 6), _data(6, 2), CONFIG)
  (tmp_path / "0" / "step_6" / "committed").unlink()
  (tmp_path / "1" / "step_6.tmp").mkdir()  # its write cut short
  said = []
  assert _resume(tmp_path, like, said) == [4, 4]
  assert said == []
  for i in (0, 1):
    assert sorted(p.name for p in (tmp_path / str(i)).iterdir()) == [
      "step_2",
      "step_4",
    ]
  # A committed step that one process lacks is a lost directory: said,
  # and the older step taken.
  shutil.rmtree(tmp_path / "1" / "step_4")
  assert _resume(tmp_path, like, said) == [2, 2]
  assert said == [
    f"skipped checkpoint step 4: process 1: FileNotFoundError: step 4 is "
    f"missing from {tmp_path / '1'}"
  ]
  # Nothing anywhere: a fresh start.
  for i in (0, 1):
    shutil.rmtree(tmp_path / str(i) / "step_2")
  assert _resume(tmp_path, like) == [None, None]


def test_a_process_with_no_step_left_is_refused_not_restarted(tmp_path):
  mesh = _mesh()
  _save_both(tmp_path, mesh, [2])
  shutil.rmtree(tmp_path / "1")
  out = _resume(tmp_path, _like(_state(mesh)))
  for e in out:
    assert isinstance(e, CannotResume)
    assert str(e) == (
      f"no checkpoint in {tmp_path / str(out.index(e))} restores: step 2: "
      f"process 1: FileNotFoundError: step 2 is missing from {tmp_path / '1'}"
    )
  assert (tmp_path / "0" / "step_2" / "committed").exists()  # kept


def test_other_processes_or_mesh_are_refused_in_one_line(tmp_path):
  mesh = _mesh()
  like = _like(_state(mesh))
  _save_both(tmp_path, mesh, [2])
  # Three processes now: process 0's step was written by one of two.
  one = ProcessCheckpointer(tmp_path / "0", process=(0, 3))
  with pytest.raises(CannotResume) as e:
    one.restore_latest(like, _accept)
  assert str(e.value) == (
    f"{tmp_path / '0' / 'step_2'} was written by process 0 of 2, this is "
    "process 0 of 3: resume with the same processes, each with its own run "
    "directory"
  )
  # Another mesh: the shards needed here were not saved.
  alone = ProcessCheckpointer(tmp_path / "alone")
  alone.save(2, _state(mesh, 2), _data(2), CONFIG)
  with pytest.raises(CannotResume) as e:
    alone.restore_latest(_like(_state(_mesh((4, 2)))), _accept)
  assert str(e.value).startswith(
    f"{tmp_path / 'alone' / 'step_2'} holds other shards of ['params']['v'] "
    "than this process needs ([0:8] is not among [0:4], [4:8], [8:12], "
    "[12:16]): "
  )
  assert str(e.value).endswith(
    "resume on the mesh (mesh.*) of the run that wrote it"
  )
  assert (tmp_path / "alone" / "step_2").exists()  # refused, not discarded


def test_a_directory_of_the_other_layout_is_refused(tmp_path):
  mesh = _mesh()
  orbax = Checkpointer(tmp_path / "orbax")
  orbax.save(1, _state(mesh), _data(1), CONFIG)
  orbax.wait()
  orbax.close()
  with pytest.raises(CannotResume, match="resume it without {process}"):
    ProcessCheckpointer(tmp_path / "orbax").restore_latest(
      _like(_state(mesh)), _accept
    )
  ours = ProcessCheckpointer(tmp_path / "ours")
  ours.save(1, _state(mesh), _data(1), CONFIG)
  with pytest.raises(CannotResume, match="resume it with {process}"):
    Checkpointer(tmp_path / "ours").restore_latest(_like(_state(mesh)), _accept)
  manifest = json.loads((tmp_path / "ours/step_1/manifest.json").read_text())
  assert (manifest["process"], manifest["processes"]) == (0, 1)
