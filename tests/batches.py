"""Hand-built jagged batches with chosen lengths, for model tests."""

import numpy as np

from gemjax.data.config import CAND_FEATURES, SEQ_FEATURES
from gemjax.data.jagged import JaggedBatch


def random_batch(
  vocab,
  lengths,
  cand_counts,
  *,
  token_capacity,
  cand_capacity,
  num_dense=3,
  seed=0,
) -> JaggedBatch:
  rng = np.random.default_rng(seed)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  cand_offsets = np.concatenate([[0], np.cumsum(cand_counts)]).astype(np.int32)
  seq = {
    f: rng.integers(0, vocab[f], token_capacity).astype(np.int32)
    for f in SEQ_FEATURES
  }
  cand = {
    f: rng.integers(0, vocab[f], cand_capacity).astype(np.int32)
    for f in CAND_FEATURES
  }
  b = len(lengths)
  return JaggedBatch(
    offsets=offsets,
    seq=seq,
    cand_offsets=cand_offsets,
    cand=cand,
    labels=rng.integers(0, 2, (cand_capacity, 2)).astype(np.float32),
    user_id=np.arange(b, dtype=np.int32),
    dense=rng.normal(size=(b, num_dense)).astype(np.float32),
  )
