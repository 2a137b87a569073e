"""Public data sets that tests read when `make data` has fetched them."""

import pathlib

import pytest

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def ml100k_path() -> pathlib.Path:
  """data/ml-100k/ml-100k.inter, or skip the test: it is not fetched."""
  path = DATA / "ml-100k" / "ml-100k.inter"
  if not path.exists():
    pytest.skip("ml-100k not found: run `make data`")
  return path
