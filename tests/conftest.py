"""Test setup: 8 simulated CPU devices, set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import pytest  # noqa: E402

from pallas_kernels import dispatch  # noqa: E402  (imports JAX)


def pytest_collection_modifyitems(config, items):
  if not dispatch.hopper():  # the Mosaic GPU kernels' GPU
    skip = pytest.mark.skip(
      reason="needs a Hopper GPU (run with -m gpu on the H200)"
    )
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
