"""Request building against a plain per-request reference (O2, O4)."""

import dataclasses

import numpy as np
import pytest

from gemjax.data import build
from gemjax.data.config import ACTION_ID, DataConfig
from gemjax.data.events import EventLog, Requests

IMP, CLICK, CART, ORDER = (
  ACTION_ID[a] for a in ("impression", "click", "cart", "order")
)


def reference(log: EventLog, req: Requests, cfg: DataConfig):
  """Per request, in plain Python: the kept log rows in time order."""
  out = []
  for u, t in zip(req.user, req.ts, strict=True):
    rows = [i for i in range(len(log)) if log.user[i] == u and log.ts[i] < t]
    rows.sort(key=lambda i: (log.ts[i], i))
    if cfg.dedup == "consecutive":
      rows = [
        r
        for j, r in enumerate(rows)
        if j == 0
        or (log.item[r], log.action[r])
        != (log.item[rows[j - 1]], log.action[rows[j - 1]])
      ]
    elif cfg.dedup in ("item", "item_action"):
      key = (
        (lambda r: log.item[r])
        if cfg.dedup == "item"
        else (lambda r: (log.item[r], log.action[r]))
      )
      last = {key(r): r for r in rows}
      rows = [r for r in rows if last[key(r)] == r]
    keep, carry = set(), 0
    for name, cap in cfg.quota:
      mine = [r for r in rows if log.action[r] == ACTION_ID[name]]
      allow = cap if name in cfg.no_backfill else cap + carry
      k = min(len(mine), allow)
      keep |= set(mine[len(mine) - k :])
      carry = carry + cap - k if name in cfg.no_backfill else allow - k
    rows = [r for r in rows if r in keep]
    out.append(rows[max(0, len(rows) - cfg.max_seq_len) :])
  return out


def random_case(seed, users=12, events=400):
  rng = np.random.default_rng(seed)
  n = events
  user = rng.integers(0, users, n)
  # Few distinct times and items, so ties and duplicates happen.
  ts = rng.integers(0, 60, n) * 10
  item = rng.integers(0, 6, n)
  # Mostly impressions and clicks, as in logs.
  action = rng.choice(4, n, p=[0.5, 0.35, 0.1, 0.05])
  order = np.lexsort((ts, user))
  user, ts, item, action = user[order], ts[order], item[order], action[order]
  # Runs of exact repeats (same user, time, item, action) for dedup.
  rep = np.flatnonzero(rng.random(n) < 0.2)
  rep = rep[rep > 0]
  for col in (user, ts, item, action):
    col[rep] = col[rep - 1]
  log = EventLog(
    user=user.astype(np.int64),
    ts=ts.astype(np.int64),
    item=item.astype(np.int32),
    category=(item % 3).astype(np.int32),
    action=action.astype(np.int8),
    price=rng.random(n).astype(np.float32),
  )
  log.check_sorted()
  # Requests: every user (one unknown to nobody: all users have events),
  # times before all, inside and after all events, and exactly at one.
  r_user = np.concatenate([np.arange(users), rng.integers(0, users, 8)])
  r_ts = np.concatenate(
    [rng.integers(0, 700, users), [0, 10, 300, 590, 600, 5000, 305, 1]]
  )
  r = r_user.size
  req = Requests(
    user=r_user.astype(np.int64),
    ts=r_ts.astype(np.int64),
    user_row=r_user.astype(np.int32),
    dense=np.zeros((r, 2), np.float32),
    cand_offsets=np.arange(r + 1, dtype=np.int64),
    cand_item=np.zeros(r, np.int32),
    cand_category=np.zeros(r, np.int32),
    cand_price=np.ones(r, np.float32),
    labels=np.zeros((r, 2), np.float32),
  )
  return log, req


QUOTAS = {
  "default": (
    ("order", 512),
    ("cart", 512),
    ("click", 924),
    ("impression", 100),
  ),
  "tight": (("order", 2), ("cart", 1), ("click", 3), ("impression", 4)),
  "no_imp": (("cart", 3), ("order", 1), ("click", 2)),
}


@pytest.mark.parametrize(
  "dedup", ["none", "consecutive", "item_action", "item"]
)
@pytest.mark.parametrize("quota", ["default", "tight", "no_imp"])
@pytest.mark.parametrize("max_len", [5, 2048])
def test_index_only_and_naive_match_reference(dedup, quota, max_len):
  cfg = DataConfig(
    dedup=dedup, quota=QUOTAS[quota], max_seq_len=max_len, token_capacity=2048
  )
  log, req = random_case(hash((dedup, quota, max_len)) % 1000)
  want = reference(log, req, cfg)
  fns = [
    build.build_sequences_naive,
    lambda *a: build.build_sequences(*a, method="mask"),
  ]
  if dedup in ("none", "consecutive"):
    fns.append(lambda *a: build.build_sequences(*a, method="positions"))
  for fn in fns:
    counters = {}
    offsets, cols, seg = fn(log, req, cfg, counters)
    for i, rows in enumerate(want):
      got = slice(offsets[i], offsets[i + 1])
      np.testing.assert_array_equal(cols["ts"][got], log.ts[rows])
      np.testing.assert_array_equal(cols["item"][got], log.item[rows])
      np.testing.assert_array_equal(cols["action"][got], log.action[rows])
      np.testing.assert_array_equal(cols["price"][got], log.price[rows])
      assert (seg[got] == i).all()
    empty = sum(
      not ((log.user == u) & (log.ts < t)).any()
      for u, t in zip(req.user, req.ts, strict=True)
    )
    assert counters.get("empty_history", 0) == empty


def test_no_requests_give_empty_sequences():
  log, req = random_case(5)
  none = req.take(np.zeros(0, np.int64))
  for fn in (
    build.build_sequences_naive,
    lambda *a: build.build_sequences(*a, method="mask"),
    lambda *a: build.build_sequences(*a, method="positions"),
  ):
    offsets, cols, seg = fn(log, none, DataConfig(dedup="consecutive"))
    np.testing.assert_array_equal(offsets, [0])
    assert seg.shape == (0,)
    for k, v in log.columns().items():
      assert cols[k].shape == (0,) and cols[k].dtype == v.dtype, k


def test_anti_leakage_is_strict_and_counted():
  log, req = random_case(3)
  cfg = DataConfig(dedup="none")
  counters = {}
  offsets, cols, seg = build.build_sequences(log, req, cfg, counters)
  assert (cols["ts"] < req.ts[seg]).all()
  future = sum(
    ((log.user == u) & (log.ts >= t)).sum()
    for u, t in zip(req.user, req.ts, strict=True)
  )
  assert counters["leakage_excluded"] == future
  # A request exactly at an event's time does not see that event.
  i = 0
  t_at = int(log.ts[i])
  one = Requests(**{**req.__dict__}).take([0])
  one = dataclasses.replace(one, user=log.user[[i]], ts=np.array([t_at]))
  _, c1, _ = build.build_sequences(log, one, cfg)
  assert (c1["ts"] < t_at).all()


def test_quota_rule_backfill_and_impression_cap():
  cfg = DataConfig()  # order 512 > cart 512 > click 924 > impression 100
  counts = np.array(
    [
      # impression, click, cart, order
      [5000, 3000, 10, 2],  # unused order+cart quota backfills clicks
      [5000, 0, 0, 0],  # impressions never exceed 100
      [50, 10, 600, 700],  # orders over cap; carts use nothing extra
      [0, 0, 0, 0],
    ]
  )
  keep = build.quota_keep(counts, cfg)
  np.testing.assert_array_equal(keep[0], [100, 924 + 510 + 502, 10, 2])
  np.testing.assert_array_equal(keep[1], [100, 0, 0, 0])
  np.testing.assert_array_equal(keep[2], [50, 10, 512, 512])
  np.testing.assert_array_equal(keep[3], [0, 0, 0, 0])


def test_truncation_keeps_newest_in_time_order_and_counts():
  n = 300
  log = EventLog(
    user=np.zeros(n, np.int64),
    ts=np.arange(n, dtype=np.int64),
    item=np.arange(n, dtype=np.int32),
    category=np.zeros(n, np.int32),
    action=np.full(n, CLICK, np.int8),
    price=np.ones(n, np.float32),
  )
  req = Requests(
    user=np.zeros(1, np.int64),
    ts=np.array([n], np.int64),
    user_row=np.zeros(1, np.int32),
    dense=np.zeros((1, 0), np.float32),
    cand_offsets=np.array([0, 1]),
    cand_item=np.zeros(1, np.int32),
    cand_category=np.zeros(1, np.int32),
    cand_price=np.ones(1, np.float32),
    labels=np.zeros((1, 2), np.float32),
  )
  cfg = DataConfig(max_seq_len=64, token_capacity=64)
  counters = {}
  offsets, cols, _ = build.build_sequences(log, req, cfg, counters)
  np.testing.assert_array_equal(cols["ts"], np.arange(n - 64, n))
  assert counters["truncated_requests"] == 1
  assert counters["truncated_events"] == n - 64


def test_seq_features_first_event_has_no_delta():
  log, req = random_case(5)
  cfg = DataConfig()
  offsets, cols, seg = build.build_sequences(log, req, cfg)
  f = build.seq_features(offsets, cols, seg, req.ts, cfg)
  starts = offsets[:-1][np.diff(offsets) > 0]
  assert (f["ts_delta"][starts] == 0).all()
  inner = np.setdiff1d(np.arange(offsets[-1]), starts)
  assert (f["ts_delta"][inner] >= 1).all()
  assert (f["ts_to_req"] >= 2).all()  # strictly positive gaps: >= 1 s
