"""Checkpoints of everything an exact resume needs, and the config, in one
of two layouts.

A checkpoint holds, at one step: `state` (the training state: parameters,
optimizer state, step, RNG key), `data` (every process's data loader
position, JSON: `{"processes": {"0": ..., "1": ...}}`) and `config`
(`gemjax.config.to_dict` of the run's config, JSON). Restoring state and
data and continuing gives bit-identical parameters to a run that never
stopped (tested in `tests/gemjax/train/test_train.py` and, with two
processes, `test_multihost.py`).

Two layouts, one per kind of run directory:

- `Checkpointer` (shared run directory, the default): Orbax, every process
  writing its part of one checkpoint into one directory that all of them
  see. JSON items are written by process 0 only (Orbax's rule), so the loop
  gathers every process's loader position before saving. Restores onto any
  mesh (Orbax reshards).
- `ProcessCheckpointer` (a run directory per process, for hosts without a
  shared disk; `train.run_dir` containing `{process}`): each process writes
  only what it holds, into its own directory: for every array of the state,
  its addressable shards (each distinct index once) in `arrays.bin`, and in
  `manifest.json` each shard's place in the global array, offset and CRC32,
  the global shapes and dtypes, the data item and the config. A step is
  written to `step_<n>.tmp`, fsynced and renamed to `step_<n>`; it is
  complete when `step_<n>/manifest.json` exists (written last). After every
  process has its step complete (an all-gather), each marks it `committed`
  and only then deletes old steps, so the processes always share a complete
  step. It restores only onto the same processes and the same shards per
  process (same mesh and strategy); anything else is refused in one line.

The stored config lets a resume notice that it is not continuing the same
run: `config_changes` lists the model and data fields that differ, which the
loop refuses unless told otherwise (a changed model would not fit the
checkpoint; changed data would silently train on other batches).

`restore_latest` (shared by both layouts) takes the newest checkpoint that
restores on every process: the candidates are the steps complete on all
processes, plus any step committed on one of them (its absence elsewhere is
a lost or damaged directory, reported, not a save cut short). One whose
files are truncated or corrupt (a crash while the disk filled up, a copy
cut short) is skipped with a one-line reason, so one bad checkpoint never
strands a run that has an older good one; every process takes each decision
together (an all-gather), so none waits in a collective the others left.
"""

import functools
import json
import logging
import os
import pathlib
import shutil
import zlib

import jax
import numpy as np
import orbax.checkpoint as ocp

# Fields that change how a run executes, not what it computes: they may
# differ between a checkpoint and the run resuming it.
RUNTIME_FIELDS = frozenset(
  {
    "data.prefetch",
    "data.workers",
    "data.read_chunk_bytes",
    "model.attention.implementation",
    "model.fp8.implementation",
  }
)


def config_changes(saved: dict, current: dict) -> list[str]:
  """`section.field old -> new` for each model or data field, nested ones
  by their full key (`model.attention.seq`), that differs between two
  `gemjax.config.to_dict` dicts of the same layout as JSON stores them (a
  field missing from `saved`, e.g. added by a newer version of the code,
  counts as unchanged)."""
  out = []
  for section in ("model", "data"):
    old = _leaves(saved.get(section, {}), f"{section}.")
    new = _leaves(current[section], f"{section}.")
    for key in sorted(new):
      if key in old and old[key] != new[key] and key not in RUNTIME_FIELDS:
        out.append(f"{key} {_short(old[key])} -> {_short(new[key])}")
    out += [f"{key} (unknown here)" for key in sorted(set(old) - set(new))]
  return out


def _leaves(d: dict, prefix: str) -> dict:
  """`{full key: value}` of a config section's fields, sub-configs opened."""
  out = {}
  for name, value in d.items():
    if isinstance(value, dict):
      out.update(_leaves(value, f"{prefix}{name}."))
    else:
      out[f"{prefix}{name}"] = value
  return out


def _short(value) -> str:
  text = json.dumps(value)
  return text if len(text) <= 40 else text[:37] + "..."


class CannotResume(Exception):
  """A run directory that this run cannot continue; the message, one line,
  says why and what to do (the CLI prints it without a traceback)."""


def alone(obj) -> list:
  """The all-gather of a run of one process: `[obj]`."""
  return [obj]


class _Checkpoints:
  """What both layouts share: the choice of the checkpoint to resume from.

  A layout sets `directory` and `gather` (an all-gather of small JSON
  objects over the processes, in process order) and provides `_held()`
  (this process's complete and committed steps; `CannotResume` when the
  directory holds the other layout), `config(step)`, `restore(step,
  like_state)` and `_discard_after(step)`.
  """

  directory: pathlib.Path
  gather = staticmethod(alone)

  def restore_latest(self, like_state, check_config, log=print):
    """(step, state, data, config) of the newest checkpoint that restores
    on every process, or None when there is none.

    `check_config(saved_config_or_None)` runs before a checkpoint's state
    is read and raises `CannotResume` to refuse the resume (that is no
    reason to skip). A checkpoint that fails to read on some process is
    skipped, `log` saying which and why in one line. Raises `CannotResume`
    when checkpoints exist but none restores. Steps after the one restored
    (or all, when none is) are discarded: they belong to no step every
    process holds, and the run writes them again.
    """
    mine, why = self._agreed(self._held)
    if why is not None:
      raise CannotResume(f"cannot list the checkpoints: {why}")
    held = self.gather(mine)
    complete = set.intersection(*(set(h["complete"]) for h in held))
    committed = {s for h in held for s in h["committed"]}
    skipped = []
    for step in sorted(complete | committed, reverse=True):
      saved, why = self._agreed(
        functools.partial(
          self._checked_config, step, mine["complete"], check_config
        )
      )
      if why is None:
        restored, why = self._agreed(
          functools.partial(self._quiet_restore, step, like_state)
        )
      if why is None:
        for s, reason in skipped:
          log(f"skipped checkpoint step {s}: {reason}")
        self._discard_after(step)
        return step, *restored, saved
      skipped.append((step, why))
    if skipped:
      raise CannotResume(
        f"no checkpoint in {self.directory} restores: "
        + "; ".join(f"step {s}: {why}" for s, why in skipped)
      )
    self._discard_after(-1)
    return None

  def _checked_config(self, step: int, complete, check_config):
    if step not in complete:
      # Committed elsewhere: this process had it complete once.
      raise FileNotFoundError(f"step {step} is missing from {self.directory}")
    with _quiet():
      saved = self.config(step)
    check_config(saved)
    return saved

  def _quiet_restore(self, step: int, like_state):
    with _quiet():
      return self.restore(step, like_state)

  def _agreed(self, fn):
    """`fn()` on every process, and one verdict for all: (this process's
    value, None) when it succeeded everywhere, else (None, why it failed
    on the first process that failed); a `CannotResume` raised on any
    process is raised on all."""
    value, outcome = None, None
    try:
      value = fn()
    except CannotResume as e:
      outcome = ["refuse", str(e)]
    except Exception as e:  # noqa: BLE001 - reported, the step skipped
      outcome = ["fail", _one_line(e)]
    outcomes = self.gather(outcome)
    for o in outcomes:
      if o is not None and o[0] == "refuse":
        raise CannotResume(o[1])
    for i, o in enumerate(outcomes):
      if o is not None:
        return None, o[1] if len(outcomes) == 1 else f"process {i}: {o[1]}"
    return value, None


class Checkpointer(_Checkpoints):
  """Orbax checkpoints in one run directory that every process sees."""

  def __init__(self, directory, keep: int = 2, gather=alone):
    self.directory = pathlib.Path(directory).absolute()
    self.gather = gather
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict, config: dict) -> None:
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config),
      ),
    )

  def restore(self, step: int, like_state):
    """State shaped and placed like `like_state`, and the data position."""
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      like_state,
    )
    out = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
      ),
    )
    return out["state"], out["data"]

  def config(self, step: int) -> dict | None:
    """The config dict saved at `step` (None for a checkpoint without one)."""
    if not (self.directory / str(step) / "config").exists():
      return None
    out = self.manager.restore(
      step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
    )
    return out["config"]

  def _held(self) -> dict:
    if any(self.directory.glob("step_*")):
      raise CannotResume(
        f"{self.directory} holds checkpoints of a run directory per "
        "process (step_<n>/): resume it with {process} in --run-dir"
      )
    steps = list(self.manager.all_steps())
    return {"complete": steps, "committed": steps}

  def _discard_after(self, step: int) -> None:
    # Orbax refuses to save a step that exists (a skipped one, which the
    # resumed run reaches again); `delete` is collective, as is this call.
    for later in self.manager.all_steps():
      if later > step:
        self.manager.delete(later)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


_MANIFEST = "manifest.json"
_ARRAYS = "arrays.bin"
_COMMITTED = "committed"


class ProcessCheckpointer(_Checkpoints):
  """This process's part of every checkpoint, in its own directory (the
  layout is in the module docstring). Saves are synchronous: a step's
  arrays are on disk when `save` returns, which is what lets every process
  mark the step committed after one all-gather."""

  def __init__(self, directory, keep: int = 2, gather=alone, process=None):
    """`process`: (index, count), default this JAX process's (tests play
    several processes in one with their own `gather`)."""
    self.directory = pathlib.Path(directory).absolute()
    self.keep = keep
    self.gather = gather
    self.process = process or (jax.process_index(), jax.process_count())
    self.directory.mkdir(parents=True, exist_ok=True)

  def _path(self, step: int) -> pathlib.Path:
    return self.directory / f"step_{step}"

  def _steps(self, marker: str) -> list[int]:
    """Steps whose directory holds `marker`, oldest first."""
    return sorted(
      int(p.name[5:])
      for p in self.directory.glob("step_*")
      if p.name[5:].isdigit() and (p / marker).exists()
    )

  def latest_step(self) -> int | None:
    """The newest step complete here (other processes may lack it)."""
    steps = self._steps(_MANIFEST)
    return steps[-1] if steps else None

  def save(self, step: int, state, data_state: dict, config: dict) -> None:
    """Write this process's shards of `state`, then (an all-gather: every
    process calls `save` at the same step) mark the step committed and
    delete all but the newest `keep` steps."""
    final = self._path(step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    arrays = {}
    offset = 0
    with open(tmp / _ARRAYS, "wb") as f:
      for name, x in _named_leaves(state):
        if not isinstance(x, jax.Array):
          x = np.asarray(x)
        shards = []
        for index, data in _distinct_shards(x):
          raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
          f.write(raw.data)
          shards.append(
            {
              "index": index,
              "offset": offset,
              "nbytes": raw.size,
              "crc32": zlib.crc32(raw),
            }
          )
          offset += raw.size
        arrays[name] = {
          "shape": list(x.shape),
          "dtype": str(x.dtype),
          "shards": shards,
        }
      f.flush()
      os.fsync(f.fileno())
    index, count = self.process
    manifest = {
      "step": step,
      "process": index,
      "processes": count,
      "arrays": arrays,
      "data": data_state,
      "config": config,
    }
    # Written last: its presence is what makes the step complete.
    with open(tmp / _MANIFEST, "w") as f:
      json.dump(manifest, f)
      f.flush()
      os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # left by a run that stopped before it resumed
      _remove(final)
    os.rename(tmp, final)
    _fsync_dir(self.directory)
    steps = self.gather(step)
    if set(steps) != {step}:
      raise RuntimeError(f"processes saved different steps: {steps}")
    (final / _COMMITTED).touch()
    for old in self._steps(_MANIFEST)[: -self.keep]:
      _remove(self._path(old))

  def _manifest(self, step: int) -> dict:
    """`step`'s manifest, refused unless this process wrote it."""
    path = self._path(step)
    with open(path / _MANIFEST) as f:
      m = json.load(f)
    index, count = self.process
    if (m["process"], m["processes"]) != (index, count):
      raise CannotResume(
        f"{path} was written by process {m['process']} of "
        f"{m['processes']}, this is process {index} of {count}: resume with "
        "the same processes, each with its own run directory"
      )
    return m

  def config(self, step: int) -> dict | None:
    return self._manifest(step)["config"]

  def shards(self, step: int) -> tuple[dict, dict]:
    """({leaf name: {index: numpy array}}, data position): every shard this
    process saved at `step`, each checked against its CRC, as numpy (to
    inspect a checkpoint, or assemble one from every process's directory,
    without this process's devices). An index is ((start, stop), ...) in
    the global array."""
    m = self._manifest(step)
    shards = {
      name: {
        _key(s["index"]): self._read(step, name, s, saved)
        for s in saved["shards"]
      }
      for name, saved in m["arrays"].items()
    }
    return shards, m["data"]

  def _read(self, step: int, name: str, shard: dict, saved: dict):
    path = self._path(step) / _ARRAYS
    raw = np.fromfile(
      path, np.uint8, count=shard["nbytes"], offset=shard["offset"]
    )
    if raw.size != shard["nbytes"]:
      raise ValueError(f"{path} is cut short ({name})")
    if zlib.crc32(raw) != shard["crc32"]:
      raise ValueError(f"{path}: {name} fails its CRC32 check")
    shape = [stop - start for start, stop in shard["index"]]
    return raw.view(np.dtype(saved["dtype"])).reshape(shape)

  def restore(self, step: int, like_state):
    """State shaped and placed like `like_state` (its leaves carry their
    shardings), and the data position. Each of this process's devices gets
    the shard saved for its index; a needed index that was not saved (another
    mesh or strategy) is refused."""
    m = self._manifest(step)
    named, treedef = _named_leaves(like_state, with_treedef=True)
    out = []
    for name, like in named:
      saved = m["arrays"].get(name)
      if saved is None:
        raise KeyError(f"{name} is not in the checkpoint")
      have = f"{saved['dtype']}{saved['shape']}"
      want = f"{like.dtype}{list(like.shape)}"
      if have != want:
        raise ValueError(f"{name} is {have} in the checkpoint, {want} here")
      by_index = {_key(s["index"]): s for s in saved["shards"]}
      read = {}
      parts = []
      needed = like.sharding.addressable_devices_indices_map(like.shape)
      for device, index in needed.items():
        key = _key(_index(index, like.shape))
        if key not in by_index:
          raise CannotResume(
            f"{self._path(step)} holds other shards of {name} than this "
            f"process needs ({_show(key)} is not among "
            f"{', '.join(_show(k) for k in by_index)}): resume on the mesh "
            "(mesh.*) of the run that wrote it"
          )
        if key not in read:
          read[key] = self._read(step, name, by_index[key], saved)
        parts.append(jax.device_put(read[key], device))
      out.append(
        jax.make_array_from_single_device_arrays(
          like.shape, like.sharding, parts
        )
      )
    return jax.tree.unflatten(treedef, out), m["data"]

  def _held(self) -> dict:
    if any(p.name.isdigit() for p in self.directory.iterdir()):
      raise CannotResume(
        f"{self.directory} holds checkpoints of a shared run directory "
        "(Orbax, <n>/): resume it without {process} in --run-dir"
      )
    return {
      "complete": self._steps(_MANIFEST),
      "committed": self._steps(_COMMITTED),
    }

  def _discard_after(self, step: int) -> None:
    for p in self.directory.glob("step_*"):
      n = p.name[5:]
      if not n.isdigit() or int(n) > step:  # also `.tmp` and `.del` ones
        _remove(p)

  def wait(self) -> None:
    """Saves are synchronous."""

  def close(self) -> None:
    pass


def _named_leaves(tree, with_treedef=False):
  """[(name, leaf)] with names like `['params']['dense']['w']`."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  named = [(jax.tree_util.keystr(path), x) for path, x in leaves]
  return (named, treedef) if with_treedef else named


def _index(index: tuple, shape) -> list[list[int]]:
  """A shard's index (slices) as [[start, stop], ...] in the global array."""
  return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def _key(index) -> tuple:
  return tuple(tuple(x) for x in index)


def _show(key: tuple) -> str:
  return "[" + ", ".join(f"{a}:{b}" for a, b in key) + "]"


def _distinct_shards(x):
  """(index, numpy data) of each distinct shard of `x` held here."""
  if not isinstance(x, jax.Array):
    yield [[0, n] for n in x.shape], x
    return
  seen = set()
  for shard in x.addressable_shards:
    index = _index(shard.index, x.shape)
    if _key(index) not in seen:
      seen.add(_key(index))
      yield index, np.asarray(shard.data)


def _fsync_dir(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _remove(path: pathlib.Path) -> None:
  """Delete a step's directory, renaming it first: a kill midway leaves a
  `.del` directory, never a step that looks complete with files missing."""
  if not path.name.endswith((".tmp", ".del")):
    gone = path.with_name(path.name + ".del")
    shutil.rmtree(gone, ignore_errors=True)
    os.rename(path, gone)
    path = gone
  shutil.rmtree(path, ignore_errors=True)


def _one_line(e: BaseException) -> str:
  first = (str(e).strip().splitlines() or [""])[0]
  # TensorStore appends a repr of its whole status object; the read that
  # failed is what says why.
  first = first.split(" See full TensorStore details")[0]
  if len(first) > 200:
    first = first[:197] + "..."
  return f"{type(e).__name__}: {first}"


class _quiet:
  """Orbax and TensorStore log every failed read of a corrupt checkpoint
  (thousands of lines); the skip is reported in one line instead."""

  def __enter__(self):
    self.logger = logging.getLogger("absl")
    self.level = self.logger.level
    self.logger.setLevel(logging.CRITICAL)

  def __exit__(self, *exc):
    self.logger.setLevel(self.level)
