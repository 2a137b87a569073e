"""Orbax checkpoints of everything an exact resume needs, and the config.

A checkpoint holds three items saved together at one step: `state` (the
training state: parameters, optimizer state, step, RNG key), `data` (every
process's data loader position, JSON: `{"processes": {"0": ..., "1": ...}}`)
and `config` (`gemjax.config.to_dict` of the run's config, JSON). Restoring
state and data and continuing gives bit-identical parameters to a run that
never stopped (tested in `tests/gemjax/train/test_train.py` and, with two
processes, `test_multihost.py`).

The stored config lets a resume notice that it is not continuing the same
run: `config_changes` lists the model and data fields that differ, which the
loop refuses unless told otherwise (a changed model would not fit the
checkpoint; changed data would silently train on other batches).

`restore_latest` takes the newest checkpoint that restores: one whose files
are truncated or corrupt (a crash while the disk filled up, a copy cut
short) is skipped with a one-line reason, so one bad checkpoint never
strands a run that has an older good one.

JSON items are written by process 0 only (Orbax's rule), so the loop
gathers every process's loader position before saving; Orbax also needs the
checkpoint directory to be one directory shared by all processes.
"""

import json
import logging
import pathlib

import jax
import orbax.checkpoint as ocp

# Fields that change how a run executes, not what it computes: they may
# differ between a checkpoint and the run resuming it.
RUNTIME_FIELDS = frozenset(
  {
    "data.prefetch",
    "data.workers",
    "data.read_chunk_bytes",
    "model.attention_implementation",
    "model.fp8_implementation",
  }
)


def config_changes(saved: dict, current: dict) -> list[str]:
  """`section.field old -> new` for each model or data field that differs
  between two `gemjax.config.to_dict` dicts as JSON stores them (a field
  missing from `saved`, e.g. added by a newer version of the code, counts as
  unchanged)."""
  out = []
  for section in ("model", "data"):
    old, new = saved.get(section, {}), current[section]
    for name in sorted(new):
      key = f"{section}.{name}"
      if name in old and old[name] != new[name] and key not in RUNTIME_FIELDS:
        out.append(f"{key} {_short(old[name])} -> {_short(new[name])}")
    out += [
      f"{section}.{n} (unknown here)" for n in sorted(set(old) - set(new))
    ]
  return out


def _short(value) -> str:
  text = json.dumps(value)
  return text if len(text) <= 40 else text[:37] + "..."


class CannotResume(Exception):
  """A run directory that this run cannot continue; the message, one line,
  says why and what to do (the CLI prints it without a traceback)."""


class Checkpointer:
  def __init__(self, directory, keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
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

  def restore_latest(self, like_state, check_config, agree=all, log=print):
    """(step, state, data, config) of the newest checkpoint that restores,
    or None when there is none.

    `check_config(saved_config_or_None)` runs before a checkpoint's state is
    read and raises to refuse the resume (that is no reason to skip). A
    checkpoint that fails to read is skipped, `log` saying which and why in
    one line. `agree([ok])` -> bool makes all processes take the same
    decision (the loop passes an all-gather; default: this process alone).
    Raises when checkpoints exist but none restores.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    skipped = []
    for step in steps:
      try:
        with _quiet():
          saved = self.config(step)
        error = None
      except Exception as e:  # noqa: BLE001 - reported and skipped
        saved, error = None, e
      if agree([error is None]):
        check_config(saved)
        try:
          with _quiet():
            state, data = self.restore(step, like_state)
        except Exception as e:  # noqa: BLE001 - reported and skipped
          error = e
      if agree([error is None]):
        for s, why in skipped:
          log(f"skipped checkpoint step {s}: {why}")
        return step, state, data, saved
      why = _one_line(error) if error else "another process could not read it"
      skipped.append((step, why))
    if skipped:
      raise CannotResume(
        f"no checkpoint in {self.directory} restores: "
        + "; ".join(f"step {s}: {why}" for s, why in skipped)
      )
    return None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


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
