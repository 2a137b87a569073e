"""Logical-axis rule tables: one per placement strategy.

A rule maps a logical axis name (what the model calls a dimension) to mesh
axes (which tiers split it). A dimension whose size the mesh axes do not
divide is left replicated rather than padded, and a mesh axis is used at most
once per array. Choosing a strategy is a config change (`mesh.strategy`).

`fsdp` (G5): dense parameters are sharded over (`zone`, `node`) and replicated
over `cluster`, so parameter all-gathers and gradient reduce-scatters stay
inside a group and only the gradient all-reduce crosses `cluster` (DDP across
groups). Embedding rows are split over every device (G7, generation 1).
The batch's leading (data-shard) axis is split over every device.
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec

ALL = ("cluster", "zone", "node")

STRATEGIES: dict[str, dict[str, tuple[str, ...]]] = {
  "fsdp": {
    # dense parameters
    "embed": ("zone", "node"),
    "mlp_in": ("zone", "node"),
    # embedding tables
    "table_rows": ALL,
    # activations
    "batch": ALL,
  },
  "replicated": {
    "batch": ALL,
  },
}


def logical_to_spec(logical_axes, shape, mesh, strategy: str) -> PartitionSpec:
  rules = _rules(strategy)
  used: set[str] = set()
  spec = []
  for name, size in zip(logical_axes, shape, strict=True):
    axes = tuple(
      a for a in rules.get(name, ()) if a not in used and mesh.shape[a] > 1
    )
    n = 1
    for a in axes:
      n *= mesh.shape[a]
    if not axes or size % n:
      spec.append(None)
      continue
    used.update(axes)
    spec.append(axes if len(axes) > 1 else axes[0])
  return PartitionSpec(*spec)


def tree_shardings(axes_tree, shapes_tree, mesh, strategy: str):
  """NamedShardings for a pytree, from parallel trees of axes and shapes."""
  return jax.tree.map(
    lambda axes, x: NamedSharding(
      mesh, logical_to_spec(axes, x.shape, mesh, strategy)
    ),
    axes_tree,
    shapes_tree,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def batch_sharding(mesh, strategy: str = "fsdp") -> NamedSharding:
  """Leading (data-shard) axis of batch arrays, split by the batch rule."""
  axes = tuple(a for a in _rules(strategy)["batch"] if mesh.shape[a] > 1)
  return NamedSharding(mesh, PartitionSpec(axes or None))


def _rules(strategy):
  try:
    return STRATEGIES[strategy]
  except KeyError:
    raise ValueError(
      f"unknown sharding strategy {strategy!r}; one of {sorted(STRATEGIES)}"
    ) from None
