"""Event-log readers (pyarrow): every bad input, summary, formats, real data.

Inputs are written under tmp_path; the real ml-100k test reads data/ when
`make data` has fetched it and skips otherwise.
"""

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

from gemjax.data import events, synthetic
from gemjax.data.config import ACTION_ID, ACTIONS, DataConfig
from gemjax.data.events import BadInputError
from gemjax.data.loader import Loader, LogSource
from tests.real_data import ml100k_path

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
  read_chunk_bytes=64,  # several blocks even for these few lines
)
SKIP = dataclasses.replace(CFG, on_bad_input="skip")

TB = "UserBehavior.csv"
EV = "user,ts,item,category,action,price\n"
INTER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
PQ = dict(user=[1, 2, 3], ts=[5, 6, 7], item=[1, 2, 3], category=[4, 4, 4])
PQ = {**PQ, "action": ["click"] * 3, "price": [1.0, 2.0, 3.0]}
PQ_TYPES = ("int64",) * 4 + ("string", "float64")


def tb(*bad):
  """Taobao lines: a good one, the bad ones (from line 2), a good one."""
  return "".join(line + "\n" for line in ("7,8,9,pv,100", *bad, "7,8,9,pv,200"))


def ev(*bad):
  return EV + "".join(
    line + "\n" for line in ("1,100,5,2,click,1.5", *bad, "1,200,5,2,cart,0")
  )


def pq_with(**cols):
  """The Parquet table PQ with some columns replaced: a column is a list,
  or (list, arrow type name)."""
  return {**PQ, **cols}


# (case, source, file, content, error in "error" mode (None: reads fine),
#  in "skip" mode: (events kept, skipped counters) or an error).
# Content: text, or a dict of columns written as Parquet.
CASES = [
  ("ids_above_2^53_stay_distinct", "taobao", TB,
   tb(f"{2**53},{2**53 + 1},9,pv,150", f"{2**53 + 1},{2**53},9,pv,150"),
   None, (4, {})),
  ("id_2^63", "taobao", TB, tb(f"7,{2**63},9,pv,150"),
   rf"{TB}:2: item '{2**63}' is not an integer id", (2, {"bad_id": 1})),
  ("id_2^64", "taobao", TB, tb(f"{2**64},8,9,pv,150"),
   rf"{TB}:2: user '{2**64}' is not an integer id", (2, {"bad_id": 1})),
  ("id_fraction", "taobao", TB, tb("7,8,9.5,pv,150"),
   rf"{TB}:2: category '9.5' is not an integer id", (2, {"bad_id": 1})),
  ("id_exponent_hex_text", "taobao", TB,
   tb("7,1e3,9,pv,150", "7,0x1,9,pv,150", "7,x2,9,pv,150"),
   rf"{TB}:2: item '1e3' is not an integer id", (2, {"bad_id": 3})),
  ("wrong_field_count", "taobao", TB, tb("7,8,9,pv", "7,8,9,pv,1,2"),
   rf"{TB}:2: expected 5 fields separated by ',', got 4: '7,8,9,pv'",
   (2, {"malformed": 2})),
  ("unknown_behaviour", "taobao", TB, tb("7,8,9,click,150"),
   rf"{TB}:2: unknown action type 'click'", (2, {"unknown_action": 1})),
  ("header_in_headerless_file", "taobao", TB,
   "user,item,category,behavior,ts\n" + tb(),
   rf"{TB}:1: user 'user' is not an integer id", (2, {"bad_id": 1})),
  ("blank_line_inside", "taobao", TB, tb("", "7,8,9,pv,150"),
   rf"{TB}:2: blank line", (3, {"blank_line": 1})),
  ("blank_lines_at_end_and_crlf", "taobao", TB,
   tb().replace("\n", "\r\n") + "\r\n\n", None, (2, {})),
  ("no_newline_at_end", "taobao", TB, tb().rstrip("\n"), None, (2, {})),
  ("nan_timestamp", "events", "events.csv", ev("1,nan,5,2,click,1"),
   r"events.csv:3: non-finite timestamp: nan",
   (2, {"nonfinite_timestamp": 1})),
  ("inf_price_and_nan_price", "events", "events.csv",
   ev("1,150,5,2,click,inf", "1,150,5,2,click,NaN"),
   r"events.csv:3: non-finite price: inf", (2, {"nonfinite_price": 2})),
  ("negative_price_and_timestamp", "events", "events.csv",
   ev("1,150,5,2,click,-3", "1,-5,5,2,click,1"),
   r"events.csv:3: negative price: -3.0",
   (2, {"negative_price": 1, "negative_timestamp": 1})),
  ("text_price_and_time", "events", "events.csv",
   ev("1,150,5,2,click,cheap", "1,noon,5,2,click,1"),
   r"events.csv:3: price 'cheap' is not a number",
   (2, {"malformed": 2})),
  ("unknown_action_name", "events", "events.csv", ev("1,150,5,2,buy,1"),
   r"events.csv:3: unknown action type 'buy' \(known: \['cart', 'click'",
   (2, {"unknown_action": 1})),
  ("events_bad_header", "events", "events.csv", "user,ts,item\n1,2,3\n",
   r"events.csv:1: header must be user,ts,item,category,action,price",
   r"events.csv:1: header must be"),
  ("empty_file", "movielens", "ratings.dat", "",
   r"^no events in \S*ratings.dat$", r"^no events in \S*ratings.dat$"),
  ("header_only", "events", "events.csv", EV,
   r"^no events in \S*events.csv$", r"^no events in \S*events.csv$"),
  ("every_row_bad", "taobao", TB, "7,8,9,pv\n\n7,8,9,pv,x\n",
   rf"{TB}:1: expected 5 fields",
   rf"no events in \S*{TB} \(every row was bad: blank_line 1, malformed 2\)"),
  ("ratings_csv_without_header", "movielens", "ratings.csv",
   "1,10,5,100\n1,11,3,200\n2,10,4,300\n", None, (3, {})),
  ("ratings_csv_other_header", "movielens", "ratings.csv",
   "user,movie,rating,ts\n1,10,5,100\n",
   r"ratings.csv:1: header must be userId,movieId,rating,timestamp",
   r"ratings.csv:1: header must be"),
  ("dat_bad_separator_and_rating", "movielens", "ratings.dat",
   "1::10::5::100\n1::10::5:3::100\n1::10::4:3:100\n1::10::nan::5\n"
   "1::10::x::5\n1::11::3::200\n",
   r"ratings.dat:2: expected 4 fields separated by '::': '1::10::5:3::100'",
   (2, {"malformed": 4})),
  ("recbole_no_timestamp", "recbole", "x.inter",
   "user_id:token\titem_id:token\n1\t2\n",
   r"x.inter:1: no column timestamp", r"x.inter:1: no column timestamp"),
  ("recbole_bad_rows", "recbole", "x.inter",
   INTER + "1\t2\t3\t881250949\n1\tab\t3\t5\n1\t3\t\t5\n1\t2\t3\tinf\n"
   "2\t2\t4\t881250950.5\n",
   r"x.inter:3: item 'ab' is not an integer id",
   (2, {"bad_id": 1, "malformed": 1, "nonfinite_timestamp": 1})),
  ("parquet_uint64_id_2^63", "parquet", "e.parquet",
   pq_with(item=([1, 2**63, 3], "uint64")),
   rf"e.parquet: row 1: item {2**63} is not an integer id",
   (2, {"bad_id": 1})),
  ("parquet_null_id_and_bad_action", "parquet", "e.parquet",
   pq_with(user=[1, None, 3], action=[1, 2, 9]),
   r"e.parquet: row 1: user null is not an integer id",
   (1, {"bad_id": 1, "unknown_action": 1})),
  ("parquet_nan_price", "parquet", "e.parquet",
   pq_with(price=[1.0, float("nan"), 2.0]),
   r"e.parquet: row 1: non-finite price: nan", (2, {"nonfinite_price": 1})),
  ("parquet_float_ids", "parquet", "e.parquet",
   pq_with(item=[1.0, 2.0, 3.0]),
   r"e.parquet: column item is double; ids must be integers",
   r"e.parquet: column item is double"),
  ("parquet_no_rows", "parquet", "e.parquet",
   {k: (v[:0], t) for k, v, t in zip(PQ, PQ.values(), PQ_TYPES)},
   r"^no events in \S*e.parquet$", r"^no events in \S*e.parquet$"),
]  # fmt: skip


def write(path, content):
  if isinstance(content, dict):
    # pyarrow is imported here, not at the top: collecting this file (e.g.
    # for `-m gpu` runs) must not need it.
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {
      k: pa.array(*v) if isinstance(v, tuple) else pa.array(v)
      for k, v in content.items()
    }
    pq.write_table(pa.table(arrays), path)
  else:
    path.write_bytes(content.encode())
  return path


def skips(counters):
  return {
    k.removeprefix("skipped_"): v
    for k, v in counters.items()
    if k.startswith("skipped_")
  }


@pytest.mark.parametrize(
  "case, source, name, content, error, skipped",
  CASES,
  ids=[c[0] for c in CASES],
)
def test_bad_input_raises_naming_file_and_line_or_is_counted(
  tmp_path, case, source, name, content, error, skipped
):
  path = write(tmp_path / name, content)
  read = LogSource.READERS[source]
  if error is None:
    log = read(path, CFG)
    assert len(log) == skipped[0]
  else:
    with pytest.raises(BadInputError, match=error):
      read(path, CFG)
  counters = {}
  if isinstance(skipped, str):
    with pytest.raises(BadInputError, match=skipped):
      read(path, SKIP, counters)
    return
  log = read(path, SKIP, counters)
  log.check_sorted()
  assert (len(log), skips(counters)) == skipped
  assert counters["events_read"] == len(log)
  if case.startswith("ids_above"):
    assert sorted(set(log.user)) == [7, 2**53, 2**53 + 1]
    assert counters["distinct_items"] == 3
  if case == "ratings_csv_without_header":  # the first line is data
    assert sorted(log.extra["line"]) == [1, 2, 3]


def test_reader_filtered_to_no_user_gives_an_empty_log(tmp_path):
  path = write(tmp_path / TB, tb())
  counters = {}
  log = events.read_taobao(
    path, CFG, counters, keep_user=lambda u: np.zeros(u.shape, bool)
  )
  assert len(log) == 0 and counters["events_read"] == 2
  assert log.users[0].size == 0
  for k, dtype in [("user", np.int64), ("item", np.int32), ("price", "f4")]:
    assert getattr(log, k).dtype == dtype


def test_path_without_file_source_is_refused():
  with pytest.raises(ValueError, match="path='x.csv': must be empty with"):
    DataConfig(path="x.csv")
  with pytest.raises(ValueError, match="path='': must be a file with data"):
    DataConfig(source="taobao")


def synthetic_events(cfg):
  """A small synthetic log in gemjax's event schema (raw ids, names)."""
  log, _, _ = synthetic.generate_raw(cfg, 0, 0, 0, 24)
  return {
    "user": (log.user.astype(np.int64) + 2**60).tolist(),  # above 2^53
    "ts": log.ts.tolist(),
    "item": log.item.tolist(),
    "category": log.category.tolist(),
    "action": [ACTIONS[a] for a in log.action],
    "price": log.price.astype(np.float64).tolist(),
  }


def test_parquet_reads_back_what_the_csv_reads(tmp_path):
  cols = synthetic_events(CFG)
  n = len(cols["user"])
  with open(tmp_path / "events.csv", "w") as f:
    f.write(EV)
    for row in zip(*cols.values(), strict=True):
      f.write(
        ",".join(repr(x) if isinstance(x, float) else str(x) for x in row)
      )
      f.write("\n")
  write(tmp_path / "names.parquet", cols)
  ids = {**cols, "action": [ACTION_ID[a] for a in cols["action"]]}
  write(tmp_path / "ids.parquet", ids)
  cfg = dataclasses.replace(CFG, read_chunk_bytes=4096)
  c_csv = {}
  want = events.read_events_csv(tmp_path / "events.csv", cfg, c_csv)
  assert len(want) == n > 500
  for name in ("names.parquet", "ids.parquet"):
    c_pq = {}
    got = events.read_events_parquet(tmp_path / name, cfg, c_pq)
    for k in events.EventLog.COLUMNS:
      np.testing.assert_array_equal(getattr(got, k), getattr(want, k))
    # CSV lines count the header from 1; Parquet rows count from 0.
    np.testing.assert_array_equal(got.extra["line"] + 2, want.extra["line"])
    assert c_pq == c_csv


def test_recbole_category_is_the_first_class_of_the_item(tmp_path):
  write(
    tmp_path / "x.inter",
    INTER + "1\t10\t5\t100\n1\t11\t2\t200\n1\t12\t3\t300\n2\t10\t4\t50\n",
  )
  write(
    tmp_path / "x.item",
    "item_id:token\tmovie_title:token_seq\tclass:token_seq\n"
    '10\tA Film, The\tDrama Comedy\n11\t"Quoted"\tDrama\n13\tNone\tWar\n',
  )
  counters = {}
  log = events.read_recbole(tmp_path / "x.inter", CFG, counters)
  assert list(log.ts) == [100, 200, 300, 50]
  a = ACTION_ID
  assert list(log.action) == [
    a["order"],
    a["impression"],
    a["click"],
    a["cart"],
  ]
  cat = dict(zip(log.item.tolist(), log.category.tolist(), strict=True))
  item = lambda i: int(events.hash_rows([i], CFG.num_items)[0])
  assert cat[item(10)] == cat[item(11)]  # both Drama
  # Item 12 has no .item row: its category is its own id, counted.
  assert cat[item(12)] == events.hash_rows([12], CFG.num_categories)[0]
  assert counters["events_without_class"] == 1
  assert counters["distinct_categories"] == 2  # Drama, item 12
  (tmp_path / "x.item").unlink()
  log = events.read_recbole(tmp_path / "x.inter", CFG)
  np.testing.assert_array_equal(
    log.category, events.hash_rows(log.item * 0 + [10, 11, 12, 10], 100)
  )


def test_log_source_prints_summary_and_table_advice(tmp_path, capsys):
  rng = np.random.default_rng(0)
  lines = [
    f"{u},{i},{i % 7},pv,{t}"
    for u, i, t in zip(
      rng.integers(0, 40, 3000),
      rng.permutation(np.arange(3000)) % 200,
      1_500_000_000 + 864 * np.arange(3000),
      strict=True,
    )
  ]
  lines.insert(5, "1,2,3")
  path = write(tmp_path / TB, "\n".join(lines) + "\n")
  cfg = dataclasses.replace(
    SKIP,
    source="taobao",
    path=str(path),
    num_items=50,
    num_categories=50,
    session_gap_s=3600,
    protocol="user",  # LogSource of one of two processes: no shared cut
  )
  loader = Loader(cfg, num_shards=2)
  err = capsys.readouterr().err.splitlines()
  assert err[0] == (
    f"data: {path}: 3,000 events read, 1 rows skipped (malformed 1), "
    "40 users, 200 items, 7 categories, time 2017-07-14 .. 2017-08-13 "
    "(30.0 days)"
  )
  need = math.ceil(199 / -math.log1p(-0.01))
  shared = loader.counters["colliding_items"]
  assert shared > 150
  assert err[1:] == [
    f"data: data.num_items=50 hashes 200 items with {shared / 200:.0%} "
    f"colliding; set data.num_items >= {need:,} for under 1%"
  ]
  counters = loader.counters
  assert counters["skipped_malformed"] == 1
  assert counters["distinct_users"] == 40 and counters["events_read"] == 3000
  # One summary per run: a process without shard 0 stays quiet.
  LogSource(cfg, 2, range(1, 2))
  assert capsys.readouterr().err == ""


def test_real_ml100k_inter():
  path = ml100k_path()
  counters = {}
  cfg = dataclasses.replace(CFG, read_chunk_bytes=1 << 20)
  log = events.read_recbole(path, cfg, counters)
  assert len(log) == counters["events_read"] == 100_000
  assert counters["distinct_users"] == 943
  assert counters["distinct_items"] == 1_682
  assert counters["distinct_categories"] == 19  # the first genre of each
  assert skips(counters) == {}
  assert "events_without_class" not in counters
  log.check_sorted()
  assert np.unique(log.user).size == 943


def test_synthetic_data_never_imports_pyarrow():
  code = (
    "import sys; from gemjax.data import loader; "
    "from gemjax.data.config import DataConfig; "
    "cfg = DataConfig(num_items=500, num_categories=50, num_users=100, "
    "max_seq_len=64, len_median=20.0, token_capacity=4096, prefetch=0); "
    "next(loader.Loader(cfg, num_shards=1)); "
    "assert 'pyarrow' not in sys.modules, 'pyarrow imported'"
  )
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_real_ml100k_through_the_loader(capsys):
  cfg = dataclasses.replace(
    CFG,
    source="recbole",
    path=str(ml100k_path()),
    num_items=200_000,
    num_categories=2_000,
    read_chunk_bytes=1 << 20,
  )
  loader = Loader(cfg, num_shards=2)
  next(loader).validate(cfg.vocab_sizes())
  assert loader.counters["events_read"] == 100_000
  assert capsys.readouterr().err.startswith(
    f"data: {cfg.path}: 100,000 events read, 0 rows skipped, 943 users, "
    "1,682 items, 19 categories, time 1997-09-20 .. 1998-04-22"
  )
