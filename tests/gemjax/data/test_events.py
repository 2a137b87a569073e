"""Readers of real formats, bad input, log-backed loader.

Every input file is written here under tmp_path; nothing is downloaded.
"""

import dataclasses

import numpy as np
import pytest

from gemjax.data import events, synthetic
from gemjax.data.config import ACTION_ID, DataConfig
from gemjax.data.events import BadInputError
from gemjax.data.loader import Loader, eval_batches

CFG = DataConfig(
  num_items=5000,
  num_categories=100,
  num_users=1000,
  max_seq_len=128,
  len_median=50.0,
  requests_per_shard=16,
  token_capacity=2048,
  cand_capacity=192,
  prefetch=0,
  read_chunk_bytes=256,  # many chunks even for tiny files
)


def skips(counters):
  """The bad-input and time-order counters (not the reading summary)."""
  return {
    k: v
    for k, v in counters.items()
    if k.startswith("skipped_") or k == "reordered"
  }


def write(path, lines):
  path.write_text("".join(line + "\n" for line in lines))
  return path


def ratings_lines(sep):
  # user, movie, rating, ts; user 2 is out of time order in the file.
  rows = [
    (1, 10, 5, 100),
    (1, 11, 3, 200),
    (1, 12, 1, 300),
    (2, 10, 4, 900),
    (2, 13, 2, 800),
    (3, 14, 4.5, 50),
  ]
  return [sep.join(str(x) for x in r) for r in rows]


@pytest.mark.parametrize("fmt", ["dat", "csv"])
def test_movielens_ratings_map_to_actions(tmp_path, fmt):
  if fmt == "dat":
    p = write(tmp_path / "ratings.dat", ratings_lines("::"))
  else:
    p = write(
      tmp_path / "ratings.csv",
      ["userId,movieId,rating,timestamp"] + ratings_lines(","),
    )
  counters = {}
  log = events.read_movielens(p, CFG, counters)
  log.check_sorted()
  assert list(log.user) == [1, 1, 1, 2, 2, 3]
  assert list(log.ts) == [100, 200, 300, 800, 900, 50]
  a = ACTION_ID
  assert list(log.action) == [
    a["order"],
    a["click"],
    a["impression"],
    a["impression"],
    a["cart"],
    a["cart"],
  ]
  assert skips(counters) == {"reordered": 1}
  assert counters["events_read"] == 6 and counters["distinct_items"] == 5
  assert list(log.extra["line"]) == (
    [1, 2, 3, 5, 4, 6] if fmt == "dat" else [2, 3, 4, 6, 5, 7]
  )
  np.testing.assert_array_equal(
    log.item[[0, 4]], events.hash_rows([10, 10], CFG.num_items)
  )
  # A custom rule: 4 and up is an order.
  cfg = dataclasses.replace(CFG, rating_actions=((4.0, "order"),))
  log2 = events.read_movielens(p, cfg)
  assert (log2.action == a["order"]).sum() == 3


def test_taobao_behaviours_and_chunking(tmp_path):
  rng = np.random.default_rng(0)
  beh = ["pv", "fav", "cart", "buy"]
  rows = [
    (
      int(rng.integers(1, 30)),
      int(rng.integers(1, 9999)),
      int(rng.integers(1, 500)),
      beh[int(rng.integers(0, 4))],
      1_511_000_000 + int(rng.integers(0, 10**6)),
    )
    for _ in range(400)
  ]
  p = write(
    tmp_path / "UserBehavior.csv", [",".join(str(x) for x in r) for r in rows]
  )
  small = events.read_taobao(p, CFG)
  # Bounded memory: the file is parsed in chunks of at most 256 bytes.
  chunks = list(
    events._csv_chunks(
      p, "abcde", sep=",", fields=5, skip_rows=0, chunk_bytes=256
    )
  )
  assert len(chunks) > 40
  assert sum(rows.line.size for rows, _ in chunks) == 400
  assert max(rows.line.size for rows, _ in chunks) <= 256 // 20
  big = events.read_taobao(
    p, dataclasses.replace(CFG, read_chunk_bytes=1 << 20)
  )
  for k in events.EventLog.COLUMNS:
    np.testing.assert_array_equal(getattr(small, k), getattr(big, k))
  want = {"pv": "click", "fav": "cart", "cart": "cart", "buy": "order"}
  order = np.lexsort(([r[4] for r in rows], [r[0] for r in rows]))
  np.testing.assert_array_equal(
    small.action, [ACTION_ID[want[rows[i][3]]] for i in order]
  )
  np.testing.assert_array_equal(small.ts, [rows[i][4] for i in order])


BAD = {
  "malformed": ("1,2,3,pv\n", "expected 5 fields"),
  "bad_id": ("1,x2,3,pv,100\n", "item 'x2' is not an integer id"),
  "unknown_action": ("1,2,3,click,100\n", "unknown action type 'click'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_lines_error_with_file_and_line_or_counted_skip(tmp_path, case):
  line, msg = BAD[case]
  good = "7,8,9,pv,100\n"
  p = tmp_path / "UserBehavior.csv"
  p.write_text(good * 3 + line + good)
  with pytest.raises(BadInputError, match=f"UserBehavior.csv:4: {msg}"):
    events.read_taobao(p, CFG)
  counters = {}
  log = events.read_taobao(
    p, dataclasses.replace(CFG, on_bad_input="skip"), counters
  )
  assert len(log) == 4
  assert skips(counters) == {f"skipped_{case}": 1}


def test_negative_price_and_timestamp(tmp_path):
  p = write(
    tmp_path / "events.csv",
    [
      "user,ts,item,category,action,price",
      "1,100,5,2,click,9.5",
      "1,200,6,2,order,-3",
      "2,-5,6,2,cart,1",
      "2,300,7,3,impression,0",
    ],
  )
  with pytest.raises(BadInputError, match="events.csv:3: negative price"):
    events.read_events_csv(p, CFG)
  counters = {}
  log = events.read_events_csv(
    p, dataclasses.replace(CFG, on_bad_input="skip"), counters
  )
  assert skips(counters) == {
    "skipped_negative_price": 1,
    "skipped_negative_timestamp": 1,
  }
  assert list(log.ts) == [100, 300]
  assert log.price[0] == np.float32(9.5)


def test_timestamps_out_of_order_sort_error_or_skip(tmp_path):
  p = write(
    tmp_path / "ratings.dat",
    ["1::1::5::100", "1::2::5::300", "1::3::5::200", "1::4::5::400"],
  )
  c = {}
  assert list(events.read_movielens(p, CFG, c).ts) == [100, 200, 300, 400]
  assert skips(c) == {"reordered": 1}
  with pytest.raises(BadInputError, match="ratings.dat:3: timestamp 200"):
    events.read_movielens(p, dataclasses.replace(CFG, time_order="error"))
  c = {}
  log = events.read_movielens(p, dataclasses.replace(CFG, time_order="skip"), c)
  assert list(log.ts) == [100, 300, 400]
  assert skips(c) == {"skipped_out_of_order": 1}


def test_requests_user_without_events_and_unlabelled_candidate(tmp_path):
  ev = write(tmp_path / "ratings.dat", ["1::1::5::100", "1::2::4::200"])
  log = events.read_movielens(ev, CFG)
  p = write(
    tmp_path / "requests.csv",
    [
      "request,user,ts,item,category,price,click,conversion",
      "0,1,300,5,1,2.0,1,0",
      "0,1,300,6,1,2.0,,",  # line 3: no label
      "1,9,300,5,1,2.0,0,0",  # line 4: user 9 has no events
      "2,1,150,7,1,2.0,1,1",
    ],
  )
  req = events.read_requests_csv(p, CFG)
  with pytest.raises(BadInputError, match="requests.csv:4: user 9 has no"):
    events.check_requests(log, req, CFG)
  log_9 = events.concat_logs(
    [
      log,
      dataclasses.replace(
        log, user=np.full(2, 9, np.int64), extra={"line": np.zeros(2, np.int64)}
      ),
    ]
  )
  with pytest.raises(BadInputError, match="requests.csv:2: candidate 1"):
    events.check_requests(events.sort_log(log_9), req, CFG)
  counters = {}
  ok = events.check_requests(
    log, req, dataclasses.replace(CFG, on_bad_input="skip"), counters
  )
  assert counters == {
    "skipped_user_without_events": 1,
    "skipped_unlabelled_candidates": 1,
  }
  assert list(ok.user) == [1, 1] and list(np.diff(ok.cand_offsets)) == [1, 1]
  assert not np.isnan(ok.labels).any()


def synthetic_taobao(path, cfg, blocks=3):
  beh = {0: "pv", 1: "pv", 2: "cart", 3: "buy"}
  with open(path, "w") as f:
    for b in range(blocks):
      log, _, _ = synthetic.generate_raw(cfg, 0, 0, b, 48)
      for u, i, c, a, t in zip(
        log.user + 1000 * b,
        log.item,
        log.category,
        log.action,
        log.ts,
        strict=True,
      ):
        if a:
          f.write(f"{u},{i},{c},{beh[int(a)]},{t}\n")
  return path


def test_log_source_loader_shards_users_and_resumes(tmp_path):
  p = synthetic_taobao(tmp_path / "UserBehavior.csv", CFG)
  # One cut time for all processes needs split_time; the user split has none.
  cfg = dataclasses.replace(
    CFG, source="taobao", path=str(p), session_gap_s=86_400, protocol="user"
  )
  whole = Loader(cfg, num_shards=2)
  parts = [
    Loader(cfg, num_shards=2, process_index=i, process_count=2)
    for i in range(2)
  ]
  users = [set(x.source.log.user) for x in parts]
  assert not users[0] & users[1]
  assert users[0] | users[1] == set(whole.source.log.user)
  for _ in range(3):
    b = next(whole)
    b.validate(cfg.vocab_sizes())
    joined = [next(x) for x in parts]
    np.testing.assert_array_equal(
      b.seq["item_id"], np.concatenate([j.seq["item_id"] for j in joined])
    )
  state = whole.state()
  want = [next(whole) for _ in range(2)]
  again = Loader(cfg, num_shards=2)
  again.restore(state)
  got = [next(again) for _ in range(2)]
  for w, g in zip(want, got, strict=True):
    np.testing.assert_array_equal(w.labels, g.labels)
    np.testing.assert_array_equal(w.seq["ts_to_req"], g.seq["ts_to_req"])
  n_eval = sum(
    int((np.diff(b.cand_offsets, axis=-1) > 0).sum())
    for b in eval_batches(cfg, num_shards=2)
  )
  assert n_eval == len(whole.source.held_req) > 0
