"""The model as pure pytrees: build, bind parameters, and their placement.

Training works on plain nested dicts of arrays (`params`), which optax,
Orbax and `jax.jit` shardings all understand. `ModelDef` keeps what turns them
back into an NNX module (`bind`) and each parameter's logical axes.
"""

import dataclasses

import jax
from flax import nnx

from gemjax.data.config import TASKS
from gemjax.model.ranking import RankingModel
from gemjax.train import remat


@dataclasses.dataclass(frozen=True)
class ModelDef:
  graphdef: nnx.GraphDef
  template: nnx.State  # abstract state: shapes, dtypes, metadata
  logical_axes: dict  # pure dict of tuples, parallel to params
  # Columns of the batch's `labels` (one per data TASKS name) that the
  # model's heads predict, in head order: `model.tasks` may be a subset.
  label_columns: tuple[int, ...]

  def bind(self, params) -> RankingModel:
    state = jax.tree.map(lambda x: x, self.template)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(self.graphdef, state)


def build(cfg, seed: int, *, abstract: bool = False):
  """`cfg` is a `Config`. Returns (ModelDef, params) with params on host, or
  with `abstract` their shapes and dtypes only (`jax.ShapeDtypeStruct`
  leaves, no initializer runs: what placement and restoring need).
  `train.activation_budget_gb` turns into per-region checkpoint policies
  here (`remat.resolve`)."""
  cfg = remat.resolve(cfg)

  def make():
    return RankingModel(
      cfg.model,
      cfg.data.vocab_sizes(),
      cfg.data.num_dense,
      rngs=nnx.Rngs(seed),
    )

  model = nnx.eval_shape(make) if abstract else make()
  graphdef, state = nnx.split(model, nnx.Param)
  axes = nnx.to_pure_dict(
    jax.tree.map(
      lambda v: v.get_metadata()["logical_axes"],
      state,
      is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
  )
  params = nnx.to_pure_dict(state)
  template = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state
  )
  columns = tuple(TASKS.index(t) for t in cfg.model.tasks)
  return ModelDef(graphdef, template, axes, columns), params
