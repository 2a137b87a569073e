"""A device mesh whose axes are the cluster's network tiers, slowest first.

- `cluster`: across zones (thin, shared links);
- `zone`: hosts of one zone (RDMA);
- `node`: GPUs of one host (NVLink).

An axis is named after the tier whose links carry its traffic, so a rule that
maps a parameter's FSDP axis onto (`zone`, `node`) keeps its all-gathers off
the thin cluster links. `-1` means "whatever devices are left" (at most one
tier may say so). Devices are ordered so that the devices of one process (one
host) are contiguous along `node`.
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("cluster", "zone", "node")


def make_mesh(
  cluster: int = 1, zone: int = 1, node: int = -1, devices=None
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
  # Group by process (host), then by local id, so `node` spans one host.
  devices.sort(key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices, dtype=object).reshape(sizes), AXES)
