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

Readers for real public formats (MovieLens, Taobao UserBehavior) live below
with the bad-input rules; the synthetic generator (`synthetic.py`) writes the
same two structures, so every source goes through one request builder.
"""

import dataclasses
import functools

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

  def take(self, idx) -> "Requests":
    """The requests `idx` (in that order), candidates following them."""
    idx = np.asarray(idx, np.int64)
    lo, hi = self.cand_offsets[idx], self.cand_offsets[idx + 1]
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
# Real logs are text. A file is read in chunks of `chunk_bytes` (cut at a line
# end), so parsing memory is bounded by the chunk, and only the compact
# columns of the rows this process keeps accumulate (21 bytes per event).
# Each chunk goes through numpy's C parser first (`np.loadtxt` on the
# separator-normalised bytes); only a chunk that fails is re-read line by
# line, to name the bad line or skip it. Bad input is never dropped silently:
# with `on_bad_input="error"` the first bad line raises `BadInputError`
# "<file>:<line>: <what>"; with "skip" the line is dropped and counted
# (`skipped_<reason>` in the caller's counters).


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
  """Raise or count one bad line."""

  def __init__(self, path, mode, counters):
    if mode not in ("error", "skip"):
      raise ValueError(f"on_bad_input must be 'error' or 'skip', got {mode!r}")
    self.path, self.mode, self.counters = path, mode, counters

  def __call__(self, line_no: int, reason: str, what: str):
    if self.mode == "error":
      raise BadInputError(f"{self.path}:{line_no}: {what}")
    _count(self.counters, f"skipped_{reason}")


def read_table(
  path,
  *,
  sep: str,
  ncols: int,
  header: bool = False,
  codes: dict | None = None,
  code_col: int | None = None,
  chunk_bytes: int = 8 << 20,
  on_bad_input: str = "error",
  counters=None,
):
  """Yield (line numbers int64[m], values float64[m, ncols]) chunk by chunk.

  `codes` maps the text values of column `code_col` (e.g. b"pv") to numbers;
  an unknown text value is a bad line (reason `unknown_action`). Empty lines
  are skipped silently only at the very end of the file.
  """
  bad = _Bad(path, on_bad_input, counters)
  sep_b = sep.encode()
  line0 = 1
  rest = b""
  with open(path, "rb") as f:
    if header:
      f.readline()
      line0 = 2
    while True:
      buf = f.read(chunk_bytes)
      data = rest + buf
      if not buf:
        rest = b""
      else:
        cut = data.rfind(b"\n") + 1
        data, rest = data[:cut], data[cut:]
      if data:
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
          lines.pop()
        yield _parse(lines, line0, sep_b, ncols, codes, code_col, bad)
        line0 += len(lines)
      if not buf:
        break


def _parse(lines, line0, sep, ncols, codes, code_col, bad):
  n = len(lines)
  nums = np.arange(line0, line0 + n, dtype=np.int64)
  text = b"\n".join(lines)
  if codes:
    # Map the text column to numbers in bulk where it is unambiguous.
    for k, v in codes.items():
      text = text.replace(sep + k + sep, sep + str(v).encode() + sep)
      text = text.replace(sep + k + b"\n", sep + str(v).encode() + b"\n")
      if text.endswith(sep + k):
        text = text[: -len(k)] + str(v).encode()
  if sep != b",":
    text = text.replace(sep, b",")
  try:
    import io
    import warnings

    with warnings.catch_warnings():
      warnings.simplefilter("error")
      vals = np.loadtxt(
        io.BytesIO(text),
        delimiter=",",
        dtype=np.float64,
        ndmin=2,
        comments=None,
      )
    if vals.shape == (n, ncols) or (n == 0):
      return nums, vals.reshape(n, ncols)
  except (ValueError, UserWarning):
    pass
  # Slow path: line by line, to name or skip the bad ones.
  keep, out = [], []
  for i, raw in enumerate(lines):
    fields = raw.rstrip(b"\r").split(sep)
    if len(fields) != ncols:
      bad(
        line0 + i,
        "malformed",
        f"expected {ncols} fields separated by {sep.decode()!r}, got "
        f"{len(fields)}: {raw[:80]!r}",
      )
      continue
    if codes is not None and code_col is not None:
      if fields[code_col] not in codes:
        bad(
          line0 + i,
          "unknown_action",
          f"unknown action type {fields[code_col].decode(errors='replace')!r}"
          f" (known: {sorted(c.decode() for c in codes)})",
        )
        continue
      fields[code_col] = str(codes[fields[code_col]]).encode()
    try:
      row = [float(x) for x in fields]
    except ValueError:
      bad(line0 + i, "malformed", f"not a number in {raw[:80]!r}")
      continue
    keep.append(line0 + i)
    out.append(row)
  return (
    np.array(keep, np.int64),
    np.array(out, np.float64).reshape(len(out), ncols),
  )


def _finish(path, parts, cfg, counters, keep_user=None) -> EventLog:
  """Chunks of (lines, user, ts, item, category, action, price) -> EventLog.

  Checks negative prices and timestamps, applies the process filter
  `keep_user(user) -> bool[m]`, then sorts by (user, ts) according to
  `cfg.time_order` ("sort": reorder and count `reordered`; "error": raise at
  the first event earlier than the previous one of its user in file order;
  "skip": drop such events, counted).
  """
  bad = _Bad(path, cfg.on_bad_input, counters)
  cols = {
    k: [] for k in ("line", "user", "ts", "item", "category", "action", "price")
  }
  for chunk in parts:
    line, user, ts, item, cat, action, price = chunk
    ok = np.ones(line.shape, bool)
    for name, bad_rows in (
      ("negative_price", price < 0),
      ("negative_timestamp", ts < 0),
    ):
      for j in np.flatnonzero(bad_rows):
        bad(
          int(line[j]),
          name,
          f"{name.replace('_', ' ')}: {price[j] if 'price' in name else ts[j]}",
        )
      ok &= ~bad_rows
    if keep_user is not None:
      ok &= keep_user(user)
    for k, v in zip(
      cols, (line, user, ts, item, cat, action, price), strict=True
    ):
      cols[k].append(v[ok])
  c = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
  log = EventLog(
    user=c["user"].astype(np.int64),
    ts=c["ts"].astype(np.int64),
    item=c["item"].astype(np.int32),
    category=c["category"].astype(np.int32),
    action=c["action"].astype(np.int8),
    price=c["price"].astype(np.float32),
    extra={"line": c["line"].astype(np.int64)},
  )
  return order_by_time(log, path, cfg, counters)


def order_by_time(log: EventLog, path, cfg, counters) -> EventLog:
  """Group by user, then handle events whose time goes backwards."""
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


def read_movielens(path, cfg, counters=None, keep_user=None) -> EventLog:
  """MovieLens `ratings.dat` (user::movie::rating::ts) or `ratings.csv`.

  The rating becomes an action by `cfg.rating_actions` ((min rating, action),
  highest first; below all thresholds: impression). MovieLens has no
  categories or prices: category = hashed movie id, price = 0.
  """
  path = str(path)
  csv = path.endswith(".csv")
  rule = sorted(cfg.rating_actions, reverse=True)
  from gemjax.data.config import ACTION_ID

  def chunks():
    for line, v in read_table(
      path,
      sep="," if csv else "::",
      ncols=4,
      header=csv,
      chunk_bytes=cfg.read_chunk_bytes,
      on_bad_input=cfg.on_bad_input,
      counters=counters,
    ):
      rating = v[:, 2]
      action = np.full(rating.shape, ACTION_ID["impression"], np.int8)
      for thr, name in rule[::-1]:
        action[rating >= thr] = ACTION_ID[name]
      raw_item = v[:, 1].astype(np.int64)
      yield (
        line,
        v[:, 0].astype(np.int64),
        v[:, 3].astype(np.int64),
        hash_rows(raw_item, cfg.num_items),
        hash_rows(raw_item, cfg.num_categories),
        action,
        np.zeros(rating.shape, np.float32),
      )

  return _finish(path, chunks(), cfg, counters, keep_user)


def read_taobao(path, cfg, counters=None, keep_user=None) -> EventLog:
  """Taobao UserBehavior.csv: user,item,category,behavior,timestamp.

  Behaviours map to actions by `cfg.taobao_actions` (default pv -> click,
  fav -> cart, cart -> cart, buy -> order); any other is `unknown_action`.
  No prices: price = 0. Item and category ids are hashed into the tables.
  """
  from gemjax.data.config import ACTION_ID

  path = str(path)
  codes = {k.encode(): ACTION_ID[a] for k, a in cfg.taobao_actions}

  def chunks():
    for line, v in read_table(
      path,
      sep=",",
      ncols=5,
      codes=codes,
      code_col=3,
      chunk_bytes=cfg.read_chunk_bytes,
      on_bad_input=cfg.on_bad_input,
      counters=counters,
    ):
      yield (
        line,
        v[:, 0].astype(np.int64),
        v[:, 4].astype(np.int64),
        hash_rows(v[:, 1].astype(np.int64), cfg.num_items),
        hash_rows(v[:, 2].astype(np.int64), cfg.num_categories),
        v[:, 3].astype(np.int8),
        np.zeros(v.shape[0], np.float32),
      )

  return _finish(path, chunks(), cfg, counters, keep_user)


def read_events_csv(path, cfg, counters=None, keep_user=None) -> EventLog:
  """gemjax's own event CSV: header `user,ts,item,category,action,price`.

  `action` is a name of `config.ACTIONS`; ids are raw and hashed into the
  tables; prices must be >= 0.
  """
  from gemjax.data.config import ACTION_ID, ACTIONS

  path = str(path)
  with open(path, "rb") as f:
    head = f.readline().strip().split(b",")
  want = [c.encode() for c in EventLog.COLUMNS]
  if head != want:
    raise BadInputError(
      f"{path}:1: header must be {b','.join(want).decode()}, got "
      f"{b','.join(head).decode()}"
    )
  codes = {a.encode(): ACTION_ID[a] for a in ACTIONS}

  def chunks():
    for line, v in read_table(
      path,
      sep=",",
      ncols=6,
      header=True,
      codes=codes,
      code_col=4,
      chunk_bytes=cfg.read_chunk_bytes,
      on_bad_input=cfg.on_bad_input,
      counters=counters,
    ):
      yield (
        line,
        v[:, 0].astype(np.int64),
        v[:, 1].astype(np.int64),
        hash_rows(v[:, 2].astype(np.int64), cfg.num_items),
        hash_rows(v[:, 3].astype(np.int64), cfg.num_categories),
        v[:, 4].astype(np.int8),
        v[:, 5].astype(np.float32),
      )

  return _finish(path, chunks(), cfg, counters, keep_user)


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
