"""Score requests: the JSON/dict form, its validation, and the conversion to
the training pipeline's `EventLog` + `Requests` (`gemjax.data.events`).

One request (all ids are table rows, as in a built training batch):

  {"user_row": 17,                 row of the user table
   "ts": 1700000000,               request time, seconds
   "dense": [0.1, ...],            `num_dense` floats of request context
   "history": {"ts": [...],        the user's events, time order (>=0 s)
               "item": [...], "category": [...],
               "action": [...],    ids or names of `data.config.ACTIONS`
               "price": [...]},    >= 0, finite
   "candidates": {"item": [...], "category": [...], "price": [...]}}

`history` may be empty (or omitted); events at or after `ts` are allowed and
excluded by the training builder's anti-leakage rule, like every other
training rule (dedup, quota, truncation), because the history goes through
`gemjax.data.build` unchanged. Every problem raises `RequestError` naming
the field, e.g. `requests[3].candidates.price[7]: NaN is not a price`.
"""

import array
import math

import numpy as np

from gemjax.data.config import ACTION_ID, ACTIONS
from gemjax.data.events import EventLog, Requests

HISTORY = ("ts", "item", "category", "action", "price")
CANDIDATES = ("item", "category", "price")
PLACEHOLDER = "serve_placeholder"
# Timestamps are seconds in [0, 2^33) (to the year 2242): the event log
# keys (user, time) in 64 bits with 33 bits of time (`EventLog._key`).
MAX_TS = 1 << 33


class RequestError(ValueError):
  """A malformed request; `field` names where (`requests[i].a.b[j]`)."""

  def __init__(self, field: str, what: str):
    super().__init__(f"{field}: {what}")
    self.field = field


def _column(obj, name, where, n_rows, table):
  """One history/candidate column as an array, checked: a vectorised check
  first, and only when it fails the element-wise one that names the bad
  entry."""
  field = f"{where}.{name}"
  vals = obj.get(name) if isinstance(obj, dict) else None
  if vals is None:
    raise RequestError(field, "missing")
  if not isinstance(vals, (list, tuple, np.ndarray)):
    raise RequestError(field, f"must be a list, got {type(vals).__name__}")
  if n_rows is not None and len(vals) != n_rows:
    raise RequestError(field, f"has {len(vals)} entries, expected {n_rows}")
  if name == "price":
    arr = _floats(vals)
    if arr is not None and np.isfinite(arr).all() and (arr >= 0).all():
      return arr.astype(np.float32)
    return _slow_price(vals, field)
  if name == "action":
    arr = _ints(vals)
    if arr is None and all(isinstance(a, str) for a in vals):
      arr = np.array([ACTION_ID.get(a, -1) for a in vals], np.int64)
    if arr is not None and _in_range(arr, len(ACTIONS)):
      return arr.astype(np.int8)
    return _slow_action(vals, field)
  arr = _ints(vals)
  if arr is not None and _in_range(arr, table):
    return arr
  return _slow_ids(vals, field, table)


def _ints(vals) -> np.ndarray | None:
  """`vals` as int64 when every entry is an integer, else None. A list
  goes through `array.array`, which takes Python ints at C speed and
  refuses floats, strings and None (a float is never truncated into an
  id); numpy's own inference is several times slower per entry."""
  if isinstance(vals, np.ndarray):
    ok = vals.ndim == 1 and (vals.dtype.kind in "iu" or vals.size == 0)
    return vals.astype(np.int64) if ok else None
  try:
    return np.frombuffer(array.array("q", vals), np.int64)
  except (TypeError, OverflowError):
    return None


def _floats(vals) -> np.ndarray | None:
  """`vals` as float64 when every entry is a number, else None."""
  if isinstance(vals, np.ndarray):
    ok = vals.ndim == 1 and (vals.dtype.kind in "iuf" or vals.size == 0)
    return vals.astype(np.float64) if ok else None
  try:
    return np.frombuffer(array.array("d", vals), np.float64)
  except (TypeError, OverflowError):
    return None


def _in_range(arr, table) -> bool:
  """Every entry in [0, table) (table None: no upper bound)."""
  if arr.size == 0:
    return True
  return arr.min() >= 0 and (table is None or arr.max() < table)


def _slow_price(vals, field):
  for j, p in enumerate(vals):
    if not _is_number(p) or not _finite(p) or p < 0:
      raise RequestError(
        f"{field}[{j}]", f"{p!r} is not a price (finite, >= 0)"
      )
  return np.array(vals, np.float32)


def _slow_action(vals, field):
  for j, a in enumerate(vals):
    if not (
      (isinstance(a, str) and a in ACTION_ID)
      or (_is_int(a) and 0 <= a < len(ACTIONS))
    ):
      raise RequestError(
        f"{field}[{j}]", f"{a!r} is not an action (one of {ACTIONS})"
      )
  return np.array([ACTION_ID.get(a, a) for a in vals], np.int8)


def _slow_ids(vals, field, table):
  for j, v in enumerate(vals):
    if not _is_int(v):
      raise RequestError(f"{field}[{j}]", f"{v!r} is not an integer")
    if v < 0:
      raise RequestError(f"{field}[{j}]", f"{v} is negative")
    if table is not None and v >= table:
      raise RequestError(f"{field}[{j}]", f"{v} is outside [0, {table})")
  return np.array(vals, np.int64)


def _finite(x) -> bool:
  try:
    return math.isfinite(x)
  except OverflowError:  # an int past the float range
    return False


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v) -> bool:
  return isinstance(v, (int, float, np.number)) and not isinstance(v, bool)


def parse_request(obj, data_cfg, num_dense: int, where: str = "request"):
  """One request dict -> a dict of checked numpy columns."""
  if not isinstance(obj, dict):
    raise RequestError(where, f"must be an object, got {type(obj).__name__}")
  for key in ("user_row", "ts", "candidates"):
    if key not in obj:
      raise RequestError(f"{where}.{key}", "missing")
  user_row, ts = obj["user_row"], obj["ts"]
  if not _is_int(user_row) or not 0 <= user_row < data_cfg.num_users:
    raise RequestError(
      f"{where}.user_row",
      f"{user_row!r} is not a user row in [0, {data_cfg.num_users})",
    )
  if not _is_int(ts) or not 0 <= ts < MAX_TS:
    raise RequestError(
      f"{where}.ts", f"{ts!r} is not a time in [0, 2^33) seconds"
    )
  dense = obj.get("dense", [] if num_dense == 0 else None)
  if not isinstance(dense, (list, tuple)) or len(dense) != num_dense:
    raise RequestError(
      f"{where}.dense", f"must be a list of {num_dense} floats"
    )
  for j, x in enumerate(dense):
    if not _is_number(x) or not _finite(x):
      raise RequestError(f"{where}.dense[{j}]", f"{x!r} is not a finite float")
  tables = {
    "item": data_cfg.num_items,
    "category": data_cfg.num_categories,
    "ts": MAX_TS,
  }
  cands = obj["candidates"]
  if not isinstance(cands, dict):
    raise RequestError(f"{where}.candidates", "must be an object of lists")
  n_c = None
  cols = {}
  for name in CANDIDATES:
    cols[f"cand_{name}"] = _column(
      cands, name, f"{where}.candidates", n_c, tables.get(name)
    )
    n_c = len(cols[f"cand_{name}"])
  if n_c == 0:
    raise RequestError(f"{where}.candidates.item", "no candidates")
  hist = obj.get("history", {})
  if not isinstance(hist, dict):
    raise RequestError(f"{where}.history", "must be an object of lists")
  n_h = None if hist else 0
  for name in HISTORY:
    if not hist:
      cols[f"hist_{name}"] = np.zeros(0, np.float32 if name == "price" else int)
      continue
    cols[f"hist_{name}"] = _column(
      hist, name, f"{where}.history", n_h, tables.get(name)
    )
    n_h = len(cols[f"hist_{name}"])
  h_ts = cols["hist_ts"]
  back = np.flatnonzero(h_ts[1:] < h_ts[:-1])
  if back.size:
    j = int(back[0]) + 1
    raise RequestError(
      f"{where}.history.ts[{j}]",
      f"{h_ts[j]} is earlier than the event before it ({h_ts[j - 1]}): "
      "histories must be in time order",
    )
  cols["user_row"], cols["ts"] = int(user_row), int(ts)
  cols["dense"] = np.asarray(dense, np.float32).reshape(num_dense)
  return cols


def to_log_and_requests(parsed, num_tasks: int):
  """Parsed requests -> (`EventLog`, `Requests`) of the training pipeline.

  Request i's history is the log's user i: every request is its own owner
  key, so two requests never share events. The builder wants every user in
  the log; a request with no history gets one placeholder event at its
  request time, which the anti-leakage rule removes (`PLACEHOLDER` marks
  it in the log's `extra` so that its count can be taken back out of
  `leakage_excluded`).
  """
  empty = [p["hist_ts"].size == 0 for p in parsed]
  n_h = np.array([max(p["hist_ts"].size, 1) for p in parsed], np.int64)
  n_c = np.array([p["cand_item"].size for p in parsed], np.int64)

  def cat(key, dtype):
    fill = key.startswith("hist_")
    parts = [
      np.array([p["ts"] if key == "hist_ts" else 0]) if e and fill else p[key]
      for p, e in zip(parsed, empty, strict=True)
    ]
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

  log = EventLog(
    user=np.repeat(np.arange(len(parsed), dtype=np.int64), n_h),
    ts=cat("hist_ts", np.int64),
    item=cat("hist_item", np.int32),
    category=cat("hist_category", np.int32),
    action=cat("hist_action", np.int8),
    price=cat("hist_price", np.float32),
    extra={PLACEHOLDER: np.repeat(np.array(empty, bool), n_h)},
  )
  f = parsed[0]["dense"].shape[0] if parsed else 0
  req = Requests(
    user=np.arange(len(parsed), dtype=np.int64),
    ts=np.array([p["ts"] for p in parsed], np.int64),
    user_row=np.array([p["user_row"] for p in parsed], np.int32),
    dense=np.stack([p["dense"] for p in parsed]).reshape(len(parsed), f),
    cand_offsets=np.concatenate([[0], np.cumsum(n_c)]).astype(np.int64),
    cand_item=cat("cand_item", np.int32),
    cand_category=cat("cand_category", np.int32),
    cand_price=cat("cand_price", np.float32),
    labels=np.zeros((int(n_c.sum()), num_tasks), np.float32),
    source="score request",
  )
  return log, req


def request_dicts(log: EventLog, req: Requests) -> list[dict]:
  """The JSON form of training's requests (inverse of the conversion
  above, for tests, benchmarks and the notebook)."""
  start, end, _, known = log.history_windows(req.user, req.ts)
  out = []
  for i in range(len(req)):
    lo, hi = int(start[i]), int(end[i])
    if not known[i]:
      lo = hi = 0
    c0, c1 = int(req.cand_offsets[i]), int(req.cand_offsets[i + 1])
    out.append(
      {
        "user_row": int(req.user_row[i]),
        "ts": int(req.ts[i]),
        "dense": req.dense[i].tolist(),
        "history": {
          "ts": log.ts[lo:hi].tolist(),
          "item": log.item[lo:hi].tolist(),
          "category": log.category[lo:hi].tolist(),
          "action": log.action[lo:hi].tolist(),
          "price": log.price[lo:hi].tolist(),
        },
        "candidates": {
          "item": req.cand_item[c0:c1].tolist(),
          "category": req.cand_category[c0:c1].tolist(),
          "price": req.cand_price[c0:c1].tolist(),
        },
      }
    )
  return out
