"""Communication model (G5, G6, G7): bytes per step on each network tier.

  PYTHONPATH=. python benchmarks/comm_model.py            # ~2 min on CPU
  PYTHONPATH=. python benchmarks/comm_model.py --quick    # measured part only

Two parts.

1. Measured. The train step of a small model (dense layers, the G7 tables,
   one DHEN layer) is compiled on 16 simulated CPU devices (2 x 2 x 4,
   cluster x zone x node) for each strategy, and every collective of the
   optimized HLO is charged to a tier: the *slowest* tier its groups span
   (a ring or pairwise exchange runs at the speed of its slowest link).
   Bytes are what one device sends with ring/pairwise algorithms
   (`sharding.hlo.wire_bytes`); collectives inside the lookup's pass loop
   count once per pass, passes taken from the real batch
   (`sharding.embedding.plan_passes`).
2. On paper. The same accounting as formulas of the layout (parameter bytes
   by sharding rule, table rows, ids per device, tiers), checked against
   part 1 on the 16-device mesh, then evaluated at GEM's scale, 4,096 GPUs
   = 2 zones x 256 hosts x 8 GPUs, for:
   - `onetrans_v31` as configured (its tables are small: replicated);
   - a GEM-like layout: 2e9 dense parameters and one 2^30-row, 64-wide
     table (275 GB in f32) read by the onetrans_v31 id volumes,
   comparing grouped FSDP (G5) with flat FSDP over all GPUs, and embedding
   generations 2 and 3 with the flat generation 1.

Per-device link speeds used to turn bytes into time (assumptions, H200
class): NVLink 450 GB/s, RDMA in a zone 50 GB/s (one 400 Gb/s NIC per GPU),
across zones 12.5 GB/s (4:1 oversubscribed). XLA:CPU sums gradients inside a
group with an all-reduce where XLA:GPU emits a reduce-scatter; the check in
part 2 models the CPU choice, the extrapolation the GPU one.
"""

import argparse
import dataclasses
import math
import os
import sys

if __name__ == "__main__":
  os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=16 "
    "--xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true",
  )

import jax
import numpy as np
from jax.sharding import AbstractMesh

TIERS = ("node", "zone", "cluster")
BANDWIDTH = {"node": 450e9, "zone": 50e9, "cluster": 12.5e9}  # bytes/s/GPU
STRATEGIES = ("fsdp", "fsdp_grouped", "fsdp_grouped_split", "flat_fsdp")
GEM = (2, 256, 8)


def slowest(tiers) -> str:
  for t in ("cluster", "zone", "node"):
    if t in tiers:
      return t
  return "node"


# ---------------------------------------------------------------- measured


def measure(cfg, mesh_shape, strategy, batch):
  from gemjax.model.embeddings import FEATURE_TABLE
  from gemjax.train.loop import Trainer
  from sharding import embedding, hlo

  n = math.prod(mesh_shape)
  tr = Trainer.create(
    dataclasses.replace(
      cfg, mesh=dataclasses.replace(cfg.mesh, strategy=strategy)
    ),
    "/nonexistent",
    devices=jax.devices()[:n],
  )
  state = tr.init_state()
  text = tr.train_step.lower(state, tr.to_device(batch)).compile().as_text()
  # Passes of the lookup loops: the most any table needs (loops of all
  # tables are charged alike; at capacity_factor 1 this is usually 1).
  sizes = cfg.data.vocab_sizes()
  passes = 1
  for table in set(FEATURE_TABLE.values()):
    cols = [
      part[f]
      for part in (batch.seq, batch.cand)
      for f in part
      if FEATURE_TABLE.get(f) == table
    ]
    rows = next(sizes[f] for f, t in FEATURE_TABLE.items() if t == table)
    passes = max(
      passes,
      embedding.plan_passes(cols, rows, mesh=tr.mesh, strategy=strategy),
    )
  out = dict.fromkeys(TIERS, 0.0)
  for c in hlo.collectives(text, n):
    tier = slowest(hlo.tiers(c, dict(tr.mesh.shape)))
    # the first pass is peeled out of the loop: the loop runs passes - 1
    reach = max(passes - 1, 0) if c.in_loop else 1
    out[tier] += hlo.wire_bytes(c) * reach * c.count
  return out, passes


# ---------------------------------------------------------------- on paper


@dataclasses.dataclass
class Layout:
  """What the formulas need to know about a model and a step."""

  params: dict  # path -> (shape, logical axes), f32 parameters
  ids: dict  # table -> ids one device looks up per step (buffer slots)
  activ_bytes: int = 0  # DHEN input per device per step (bytes)
  capacity_factor: float = 1.0


def layout_of(cfg, batch_per_device) -> Layout:
  """`batch_per_device`: one shard's `JaggedBatch` (numpy)."""
  from gemjax.model.embeddings import FEATURE_TABLE
  from gemjax.train.state import build

  model_def, params = build(cfg, 0)
  flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_a = jax.tree.leaves(
    model_def.logical_axes, is_leaf=lambda x: type(x) is tuple
  )
  ps = {
    jax.tree_util.keystr(path): (x.shape, axes)
    for (path, x), axes in zip(flat_p, flat_a, strict=True)
  }
  ids = {}
  for part in (batch_per_device.seq, batch_per_device.cand):
    for f, v in part.items():
      if f in FEATURE_TABLE:
        ids[FEATURE_TABLE[f]] = ids.get(FEATURE_TABLE[f], 0) + v.size
  m = cfg.model
  d = 2 * m.d_model + m.emb_dim
  activ = (
    batch_per_device.labels.shape[-2] * d * np.dtype(m.dtype).itemsize
    if m.dhen_layers
    else 0
  )
  return Layout(ps, ids, activ)


def analytic(
  lay: Layout,
  mesh_shape,
  strategy,
  *,
  cpu_allreduce=False,
  passes=1,
  sparse_table_grads=False,
):
  """Bytes one device sends per step, per tier, and a breakdown.

  `passes`: lookup passes per table (1 when buckets never overflow).
  `sparse_table_grads`: price the gen-2/3 gradient sync across groups as
  touched rows only (row + index for every id slot a device served) instead
  of the dense `[v / n, e]` all-reduce this code runs."""
  from sharding import rules

  c, z, n = mesh_shape
  mesh = AbstractMesh(mesh_shape, rules.ALL)
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  f = lambda k: (k - 1) / k if k > 1 else 0.0
  parts = {}

  def add(what, tiers, b):
    key = (what, slowest(tiers))
    parts[key] = parts.get(key, 0.0) + b

  every = tuple(a for a in rules.ALL if mesh.shape[a] > 1)
  for path, (shape, axes) in lay.params.items():
    nbytes = 4 * math.prod(shape)
    if "tables" in path:
      continue
    if "experts" in axes:  # [E, L]: one expert per GPU of a node group
      e = shape[0]
      ez = z if shape[1] % z == 0 else 1
      shard = nbytes / e / ez
      copies = c * (n // e) if n % e == 0 else c * n
      add(
        "experts: weights (AG+RS over zone)", ("zone",), 2 * f(ez) * ez * shard
      )
      add(
        "experts: gradient copies", ("cluster", "node"), 2 * f(copies) * shard
      )
      continue
    spec = rules.logical_to_spec(axes, shape, mesh, strategy)
    used = tuple(
      a for s in spec if s for a in ((s,) if isinstance(s, str) else s)
    )
    k = size(used)
    if k == 1:  # replicated: DDP over every device
      add("dense: replicated grads (AR)", every, 2 * f(size(every)) * nbytes)
      continue
    add("dense: FSDP all-gather", used, f(k) * nbytes)
    if cpu_allreduce:
      add("dense: FSDP grad sum", used, 2 * f(k) * nbytes)
    else:
      add("dense: FSDP reduce-scatter", used, f(k) * nbytes)
    rest = tuple(a for a in every if a not in used)
    if rest:
      add("dense: sharded grad AR (DDP)", rest, 2 * f(size(rest)) * nbytes / k)
  if lay.activ_bytes:
    e = 2
    if n % e == 0:  # in, back, and the same in the backward
      add(
        "experts: activations (pair)", ("node",), 4 * f(e) * e * lay.activ_bytes
      )
  from sharding.embedding import table_layout

  for table, m in lay.ids.items():
    ((shape, _),) = [v for k, v in lay.params.items() if f"'{table}'" in k]
    rows, e = shape
    tl = table_layout(mesh, strategy, rows)
    nbytes = 4 * rows * e
    if not tl.sharded:
      add("tables: replicated grads (AR)", every, 2 * f(size(every)) * nbytes)
      continue
    ex, g = size(tl.exchange), size(tl.gather)
    slots = max(1, math.ceil(lay.capacity_factor * m / ex)) * ex
    # fwd: ids out, rows back; bwd: ids out, gradient rows out
    slots *= passes
    add("tables: all-to-all", tl.exchange, f(ex) * slots * (2 * 4 + 2 * 4 * e))
    if g > 1:  # fwd: AG ids, RS rows; bwd: AG ids + gradient rows
      add(
        "tables: host gather (gen 3)",
        tl.gather,
        (g - 1) * slots * (4 + 4 * e) + (g - 1) * slots * (4 + 4 * e),
      )
    if tl.copies:
      rows_b = nbytes / size(tl.rows)
      if sparse_table_grads:
        rows_b = min(rows_b, slots * (4 * e + 4))
      add(
        "tables: grad AR across groups",
        tl.copies,
        2 * f(size(tl.copies)) * rows_b,
      )
  total = dict.fromkeys(TIERS, 0.0)
  for (_, tier), b in parts.items():
    total[tier] += b
  return total, parts


def a2a_message(lay: Layout, mesh_shape, strategy) -> float:
  """Bytes per peer of the forward row all-to-all, summed over tables."""
  from sharding import rules
  from sharding.embedding import table_layout

  mesh = AbstractMesh(mesh_shape, rules.ALL)
  out = 0.0
  for table, m in lay.ids.items():
    ((shape, _),) = [v for k, v in lay.params.items() if f"'{table}'" in k]
    tl = table_layout(mesh, strategy, shape[0])
    if tl.sharded:
      ex = math.prod(mesh.shape[a] for a in tl.exchange)
      out += max(1, math.ceil(lay.capacity_factor * m / ex)) * 4 * shape[1]
  return out


def seconds(tier_bytes) -> float:
  return sum(b / BANDWIDTH[t] for t, b in tier_bytes.items())


def gem_like(lay: Layout) -> Layout:
  """2e9 dense parameters (as 4 FSDP-sharded tensors) and one 2^30 x 64
  table read by every id column of `lay`."""
  params = {
    f"['dense'][{i}]": ((2**15, 2e9 / 4 / 2**15), ("embed", "mlp"))
    for i in range(4)
  }
  params = {k: ((s[0], int(s[1])), a) for k, (s, a) in params.items()}
  params["['tables']['big']"] = ((2**30, 64), ("table_rows", "table_dim"))
  return Layout(params, {"big": sum(lay.ids.values())})


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="measured part only")
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
  from benchmarks import common
  from configs.onetrans_v31 import get_config
  from gemjax.data import loader
  from tests.sharding.meshes_worker import batches, config

  records = []
  cfg = config(mesh=(2, 2, 4))
  batch = batches(cfg, steps=1)[0]
  one = jax.tree.map(lambda x: x[0], batch)
  lay = layout_of(cfg, one)
  print(
    "measured: small model, 16 simulated devices (2x2x4), "
    "bytes/device/step by tier"
  )
  print(
    f"{'strategy':22s} {'passes':>6s} "
    + " ".join(f"{t + ' HLO':>12s} {t + ' paper':>12s}" for t in TIERS)
  )
  for strategy in STRATEGIES:
    got, passes = measure(cfg, (2, 2, 4), strategy, batch)
    lay.capacity_factor = 1.0
    paper, _ = analytic(
      lay, (2, 2, 4), strategy, cpu_allreduce=True, passes=passes
    )
    print(
      f"{strategy:22s} {passes:6d} "
      + " ".join(f"{got[t]:12.0f} {paper[t]:12.0f}" for t in TIERS)
    )
    for t in TIERS:
      r = common.record(
        "comm_model",
        f"small/2x2x4/{t}",
        strategy,
        "bytes_per_step_hlo",
        got[t],
        baseline="paper model (XLA:CPU collectives)",
        baseline_value=paper[t] or None,
        lower_is_better=True,
      )
      r["device"] = "cpu (16 simulated devices)"
      records.append(r)
  if not args.quick:
    full = get_config()
    it = loader.Loader(
      full.data, num_shards=1, split="train", process_index=0, process_count=1
    )
    shard = jax.tree.map(lambda x: x[0], next(it))
    it.close()
    scenarios = {"onetrans_v31": layout_of(full, shard)}
    scenarios["gem_like"] = gem_like(scenarios["onetrans_v31"])
    print(
      "\non paper: 4,096 GPUs = 2 zones x 256 hosts x 8 GPUs, bytes/device/"
      "step (node / zone / cluster), est. seconds at the link speeds above"
    )
    for name, sl in scenarios.items():
      print(f"\n{name}")
      print(
        f"{'strategy':38s} {'dense+experts':>32s} {'tables':>32s} "
        f"{'est. s':>7s} {'a2a B/peer':>10s}"
      )
      res = {}
      for strategy in STRATEGIES:
        for sparse in (False, True):
          if sparse and strategy in ("fsdp", "flat_fsdp"):
            continue  # gen 1 has no gradient sync across groups
          key = strategy + (" (sparse grad sync)" if sparse else "")
          tot, parts = analytic(sl, GEM, strategy, sparse_table_grads=sparse)
          comp = {
            c: {
              t: sum(
                b
                for (w, tier), b in parts.items()
                if tier == t and w.startswith(c)
              )
              for t in TIERS
            }
            for c in ("dense", "tables")
          }
          for t in TIERS:
            comp["dense"][t] = tot[t] - comp["tables"][t]
          res[key] = (tot, comp)
          fmt = lambda d: " ".join(f"{d[t]:10.3g}" for t in TIERS)
          print(
            f"{key:38s} {fmt(comp['dense'])} {fmt(comp['tables'])} "
            f"{seconds(tot):7.3f} {a2a_message(sl, GEM, strategy):10.3g}"
          )
      for key, (tot, comp) in res.items():
        for c, base_key in (("dense", "flat_fsdp"), ("tables", "fsdp")):
          base = res[base_key][1][c]
          for t in TIERS:
            r = common.record(
              "comm_model",
              f"{name}/4096gpu/{c}/{t}",
              key,
              "bytes_per_step_paper",
              comp[c][t],
              baseline=base_key,
              baseline_value=base[t] or None,
              lower_is_better=True,
            )
            r["device"] = "paper model"
            records.append(r)
        r = common.record(
          "comm_model",
          f"{name}/4096gpu/est_seconds",
          key,
          "comm_seconds_per_step_paper",
          seconds(tot),
          baseline="flat_fsdp",
          baseline_value=seconds(res["flat_fsdp"][0]),
          lower_is_better=True,
        )
        r["device"] = "paper model"
        records.append(r)
  common.write_results("comm_model", records)


if __name__ == "__main__":
  main()
