"""Meshes from tiers and the per-strategy placement of every parameter.

`golden_specs.json` holds the `PartitionSpec` of every parameter of a small
model with a DHEN layer, per strategy, on a 2x2x2 mesh. Regenerate it after
an intended change with `GEMJAX_UPDATE_GOLDEN=1 pytest tests/sharding`.
"""

import json
import os
import pathlib

import jax
import pytest
from jax.sharding import AbstractMesh

import sharding
from gemjax.train.state import build
from sharding import rules
from tests.sharding.meshes_worker import config

GOLDEN = pathlib.Path(__file__).with_name("golden_specs.json")


def test_make_mesh_fills_one_tier():
  assert dict(sharding.make_mesh(2, 2, -1).shape) == {
    "cluster": 2,
    "zone": 2,
    "node": 2,
  }
  assert dict(sharding.make_mesh(-1, 1, 4).shape)["cluster"] == 2
  m = sharding.make_mesh(1, 2, 4)
  assert [d.id for d in m.devices.flat] == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize(
  "tiers", [(-1, -1, 2), (3, 1, -1), (2, 2, 4), (0, 1, -1)]
)
def test_make_mesh_rejects_bad_tiers(tiers):
  with pytest.raises(ValueError):
    sharding.make_mesh(*tiers)


def test_zone_ids_must_fit_the_cluster_tier():
  sharding.make_mesh(2, 2, 2, zone_of_process=[0])  # one host: one zone
  with pytest.raises(ValueError, match="zone ids for 0 processes"):
    sharding.make_mesh(2, 2, 2, zone_of_process=[])


def test_unknown_strategy_lists_the_known_ones():
  with pytest.raises(ValueError, match="fsdp_grouped_split"):
    sharding.Placement(sharding.make_mesh(1, 1, -1), "fsdp_grouped_slpit")


def test_indivisible_dimensions_stay_replicated():
  mesh = AbstractMesh((2, 2, 4), rules.ALL)
  spec = rules.logical_to_spec(
    ("table_rows", "table_dim"), (4, 32), mesh, "fsdp"
  )
  assert spec == jax.sharding.PartitionSpec(None, None)
  spec = rules.logical_to_spec(("embed", "mlp"), (64, 96), mesh, "fsdp")
  assert spec == jax.sharding.PartitionSpec(("zone", "node"), None)
  spec = rules.logical_to_spec(("embed", "mlp"), (64, 96), mesh, "flat_fsdp")
  assert spec == jax.sharding.PartitionSpec(("cluster", "zone", "node"), None)


def _specs():
  cfg = config()
  model_def, params = build(cfg, 0)
  mesh = sharding.make_mesh(2, 2, 2)
  out = {}
  for strategy in sorted(rules.STRATEGIES):
    shardings = sharding.tree_shardings(
      model_def.logical_axes, params, mesh, strategy
    )
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    out[strategy] = {
      jax.tree_util.keystr(path): f"{tuple(s.mesh.axis_names)} {s.spec}"
      for path, s in flat
    }
  return out


def test_golden_partition_specs():
  got = _specs()
  if os.environ.get("GEMJAX_UPDATE_GOLDEN"):
    GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
  want = json.loads(GOLDEN.read_text())
  assert got == want
