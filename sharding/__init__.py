"""Placement: meshes from network tiers and logical-axis rule tables.

Only this package knows mesh axes; models name logical axes only.
- `mesh`: tiers -> a `Mesh` with axes ("cluster", "zone", "node");
- `rules`: one logical-axis rule table per strategy (G5, G7 generations);
- `embedding`: sharded lookups with bucketed all-to-all (G7);
- `experts`: one expert per GPU of a node group, FSDP over zone (G6);
- `placement`: `Placement(mesh, strategy)`, what the train step uses.
"""

from sharding.mesh import AXES, make_mesh
from sharding.placement import Placement, tree_shardings
from sharding.rules import (
  STRATEGIES,
  batch_axes,
  batch_sharding,
  logical_to_spec,
  state_axes,
)

__all__ = [
  "AXES",
  "STRATEGIES",
  "Placement",
  "batch_axes",
  "batch_sharding",
  "logical_to_spec",
  "make_mesh",
  "state_axes",
  "tree_shardings",
]
