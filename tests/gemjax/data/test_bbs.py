"""Base Batch Shuffling (G10), packing, context-feature buckets (O3)."""

import numpy as np
import pytest

from gemjax.data import bbs, features
from gemjax.data.config import DataConfig
from gemjax.data.jagged import JaggedBatch, to_padded


def test_seed_example_pairs_heaviest_with_lightest():
  # 16 mini-batches weighing 16..1 (one request each), 2 batches of 8: the
  # seed's worked example gives two batches of 68.
  w = np.arange(16, 0, -1).astype(float)
  plan = bbs.plan_bbs(w, batch=8, minibatch=1)
  assert [w[p].sum() for p in plan] == [68, 68]


@pytest.mark.parametrize(
  "batch,minibatch,g", [(32, 4, 8), (24, 8, 4), (12, 4, 5), (8, 8, 3)]
)
def test_plan_is_a_partition_into_whole_minibatches(batch, minibatch, g):
  rng = np.random.default_rng(0)
  w = rng.lognormal(7, 0.6, batch * g)
  plan = bbs.plan_bbs(w, batch, minibatch)
  assert len(plan) == g and all(p.size == batch for p in plan)
  flat = np.sort(np.concatenate(plan))
  np.testing.assert_array_equal(flat, np.arange(batch * g))
  for p in plan:  # mini-batches stay whole (consecutive stream runs)
    runs = p.reshape(-1, minibatch)
    assert (runs % minibatch == np.arange(minibatch)).all()
    assert (np.diff(runs, axis=1) == 1).all()


def lognormal_lengths(rng, n):
  x = np.round(rng.lognormal(np.log(1100), 0.6, n))
  return np.minimum(x, 2048)


def test_bbs_balances_ranks_better_than_random():
  rng = np.random.default_rng(1)
  ranks, batch, mb, g = 8, 256, 32, 8
  costs = {"random": [], "bbs": []}
  for _ in range(3):  # pools
    per_rank = {"random": [], "bbs": []}
    for _ in range(ranks):
      lens = lognormal_lengths(rng, batch * g)
      w = bbs.sample_weight(lens, "cost")
      for name, plan in (
        ("random", bbs.plan_random(lens.size, batch)),
        ("bbs", bbs.plan_bbs(w, batch, mb)),
      ):
        per_rank[name].append([w[p].sum() for p in plan])
    for name in costs:
      costs[name] += list(np.array(per_rank[name]).T)  # [steps, ranks]
  r = {k: bbs.straggler_ratio(v) for k, v in costs.items()}
  assert r["bbs"] < 1.02 < r["random"]


def test_sample_weight_kinds():
  x = np.array([0, 1, 2688])
  np.testing.assert_array_equal(bbs.sample_weight(x, "tokens"), x)
  np.testing.assert_array_equal(bbs.sample_weight(x, "attn"), x * x)
  np.testing.assert_allclose(
    bbs.sample_weight(x, "cost"), [0, 1 + 1 / 2688, 2 * 2688]
  )
  with pytest.raises(ValueError):
    bbs.sample_weight(x, "flops")


def test_first_fit_defers_in_order_and_never_overfills():
  take, rest = bbs.first_fit(
    [5, 9, 3, 4, 1], [1, 1, 1, 1, 1], batch=3, tokens=10, cands=10
  )
  assert (take, rest) == ([0, 2, 4], [1, 3])
  take, rest = bbs.first_fit(
    [5, 9, 3, 4, 1], [1, 1, 1, 1, 1], batch=5, tokens=10, cands=2
  )
  assert (take, rest) == ([0, 2], [1, 3, 4])


def pool(lens, ncands):
  off = np.r_[0, np.cumsum(lens)].astype(np.int32)
  coff = np.r_[0, np.cumsum(ncands)].astype(np.int32)
  t, c = int(off[-1]), int(coff[-1])
  return JaggedBatch(
    offsets=off,
    seq={"item_id": np.arange(t, dtype=np.int32) + 1},
    cand_offsets=coff,
    cand={"item_id": np.arange(c, dtype=np.int32) + 7},
    labels=(np.arange(2 * c).reshape(c, 2) % 2).astype(np.float32),
    user_id=np.arange(len(lens), dtype=np.int32),
    dense=np.arange(len(lens) * 3, dtype=np.float32).reshape(-1, 3),
  )


def test_gather_packs_exactly_the_chosen_requests():
  lens, nc = [3, 0, 1, 5, 2], [2, 1, 3, 1, 2]
  p, q = pool(lens, nc), pool([4, 1], [1, 2])
  out = bbs.gather(
    [(p, [3, 1]), (q, [1]), (p, [0])], batch=6, tokens=16, cands=9
  )
  out.validate()
  assert list(np.diff(out.offsets)) == [5, 0, 1, 3, 0, 0]
  assert list(np.diff(out.cand_offsets)) == [1, 1, 2, 2, 0, 0]
  seqs, mask = to_padded(out.seq["item_id"], out.offsets, 5)
  np.testing.assert_array_equal(seqs[0], [5, 6, 7, 8, 9])  # p's request 3
  np.testing.assert_array_equal(seqs[2, :1], [5])  # q's request 1
  np.testing.assert_array_equal(seqs[3, :3], [1, 2, 3])
  assert (out.seq["item_id"][9:] == 0).all()
  np.testing.assert_array_equal(out.user_id, [3, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(out.dense[0], p.dense[3])
  with pytest.raises(ValueError, match="do not fit"):
    bbs.gather([(p, [3, 0])], batch=6, tokens=7, cands=9)


def test_log_buckets_have_exact_documented_edges():
  edges = features.bucket_edges(2.0, 6)
  np.testing.assert_array_equal(edges, [0, 1, 3, 7, 15])
  x = np.array([-1, 0, 0.99, 1, 2.99, 3, 6, 7, 14, 15, 1e9])
  np.testing.assert_array_equal(
    features.log_bucket(x, 2.0, 6), [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
  )
  cfg = DataConfig()
  p = features.log_bucket([0, 0.49, 0.5, 1.24, 1.25, 1e12], 1.5, 48)
  np.testing.assert_array_equal(p, [1, 1, 2, 2, 3, 47])
  assert (
    features.log_bucket([2**31], cfg.ts_bucket_base, cfg.ts_buckets)[0]
    == cfg.ts_buckets - 1
  )
