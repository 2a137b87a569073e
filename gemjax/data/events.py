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


def ranges(start, end) -> np.ndarray:
  """Concatenation of arange(start[i], end[i]) (int64), vectorised."""
  start = np.asarray(start, np.int64)
  lens = np.asarray(end, np.int64) - start
  total = int(lens.sum())
  if total == 0:
    return np.zeros(0, np.int64)
  # Each run's first index minus the running position, repeated over the run.
  csum = np.cumsum(lens) - lens
  return np.repeat(start - csum, lens) + np.arange(total, dtype=np.int64)
