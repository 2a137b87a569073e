"""Test setup, before JAX starts: 8 simulated CPU devices, and XLA's CPU
backend without its LLVM optimizations: the suite's programs are tiny and
their compile time is what it waits on (on the 2-core machine, 2026-12-02,
run one after the other: the bit-identical resume test, three training
runs, 135 s with them and 100 / 98 s without; the block attention and
ranking-model tests, `-n 2`, 169 s and 126 s). No persistent compilation
cache: a cached collective program hung XLA:CPU once, and CI must never
hang."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8"
  + " --xla_backend_optimization_level=0"
  + " --xla_llvm_disable_expensive_passes=true"
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
