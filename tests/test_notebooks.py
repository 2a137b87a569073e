"""Every notebook under notebooks/ runs top to bottom without error."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted(
  (pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb")
)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs, f"{path.name}: commit notebooks without outputs"
  NotebookClient(
    nb,
    timeout=600,
    kernel_name="python3",
    resources={"metadata": {"path": str(path.parents[1])}},
  ).execute()
