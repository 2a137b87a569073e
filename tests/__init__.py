"""The test package. Importing it (every test module, the conftest, and the
workers the tests start: `meshes_worker`, the multi-host worker, the FP8
parity run) makes Python's cyclic garbage collector run less often.

JAX's tracing and lowering allocate millions of short-lived objects, and
with the default thresholds (700, 10, 10) the collector keeps walking the
long-lived ones (modules, jaxprs, compiled-function caches), a sixth of
the suite's time (docs/test_suite.md). Cycles are still collected, only
in larger batches.
"""

import gc

gc.set_threshold(200_000, 50, 1000)
