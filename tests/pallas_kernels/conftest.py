"""The kernel tests' two modes: one test body runs every case in GPU
interpret mode on the CPU (the default lane) and compiled on a Hopper GPU
(`pytest -m gpu`), so the compiled run covers every case the CPU run does.

A test that calls a kernel takes the `interpret` fixture (True in the
"interpret" mode, False in the "gpu" one) and passes it to the op; a test
of an op that picks its mode from the backend (`fp8_dot_general`'s
"mosaic") takes `mode` alone. The "gpu" cases carry `pytest.mark.gpu`:
the default lane deselects them (pyproject's addopts) and the root
conftest skips them where no Hopper GPU is. Tests that only the
interpreter can run (its race detector) take neither; tests at real
shapes, too slow to interpret, are marked gpu alone.
"""

import jax
import pytest


@pytest.fixture(
  params=["interpret", pytest.param("gpu", marks=pytest.mark.gpu)]
)
def mode(request) -> str:
  return request.param


@pytest.fixture
def interpret(mode) -> bool:
  return mode == "interpret"


@pytest.fixture(autouse=True)
def _fresh_traces_when_patched(request):
  # A test that monkeypatches what tracing reads (a kernel spy, a fake GPU)
  # must neither meet traces cached by an earlier test nor leave its own:
  # the kernel ops are jitted (`mosaic.trace_once`) and reuse a trace for
  # equal shapes and settings.
  patched = "monkeypatch" in request.fixturenames
  if patched:
    jax.clear_caches()
  yield
  if patched:
    jax.clear_caches()
