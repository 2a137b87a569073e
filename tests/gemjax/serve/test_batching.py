"""Bucket packing: every unit lands in a bucket that holds its batch,
in order, under every budget; big requests are split."""

import numpy as np
import pytest

from gemjax.serve import batching


def test_plan_respects_every_budget():
  buckets = batching.make_buckets(
    [(1, 64), (4, 64, 32, 100), (8, 128, 32, 300)], max_seq_len=64
  )
  rng = np.random.default_rng(0)
  cands = rng.integers(1, 33, 200).tolist()
  tokens = rng.integers(0, 65, 200).tolist()
  batches = batching.plan(cands, tokens, buckets)
  assert [u for idx, _ in batches for u in idx] == list(range(200))
  for idx, b in batches:
    assert b in buckets
    assert b.holds(
      len(idx),
      sum(cands[u] for u in idx),
      max(cands[u] for u in idx),
      sum(tokens[u] for u in idx),
    )
  # A full-length history and a request of 64 candidates fit alone.
  assert batching.plan([64], [64], buckets)[0][1] == batching.Bucket(1, 64, 64)


def test_split_units_and_bad_buckets():
  assert batching.split_units([5, 0, 2], 2) == [
    (0, 0, 2),
    (0, 2, 4),
    (0, 4, 5),
    (2, 0, 2),
  ]
  with pytest.raises(ValueError, match="max_seq_len=64"):
    batching.make_buckets([(4, 64, 64, 32)], max_seq_len=64)
  with pytest.raises(ValueError, match="candidates of one request"):
    batching.make_buckets([(1, 8, 16)], max_seq_len=64)
  with pytest.raises(ValueError, match="no bucket holds"):
    batching.plan([65], [1], batching.make_buckets([(1, 64)], 64))
