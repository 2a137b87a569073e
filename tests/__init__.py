"""The test package. Importing it (every test module, the conftest, and the
workers the tests start: `meshes_worker`, the multi-host worker, the FP8
parity run) makes Python's cyclic garbage collector run less often.

JAX's tracing and lowering allocate millions of short-lived objects, and
with the default thresholds (700, 10, 10) the collector keeps walking the
long-lived ones (modules, jaxprs, compiled-function caches): on the 2-core
machine, 2026-12-04, the upscale test and a jagged-attention interpret test
run one after the other took 71-82 s with the defaults and 61-63 s with
these thresholds plus the conftest's `gc.freeze()` (peak RSS 1.59 and
1.53 GB); `perf` of a train-step compile showed 6% of its time in the
collector. Cycles are still collected, only in larger batches.
"""

import gc

gc.set_threshold(200_000, 50, 1000)
