"""A device mesh whose axes are the cluster's network tiers, slowest first.

- `cluster`: across zones (thin, shared links);
- `zone`: hosts of one zone (RDMA);
- `node`: GPUs of one host (NVLink).

An axis is named after the tier whose links carry its traffic, so a rule that
maps a parameter's FSDP axis onto (`zone`, `node`) keeps its all-gathers off
the thin cluster links. `-1` means "whatever devices are left" (at most one
tier may say so).

Devices are ordered by (zone of their host, host, local id): the devices of
one process (one host) are contiguous along `node`, and the hosts of one
network zone share a `cluster` index. The zone of each host comes from
`zone_of_process` (one zone id per process index) or, when not given, from
the environment variable `GEMJAX_ZONE_OF_PROCESS` that the launcher sets to
the same comma-separated list on every host (e.g. "0,0,1,1"); without
either, process order decides (hosts 0..k-1 form the first zone).
"""

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("cluster", "zone", "node")
ZONE_ENV = "GEMJAX_ZONE_OF_PROCESS"


def make_mesh(
  cluster: int = 1,
  zone: int = 1,
  node: int = -1,
  devices=None,
  zone_of_process=None,
) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  sizes = [cluster, zone, node]
  if sizes.count(-1) > 1:
    raise ValueError(
      f"at most one tier may be -1, got {dict(zip(AXES, sizes))}"
    )
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"tier sizes must be positive or -1, got {sizes}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(
        f"{len(devices)} devices do not divide into tiers "
        f"{dict(zip(AXES, sizes))}"
      )
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(
      f"tiers {dict(zip(AXES, sizes))} need {math.prod(sizes)} devices, "
      f"have {len(devices)}"
    )
  zones = _zones(zone_of_process)
  zone_of = lambda d: zones[d.process_index] if zones else 0
  # Group by zone, then process (host), then local id: `node` spans one
  # host, a `cluster` index one zone.
  devices.sort(key=lambda d: (zone_of(d), d.process_index, d.id))
  grid = np.array(devices, dtype=object).reshape(sizes)
  for c in range(sizes[0]):
    ids = {zone_of(d) for d in grid[c].flat}
    if len(ids) > 1:
      raise ValueError(
        f"cluster index {c} mixes hosts of zones {sorted(ids)}: "
        f"{ZONE_ENV}={zones} does not fit tiers {dict(zip(AXES, sizes))}"
      )
  return Mesh(grid, AXES)


def _zones(zone_of_process):
  if zone_of_process is None:
    raw = os.environ.get(ZONE_ENV, "").strip()
    if not raw:
      return None
    zone_of_process = [int(z) for z in raw.split(",")]
  zones = list(zone_of_process)
  if len(zones) < jax.process_count():
    raise ValueError(
      f"zone ids for {len(zones)} processes, have {jax.process_count()}"
    )
  return zones
