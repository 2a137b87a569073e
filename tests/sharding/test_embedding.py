"""Sharded embedding lookups (G7) against `jnp.take`, values and gradients.

Every strategy, on two 8-device meshes, with jagged id columns (empty
requests, length 1, a buffer tail), a bucket capacity so small that every
lookup needs several passes, pooled lookups, and the tiers each generation's
collectives span in the compiled HLO.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import sharding
from gemjax.model import embeddings as emb_lib
from sharding import embedding, hlo

V, E, S, T, C = 64, 8, 8, 12, 5
LENGTHS = [0, 1, 4, 5]  # per shard: an empty request, one of length 1
STRATEGIES = ["fsdp", "fsdp_grouped", "fsdp_grouped_split"]
MESHES = {"2x2x2": (2, 2, 2), "1x2x4": (1, 2, 4)}
# Tiers of the lookup's collectives (larger than a scalar), per strategy:
# gen 1 exchanges over every device; gen 2 inside a group, gradients summed
# over `cluster`; gen 3 over `zone`, rows gathered / scattered over `node`.
EXPECTED_TIERS = {
  "fsdp": {("all-to-all", ("cluster", "zone", "node"))},
  "fsdp_grouped": {
    ("all-to-all", ("zone", "node")),
    ("all-reduce", ("cluster",)),
  },
  "fsdp_grouped_split": {
    ("all-to-all", ("zone",)),
    ("all-gather", ("node",)),
    ("reduce-scatter", ("node",)),
    ("all-reduce", ("cluster",)),
  },
}


def _ids(rng, skew=False):
  """Jagged seq ids `[S, T]` (offsets `[S, 5]`) and candidate ids `[S, C]`."""
  offsets = np.tile(np.concatenate([[0], np.cumsum(LENGTHS)]), (S, 1))
  hi = 6 if skew else V  # skew: every id in the first device's rows
  seq = rng.integers(0, hi, (S, T))
  cand = rng.integers(0, hi, (S, C))
  return (
    jnp.asarray(seq, jnp.int32),
    jnp.asarray(offsets, jnp.int32),
    jnp.asarray(cand, jnp.int32),
  )


def _reference_loss(table, seq, cand, w_seq, w_cand):
  return jnp.sum(jnp.take(table, seq, axis=0) * w_seq) + jnp.sum(
    jnp.take(table, cand, axis=0) ** 2 * w_cand
  )


def _run(mesh_shape, strategy, capacity_factor, skew, seed):
  rng = np.random.default_rng(seed)
  mesh = sharding.make_mesh(
    *mesh_shape, devices=jax.devices()[: np.prod(mesh_shape)]
  )
  table = jnp.asarray(rng.normal(size=(V, E)), jnp.float32)
  seq, _, cand = _ids(rng, skew)
  w_seq = jnp.asarray(rng.normal(size=(S, T, E)), jnp.float32)
  w_cand = jnp.asarray(rng.normal(size=(S, C, E)), jnp.float32)
  layout = embedding.table_layout(mesh, strategy, V)
  placed = jax.device_put(
    table, NamedSharding(mesh, PartitionSpec(layout.rows or None))
  )

  def loss(t):
    r_seq, r_cand = embedding.lookup(
      t,
      [seq, cand],
      mesh=mesh,
      strategy=strategy,
      capacity_factor=capacity_factor,
    )
    return jnp.sum(r_seq * w_seq) + jnp.sum(r_cand**2 * w_cand)

  compiled = jax.jit(jax.value_and_grad(loss)).lower(placed).compile()
  value, grad = compiled(placed)
  ref_value, ref_grad = jax.value_and_grad(_reference_loss)(
    table, seq, cand, w_seq, w_cand
  )
  np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)
  assert grad.sharding.spec == placed.sharding.spec
  return mesh, layout, compiled.as_text()


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lookup_matches_take(strategy, mesh_name):
  mesh, layout, text = _run(MESHES[mesh_name], strategy, 1.0, False, seed=1)
  assert layout.sharded
  found = {
    (c.kind, hlo.tiers(c, dict(mesh.shape)))
    for c in hlo.collectives(text, mesh.size)
    if c.bytes > 8
  }
  want = EXPECTED_TIERS[strategy]
  if mesh.shape["cluster"] == 1:  # no second group: drop cluster traffic
    want = {(k, tuple(a for a in t if a != "cluster")) for k, t in want} - {
      (k, ()) for k in ("all-reduce",)
    }
  assert found == want


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overflowing_buckets_take_more_passes(strategy):
  """All ids in one device's rows, one slot per bucket: many passes, none
  dropped (a dropped id would read a zero row and fail the comparison)."""
  mesh = sharding.make_mesh(2, 2, 2)
  layout = embedding.table_layout(mesh, strategy, V)
  n = int(np.prod([mesh.shape[a] for a in layout.exchange]))
  m = (S // mesh.size) * (T + C)
  capacity = 0.5 * n / m  # k = 1 slot per bucket
  rng = np.random.default_rng(2)
  seq, _, cand = _ids(rng, skew=True)
  per_device = np.concatenate(
    [
      np.asarray(seq).reshape(mesh.size, -1),
      np.asarray(cand).reshape(mesh.size, -1),
    ],
    1,
  )
  distinct = max(len(set(row)) for row in per_device)
  passes = embedding.plan_passes(
    [seq, cand], V, mesh=mesh, strategy=strategy, capacity_factor=capacity
  )
  assert passes == distinct > 1  # one id per pass for the busiest device
  _run((2, 2, 2), strategy, capacity, True, seed=2)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 2), (2, 2, 2)])
def test_loop_only_where_one_pass_may_not_do(mesh_shape):
  """2 devices: buckets hold every id (k = m), so even all ids in one
  device's rows take one pass and the step has no loop (a host round trip
  per lookup on the GPU). 8 devices: k = m / 8 and the loop stays."""
  mesh, _, text = _run(mesh_shape, "fsdp", 1.0, True, seed=3)
  # Any skewed ids (all in the first device's rows) show the pass counts.
  seq, _, cand = _ids(np.random.default_rng(3), skew=True)
  passes = embedding.plan_passes([seq, cand], V, mesh=mesh, strategy="fsdp")
  if mesh.size == 2:
    assert passes == 1 and " while(" not in text
  else:
    assert passes > 1 and " while(" in text


def test_invalid_ids_read_zero_rows():
  mesh = sharding.make_mesh(2, 2, 2)
  table = jnp.ones((V, E), jnp.float32)
  ids = jnp.asarray(np.tile([-1, 0, V, V + 5, 3, 2, 1, 0], (S, 1)), jnp.int32)
  for strategy in ("fsdp", "replicated"):
    (rows,) = jax.jit(
      lambda t, i, s=strategy: embedding.lookup(t, [i], mesh=mesh, strategy=s)
    )(table, ids)
    np.testing.assert_array_equal(
      np.asarray(rows)[:, :, 0], np.tile([0, 1, 0, 0, 1, 1, 1, 1], (S, 1))
    )


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_pooled_lookup(combiner):
  mesh = sharding.make_mesh(1, 2, 4)
  rng = np.random.default_rng(3)
  table = jnp.asarray(rng.normal(size=(V, E)), jnp.float32)
  seq, offsets, _ = _ids(rng)
  w = jnp.asarray(rng.normal(size=(S, len(LENGTHS), E)), jnp.float32)

  def pooled(t):
    return embedding.lookup_pooled(
      t,
      seq,
      offsets,
      mesh=mesh,
      strategy="fsdp_grouped_split",
      combiner=combiner,
    )

  def reference(t):
    rows = np.asarray(t)[np.asarray(seq)]
    out = np.zeros((S, len(LENGTHS), E), np.float32)
    for s in range(S):
      o = np.asarray(offsets[s])
      for i in range(len(LENGTHS)):
        r = rows[s, o[i] : o[i + 1]]
        if len(r):
          out[s, i] = r.sum(0) / (len(r) if combiner == "mean" else 1)
    return out

  got, vjp = jax.jit(lambda t: jax.vjp(pooled, t))(table)
  np.testing.assert_allclose(got, reference(table), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got)[:, 0], 0)  # empty request
  (grad,) = jax.jit(vjp)(w)
  ref_grad = np.zeros((V, E), np.float32)
  for s in range(S):
    o = np.asarray(offsets[s])
    for i in range(len(LENGTHS)):
      n = o[i + 1] - o[i]
      for j in range(o[i], o[i + 1]):  # the tail past o[-1] pools nowhere
        scale = 1 / n if combiner == "mean" else 1
        ref_grad[int(seq[s, j])] += np.asarray(w[s, i]) * scale
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)


def test_shared_slices_one_exchange_per_table():
  """O9: history and candidate columns of a table are served by one call,
  and both read the same rows."""
  from gemjax.data.jagged import stack
  from tests.batches import random_batch

  vocab = dict(
    item_id=64,
    category_id=16,
    action=4,
    ts_delta=16,
    ts_to_req=16,
    price=16,
    user_id=8,
  )
  batch = stack(
    [
      random_batch(
        vocab, [2, 0, 3], [1, 2, 1], token_capacity=8, cand_capacity=6, seed=i
      )
      for i in range(2)
    ]
  )
  rng = np.random.default_rng(4)
  tables = {
    name: jnp.asarray(rng.normal(size=(rows, 32)), jnp.float32)
    for name, rows in emb_lib.table_sizes(vocab).items()
  }
  calls = []

  def lookup_fn(table, ids):
    calls.append(len(ids))
    return [jnp.take(table, i, axis=0) for i in ids]

  out = emb_lib.gather_rows(tables, batch, lookup_fn)
  assert sorted(calls) == [1, 1, 1, 2, 2, 2]  # item, category, price shared
  item = tables["item"]
  np.testing.assert_array_equal(
    out.seq["item_id"].rows, np.asarray(item)[batch.seq["item_id"]]
  )
  np.testing.assert_array_equal(
    out.cand["item_id"].rows, np.asarray(item)[batch.cand["item_id"]]
  )
  assert out.seq["item_id"].shape == batch.seq["item_id"].shape
