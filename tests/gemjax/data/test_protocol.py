"""Offline protocols: requests, leak-free negatives, temporal / LOO / user."""

import dataclasses

import numpy as np
import pytest

from gemjax.data import build, protocol
from gemjax.data.config import ACTION_ID, DataConfig
from gemjax.data.events import EventLog, concat_logs, sort_log

CFG = DataConfig(
  source="events",
  path="events.csv",  # the protocol reads an EventLog; no file is opened
  num_items=1 << 16,
  num_categories=64,
  num_users=1 << 16,
  max_seq_len=64,
  max_cands=6,
  min_cands=1,
  neg_per_request=2,
  session_gap_s=100,
  token_capacity=1024,
  cand_capacity=64,
  requests_per_shard=8,
  bbs_minibatch=4,
)


def random_log(seed=0, users=40, items=300, events=1500) -> EventLog:
  """Users with bursts of events (sessions) over a long time span."""
  rng = np.random.default_rng(seed)
  user = rng.integers(0, users, events) + 1000
  ts = rng.integers(0, 50, events) * 1000 + rng.integers(0, 60, events)
  item = rng.zipf(1.3, events) % items
  act = rng.choice(4, events, p=[0.3, 0.4, 0.2, 0.1])
  return sort_log(
    EventLog(
      user=user.astype(np.int64),
      ts=ts.astype(np.int64),
      item=item.astype(np.int32),
      category=(item % 64).astype(np.int32),
      action=act.astype(np.int8),
      price=rng.uniform(0, 10, events).astype(np.float32),
    )
  )


def per_request(req):
  return [
    slice(req.cand_offsets[i], req.cand_offsets[i + 1]) for i in range(len(req))
  ]


def check_negatives(log, req, n_neg):
  """Negatives: items the user never touched, no repeats in a request."""
  touched = {}
  for u, i in zip(log.user, log.item, strict=True):
    touched.setdefault(int(u), set()).add(int(i))
  for r, sl in enumerate(per_request(req)):
    items = req.cand_item[sl]
    assert len(set(items.tolist())) == items.size  # no item twice
    neg = items[-n_neg:]
    assert not set(neg.tolist()) & touched[int(req.user[r])]
    np.testing.assert_array_equal(req.labels[sl][-n_neg:], 0)


def test_temporal_split_same_users_no_future():
  log = random_log()
  cfg = dataclasses.replace(CFG, protocol="temporal", eval_frac=0.2)
  c = {}
  train, held = protocol.split_requests(log, cfg, "log", c)
  cut = c["split_time"]
  assert (train.ts < cut).all() and (held.ts >= cut).all()
  assert (np.sort(log.ts) < cut).mean() == pytest.approx(0.8, abs=0.02)
  assert set(held.user) <= set(log.user)
  assert set(held.user) & set(train.user)  # the same users on both sides
  # Train candidates are events before the cut (the cut splits sessions).
  ts_of = {}
  for u, t, i in zip(log.user, log.ts, log.item, strict=True):
    ts_of.setdefault((int(u), int(i)), []).append(int(t))
  for r, sl in enumerate(per_request(train)):
    for i, y in zip(train.cand_item[sl], train.labels[sl, 0], strict=True):
      if y:
        t = [x for x in ts_of[int(train.user[r]), int(i)] if x >= train.ts[r]]
        assert min(t) < cut
  # Histories are strictly before each request.
  off, cols, seg = build.build_sequences(log, held, cfg, {})
  assert (cols["ts"] < held.ts[seg]).all()
  check_negatives(log, train, 2)
  check_negatives(log, held, 2)
  assert c["cand_sampled_train"] == 2 * len(train)
  assert c["requests_train"] == len(train) and c["requests_eval"] == len(held)


def test_requests_are_chunks_of_distinct_items_labelled_by_actions():
  a = ACTION_ID
  # One user: session A (t 0, 10), session B (500..530: items 3, 4, 3, 5,
  # 6 -> distinct 3, 4, 5, 6 -> chunks [3, 4, 5, 6] of at most k = 4).
  one = EventLog(
    user=np.ones(8, np.int64),
    ts=np.array([0, 10, 500, 510, 520, 525, 530, 2000], np.int64),
    item=np.array([1, 2, 3, 4, 3, 5, 6, 7], np.int32),
    category=np.zeros(8, np.int32),
    action=np.array(
      [
        a["click"],
        a["order"],
        a["impression"],
        a["click"],
        a["order"],
        a["impression"],
        a["cart"],
        a["click"],
      ],
      np.int8,
    ),
    price=np.ones(8, np.float32),
  )
  # User 2's items are the only ones user 1 never touched: its negatives.
  other = EventLog(
    user=np.full(3, 2, np.int64),
    ts=np.array([0, 1, 2], np.int64),
    item=np.array([20, 21, 22], np.int32),
    category=np.zeros(3, np.int32),
    action=np.full(3, a["click"], np.int8),
    price=np.ones(3, np.float32),
  )
  log = sort_log(concat_logs([one, other]))
  cfg = dataclasses.replace(
    CFG, protocol="temporal", split_time=2000, max_cands=4, neg_per_request=1
  )
  train, held = protocol.split_requests(log, cfg)
  # k = 3 items a request: [1, 2] | [3, 4, 5] [6] | eval [7].
  train = train.take(np.flatnonzero(train.user == 1))
  assert list(train.ts) == [0, 500, 530] and list(held.ts) == [2000]
  assert set(train.cand_item[train.cand_offsets[1:] - 1]) <= {20, 21, 22}
  pos = [train.cand_item[sl][:-1].tolist() for sl in per_request(train)]
  assert pos == [[1, 2], [3, 4, 5], [6]]
  # item 3: impression then order -> click and conversion; 5 impression.
  np.testing.assert_array_equal(
    train.labels[train.cand_offsets[1] : train.cand_offsets[2] - 1],
    [[1, 1], [1, 0], [0, 0]],
  )


def test_leave_one_out_holds_each_users_last_event():
  log = random_log(1)
  cfg = dataclasses.replace(
    CFG, protocol="leave_one_out", loo_negatives=20, negatives="uniform"
  )
  c = {}
  train, held = protocol.split_requests(log, cfg, "log", c)
  users, starts = log.users
  assert sorted(held.user.tolist()) == sorted(users.tolist())
  assert (np.diff(held.cand_offsets) == 21).all()
  last_item = dict(zip(users, log.item[starts[1:] - 1], strict=True))
  last_ts = dict(zip(users, log.ts[starts[1:] - 1], strict=True))
  for r, sl in enumerate(per_request(held)):
    u = held.user[r]
    assert held.cand_item[sl][0] == last_item[u] and held.ts[r] == last_ts[u]
    assert held.labels[sl][0, 0] == 1 and (held.labels[sl][1:] == 0).all()
  check_negatives(log, held, 20)
  # Training never labels a user's last event: its item is a training
  # candidate only if the user touched it before.
  earlier = {
    (int(u), int(i))
    for u, i, t in zip(log.user, log.item, log.ts, strict=True)
    if t < last_ts[u] or i != last_item[u]
  }
  for r, sl in enumerate(per_request(train)):
    u = train.user[r]
    assert train.ts[r] <= last_ts[u]
    pos = train.cand_item[sl][train.labels[sl, 0] > 0]
    if last_item[u] in pos:
      assert (int(u), int(last_item[u])) in earlier
  assert c["cand_sampled_eval"] == 20 * len(held)


def test_user_split_holds_out_whole_users():
  log = random_log(2)
  cfg = dataclasses.replace(CFG, protocol="user", eval_frac=0.3)
  train, held = protocol.split_requests(log, cfg)
  assert not set(train.user) & set(held.user) and len(held)


def test_popularity_negatives_follow_training_counts():
  log = random_log(3, users=400, items=2000, events=4000)
  cfg = dataclasses.replace(CFG, neg_per_request=4, max_cands=8)
  train, _ = protocol.split_requests(log, cfg)
  neg = np.concatenate([train.cand_item[sl][-4:] for sl in per_request(train)])
  counts = np.bincount(log.item, minlength=2000)
  # Popular items are drawn more often (Zipf log: rank correlation > 0).
  drawn = np.bincount(neg, minlength=2000)
  assert np.corrcoef(counts, drawn)[0, 1] > 0.5


def test_a_user_who_touched_every_item_gets_counted_empty_slots():
  log = EventLog(
    user=np.array([1, 1, 1, 2, 2], np.int64),
    ts=np.array([0, 1000, 2000, 0, 5], np.int64),
    item=np.array([1, 2, 3, 1, 9], np.int32),
    category=np.zeros(5, np.int32),
    action=np.full(5, ACTION_ID["click"], np.int8),
    price=np.zeros(5, np.float32),
  )
  cfg = dataclasses.replace(
    CFG, protocol="temporal", split_time=2000, negatives="uniform"
  )
  c = {}
  train, held = protocol.split_requests(log, cfg, "x", c)
  # Items are {1, 2, 3, 9}: user 1 can only get 9, user 2 only 2 and 3.
  assert c["neg_unfilled_eval"] == 1  # user 1's held request: one slot left
  assert held.cand_item.tolist() == [3, 9]


@pytest.mark.parametrize(
  "cfg, match",
  [
    (dict(protocol="temporal", split_time=10**9), "no held-out requests"),
    (dict(protocol="temporal", split_time=1), "no training"),
  ],
)
def test_protocol_errors_say_what_is_missing(cfg, match):
  log = random_log()
  with pytest.raises(ValueError, match=match):
    protocol.split_requests(log, dataclasses.replace(CFG, **cfg), "f.csv")


def test_empty_log_is_an_error_naming_the_file():
  empty = EventLog(
    *(np.zeros(0, d) for d in (np.int64, np.int64, np.int32, np.int32)),
    action=np.zeros(0, np.int8),
    price=np.zeros(0, np.float32),
  )
  with pytest.raises(ValueError, match="f.csv: no events"):
    protocol.split_requests(empty, CFG, "f.csv")
