"""Test setup, before JAX starts: 8 simulated CPU devices, and XLA's CPU
backend without its LLVM optimizations: the suite's programs are tiny and
their compile time is what it waits on (on the 2-core machine, 2026-12-02,
run one after the other: the bit-identical resume test, three training
runs, 135 s with them and 100 / 98 s without; the block attention and
ranking-model tests, `-n 2`, 169 s and 126 s). The two tests that run many
steps (the FP8 on/off parity run, 200 steps, and the notebook, 20) start
fresh processes at level 1 instead, where a step runs twice as fast (see
each). No persistent compilation
cache: a cached collective program hung XLA:CPU once, and CI must never
hang.

XLA:CPU's thread pool gets at least 32 threads (`NPROC`, which XLA reads
for its size; 8 by default on the 2-core machine; a smaller `NPROC` from
the environment, which some CI systems set, is raised). GPU interpret
mode runs every simulated warpgroup as a Python thread whose program XLA
may hand to that pool, where it blocks in the interpreter's barrier
callbacks. With more simulated warpgroups than pool threads, the one
that would release the others can wait for a pool thread forever. The
quantizing GEMM's 4-CTA-cluster case (16 warpgroups) did (2026-12-03,
run alone as a test with copies of itself beside it): 3 of 25 runs hung
with one other copy, 9 of 11 with three (a thread dump showed 8 threads
that XLA had started, blocked in the barrier callbacks), and once in a
full `make test`. The largest interpret kernel in the suite runs 16
warpgroups. With 32 threads, 30 runs, two at a time beside two unchanged
copies, all passed; turning XLA's async dispatch off did not help (2 of
11 hung)."""

import gc
import os

# Before JAX starts (see above).
os.environ["NPROC"] = str(max(32, int(os.environ.get("NPROC") or 0)))
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8"
  + " --xla_backend_optimization_level=0"
  + " --xla_llvm_disable_expensive_passes=true"
).strip()

import pytest  # noqa: E402

from pallas_kernels import dispatch  # noqa: E402  (imports JAX)


def pytest_collection_finish(session):
  # Everything imported and collected so far lives for the whole session:
  # out of the collector's sight (see `tests/__init__.py`).
  gc.collect()
  gc.freeze()


def pytest_collection_modifyitems(config, items):
  # Tests marked slow (the longest, 20 s to 3 min on 2 cores) first, the rest in
  # their order: xdist deals tests in collection order, so a long test
  # collected last would leave the other worker idle at the end.
  items.sort(key=lambda item: "slow" not in item.keywords)
  if not dispatch.hopper():  # the Mosaic GPU kernels' GPU
    skip = pytest.mark.skip(
      reason="needs a Hopper GPU (run with -m gpu on the H200)"
    )
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
