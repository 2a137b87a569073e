"""Event logs and requests: the input side of the pipeline (O1).

An event log is one unified source of user behaviour (OneTrans V3.1 dropped
its second, snapshot source because aligning timestamps and dedup across two
sources was the hard part). Columns, one row per event (legend: `n` events,
`r` requests, `c` candidates, `f` dense features):

  user      int64[n]    the history's owner key (raw user id)
  ts        int64[n]    seconds
  item      int32[n]    item table row
  category  int32[n]    category table row
  action    int8[n]     index into `config.ACTIONS` (impression, click, ...)
  price     float32[n]  >= 0
  extra     {name: [n]} optional further columns, carried along untouched

sorted by (user, ts), ties in input order, so one user's history is one
contiguous, time-ordered slice.

A request asks "rank these candidates for this user at this time":

  user          int64[r]    owner key into the log
  ts            int64[r]    request time; the history is the user's events
                            strictly before it (anti-leakage)
  user_row      int32[r]    row of the user table (the `user_id` feature)
  dense         float32[r, f]
  cand_offsets  int64[r+1]  request i owns candidates cand_offsets[i]:[i+1]
  cand_item, cand_category  int32[c]
  cand_price    float32[c]
  labels        float32[c, 2]  (click, conversion); NaN = missing label

Readers for real formats (MovieLens, Taobao UserBehavior, RecBole atomic
files, gemjax's event CSV and Parquet) live below with the bad-input rules;
the synthetic generator (`synthetic.py`) writes the same two structures, so
every source goes through one request builder.
"""

import dataclasses
import datetime
import functools
import hashlib
import itertools
import math
import os
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class EventLog:
  user: np.ndarray
  ts: np.ndarray
  item: np.ndarray
  category: np.ndarray
  action: np.ndarray
  price: np.ndarray
  extra: dict = dataclasses.field(default_factory=dict)

  COLUMNS = ("user", "ts", "item", "category", "action", "price")

  def __len__(self) -> int:
    return self.user.shape[0]

  def columns(self) -> dict[str, np.ndarray]:
    """Every per-event column but `user` (what a built sequence carries)."""
    out = {k: getattr(self, k) for k in self.COLUMNS[1:]}
    out.update(self.extra)
    return out

  @functools.cached_property
  def users(self) -> tuple[np.ndarray, np.ndarray]:
    """(distinct users int64[u], start of each user's slice int64[u+1])."""
    if len(self) == 0:
      return np.zeros(0, np.int64), np.zeros(1, np.int64)
    change = np.flatnonzero(self.user[1:] != self.user[:-1]) + 1
    starts = np.concatenate([[0], change, [len(self)]]).astype(np.int64)
    return self.user[starts[:-1]], starts

  def history_windows(self, user, ts) -> tuple[np.ndarray, ...]:
    """Per request: [start, end) of the user's events with event ts < ts.

    Returns (start int64[r], end int64[r], future int64[r] = events of that
    user at or after ts, known bool[r] = the user has events at all).
    Vectorised: one searchsorted for the users, one on a combined
    (user rank, ts) int64 key for the time cut.
    """
    user = np.asarray(user, np.int64)
    ts = np.asarray(ts, np.int64)
    users, starts = self.users
    if not users.size:
      z = np.zeros(user.shape, np.int64)
      return z, z, z, np.zeros(user.shape, bool)
    rank = np.minimum(np.searchsorted(users, user), users.size - 1)
    known = users[rank] == user
    rank = np.where(known, rank, 0)
    key = self._key
    t0 = self._t0
    qt = np.clip(ts - t0, 0, (1 << 33) - 1)
    qkey = (rank.astype(np.int64) << 33) | qt
    end = np.searchsorted(key, qkey, side="left")
    # A request before the user's first event, or with ts below the log's
    # minimum, clips to the slice start.
    start = starts[rank]
    stop = starts[rank + 1]
    end = np.clip(end, start, stop)
    start = np.where(known, start, 0)
    end = np.where(known, end, 0)
    future = np.where(known, stop - end, 0)
    return start, end, future, known

  @functools.cached_property
  def _t0(self) -> int:
    return int(self.ts.min()) if len(self) else 0

  @functools.cached_property
  def _key(self) -> np.ndarray:
    # (user rank << 33) | (ts - t0): sorted because the log is sorted by
    # (user, ts); 33 bits of seconds span 272 years.
    users, starts = self.users
    rank = np.repeat(np.arange(users.size, dtype=np.int64), np.diff(starts))
    dt = self.ts - self._t0
    if dt.size and dt.max() >= (1 << 33):
      raise ValueError("event timestamps span more than 2^33 seconds")
    return (rank << 33) | dt

  def check_sorted(self) -> None:
    """Raise if not sorted by (user, ts)."""
    u, t = self.user, self.ts
    bad = np.flatnonzero(
      (u[1:] < u[:-1]) | ((u[1:] == u[:-1]) & (t[1:] < t[:-1]))
    )
    if bad.size:
      i = int(bad[0])
      raise ValueError(
        f"event log not sorted by (user, ts) at rows {i}, {i + 1}: "
        f"({u[i]}, {t[i]}) then ({u[i + 1]}, {t[i + 1]})"
      )


def sort_log(log: EventLog) -> EventLog:
  """Stable sort by (user, ts)."""
  order = np.lexsort((log.ts, log.user))
  if np.all(order[1:] > order[:-1]):
    return log
  return EventLog(
    **{k: getattr(log, k)[order] for k in EventLog.COLUMNS},
    extra={k: v[order] for k, v in log.extra.items()},
  )


def concat_logs(logs) -> EventLog:
  logs = list(logs)
  extra_keys = set(logs[0].extra) if logs else set()
  return EventLog(
    **{
      k: np.concatenate([getattr(g, k) for g in logs]) for k in EventLog.COLUMNS
    },
    extra={k: np.concatenate([g.extra[k] for g in logs]) for k in extra_keys},
  )


@dataclasses.dataclass(frozen=True)
class Requests:
  user: np.ndarray
  ts: np.ndarray
  user_row: np.ndarray
  dense: np.ndarray
  cand_offsets: np.ndarray
  cand_item: np.ndarray
  cand_category: np.ndarray
  cand_price: np.ndarray
  labels: np.ndarray
  # Where each request came from, for error messages: (file, line int64[r]).
  source: str = ""
  line: np.ndarray | None = None

  def __len__(self) -> int:
    return self.user.shape[0]

  def where(self, i: int) -> str:
    if self.line is not None:
      return f"{self.source}:{int(self.line[i])}"
    return f"{self.source or 'requests'}[{i}]"

  def take(self, idx, cand_lo=None, cand_hi=None) -> "Requests":
    """The requests `idx` (in that order), candidates following them; with
    `cand_lo` / `cand_hi` (per taken request, relative to its first
    candidate) only those candidates (a request split into chunks)."""
    idx = np.asarray(idx, np.int64)
    lo, hi = self.cand_offsets[idx], self.cand_offsets[idx + 1]
    if cand_lo is not None:
      lo, hi = lo + np.asarray(cand_lo), lo + np.asarray(cand_hi)
    cidx = ranges(lo, hi)
    return Requests(
      user=self.user[idx],
      ts=self.ts[idx],
      user_row=self.user_row[idx],
      dense=self.dense[idx],
      cand_offsets=np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64),
      cand_item=self.cand_item[cidx],
      cand_category=self.cand_category[cidx],
      cand_price=self.cand_price[cidx],
      labels=self.labels[cidx],
      source=self.source,
      line=None if self.line is None else self.line[idx],
    )


_RANGES_CHUNK = 1 << 16


def ranges(start, end) -> np.ndarray:
  """Concatenation of arange(start[i], end[i]) (int64), vectorised."""
  start = np.asarray(start, np.int64)
  lens = np.asarray(end, np.int64) - start
  total = int(lens.sum())
  if total == 0:
    return np.zeros(0, np.int64)
  # Each run's first index minus the running position, repeated over the
  # run, plus the position (added in chunks: no second full-size array).
  csum = np.cumsum(lens) - lens
  out = np.repeat(start - csum, lens)
  for c in range(0, total, _RANGES_CHUNK):
    part = out[c : c + _RANGES_CHUNK]
    part += np.arange(c, c + part.shape[0], dtype=np.int64)
  return out


# -- Readers --------------------------------------------------------------
#
# Every file format goes through pyarrow (imported only when a real log is
# read; synthetic runs never need it): CSV/TSV through its streaming reader
# (`pyarrow.csv.open_csv`, blocks of `cfg.read_chunk_bytes`), Parquet through
# `ParquetFile.iter_batches` (a row group at a time). Parsing memory is
# bounded by one block; only the compact columns of the rows this process
# keeps accumulate (37 bytes per event, with its line number).
#
# Text fields are read as strings and converted by pyarrow's casts: ids go
# straight to int64 (no float detour, so ids above 2^53 stay distinct); an id
# that is not a decimal integer in [-2^63, 2^63) is a bad row. Quoting is off
# (none of the formats quote), so one row is one physical line and CSV line
# numbers (header counted) are exact; Parquet rows are named by their index.
#
# Bad input is never dropped silently: with `on_bad_input="error"` the first
# bad row raises `BadInputError` "<file>:<line>: <what>"; with "skip" the row
# is dropped and counted as `skipped_<reason>`, one reason per row:
#   malformed           wrong number of fields, a field that is not a number
#   blank_line          a blank line before the end of the file (blank lines
#                       at the very end are fine)
#   bad_id              an id that is not an integer in [-2^63, 2^63)
#   unknown_action      an action (behaviour) name outside the mapping
#   nonfinite_timestamp, nonfinite_price   NaN or infinite
#   negative_timestamp, negative_price
# A file without a single event raises "no events in <file>".
#
# Raw ids are hashed into the tables (`hash_rows`). Each reader counts the
# distinct raw users, items and categories of the file and how many of them
# share a table row with another (`distinct_*`, `colliding_*`), with
# `events_read` and the time span (`ts_min`, `ts_max`); `describe` turns
# these into the one-line summary and the table-size advice.


class BadInputError(ValueError):
  """A malformed or inconsistent input row, named by file and line."""


def hash_rows(raw, rows: int) -> np.ndarray:
  """Raw int64 ids -> table rows in [0, rows) by a splitmix64 hash (int32)."""
  x = np.asarray(raw, np.int64).astype(np.uint64)
  with np.errstate(over="ignore"):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
  return (x % np.uint64(rows)).astype(np.int32)


def _count(counters, key, n=1):
  if counters is not None and n:
    counters[key] = counters.get(key, 0) + int(n)


class _Bad:
  """Raise or count one bad line (`unit` "row": Parquet row indices)."""

  def __init__(self, path, mode, counters, unit="line"):
    if mode not in ("error", "skip"):
      raise ValueError(f"on_bad_input must be 'error' or 'skip', got {mode!r}")
    self.path, self.mode, self.counters, self.unit = path, mode, counters, unit

  def where(self, n: int) -> str:
    return f"{self.path}: row {n}" if self.unit == "row" else f"{self.path}:{n}"

  def __call__(self, line_no: int, reason: str, what: str):
    if self.mode == "error":
      raise BadInputError(f"{self.where(line_no)}: {what}")
    _count(self.counters, f"skipped_{reason}")


def _arrow():
  """pyarrow with the submodules the readers use, or a one-line error."""
  try:
    import pyarrow
    import pyarrow.compute
    import pyarrow.csv
    import pyarrow.parquet  # noqa: F401 - loads pyarrow.parquet
  except ImportError as e:
    raise ImportError(
      "reading event logs needs pyarrow: pip install -e '.[data]'"
    ) from e
  return pyarrow


class _Rows:
  """One chunk's rows and their bad-input checks, settled in line order.

  `flag` marks rows that fail a check (each row keeps its first failure);
  `extra` holds bad rows that never reached the chunk (wrong field count,
  blank lines) as (line, reason, what). `settle` raises at the first bad
  row in line order ("error") or counts them ("skip") and returns the mask
  of good rows.
  """

  def __init__(self, line: np.ndarray, extra=()):
    self.line = line
    self.ok = np.ones(line.shape, bool)
    self.flags = []  # (mask bool[m], reason, what(i) -> str)
    self.extra = list(extra)

  def flag(self, mask, reason: str, what) -> None:
    mask = np.asarray(mask, bool) & self.ok
    if mask.any():
      self.flags.append((mask, reason, what))
      self.ok &= ~mask

  def settle(self, bad: _Bad) -> np.ndarray:
    if bad.mode == "error":
      first = [(ln, what) for ln, _, what in self.extra]
      for mask, _, what in self.flags:
        i = int(np.argmax(mask))
        first.append((int(self.line[i]), what(i)))
      if first:
        ln, what = min(first, key=lambda x: x[0])
        raise BadInputError(f"{bad.where(ln)}: {what}")
    for mask, reason, _ in self.flags:
      _count(bad.counters, f"skipped_{reason}", mask.sum())
    for _, reason, _ in self.extra:
      _count(bad.counters, f"skipped_{reason}")
    return self.ok


def _file_head(path) -> str | None:
  """The first line of a file without its line end; None if it is empty."""
  with open(path, "rb") as f:
    head = f.readline()
  if not head:
    return None
  return head.rstrip(b"\r\n").decode(errors="replace")


def _csv_chunks(path, names, *, sep, fields, skip_rows, chunk_bytes):
  """Yield (_Rows, {name: pyarrow string array}) block by block.

  `names` name the columns pyarrow splits a line into at `sep[0]`; `fields`
  and `sep` describe the format for messages ("::" is read as ":" with an
  empty column between fields, checked by the caller). A row with the wrong
  number of columns goes to the handler and becomes a `malformed` extra; a
  blank line is a `blank_line` extra once a later line shows it is not at
  the end of the file.
  """
  pa = _arrow()
  csv, pc = pa.csv, pa.compute
  if os.path.getsize(path) == 0:
    return
  wrong = []  # (line, text) of rows with the wrong number of columns

  def on_invalid(row):
    wrong.append((row.number, row.text))
    return "skip"

  reader = csv.open_csv(
    path,
    read_options=csv.ReadOptions(
      block_size=chunk_bytes,
      use_threads=False,
      skip_rows=skip_rows,
      column_names=list(names),
    ),
    parse_options=csv.ParseOptions(
      delimiter=sep[0],
      quote_char=False,
      ignore_empty_lines=False,
      invalid_row_handler=on_invalid,
    ),
    convert_options=csv.ConvertOptions(
      column_types={n: pa.string() for n in names},
      strings_can_be_null=False,
    ),
  )
  cursor = skip_rows + 1  # line number of the next row not yet placed
  blank = np.zeros(0, np.int64)  # blank lines not yet known to be inside
  for batch in itertools.chain(reader, [None]):
    n = 0 if batch is None else batch.num_rows
    # The batch's rows are the next n lines not taken by the handler.
    if any(ln is None for ln, _ in wrong):
      raise BadInputError(f"{path}: malformed row {wrong[0][1][:80]!r}")
    skipped = np.array(sorted(ln for ln, _ in wrong), np.int64)
    gap = skipped - cursor - np.arange(skipped.size)
    j = np.arange(n)
    line = cursor + j + np.searchsorted(gap, j, side="right")
    end = int(line[-1]) + 1 if n else None
    mine = [w for w in wrong if end is None or w[0] < end]
    wrong[:] = [w for w in wrong if end is not None and w[0] >= end]
    if n:
      cursor = end
      cols = {k: batch.column(k) for k in names}
      empty = np.logical_and.reduce(
        [np.asarray(pc.equal(c, "")) for c in cols.values()]
      )
    else:
      cols, empty = {k: pa.array([], pa.string()) for k in names}, np.zeros(0)
    empty = np.asarray(empty, bool)
    blank = np.concatenate([blank, line[empty]])
    tails = [ln for ln, _ in mine]  # the last line that is not blank
    if not empty.all():
      tails.append(int(line[~empty].max()))
    last = max(tails, default=-1)
    inside, blank = blank[blank < last], blank[blank >= last]
    extra = [
      (ln, "malformed", _field_count(text, sep, fields)) for ln, text in mine
    ] + [
      (int(ln), "blank_line", "blank line (allowed only at the end)")
      for ln in inside
    ]
    if empty.any():
      keep = pa.array(~empty)
      cols = {k: c.filter(keep) for k, c in cols.items()}
    yield _Rows(line[~empty], extra), cols


def _field_count(text: str, sep: str, fields: int) -> str:
  got = len(text.split(sep))
  n = f", got {got}" if got != fields else ""  # "::" with a stray ":"
  return f"expected {fields} fields separated by {sep!r}{n}: {text[:80]!r}"


_INT_RE = r"^-?[0-9]+$"
_FLOAT_RE = re.compile(
  r"[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|nan|inf|infinity)",
  re.IGNORECASE,
)
_I64 = 2**63


def _show(arr, i: int) -> str:
  """Row i of a pyarrow array for a message: repr of its value, or null."""
  v = arr[i].as_py()
  return "null" if v is None else repr(v)


def _is_text(arr) -> bool:
  pa = _arrow()
  return pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)


def _present(arr) -> np.ndarray:
  """bool[m]: not null (Parquet columns may hold nulls)."""
  return np.asarray(_arrow().compute.is_valid(arr))


def _parse_ints(arr) -> tuple[np.ndarray, np.ndarray]:
  """(int64[m], ok bool[m]) of a string or integer pyarrow array."""
  pa = _arrow()
  pc = pa.compute
  if pa.types.is_integer(arr.type):
    ok = _present(arr)
    if arr.type == pa.uint64():
      ok &= np.asarray(
        pc.fill_null(pc.less(arr, pa.scalar(_I64, pa.uint64())), False)
      )
    vals = pc.cast(pc.fill_null(arr, 0), pa.int64(), safe=False)
    return np.asarray(vals), ok
  if not _is_text(arr):
    return np.zeros(len(arr), np.int64), np.zeros(len(arr), bool)
  ok = np.asarray(pc.fill_null(pc.match_substring_regex(arr, _INT_RE), False))
  src = arr if ok.all() else pc.if_else(pa.array(ok), arr, "0")
  try:
    return np.asarray(pc.cast(src, pa.int64())), ok
  except pa.ArrowInvalid:  # a decimal integer outside int64
    py = [int(s) if o else 0 for s, o in zip(arr.to_pylist(), ok)]
    ok &= np.array([-_I64 <= v < _I64 for v in py], bool)
    return np.array([v if o else 0 for v, o in zip(py, ok)], np.int64), ok


def _parse_floats(arr, where) -> tuple[np.ndarray, np.ndarray]:
  """(float64[m], ok bool[m]) for the rows `where` (others: 0, False)."""
  pa = _arrow()
  pc = pa.compute
  where = np.asarray(where, bool) & _present(arr)
  if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type):
    vals = np.asarray(pc.cast(pc.fill_null(arr, 0), pa.float64()))
    return np.where(where, vals, 0.0), where
  if not _is_text(arr):
    return np.zeros(len(arr)), np.zeros(len(arr), bool)
  try:
    src = pc.if_else(pa.array(where), arr, "0")
    return np.asarray(pc.cast(src, pa.float64())), where
  except pa.ArrowInvalid:  # some row is not a number: find which
    vals, ok = np.zeros(len(arr)), np.zeros(len(arr), bool)
    for i in np.flatnonzero(where):
      s = arr[i].as_py()
      if _FLOAT_RE.fullmatch(s):
        vals[i], ok[i] = float(s), True
    return vals, ok


def _ids(rows: _Rows, arr, name: str) -> np.ndarray:
  """int64[m] ids; anything else is a `bad_id` row."""
  vals, ok = _parse_ints(arr)
  rows.flag(
    ~ok,
    "bad_id",
    lambda i: f"{name} {_show(arr, i)} is not an integer id in [-2^63, 2^63)",
  )
  return vals


def _numbers(rows: _Rows, arr, name: str) -> np.ndarray:
  """float64[m]; a field that is not a number is a `malformed` row."""
  vals, ok = _parse_floats(arr, np.ones(len(arr), bool))
  rows.flag(
    ~ok, "malformed", lambda i: f"{name} {_show(arr, i)} is not a number"
  )
  return vals


def _times(rows: _Rows, arr, name: str = "timestamp") -> np.ndarray:
  """int64[m] seconds from integers, or from finite numbers (floored)."""
  pa = _arrow()
  if pa.types.is_timestamp(arr.type):
    arr = pa.compute.cast(arr, pa.timestamp("s"), safe=False).cast(pa.int64())
  vals, ok = _parse_ints(arr)
  rest = ~ok
  if rest.any():
    f, okf = _parse_floats(arr, rest)
    fin = np.isfinite(f)
    rows.flag(
      rest & okf & ~fin,
      "nonfinite_timestamp",
      lambda i: f"non-finite timestamp: {f[i]}",
    )
    inside = okf & fin & (np.abs(f) < 2.0**62)
    rows.flag(
      rest & ~inside,
      "malformed",
      lambda i: f"{name} {_show(arr, i)} is not a time in seconds",
    )
    put = rest & inside
    vals = vals.copy()
    vals[put] = np.floor(f[put])  # exact ints never pass through floats
  return vals


def _named(rows: _Rows, arr, codes: dict) -> np.ndarray:
  """int8[m] action ids of names by `codes`; others are `unknown_action`."""
  pa = _arrow()
  pc = pa.compute
  if pa.types.is_dictionary(arr.type):
    arr = arr.cast(arr.type.value_type)
  if pa.types.is_integer(arr.type):
    vals, ok = _parse_ints(arr)
    ok &= (vals >= 0) & (vals < len(codes))
  else:
    enc = pc.dictionary_encode(arr)
    table = np.array([codes.get(s, -1) for s in enc.dictionary.to_pylist()])
    idx = np.asarray(pc.fill_null(enc.indices, 0))
    vals = table[idx] if table.size else np.zeros(len(arr), np.int64)
    ok = (vals >= 0) & _present(arr)
  rows.flag(
    ~ok,
    "unknown_action",
    lambda i: f"unknown action type {_show(arr, i)} (known: {sorted(codes)})",
  )
  return np.where(ok, vals, 0).astype(np.int8)


def _sorted_unique(x) -> np.ndarray:
  # Sort and compare neighbours: numpy's hash-based `np.unique` of int64
  # is several times slower on these sizes.
  x = np.sort(x)
  return x[np.r_[True, x[1:] != x[:-1]]] if x.size else x


class _Distinct:
  """Distinct int64 values of a stream: chunk uniques, merged when the
  pending parts outgrow the merged set (amortised O(n log n), memory a
  small multiple of the distinct count)."""

  def __init__(self):
    self.parts = [np.zeros(0, np.int64)]
    self.pending = 0
    self.merged = 0

  def add(self, x) -> None:
    u = _sorted_unique(x)
    self.parts.append(u)
    self.pending += u.size
    if self.pending > 2 * self.merged + (1 << 20):
      self.values()

  def values(self) -> np.ndarray:
    if len(self.parts) > 1:
      self.parts = [_sorted_unique(np.concatenate(self.parts))]
      self.merged, self.pending = self.parts[0].size, 0
    return self.parts[0]


# (what, DataConfig table field, raw column); the user table is `user_row`.
_TABLES = (
  ("users", "num_users", "user"),
  ("items", "num_items", "item"),
  ("categories", "num_categories", "category"),
)


def _read(
  path, chunks, cfg, counters, keep_user, unit="line", categorize=None
) -> EventLog:
  """Chunks of (_Rows, raw columns) -> sorted EventLog, with counters.

  Raw columns: user, ts, item, category (int64 raw ids), action (int8),
  price (float64). Applies the checks every source shares (non-finite and
  negative values), settles bad rows, sets the category of good rows by
  `categorize(items, counters)` where given, counts distinct ids, applies
  the process filter `keep_user(user) -> bool[m]`, hashes ids into the
  tables and orders by time (`order_by_time`).
  """
  if counters is None:
    counters = {}
  bad = _Bad(path, cfg.on_bad_input, counters, unit)
  cols = {k: [] for k in ("line", *EventLog.COLUMNS)}
  seen = {col: _Distinct() for _, _, col in _TABLES}
  n_read, t_lo, t_hi = 0, None, None
  for rows, c in chunks:
    price, ts = c["price"], c["ts"]
    rows.flag(
      ~np.isfinite(price),
      "nonfinite_price",
      lambda i, p=price: f"non-finite price: {p[i]}",
    )
    rows.flag(
      price < 0, "negative_price", lambda i, p=price: f"negative price: {p[i]}"
    )
    rows.flag(
      ts < 0,
      "negative_timestamp",
      lambda i, t=ts: f"negative timestamp: {t[i]}",
    )
    ok = rows.settle(bad)
    c = {k: v[ok] for k, v in c.items()}
    line = rows.line[ok]
    if not line.size:
      continue
    n_read += line.size
    if categorize is not None:
      c["category"] = categorize(c["item"], counters)
    for col, d in seen.items():
      d.add(c[col])
    lo, hi = int(c["ts"].min()), int(c["ts"].max())
    t_lo = lo if t_lo is None else min(t_lo, lo)
    t_hi = hi if t_hi is None else max(t_hi, hi)
    if keep_user is not None:
      mine = keep_user(c["user"])
      c = {k: v[mine] for k, v in c.items()}
      line = line[mine]
    cols["line"].append(line)
    cols["user"].append(c["user"])
    cols["ts"].append(c["ts"])
    cols["item"].append(hash_rows(c["item"], cfg.num_items))
    cols["category"].append(hash_rows(c["category"], cfg.num_categories))
    cols["action"].append(c["action"].astype(np.int8))
    cols["price"].append(c["price"].astype(np.float32))
  if not n_read:
    skipped = {k: v for k, v in counters.items() if k.startswith("skipped_")}
    why = ", ".join(f"{k[8:]} {v:,}" for k, v in sorted(skipped.items()))
    raise BadInputError(
      f"no events in {path}" + (f" (every row was bad: {why})" if why else "")
    )
  counters["events_read"] = n_read
  counters["ts_min"], counters["ts_max"] = t_lo, t_hi
  for what, field, col in _TABLES:
    ids = seen[col].values()
    r = hash_rows(ids, getattr(cfg, field))
    shared = np.bincount(r, minlength=getattr(cfg, field))[r] > 1
    counters[f"distinct_{what}"] = int(ids.size)
    counters[f"colliding_{what}"] = int(shared.sum())
  dtypes = dict(
    line=np.int64,
    user=np.int64,
    ts=np.int64,
    item=np.int32,
    category=np.int32,
    action=np.int8,
    price=np.float32,
  )
  c = {
    k: np.concatenate(v) if v else np.zeros(0, dtypes[k])
    for k, v in cols.items()
  }
  log = EventLog(
    **{k: c[k] for k in EventLog.COLUMNS}, extra={"line": c["line"]}
  )
  return order_by_time(log, path, cfg, counters)


def describe(path, counters: dict, cfg) -> list[str]:
  """The reading summary of one file, then one line per hashed table too
  small for its distinct raw ids (more than 1% of them share a row), with
  the size to set."""
  skipped = {
    k[8:]: v for k, v in sorted(counters.items()) if k.startswith("skipped_")
  }
  n_skip = sum(skipped.values())
  why = ", ".join(f"{k} {v:,}" for k, v in skipped.items())
  day = lambda t: datetime.datetime.fromtimestamp(t, datetime.UTC).date()
  t0, t1 = counters["ts_min"], counters["ts_max"]
  out = [
    f"data: {path}: {counters['events_read']:,} events read, {n_skip:,} "
    f"rows skipped{f' ({why})' if why else ''}, "
    + ", ".join(f"{counters[f'distinct_{w}']:,} {w}" for w, _, _ in _TABLES)
    + f", time {day(t0)} .. {day(t1)} ({(t1 - t0) / 86_400:,.1f} days)"
  ]
  for what, field, _ in _TABLES:
    # A raw id shares its row with probability 1 - (1 - 1/m)^(n-1)
    # ~ 1 - exp(-(n-1)/m) among n ids hashed into m rows; <= 1% needs
    # m >= (n-1) / -ln(0.99).
    n = counters[f"distinct_{what}"]
    shared = counters[f"colliding_{what}"]
    need = math.ceil((n - 1) / -math.log1p(-0.01)) if n else 0
    # Only where the table is too small: a table of the right size still
    # shows 1% give or take a few ids by chance.
    if n and shared / n > 0.01 and getattr(cfg, field) < need:
      out.append(
        f"data: data.{field}={getattr(cfg, field):,} hashes {n:,} {what} "
        f"with {shared / n:.0%} colliding; set data.{field} >= {need:,} "
        "for under 1%"
      )
  return out


def order_by_time(log: EventLog, path, cfg, counters) -> EventLog:
  """Group by user, then handle events whose time goes backwards.

  `cfg.time_order`: "sort" (reorder, counted as `reordered`), "error"
  (raise at the first event earlier than the previous one of its user in
  file order) or "skip" (drop such events, counted `skipped_out_of_order`).
  """
  order = np.argsort(log.user, kind="stable")  # file order inside a user
  log = _take(log, order)
  u, t = log.user, log.ts
  back = np.zeros(len(log), bool)
  back[1:] = (u[1:] == u[:-1]) & (t[1:] < t[:-1])
  if back.any():
    if cfg.time_order == "error":
      i = int(np.flatnonzero(back)[0])
      line = log.extra["line"][i]
      raise BadInputError(
        f"{path}:{line}: timestamp {t[i]} of user {u[i]} is earlier than the "
        f"previous event's {t[i - 1]} (time_order='error')"
      )
    if cfg.time_order == "skip":
      # Drop events earlier than the running maximum of their user.
      # Per-user running maximum in one pass: offset each user's times by
      # its rank so that the maxima never cross users.
      rank = np.cumsum(np.r_[False, u[1:] != u[:-1]]).astype(np.int64)
      key = (rank << 34) | (t - t.min())
      keep = key >= np.maximum.accumulate(key)
      _count(counters, "skipped_out_of_order", (~keep).sum())
      log = _take(log, np.flatnonzero(keep))
    else:
      _count(counters, "reordered", back.sum())
  return sort_log(log)


def _take(log: EventLog, idx) -> EventLog:
  return EventLog(
    **{k: getattr(log, k)[idx] for k in EventLog.COLUMNS},
    extra={k: v[idx] for k, v in log.extra.items()},
  )


def _rating_actions(rating: np.ndarray, cfg) -> np.ndarray:
  """int8 actions of ratings by `cfg.rating_actions` (else impression)."""
  from gemjax.data.config import ACTION_ID

  action = np.full(rating.shape, ACTION_ID["impression"], np.int8)
  for thr, name in sorted(cfg.rating_actions):
    action[rating >= thr] = ACTION_ID[name]
  return action


def _rated(rows: _Rows, c: dict, cfg, user, item, ts, rating) -> dict:
  """Raw columns of a rating log (no prices): rating -> action."""
  r = _numbers(rows, c[rating], "rating")
  rows.flag(
    ~np.isfinite(r), "malformed", lambda i: f"rating {r[i]} is not finite"
  )
  items = _ids(rows, c[item], "item")
  return {
    "user": _ids(rows, c[user], "user"),
    "ts": _times(rows, c[ts]),
    "item": items,
    "category": items,
    "action": _rating_actions(r, cfg),
    "price": np.zeros(r.shape),
  }


_ML_HEADER = "userId,movieId,rating,timestamp"


def read_movielens(path, cfg, counters=None, keep_user=None) -> EventLog:
  """MovieLens `ratings.dat` (user::movie::rating::ts) or `ratings.csv`.

  The rating becomes an action by `cfg.rating_actions` ((min rating, action),
  highest first; below all thresholds: impression). MovieLens has no
  categories or prices: category = hashed movie id, price = 0. A
  `ratings.csv` whose first line is data (no header) is read from line 1;
  any other first line must be the header `userId,movieId,rating,timestamp`.
  """
  path = str(path)
  chunk = cfg.read_chunk_bytes
  if path.endswith(".csv"):
    head = _file_head(path)
    header = head is not None and not re.match(r"-?[0-9]+,", head)
    if header and head != _ML_HEADER:
      raise BadInputError(
        f"{path}:1: header must be {_ML_HEADER} (or no header), got {head!r}"
      )
    names = ("user", "item", "rating", "ts")
    parts = _csv_chunks(
      path, names, sep=",", fields=4, skip_rows=int(header), chunk_bytes=chunk
    )
  else:
    # "::" is read as ":" with an empty column between the fields.
    names = ("user", "_1", "item", "_2", "rating", "_3", "ts")
    parts = _csv_chunks(
      path, names, sep="::", fields=4, skip_rows=0, chunk_bytes=chunk
    )

  def chunks():
    pc = _arrow().compute
    for rows, c in parts:
      if "_1" in c:
        gap = np.zeros(len(rows.line), bool)
        for k in ("_1", "_2", "_3"):
          gap |= np.asarray(pc.not_equal(c[k], ""))
        rows.flag(
          gap,
          "malformed",
          lambda i, c=c: (
            "expected 4 fields separated by '::': "
            f"{':'.join(c[k][i].as_py() for k in names)!r}"
          ),
        )
      yield rows, _rated(rows, c, cfg, "user", "item", "ts", "rating")

  return _read(path, chunks(), cfg, counters, keep_user)


def read_taobao(path, cfg, counters=None, keep_user=None) -> EventLog:
  """Taobao UserBehavior.csv: user,item,category,behavior,timestamp.

  Behaviours map to actions by `cfg.taobao_actions` (default pv -> click,
  fav -> cart, cart -> cart, buy -> order); any other is `unknown_action`.
  No prices: price = 0. Item and category ids are hashed into the tables.
  """
  from gemjax.data.config import ACTION_ID

  path = str(path)
  codes = {k: ACTION_ID[a] for k, a in cfg.taobao_actions}
  names = ("user", "item", "category", "behavior", "ts")
  parts = _csv_chunks(
    path,
    names,
    sep=",",
    fields=5,
    skip_rows=0,
    chunk_bytes=cfg.read_chunk_bytes,
  )

  def chunks():
    for rows, c in parts:
      yield (
        rows,
        {
          "user": _ids(rows, c["user"], "user"),
          "item": _ids(rows, c["item"], "item"),
          "category": _ids(rows, c["category"], "category"),
          "action": _named(rows, c["behavior"], codes),
          "ts": _times(rows, c["ts"]),
          "price": np.zeros(len(rows.line)),
        },
      )

  return _read(path, chunks(), cfg, counters, keep_user)


def _events(rows: _Rows, c: dict) -> dict:
  """Raw columns of gemjax's event schema (CSV strings or Parquet)."""
  from gemjax.data.config import ACTION_ID

  return {
    "user": _ids(rows, c["user"], "user"),
    "ts": _times(rows, c["ts"], "ts"),
    "item": _ids(rows, c["item"], "item"),
    "category": _ids(rows, c["category"], "category"),
    "action": _named(rows, c["action"], ACTION_ID),
    "price": _numbers(rows, c["price"], "price"),
  }


def read_events_csv(path, cfg, counters=None, keep_user=None) -> EventLog:
  """gemjax's own event CSV: header `user,ts,item,category,action,price`.

  `action` is a name of `config.ACTIONS`; ids are raw and hashed into the
  tables; prices must be finite and >= 0.
  """
  path = str(path)
  head = _file_head(path)
  want = ",".join(EventLog.COLUMNS)
  if head is not None and head != want:
    raise BadInputError(f"{path}:1: header must be {want}, got {head}")
  parts = _csv_chunks(
    path,
    EventLog.COLUMNS,
    sep=",",
    fields=len(EventLog.COLUMNS),
    skip_rows=1,
    chunk_bytes=cfg.read_chunk_bytes,
  )
  chunks = ((rows, _events(rows, c)) for rows, c in parts)
  return _read(path, chunks, cfg, counters, keep_user)


def read_events_parquet(path, cfg, counters=None, keep_user=None) -> EventLog:
  """gemjax's event schema in Parquet: columns user, ts, item, category
  (integers), action (a name of `config.ACTIONS`, or its index), price.

  Read a batch of about `cfg.read_chunk_bytes / 64` rows at a time; rows
  are named by their index (from 0) in errors and in `extra["line"]`. Ids
  stored as floating point are refused for the whole file: they may have
  lost digits before gemjax sees them.
  """
  pa = _arrow()
  path = str(path)
  f = pa.parquet.ParquetFile(path)
  schema = f.schema_arrow
  missing = [k for k in EventLog.COLUMNS if k not in schema.names]
  if missing:
    raise BadInputError(
      f"{path}: no column {', '.join(missing)} (an event Parquet file has "
      f"{', '.join(EventLog.COLUMNS)})"
    )
  for k in ("user", "item", "category"):
    t = schema.field(k).type
    if not (pa.types.is_integer(t) or pa.types.is_string(t)):
      raise BadInputError(
        f"{path}: column {k} is {t}; ids must be integers (or decimal text)"
      )
  size = max(1, cfg.read_chunk_bytes // 64)

  def chunks():
    start = 0
    for b in f.iter_batches(batch_size=size, columns=list(EventLog.COLUMNS)):
      rows = _Rows(np.arange(start, start + b.num_rows, dtype=np.int64))
      start += b.num_rows
      c = {k: b.column(k) for k in EventLog.COLUMNS}
      yield rows, _events(rows, c)

  return _read(path, chunks(), cfg, counters, keep_user, unit="row")


def _recbole_columns(path, head: str) -> dict[str, str]:
  """RecBole header `name:type<TAB>...` -> {name: arrow column name}."""
  names = [h.split(":", 1)[0] for h in head.split("\t")]
  if len(set(names)) != len(names):
    raise BadInputError(f"{path}:1: repeated column names in {head!r}")
  return {n: f"c{i}" for i, n in enumerate(names)}


def _recbole_classes(path, cfg, counters):
  # counters: for bad rows of the `.item` file.
  """item raw id -> raw category id from the sibling `.item` file, or None.

  The category of an item is its first `class` token, hashed to int64 by
  a stable hash of its text (blake2b); items without a class keep their
  own id as category.
  """
  pa = _arrow()
  pc = pa.compute
  item_path = path[: -len(".inter")] + ".item"
  if not path.endswith(".inter") or not os.path.exists(item_path):
    return None
  head = _file_head(item_path)
  cols = _recbole_columns(item_path, head or "")
  if "item_id" not in cols or "class" not in cols:
    return None
  bad = _Bad(item_path, cfg.on_bad_input, counters)
  ids, cls = [], []
  for rows, c in _csv_chunks(
    item_path,
    list(cols.values()),
    sep="\t",
    fields=len(cols),
    skip_rows=1,
    chunk_bytes=cfg.read_chunk_bytes,
  ):
    item = _ids(rows, c[cols["item_id"]], "item_id")
    ok = rows.settle(bad)
    if not ok.size:
      continue
    first = pc.list_element(
      pc.split_pattern(c[cols["class"]], " ", max_splits=1), 0
    )
    enc = pc.dictionary_encode(first)
    code = np.array(
      [
        int.from_bytes(
          hashlib.blake2b(s.encode(), digest_size=8).digest(),
          "little",
          signed=True,
        )
        if s
        else 0
        for s in enc.dictionary.to_pylist()
      ],
      np.int64,
    )
    has = ok & np.asarray(pc.not_equal(first, ""))
    ids.append(item[has])
    cls.append(code[np.asarray(enc.indices)][has])
  ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
  cls = np.concatenate(cls) if cls else np.zeros(0, np.int64)
  order = np.argsort(ids, kind="stable")
  ids, cls = ids[order], cls[order]

  def category(items: np.ndarray, counters) -> np.ndarray:
    at = np.minimum(np.searchsorted(ids, items), max(ids.size - 1, 0))
    found = ids[at] == items if ids.size else np.zeros(items.shape, bool)
    _count(counters, "events_without_class", (~found).sum())
    return np.where(found, cls[at] if ids.size else items, items)

  return category


def read_recbole(path, cfg, counters=None, keep_user=None) -> EventLog:
  """A RecBole atomic `.inter` file: tab-separated, header `name:type` per
  column, e.g. `user_id:token  item_id:token  rating:float  timestamp:float`.

  Columns are found by name: user_id, item_id and timestamp are required
  (tokens must be decimal integer ids); a `rating` becomes an action by
  `cfg.rating_actions` as in MovieLens, and without one every event is a
  click. Category: the item's first `class` token from the sibling
  `<name>.item` file when it has a `class:token_seq` column (items missing
  there: counted `events_without_class`, category = item), else the item.
  No prices: price = 0.
  """
  from gemjax.data.config import ACTION_ID

  path = str(path)
  if counters is None:
    counters = {}
  head = _file_head(path)
  if head is None:
    raise BadInputError(f"no events in {path} (empty file)")
  cols = _recbole_columns(path, head)
  missing = [k for k in ("user_id", "item_id", "timestamp") if k not in cols]
  if missing:
    raise BadInputError(
      f"{path}:1: no column {', '.join(missing)} in the header {head!r}"
    )
  category = _recbole_classes(path, cfg, counters)
  parts = _csv_chunks(
    path,
    list(cols.values()),
    sep="\t",
    fields=len(cols),
    skip_rows=1,
    chunk_bytes=cfg.read_chunk_bytes,
  )

  def chunks():
    for rows, c in parts:
      if "rating" in cols:
        yield (
          rows,
          _rated(
            rows,
            c,
            cfg,
            cols["user_id"],
            cols["item_id"],
            cols["timestamp"],
            cols["rating"],
          ),
        )
        continue
      item = _ids(rows, c[cols["item_id"]], "item")
      yield (
        rows,
        {
          "user": _ids(rows, c[cols["user_id"]], "user"),
          "ts": _times(rows, c[cols["timestamp"]]),
          "item": item,
          "category": item,
          "action": np.full(item.shape, ACTION_ID["click"], np.int8),
          "price": np.zeros(item.shape),
        },
      )

  return _read(path, chunks(), cfg, counters, keep_user, categorize=category)


# -- Requests -------------------------------------------------------------


def read_requests_csv(path, cfg) -> Requests:
  """Requests file, one line per candidate, with the header
  `request,user,ts,item,category,price,click,conversion`.

  One line per candidate; a request's lines are consecutive. An empty label
  field is a missing label (NaN), handled by `check_requests`. Lines are
  remembered per request (its first line) for error messages.
  """
  path = str(path)
  want = "request,user,ts,item,category,price,click,conversion"
  rows, lines = [], []
  with open(path) as f:
    head = f.readline().strip()
    if head != want:
      raise BadInputError(f"{path}:1: header must be {want}, got {head}")
    for no, raw in enumerate(f, start=2):
      fields = raw.rstrip("\r\n").split(",")
      if len(fields) != 8:
        raise BadInputError(
          f"{path}:{no}: expected 8 fields, got {len(fields)}: {raw[:80]!r}"
        )
      try:
        row = [
          float(x) if x != "" or j < 6 else float("nan")
          for j, x in enumerate(fields)
        ]
      except ValueError:
        raise BadInputError(
          f"{path}:{no}: not a number in {raw[:80]!r}"
        ) from None
      rows.append(row)
      lines.append(no)
  v = np.array(rows, np.float64).reshape(-1, 8)
  lines = np.array(lines, np.int64)
  rid = v[:, 0].astype(np.int64)
  start = (
    np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    if rid.size
    else np.zeros(0, np.int64)
  )
  if np.unique(rid).size != start.size:
    raise BadInputError(f"{path}: the lines of a request must be consecutive")
  r = start.size
  dense = np.zeros((r, cfg.num_dense), np.float32)
  return Requests(
    user=v[start, 1].astype(np.int64),
    ts=v[start, 2].astype(np.int64),
    user_row=hash_rows(v[start, 1].astype(np.int64), cfg.num_users),
    dense=dense,
    cand_offsets=np.r_[start, v.shape[0]].astype(np.int64),
    cand_item=hash_rows(v[:, 3].astype(np.int64), cfg.num_items),
    cand_category=hash_rows(v[:, 4].astype(np.int64), cfg.num_categories),
    cand_price=v[:, 5].astype(np.float32),
    labels=v[:, 6:8].astype(np.float32),
    source=path,
    line=lines[start],
  )


def check_requests(log: EventLog, req: Requests, cfg, counters=None):
  """Bad requests: a user with no events, a candidate with no label.

  With `on_bad_input="error"` the first one raises naming its file and line;
  with "skip" it is dropped and counted (`skipped_user_without_events`,
  `skipped_unlabelled_candidates`, and `skipped_requests_without_candidates`
  for a request left empty).
  """
  bad = _Bad(req.source or "requests", cfg.on_bad_input, counters)
  _, _, _, known = log.history_windows(req.user, req.ts)
  keep = known.copy()
  for i in np.flatnonzero(~known):
    bad(
      req.line[i] if req.line is not None else i,
      "user_without_events",
      f"user {req.user[i]} has no events in the log",
    )
  unl = np.isnan(req.labels).any(1)
  cseg = np.repeat(np.arange(len(req)), np.diff(req.cand_offsets))
  for c in np.flatnonzero(unl):
    i = cseg[c]
    bad(
      req.line[i] if req.line is not None else i,
      "unlabelled_candidates",
      f"candidate {c - req.cand_offsets[i]} (item row {req.cand_item[c]}) "
      "of this request has no label",
    )
  if not keep.all() or unl.any():
    # Drop unlabelled candidates, then requests left with none or unknown.
    cidx = np.flatnonzero(~unl)
    per = np.bincount(cseg[cidx], minlength=len(req))
    empty = (per == 0) & keep
    _count(counters, "skipped_requests_without_candidates", empty.sum())
    keep &= per > 0
    lab = Requests(
      **{
        **req.__dict__,
        "cand_offsets": np.r_[0, np.cumsum(per)].astype(np.int64),
        "cand_item": req.cand_item[cidx],
        "cand_category": req.cand_category[cidx],
        "cand_price": req.cand_price[cidx],
        "labels": req.labels[cidx],
      }
    )
    req = lab.take(np.flatnonzero(keep))
  return req
