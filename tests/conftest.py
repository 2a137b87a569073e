"""Test setup: 8 simulated CPU devices, set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason="needs a GPU (run with -m gpu on the H200)")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)


# Many tests train tiny models with identical shapes: a persistent compilation
# cache (shared by the xdist workers) compiles each program once per session.
jax.config.update(
  "jax_compilation_cache_dir",
  os.environ.get("GEMJAX_TEST_JAX_CACHE", "/tmp/gemjax-test-jax-cache"),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
