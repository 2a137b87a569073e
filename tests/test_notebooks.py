"""Every notebook under notebooks/ runs top to bottom without error."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from tests.real_data import ml100k_path

NOTEBOOKS = sorted(
  (pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb")
)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
  # The kernel is a fresh process with one CPU device, as on a user's
  # laptop (8 simulated devices made the quickstart and serving notebooks
  # 1.5-2.3x slower, docs/test_suite.md), and XLA:CPU's LLVM optimizations
  # at level 1, since the quickstart's 20 training steps outweigh the
  # compile time they add.
  monkeypatch.setenv(
    "XLA_FLAGS",
    "--xla_backend_optimization_level=1 "
    "--xla_llvm_disable_expensive_passes=true",
  )
  nb = nbformat.read(path, as_version=4)
  if nb.metadata.get("gemjax", {}).get("needs") == "ml-100k":
    ml100k_path()  # skips when `make data` has not fetched it
    monkeypatch.setenv("GEMJAX_NOTEBOOK_QUICK", "1")  # a few steps
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs, f"{path.name}: commit notebooks without outputs"
  NotebookClient(
    nb,
    timeout=600,
    kernel_name="python3",
    resources={"metadata": {"path": str(path.parents[1])}},
  ).execute()
