"""Expert parallelism (G6): one DHEN expert per GPU of a node pair.

Sharded experts give the local numbers (values and gradients), and the
compiled HLO shows the activation exchange inside node pairs and each
expert's FSDP traffic over `zone`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import sharding
from gemjax.model.experts import DHEN
from sharding import experts, hlo

D, S, C = 16, 8, 3


def test_expert_mesh_splits_node_into_pairs():
  mesh = sharding.make_mesh(1, 2, 4)
  em = experts.expert_mesh(mesh, "fsdp", 2)
  assert em.axis_names == ("cluster", "zone", "node_group", "expert")
  assert dict(em.shape) == {
    "cluster": 1,
    "zone": 2,
    "node_group": 2,
    "expert": 2,
  }
  assert list(em.devices.flat) == list(mesh.devices.flat)
  # A pair is two neighbouring GPUs of one host.
  pair = em.devices[0, 1, 1, :]
  assert [d.id for d in pair] == [
    mesh.devices[0, 1, 2].id,
    mesh.devices[0, 1, 3].id,
  ]
  assert experts.expert_mesh(sharding.make_mesh(1, 8, 1), "fsdp", 2) is None
  assert experts.expert_mesh(mesh, "replicated", 2) is None


@pytest.mark.parametrize("mesh_shape", [(1, 2, 4), (2, 2, 2)])
def test_sharded_experts_match_local(mesh_shape):
  mesh = sharding.make_mesh(*mesh_shape)
  strategy = "fsdp_grouped_split"
  model = DHEN(D, 2, rngs=nnx.Rngs(0), dtype=jnp.float32)
  graphdef, state = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(0)
  # Non-trivial weights everywhere (biases and gains too).
  params = jax.tree.map(
    lambda p: p + 0.05 * rng.normal(size=p.shape).astype(np.float32), params
  )
  x = jnp.asarray(rng.normal(size=(S, C, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(S, C, D)), jnp.float32)
  placement = sharding.Placement(mesh, strategy)

  def loss(params, x, run):
    st = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(st, params)
    return jnp.sum(nnx.merge(graphdef, st)(x, run) * w)

  ref_v, (ref_gp, ref_gx) = jax.value_and_grad(loss, (0, 1))(params, x, None)

  axes = jax.tree.map(
    lambda v: v.get_metadata()["logical_axes"],
    state,
    is_leaf=lambda v: isinstance(v, nnx.Variable),
  )
  shardings = sharding.tree_shardings(
    nnx.to_pure_dict(axes), params, mesh, strategy
  )
  placed = jax.device_put(params, shardings)
  xs = jax.device_put(x, sharding.batch_sharding(mesh, strategy))
  f = jax.jit(
    jax.value_and_grad(lambda p, x: loss(p, x, placement.run_experts), (0, 1))
  )
  compiled = f.lower(placed, xs).compile()
  v, (gp, gx) = compiled(placed, xs)
  np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(gx, ref_gx, rtol=1e-4, atol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
    gp,
    ref_gp,
  )

  w_sharding = shardings["layers"][0]["w"]
  assert w_sharding.spec == PartitionSpec("expert", "zone")
  assert isinstance(w_sharding, NamedSharding)
  # Per device: one expert's row, a 1/zone slice of it.
  shard = placed["layers"][0]["w"].addressable_shards[0].data
  assert shard.shape == (1, params["layers"][0]["w"].shape[1] // 2)

  found = {}
  for c in hlo.collectives(compiled.as_text(), mesh.size):
    if c.bytes > 64:
      key = (c.kind, hlo.tiers(c, dict(mesh.shape)))
      found.setdefault(key, set()).add(c.group_size)
  # Activations: all-gather in, all-to-all back, inside node pairs (size 2);
  # expert weights: all-gather / reduce-scatter over `zone`; the expert's
  # sharded gradient summed over its copies (other pairs, other clusters);
  # the layer norms' gains are replicated: their gradient over every device.
  every = tuple(a for a in ("cluster", "zone", "node") if mesh.shape[a] > 1)
  copies = ("cluster",) * (mesh_shape[0] > 1) + ("node",) * (mesh_shape[2] > 2)
  want = {
    ("all-reduce", every): {mesh.size},
    ("all-gather", ("node",)): {2},
    ("all-to-all", ("node",)): {2},
    ("reduce-scatter", ("node",)): {2},
    ("all-gather", ("zone",)): {2},
    ("reduce-scatter", ("zone",)): {2},
    ("all-reduce", copies): {mesh_shape[0] * mesh_shape[2] // 2},
  }
  assert found == want
