"""Small data configs shared by the data tests."""

import pytest

from gemjax.data.config import DataConfig

SMOKE = DataConfig(
  num_items=5000,
  num_categories=100,
  num_users=1000,
  max_seq_len=128,
  len_median=50.0,
  requests_per_shard=32,
  token_capacity=2048,
  cand_capacity=320,
  eval_requests=600,
  prefetch=0,
)


@pytest.fixture
def smoke() -> DataConfig:
  return SMOKE
