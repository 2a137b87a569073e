"""JaggedBatch validation errors and padded conversions."""

import dataclasses

import numpy as np
import pytest

from gemjax.data.jagged import (
  JaggedBatch,
  from_padded,
  segment_ids,
  stack,
  to_padded,
)
from tests.batches import random_batch

VOCAB = dict(
  item_id=50, category_id=10, action=4, ts_delta=8, ts_to_req=8, price=8
)


def batch(**changes) -> JaggedBatch:
  b = random_batch(
    VOCAB, [3, 0, 5, 1], [2, 1, 3, 2], token_capacity=12, cand_capacity=10
  )
  return dataclasses.replace(b, **changes)


def test_valid_batch_passes():
  batch().validate(VOCAB)
  stack([batch(), batch()]).validate(VOCAB)


@pytest.mark.parametrize(
  "change, match",
  [
    (
      dict(offsets=np.array([0, 3, 2, 8, 9], np.int32)),
      r"offsets must be non-decreasing: \[1\]=3 > \[2\]=2",
    ),
    (
      dict(offsets=np.array([1, 3, 3, 8, 9], np.int32)),
      r"offsets\[0\] must be 0",
    ),
    (
      dict(offsets=np.array([0, 3, 3, 8, 13], np.int32)),
      r"offsets\[-1\]=13 is beyond the buffer capacity 12",
    ),
    (
      dict(cand_offsets=np.array([0, 2, 3, 6, 11], np.int32)),
      r"cand_offsets\[-1\]=11 is beyond the buffer capacity 10",
    ),
    (
      dict(offsets=np.array([0, 3, 3, 8, 9], np.int64)),
      "offsets must be int32",
    ),
    (dict(labels=np.full((10, 2), 0.5, np.float32)), "labels must be 0 or 1"),
    (dict(user_id=np.arange(3, dtype=np.int32)), "user_id must have 4 rows"),
  ],
)
def test_bad_batches_fail_clearly(change, match):
  with pytest.raises(ValueError, match=match):
    batch(**change).validate(VOCAB)


def test_id_outside_its_table():
  b = batch()
  seq = dict(b.seq, category_id=b.seq["category_id"].copy())
  seq["category_id"][4] = 10
  with pytest.raises(
    ValueError,
    match=r"seq.category_id\[4\]=10 is outside its "
    r"table of 10 rows",
  ):
    dataclasses.replace(b, seq=seq).validate(VOCAB)


def test_wrong_column_length():
  b = batch()
  seq = dict(b.seq, price=b.seq["price"][:11])
  with pytest.raises(ValueError, match="seq.price has 11 rows, expected 12"):
    dataclasses.replace(b, seq=seq).validate(VOCAB)


def test_padded_round_trip_with_empty_and_length_one():
  rng = np.random.default_rng(0)
  lengths = np.array([0, 1, 4, 0, 3])
  values, offsets = from_padded(
    rng.normal(size=(5, 4, 2)), lengths, capacity=10
  )
  assert offsets.tolist() == [0, 0, 1, 5, 5, 8]
  np.testing.assert_array_equal(values[8:], 0)
  padded, mask = to_padded(values, offsets, max_len=4)
  assert mask.sum() == 8 and mask[1].tolist() == [True, False, False, False]
  again, _ = from_padded(padded, lengths, capacity=10)
  np.testing.assert_array_equal(again, values)
  with pytest.raises(ValueError, match="length 4 > max_len 3"):
    to_padded(values, offsets, max_len=3)


def test_segment_ids_mark_the_tail():
  seg = np.asarray(segment_ids(np.array([0, 2, 2, 5]), 7))
  assert seg.tolist() == [0, 0, 2, 2, 2, 3, 3]
