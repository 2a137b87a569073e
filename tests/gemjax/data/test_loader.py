"""The loader contract: shapes, determinism, exact resume, sharding, eval."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from gemjax import metrics
from gemjax.data import synthetic
from gemjax.data.config import DataConfig
from gemjax.data.loader import Loader, eval_batches


def _equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb)
  )


def _take(loader, n):
  return [next(loader) for _ in range(n)]


def test_batches_have_static_shapes_and_validate(smoke):
  loader = Loader(smoke, num_shards=4)
  for b in _take(loader, 3):
    b.validate(smoke.vocab_sizes())
    assert b.offsets.shape == (4, smoke.requests_per_shard + 1)
    assert b.cand_offsets.shape == (4, smoke.requests_per_shard + 1)
    assert set(b.seq) == {
      "item_id",
      "category_id",
      "action",
      "ts_delta",
      "ts_to_req",
      "price",
    }
    assert set(b.cand) == {"item_id", "category_id", "price"}
    for v in b.seq.values():
      assert v.shape == (4, smoke.token_capacity) and v.dtype == np.int32
    for v in b.cand.values():
      assert v.shape == (4, smoke.cand_capacity)
    assert b.labels.shape == (4, smoke.cand_capacity, 2)
    assert b.dense.shape == (4, smoke.requests_per_shard, smoke.num_dense)
    assert b.user_id.shape == (4, smoke.requests_per_shard)
    # Every request has candidates; lengths never exceed max_seq_len.
    lens = np.diff(b.offsets, axis=-1)
    assert lens.max() <= smoke.max_seq_len
    assert (np.diff(b.cand_offsets, axis=-1) >= smoke.min_cands).all()


def test_vocab_sizes_cover_every_int_column(smoke):
  v = smoke.vocab_sizes()
  for k in (
    "item_id",
    "category_id",
    "action",
    "ts_delta",
    "ts_to_req",
    "price",
    "user_id",
  ):
    assert v[k] >= 1
  assert v["action"] == 4 and v["ts_delta"] == smoke.ts_buckets


def test_config_rejects_bad_values():
  with pytest.raises(ValueError, match="token_capacity"):
    DataConfig(max_seq_len=4096, token_capacity=2048)
  with pytest.raises(ValueError, match="bbs_minibatch"):
    DataConfig(requests_per_shard=30, bbs_minibatch=4)
  with pytest.raises(ValueError, match="quota"):
    DataConfig(quota=(("buy", 3),))


def test_deterministic_given_seed(smoke):
  a = _take(Loader(smoke, num_shards=2), 3)
  b = _take(Loader(smoke, num_shards=2), 3)
  c = _take(Loader(dataclasses.replace(smoke, seed=1), num_shards=2), 3)
  assert _equal(a, b)
  assert not _equal(a, c)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_is_exact_with_carry(smoke, prefetch):
  # A tight buffer forces requests to be carried over across steps and
  # blocks, so the state must carry them too.
  cfg = dataclasses.replace(smoke, token_capacity=1400, prefetch=prefetch)
  ref = Loader(cfg, num_shards=2)
  full = _take(ref, 14)
  assert ref.counters["carried_over"] > 0
  cut = Loader(cfg, num_shards=2)
  _take(cut, 5)  # 5 steps: mid block (bbs_pool_batches = 8)
  state = json.loads(json.dumps(cut.state()))
  assert any(state["carry"].values())
  cut.close()
  resumed = Loader(cfg, num_shards=2)
  resumed.restore(state)
  assert _equal(full[5:], _take(resumed, 9))
  assert resumed.counters == ref.counters
  ref.close()
  resumed.close()


def test_nothing_is_dropped(smoke):
  cfg = dataclasses.replace(smoke, token_capacity=1700)
  loader = Loader(cfg, num_shards=1)
  steps = 2 * cfg.bbs_pool_batches  # two whole blocks
  seen = sum(
    int((np.diff(b.cand_offsets[0]) > 0).sum()) for b in _take(loader, steps)
  )
  waiting = len(loader.state()["carry"]["0"])
  assert loader.counters["carried_over"] > 0
  assert seen + waiting == steps * cfg.requests_per_shard
  assert loader.counters["requests"] == seen


def test_processes_read_their_own_shards(smoke):
  whole = _take(Loader(smoke, num_shards=4), 2)
  parts = [
    _take(Loader(smoke, num_shards=4, process_index=p, process_count=2), 2)
    for p in range(2)
  ]
  for step in range(2):
    joined = jax.tree.map(
      lambda *x: np.concatenate(x), parts[0][step], parts[1][step]
    )
    assert _equal(whole[step], joined)


def test_state_is_checked_on_restore(smoke):
  state = Loader(smoke, num_shards=2).state()
  with pytest.raises(ValueError, match="num_shards 2 .this loader: 4."):
    Loader(smoke, num_shards=4).restore(state)
  # Another process's position: same split and shard count, other shards.
  first = Loader(smoke, num_shards=4, process_index=0, process_count=2)
  second = Loader(smoke, num_shards=4, process_index=1, process_count=2)
  with pytest.raises(
    ValueError, match=r"shards \[0, 1\] \(this loader: \[2, 3\]\)$"
  ):
    second.restore(first.state())


def _requests(batches):
  """(user, history items, candidate items) of every real request."""
  out = []
  for b in batches:
    for s in range(b.offsets.shape[0]):
      o, co = b.offsets[s], b.cand_offsets[s]
      for i in range(o.size - 1):
        if co[i + 1] > co[i]:
          out.append(
            (
              int(b.user_id[s, i]),
              tuple(b.seq["item_id"][s, o[i] : o[i + 1]]),
              tuple(b.cand["item_id"][s, co[i] : co[i + 1]]),
            )
          )
  return out


def test_eval_set_is_fixed_complete_and_held_out(smoke):
  one = _requests(eval_batches(smoke, num_shards=1))
  four = list(eval_batches(smoke, num_shards=4))
  for b in four:
    b.validate(smoke.vocab_sizes())
  assert len(one) == smoke.eval_requests
  assert sorted(one) == sorted(_requests(four))
  train = set(_requests(_take(Loader(smoke, num_shards=4), 8)))
  assert not train & set(one)


def test_hidden_model_ceiling_is_learnable_but_not_trivial(smoke):
  labels, probs = synthetic.hidden_model_probs(
    dataclasses.replace(smoke, eval_requests=2048)
  )
  ctr, cvr = (metrics.auc(labels[:, i], probs[:, i]) for i in range(2))
  assert 0.78 < ctr < 0.92
  assert 0.78 < cvr < 0.95


def test_worker_processes_yield_the_same_batches(smoke):
  want = _take(Loader(smoke, num_shards=2), 9)
  cfg = dataclasses.replace(smoke, workers=2, prefetch=1)
  loader = Loader(cfg, num_shards=2)
  try:
    assert _equal(want, _take(loader, 9))
  finally:
    loader.close()
