"""Test setup, before JAX starts: 8 simulated CPU devices, and XLA's CPU
backend without its LLVM optimizations: the suite's programs are tiny and
compile time dominates. The two tests that run many steps (the FP8 on/off
parity run, 200 steps, and the notebook, 20) start fresh processes at
level 1 instead, where a step runs twice as fast (see each). No persistent
compilation cache: a cached collective program hung XLA:CPU once, and CI
must never hang.

XLA:CPU's thread pool gets at least 32 threads (`NPROC`, which XLA reads
for its size; 8 by default on the 2-core machine; a smaller `NPROC` from
the environment, which some CI systems set, is raised). GPU interpret
mode runs every simulated warpgroup as a Python thread whose program XLA
may hand to that pool, where it blocks in the interpreter's barrier
callbacks. With more simulated warpgroups than pool threads, the one
that would release the others can wait for a pool thread forever, as the
quantizing GEMM's 16-warpgroup case, the largest interpret kernel in the
suite, did with 8. The runs behind both settings: docs/test_suite.md."""

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


def pytest_configure(config):
  # xdist deals the first quarter of each worker's share in one consecutive
  # chunk: with the slow tests sorted first, one worker would get all of
  # them. One test at a time lets whichever worker is free take the next.
  if getattr(config.option, "maxschedchunk", "absent") is None:
    config.option.maxschedchunk = 1


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
