"""Synthetic traffic: the seed's length mix, action skew, determinism."""

import dataclasses

import numpy as np

from gemjax.data import synthetic
from gemjax.data.config import ACTION_ID, DataConfig


def test_2k_lengths_are_lognormal_capped_with_empty_users():
  cfg = DataConfig(zero_len_frac=0.03)
  counters = {}
  b = synthetic.make_block(cfg, synthetic.TRAIN, 0, 0, 512, counters)
  b.validate(cfg.vocab_sizes())
  lens = np.diff(b.offsets)
  assert lens.max() == cfg.max_seq_len  # the cap is reached ...
  assert 0.05 < (lens == cfg.max_seq_len).mean() < 0.3  # ... by the tail
  assert (lens == 0).sum() >= 3  # zero-length users
  nz = lens[lens > 0]
  assert 900 < np.median(nz) < 1300
  assert abs(lens.mean() / cfg.expected_tokens_per_request() - 1) < 0.1
  # Quota and cleaning did work and said so.
  assert counters["quota_dropped_impression"] > 0
  assert counters["dedup_dropped"] > 0
  assert counters["leakage_excluded"] >= 512


def test_action_skew_and_impression_cap(smoke):
  b = synthetic.make_block(smoke, synthetic.TRAIN, 0, 0, 256)
  a = np.bincount(b.seq["action"], minlength=4)
  click, cart, order = (a[ACTION_ID[k]] for k in ("click", "cart", "order"))
  assert click > cart > order > 0
  assert a[ACTION_ID["impression"]] > 0
  big = synthetic.make_block(DataConfig(), synthetic.TRAIN, 0, 0, 64)
  for i in range(64):
    seq = big.seq["action"][big.offsets[i] : big.offsets[i + 1]]
    assert (seq == ACTION_ID["impression"]).sum() <= 100


def test_blocks_are_deterministic_and_seeded(smoke):
  a = synthetic.make_block(smoke, 0, 1, 2, 64)
  b = synthetic.make_block(smoke, 0, 1, 2, 64)
  c = synthetic.make_block(smoke, 0, 1, 3, 64)
  d = synthetic.make_block(dataclasses.replace(smoke, seed=5), 0, 1, 2, 64)
  assert np.array_equal(a.seq["item_id"], b.seq["item_id"])
  assert np.array_equal(a.labels, b.labels)
  assert not np.array_equal(a.offsets, c.offsets)
  assert not np.array_equal(a.offsets, d.offsets)


def test_labels_follow_the_hidden_model(smoke):
  b, p = synthetic.make_block(smoke, 0, 0, 0, 1024, with_probs=True)
  y = b.labels
  assert set(np.unique(y)) <= {0.0, 1.0}
  assert (y[:, 1] <= y[:, 0]).all()  # conversion implies click
  # Base rates match the true probabilities (4 sigma).
  for t in range(2):
    sd = np.sqrt((p[:, t] * (1 - p[:, t])).sum())
    assert abs(y[:, t].sum() - p[:, t].sum()) < 4 * sd
  assert 0.1 < y[:, 0].mean() < 0.35
