"""Expert parallelism inside a host (G6): one expert per GPU of a group.

GEM's DHEN layers hold large, different expert modules. Instead of every
GPU running every expert on its own samples, the `E` GPUs of a group inside
one host (a pair for `E = 2`) each hold one expert, FSDP-sharded over `zone`
(GEM: 16-way across hosts), and trade activations over NVLink:

  x   [s, ...]       my samples (s = shards per device)
  all-gather over `expert`   -> [E*s, ...]  the samples of my whole group
  y = expert_e(x)            -> [E*s, ...]  my expert on all of them
  all-to-all over `expert`   -> [E, s, ...] every expert's output on mine

Compute per GPU is unchanged (one expert on E times the samples instead of
E experts on its own), parameter memory and the expert's all-gather shrink
E-fold, and the activation exchange stays on the node's links.

Mesh. The rule `experts: (node,)` splits `node` into (`node_group`,
`expert`): same devices, same order, so `node = node_group * E + expert` and
the batch's shard axis lines up on both meshes. Expert parameters are one
flat `[E, L]` array per layer (logical axes `experts`, `expert_params`;
each expert's tensors packed in its row, like a "flat parameter"), placed
`P("expert", "zone")` on that mesh. When `node` is not a multiple of `E`
(e.g. one GPU) the experts run locally, every device all of them: the same
numbers.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from sharding import rules

GROUP_SUFFIX = "_group"


def expert_mesh(mesh: Mesh, strategy: str, num_experts: int) -> Mesh | None:
  """`mesh` with its expert tier split into (`<tier>_group`, `expert`), or
  None when experts cannot be spread (no rule, or the tier is not a multiple
  of `num_experts`)."""
  axes = rules.rule(strategy, "experts")
  if len(axes) != 1 or num_experts < 2:
    return None
  (tier,) = axes
  n = mesh.shape[tier]
  if n % num_experts:
    return None
  i = mesh.axis_names.index(tier)
  shape = list(mesh.devices.shape)
  shape[i : i + 1] = [n // num_experts, num_experts]
  names = list(mesh.axis_names)
  names[i : i + 1] = [tier + GROUP_SUFFIX, "expert"]
  return Mesh(np.asarray(mesh.devices).reshape(shape), tuple(names))


def param_spec(logical_axes, shape, em: Mesh, strategy: str) -> PartitionSpec:
  """`P("expert", <expert_params tiers>)` for a flat `[E, L]` parameter."""
  if tuple(logical_axes) != ("experts", "expert_params"):
    raise ValueError(
      f"expert parameters are [experts, expert_params], got {logical_axes}"
    )
  # The FSDP tiers of an expert: the `expert_params` rule, on `em`.
  axes = tuple(
    a for a in rules.rule(strategy, "expert_params") if em.shape.get(a, 1) > 1
  )
  n = int(np.prod([em.shape[a] for a in axes])) if axes else 1
  if shape[1] % n:
    axes = ()
  return PartitionSpec("expert", axes or None)


def run_experts(mesh: Mesh, strategy: str, w_el, x_s, fns):
  """Outputs of every expert on `x_s`, a list of `E` arrays like `x_s`.

  `w_el`: flat expert parameters `[E, L]`; `fns[e](w_l, x)` applies expert
  `e` to rows of `x` (any leading shape). `x_s`'s leading axis is the
  batch's shard axis, split by the batch rule (over every device).
  """
  num = len(fns)
  if w_el.shape[0] != num:
    raise ValueError(f"{w_el.shape[0]} expert rows for {num} experts")
  em = expert_mesh(mesh, strategy, num)
  if em is None:
    return [fn(w_el[e], x_s) for e, fn in enumerate(fns)]
  tier = rules.rule(strategy, "experts")[0]
  batch = []
  for a in rules.batch_axes(mesh, strategy):
    batch += [a + GROUP_SUFFIX, "expert"] if a == tier else [a]
  if "expert" not in batch:
    raise ValueError(
      f"strategy {strategy!r}: the batch must be split over {tier!r} to "
      "exchange activations between experts"
    )
  batch = tuple(a for a in batch if em.shape[a] > 1)
  w_spec = param_spec(("experts", "expert_params"), w_el.shape, em, strategy)
  fsdp = w_spec[1]
  # Tiers holding copies of an expert shard. Marking the shard as varying
  # there *before* the all-gather makes autodiff sum its gradient over them
  # after the reduce-scatter, on the shard, not on the gathered expert.
  copies = tuple(
    a
    for a in em.axis_names
    if a != "expert" and a not in (fsdp or ()) and em.shape[a] > 1
  )

  def body(w_1l, x):
    w_l = jax.lax.pcast(w_1l[0], copies, to="varying")
    if fsdp is not None:  # FSDP all-gather of my expert, over `zone`
      w_l = jax.lax.all_gather(w_l, fsdp, axis=0, tiled=True)
    s = x.shape[0]
    x_all = jax.lax.all_gather(x, "expert", axis=0, tiled=True)  # [E*s, ...]
    e = jax.lax.axis_index("expert")
    y = jax.lax.switch(e, [lambda w, x, f=f: f(w, x) for f in fns], w_l, x_all)
    y = y.reshape(num, s, *x.shape[1:])  # [E (source GPU), s, ...]
    # Send each GPU its samples back; receive every expert's output on mine.
    y = jax.lax.all_to_all(y, "expert", 0, 0, tiled=True)  # [E (expert), s]
    return jnp.moveaxis(y, 0, 1)  # [s, E, ...]

  # `em` splits `node` in two, so it is not the caller's context mesh (the
  # training loop sets one): the expert exchange runs under its own.
  with jax.sharding.use_abstract_mesh(em.abstract_mesh):
    out = jax.shard_map(
      body,
      mesh=em,
      in_specs=(w_spec, PartitionSpec(batch)),
      out_specs=PartitionSpec(batch),
    )(w_el, x_s)
  return [out[:, e] for e in range(num)]
