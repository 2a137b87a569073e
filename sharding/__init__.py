"""Placement: meshes from network tiers and logical-axis rule tables.

Only this package knows mesh axes; models name logical axes only.
"""

from sharding.mesh import AXES, make_mesh
from sharding.rules import (
  STRATEGIES,
  batch_sharding,
  logical_to_spec,
  tree_shardings,
)

__all__ = [
  "AXES",
  "STRATEGIES",
  "batch_sharding",
  "logical_to_spec",
  "make_mesh",
  "tree_shardings",
]
