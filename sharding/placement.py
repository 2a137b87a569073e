"""`Placement`: the one object the train step asks where work runs.

It bundles a mesh and a strategy name (a rule table of `sharding.rules`)
and offers the two placement-aware operations the model cannot express with
logical axes alone: sharded embedding lookups (`sharding.embedding`, G7)
and expert parallelism (`sharding.experts`, G6). Dense layers need nothing
here: their parameters carry shardings and XLA's SPMD partitioner inserts
the FSDP all-gathers and reduce-scatters.
"""

import dataclasses

from jax.sharding import Mesh

from sharding import embedding, experts, rules


@dataclasses.dataclass(frozen=True)
class Placement:
  mesh: Mesh
  strategy: str = "fsdp"
  capacity_factor: float = embedding.DEFAULT_CAPACITY_FACTOR

  def __post_init__(self):
    rules.rule(self.strategy, "batch")  # an unknown name fails here

  def lookup(self, table_ve, ids):
    """One exchange for all id arrays `[S, ...]` of one table."""
    return embedding.lookup(
      table_ve,
      ids,
      mesh=self.mesh,
      strategy=self.strategy,
      capacity_factor=self.capacity_factor,
    )

  def run_experts(self, w_el, x_s, fns):
    return experts.run_experts(self.mesh, self.strategy, w_el, x_s, fns)
