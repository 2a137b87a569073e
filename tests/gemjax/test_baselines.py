"""In-project baselines and ranking metrics, against brute force."""

import dataclasses

import numpy as np
import pytest

from gemjax import baselines, metrics
from gemjax.data import build, protocol
from tests.gemjax.data.test_protocol import CFG, random_log


def built_pools(seed=0, **kw):
  log = random_log(seed, **kw)
  cfg = dataclasses.replace(CFG, num_dense=3)
  train, held = protocol.split_requests(log, cfg)

  def pool(req):
    off, cols, seg = build.build_sequences(log, req, cfg, {})
    return build.assemble(req, off, cols, seg, cfg)

  return pool(train), pool(held)


def test_examples_match_a_loop_over_requests():
  _, pool = built_pools()
  ex = baselines.examples([pool, pool])
  n = int(pool.cand_offsets[-1])
  assert ex.item.size == 2 * n
  assert ex.request[n] == pool.num_requests  # second pool continues ids
  for r in range(pool.num_requests):
    lo, hi = pool.offsets[r], pool.offsets[r + 1]
    h_item = pool.seq["item_id"][lo:hi].tolist()
    h_cat = pool.seq["category_id"][lo:hi].tolist()
    h_act = pool.seq["action"][lo:hi].tolist()
    for c in range(pool.cand_offsets[r], pool.cand_offsets[r + 1]):
      x = ex.x[c]
      ln = max(len(h_item), 1)
      want = [np.log1p(len(h_item))]
      want += [h_act.count(a) / ln for a in range(4)]
      want += [pool.cand["item_id"][c] in h_item]
      want += [h_cat.count(pool.cand["category_id"][c]) / ln]
      want += pool.dense[r].tolist()
      np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-7)
      assert ex.request[c] == r and ex.user[c] == pool.user_id[r]


def test_popularity_counts_training_positives_per_task():
  train, test = built_pools(1)
  tr, te = baselines.examples([train]), baselines.examples([test])
  s = baselines.popularity(tr, te)
  for j in range(2):
    for c in range(0, te.item.size, 7):
      want = tr.labels[tr.item == te.item[c], j].sum()
      assert s[c, j] == want


def test_logistic_regression_learns_a_planted_item_effect():
  rng = np.random.default_rng(0)
  n, items = 6000, 50
  good = rng.uniform(-2, 2, items)

  def make(n):
    item = rng.integers(0, items, n).astype(np.int32)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    p = 1 / (1 + np.exp(-(good[item] + 1.5 * x[:, 0])))
    y = (rng.uniform(size=n) < p).astype(np.float32)
    return baselines.Examples(
      item=item,
      category=np.zeros(n, np.int32),
      x=x,
      labels=np.stack([y, y], 1),
      request=np.arange(n),
      user=np.zeros(n, np.int32),
    ), p

  train, _ = make(n)
  test, p_true = make(2000)
  q = baselines.logistic_regression(train, test)
  best = metrics.auc(test.labels[:, 0], p_true)
  assert metrics.auc(test.labels[:, 0], q[:, 0]) > best - 0.01
  assert abs(q[:, 0].mean() - test.labels[:, 0].mean()) < 0.03


def brute_hr_ndcg(y, s, g, k):
  hrs, nds = [], []
  for grp in np.unique(g):
    m = g == grp
    pos, neg = s[m][y[m] == 1], s[m][y[m] == 0]
    if not pos.size or not neg.size:
      continue
    h = n = 0.0
    for p in pos:
      rank = (neg > p).sum() + 0.5 * (neg == p).sum()
      if rank < k:
        h += 1
        n += 1 / np.log2(rank + 2)
    hrs.append(h / pos.size)
    nds.append(n / pos.size)
  return np.mean(hrs), np.mean(nds), len(hrs)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_hit_rate_ndcg_matches_brute_force(k):
  rng = np.random.default_rng(k)
  g = rng.integers(0, 30, 400)
  y = (rng.uniform(size=400) < 0.1).astype(float)
  s = rng.integers(0, 6, 400).astype(float)  # many ties
  got = metrics.hit_rate_ndcg(y, s, g, k)
  want = brute_hr_ndcg(y, s, g, k)
  np.testing.assert_allclose(got[:2], want[:2], rtol=1e-12)
  assert got[2] == want[2]


def test_format_table_shows_baselines_under_each_task():
  m = {
    "ctr": {"auc": 0.7, "uauc": 0.6, "ne": 0.9, "calibration": 1.0,
            "count": 10, "hr@10": 0.5, "ndcg@10": 0.3},
    "baselines": {"popularity": {"ctr": {"auc": 0.6, "uauc": 0.5,
                                         "count": 10, "hr@10": 0.4}}},
  }  # fmt: skip
  text = metrics.format_table(m)
  lines = text.splitlines()
  assert "HR@10" in lines[0] and "NDCG@10" in lines[0]
  assert lines[2].startswith("ctr") and lines[3].startswith("  popularity")
  assert "nan" in lines[3]  # popularity has no NE
