"""`Placement`: the one object the train step asks where work runs.

It bundles a mesh and a strategy name (a rule table of `sharding.rules`)
and offers the two placement-aware operations the model cannot express with
logical axes alone: sharded embedding lookups (`sharding.embedding`, G7)
and expert parallelism (`sharding.experts`, G6). Dense layers need nothing
here: their parameters carry shardings and XLA's SPMD partitioner inserts
the FSDP all-gathers and reduce-scatters.
"""

import dataclasses
import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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

  def gather_dense(self, params, logical_axes, keep=None):
    """Dense parameters as full copies where they are used (FSDP, G5).

    Stored sharded, a weight is all-gathered inside its group before its
    layer runs, and its gradient is constrained back to the stored layout,
    so XLA reduces it inside the group and sends only the shard across
    `cluster`; the partitioner is not left to trade weight traffic for
    activation traffic. Tables and experts are returned as they are (their
    lookups and exchanges place them), and so is every weight `keep` (a
    pure dict parallel to `params`) marks: FP8 layers' weights, which the
    FP8 hook gathers in 8 bits (`fp8_hook`)."""
    full = NamedSharding(self.mesh, PartitionSpec())
    if keep is None:
      keep = jax.tree.map(lambda _: False, params)

    def one(axes, x, kept):
      if kept or "table_rows" in axes or "experts" in axes:
        return x
      spec = rules.logical_to_spec(axes, x.shape, self.mesh, self.strategy)
      return _gather(x, full, NamedSharding(self.mesh, spec))

    return jax.tree.map(one, logical_axes, params, keep, is_leaf=rules._is_axes)

  def fp8_hook(self):
    """The FP8 weight hook (G4): quantize the local shard, gather 8 bits."""
    from sharding.fp8 import QuantizedGather

    return QuantizedGather(self.mesh, self.strategy)

  def run_experts(self, w_el, x_s, fns):
    return experts.run_experts(self.mesh, self.strategy, w_el, x_s, fns)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x, full, stored):
  return jax.lax.with_sharding_constraint(x, full)


def _gather_fwd(x, full, stored):
  return _gather(x, full, stored), None


def _gather_bwd(full, stored, _, g):
  return (jax.lax.with_sharding_constraint(g, stored),)


_gather.defvjp(_gather_fwd, _gather_bwd)
