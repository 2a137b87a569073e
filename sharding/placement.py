"""`Placement`: the one object the train step asks where work runs.

It bundles a mesh and a strategy name (a rule table of `sharding.rules`)
and offers the placement-aware operations the model cannot express with
logical axes alone: sharded embedding lookups (`sharding.embedding`, G7),
expert parallelism (`sharding.experts`, G6) and per-shard work for the
Pallas kernels (`per_shard`). Dense parameters carry their stored shardings;
`gather_dense` (under XLA's partitioner) and `per_shard` (in `shard_map`)
all-gather them inside their FSDP group where they are used, so their
gradients are reduce-scattered back inside the group.
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

    def one(axes, x, kept):
      if _stays_local(axes, kept):
        return x
      spec = rules.logical_to_spec(axes, x.shape, self.mesh, self.strategy)
      return _gather(x, full, NamedSharding(self.mesh, spec))

    keep = _no_keep(params) if keep is None else keep
    return jax.tree.map(one, logical_axes, params, keep, is_leaf=rules.is_axes)

  def per_shard(self, fn, logical_axes, keep=None):
    """`fn(params, batch)` over stacked data shards `[S, ...]`, run by each
    device on its own shards only (`shard_map` over the whole mesh).

    The Pallas kernels (attention, norms, FP8 matmuls) are custom calls,
    which XLA's SPMD partitioner cannot split: left to it, every device
    all-gathers the whole batch and runs the kernels on every shard (2 H200s
    ran a step 3x slower than one). Here the kernels see local shards.

    `params` go in as stored. Dense weights are all-gathered inside their
    FSDP group as `fn` receives them, so their gradients are reduce-scattered
    back inside the group and only the shard is summed across the axes the
    weight is replicated on (G5, as `gather_dense`). Tables and experts stay
    local (their lookups and exchanges run outside); weights `keep` marks
    (FP8 layers) stay local for the manual FP8 hook (`fp8_hook(manual=True)`),
    which gathers them in 8 bits."""
    mesh, strategy = self.mesh, self.strategy
    batch_spec = PartitionSpec(rules.batch_axes(mesh, strategy) or None)

    def spec(axes, x):
      return rules.logical_to_spec(axes, x.shape, mesh, strategy)

    def run(params, batch):
      kept = _no_keep(params) if keep is None else keep
      specs = jax.tree.map(spec, logical_axes, params, is_leaf=rules.is_axes)

      def body(params_local, batch_local):
        def gather(axes, x, p_spec, k):
          if _stays_local(axes, k):
            return x
          for dim, a in enumerate(p_spec):
            if a is not None:
              x = jax.lax.all_gather(x, a, axis=dim, tiled=True)
          return x

        used = jax.tree.map(
          gather,
          logical_axes,
          params_local,
          specs,
          kept,
          is_leaf=rules.is_axes,
        )
        return fn(used, batch_local)

      return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, batch_spec),
        out_specs=batch_spec,
        check_vma=False,
      )(params, batch)

    return run

  def fp8_hook(self, manual: bool = False):
    """The FP8 weight hook (G4): quantize the local shard, gather 8 bits."""
    from sharding.fp8 import QuantizedGather

    return QuantizedGather(self.mesh, self.strategy, manual)

  def run_experts(self, w_el, x_s, fns):
    return experts.run_experts(self.mesh, self.strategy, w_el, x_s, fns)


def tree_shardings(axes_tree, shapes_tree, mesh, strategy: str):
  """NamedShardings for a pytree, from parallel trees of axes and shapes.

  Arrays with an `experts` axis live on the expert mesh (`node` split into
  groups x experts, same devices in the same order); see `sharding.experts`.
  """

  def one(axes, x):
    if "experts" in axes:
      em = experts.expert_mesh(mesh, strategy, x.shape[axes.index("experts")])
      if em is not None:
        return NamedSharding(
          em, experts.param_spec(axes, x.shape, em, strategy)
        )
    return NamedSharding(
      mesh, rules.logical_to_spec(axes, x.shape, mesh, strategy)
    )

  return jax.tree.map(one, axes_tree, shapes_tree, is_leaf=rules.is_axes)


def _stays_local(logical_axes, kept: bool) -> bool:
  """Not gathered for use: tables and experts (their lookups and exchanges
  place them) and weights the FP8 hook gathers in 8 bits (`kept`)."""
  return kept or "table_rows" in logical_axes or "experts" in logical_axes


def _no_keep(params):
  return jax.tree.map(lambda _: False, params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x, full, stored):
  return jax.lax.with_sharding_constraint(x, full)


def _gather_fwd(x, full, stored):
  return _gather(x, full, stored), None


def _gather_bwd(full, stored, _, g):
  return (jax.lax.with_sharding_constraint(g, stored),)


_gather.defvjp(_gather_fwd, _gather_bwd)
