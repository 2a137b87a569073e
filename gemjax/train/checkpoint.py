"""Orbax checkpoints of everything an exact resume needs.

A checkpoint holds the training state (parameters, optimizer state, step,
RNG key) and the data loader's position (JSON), saved together at one step.
Restoring both and continuing gives bit-identical parameters to a run that
never stopped (tested in `tests/gemjax/train/test_resume.py`).
"""

import pathlib

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory, keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict) -> None:
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
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

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
