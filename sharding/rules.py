"""Logical-axis rule tables: one per placement strategy.

A rule maps a logical axis name (what the model calls a dimension) to mesh
axes (which tiers split it). A dimension whose size the mesh axes do not
divide is left replicated rather than padded, and a mesh axis is used at most
once per array. Choosing a strategy is a config change (`mesh.strategy`).

Dense parameters (G5). `fsdp*`: sharded over (`zone`, `node`), replicated
over `cluster`. Inside one group (one `cluster` index) parameter all-gathers
and gradient reduce-scatters run over RDMA and NVLink only; the thin cluster
links carry one all-reduce of the *sharded* gradient (DDP across groups).
`flat_fsdp` is the naive layout kept as a baseline: FSDP over every device,
so every all-gather and reduce-scatter crosses the cluster tier.

Embedding tables (G7), three generations; two rules decide them:
`table_rows` (which tiers split the rows at rest) and `table_exchange` (the
all-to-all group of a lookup; `sharding.embedding` does the lookup). The
tiers in `table_rows` but not in `table_exchange` are re-assembled by an
all-gather before the lookup and reduce-scattered after it.
  gen 1 `fsdp`:               rows over all devices, exchange over all;
  gen 2 `fsdp_grouped`:       each group a full copy, rows over (zone, node),
                              exchange inside the group, gradients all-reduced
                              over `cluster`;
  gen 3 `fsdp_grouped_split`: as gen 2 at rest, but the exchange runs over
                              `zone` only: a host's rows are gathered over
                              NVLink (`node`) before the lookup.

Experts (G6): `experts` names the tier whose devices each hold one expert
(consecutive devices of `node`, e.g. the two GPUs of a pair); `expert_params`
shards each expert (FSDP) over `zone`. See `sharding.experts`, and
`sharding.placement.tree_shardings`, which puts them on the expert mesh.

The batch's leading (data-shard) axis is split over every device.
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec

ALL = ("cluster", "zone", "node")
GROUP = ("zone", "node")  # one FSDP / embedding group: a cluster index

_DENSE_GROUP = {"embed": GROUP, "mlp_in": GROUP}
_EXPERTS = {"experts": ("node",), "expert_params": ("zone",)}
_BATCH = {"batch": ALL}

STRATEGIES: dict[str, dict[str, tuple[str, ...]]] = {
  "fsdp": {
    **_DENSE_GROUP,
    **_EXPERTS,
    "table_rows": ALL,
    "table_exchange": ALL,
    **_BATCH,
  },
  "fsdp_grouped": {
    **_DENSE_GROUP,
    **_EXPERTS,
    "table_rows": GROUP,
    "table_exchange": GROUP,
    **_BATCH,
  },
  "fsdp_grouped_split": {
    **_DENSE_GROUP,
    **_EXPERTS,
    "table_rows": GROUP,
    "table_exchange": ("zone",),
    **_BATCH,
  },
  # Baselines for the communication model.
  "flat_fsdp": {
    "embed": ALL,
    "mlp_in": ALL,
    **_EXPERTS,
    "table_rows": ALL,
    "table_exchange": ALL,
    **_BATCH,
  },
  "replicated": dict(_BATCH),
}


def rule(strategy: str, name: str) -> tuple[str, ...]:
  """Mesh axes of logical axis `name` under `strategy` (() = replicated)."""
  return _rules(strategy).get(name, ())


def logical_to_spec(logical_axes, shape, mesh, strategy: str) -> PartitionSpec:
  rules = _rules(strategy)
  used: set[str] = set()
  spec = []
  for name, size in zip(logical_axes, shape, strict=True):
    axes = tuple(
      a
      for a in rules.get(name, ())
      if a in mesh.shape and a not in used and mesh.shape[a] > 1
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


def state_axes(state, param_axes):
  """Logical axes of every leaf of a train state, from the parameters'.

  A leaf whose key path ends with a parameter's path (optimizer moments,
  `state["params"]` itself) takes that parameter's axes when it has its
  shape, or the axes of its leading dims when it is shorter (row-wise
  accumulators `[v]` of a table `[v, e]`); anything else is replicated.
  Matching by path, not by shape, keeps two parameters of the same shape
  but different layouts apart.
  """
  index = {}
  for path, axes in jax.tree_util.tree_flatten_with_path(
    param_axes, is_leaf=is_axes
  )[0]:
    index[_keys(path)] = axes

  def axes_of(path, x):
    keys = _keys(path)
    for i in range(len(keys)):
      axes = index.get(keys[i:])
      if axes is None:
        continue
      if tuple(x.shape) == () or len(axes) < x.ndim:
        break
      return tuple(axes[: x.ndim])
    return (None,) * x.ndim

  return jax.tree_util.tree_map_with_path(axes_of, state)


def _keys(path) -> tuple:
  out = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        out.append(getattr(k, attr))
        break
    else:
      out.append(str(k))
  return tuple(out)


def is_axes(x) -> bool:
  """A leaf of an axes tree: a plain tuple of names (not optax's tuples of
  states, nor its namedtuples)."""
  return type(x) is tuple and all(a is None or isinstance(a, str) for a in x)


def batch_axes(mesh, strategy: str = "fsdp") -> tuple[str, ...]:
  """Mesh axes (of size > 1) that split the batch's leading shard axis."""
  return tuple(a for a in _rules(strategy)["batch"] if mesh.shape[a] > 1)


def batch_sharding(mesh, strategy: str = "fsdp") -> NamedSharding:
  """Leading (data-shard) axis of batch arrays, split by the batch rule."""
  return NamedSharding(mesh, PartitionSpec(batch_axes(mesh, strategy) or None))


def _rules(strategy):
  try:
    return STRATEGIES[strategy]
  except KeyError:
    raise ValueError(
      f"unknown sharding strategy {strategy!r}; one of {sorted(STRATEGIES)}"
    ) from None
