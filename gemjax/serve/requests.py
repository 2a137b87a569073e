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

Every column of `history` and `candidates` is either a JSON list or, in
the binary form, a string: the base64 (standard alphabet, padded) of its
values as little-endian numbers of the column's `BINARY` dtype (`ts` int64,
`item` and `category` int32, `action` int8 ids, `price` float32), which
decodes straight into a numpy array with no Python number per entry
(`encode_column` writes it). Both forms pass the same checks.

`history` may be empty (or omitted); events at or after `ts` are allowed and
excluded by the training builder's anti-leakage rule, like every other
training rule (dedup, quota, truncation), because the history goes through
`gemjax.data.build` unchanged. Every problem raises `RequestError` naming
the field, e.g. `requests[3].candidates.price[7]: NaN is not a price`.
"""

import array
import base64
import binascii
import functools
import math

import numpy as np

try:  # The `serve` extra's SIMD base64 decoder; binascii's without it.
  import pybase64

  _b64decode = functools.partial(pybase64.b64decode, validate=True)
except ImportError:
  _b64decode = functools.partial(binascii.a2b_base64, strict_mode=True)

from gemjax.data.config import ACTION_ID, ACTIONS
from gemjax.data.events import EventLog, Requests

HISTORY = ("ts", "item", "category", "action", "price")
CANDIDATES = ("item", "category", "price")
PLACEHOLDER = "serve_placeholder"
# The binary form's dtype of each column: the widths of the event log's own
# columns, so a decoded column needs no conversion.
BINARY = {
  "ts": np.dtype("<i8"),
  "item": np.dtype("<i4"),
  "category": np.dtype("<i4"),
  "action": np.dtype("<i1"),
  "price": np.dtype("<f4"),
}
# Timestamps are seconds in [0, 2^33) (to the year 2242): the event log
# keys (user, time) in 64 bits with 33 bits of time (`EventLog._key`).
MAX_TS = 1 << 33


class RequestError(ValueError):
  """A malformed request; `field` names where (`requests[i].a.b[j]`)."""

  def __init__(self, field: str, what: str):
    super().__init__(f"{field}: {what}")
    self.field = field


def _column(obj, name, where, n_rows, table):
  """One history/candidate column as an array, checked: a list converted
  at C speed (the element-wise reading, which names the first entry of a
  wrong type, only when that fails), a base64 string decoded, then the
  values checked as one array, the first bad entry named."""
  field = f"{where}.{name}"
  vals = obj.get(name) if isinstance(obj, dict) else None
  if vals is None:
    raise RequestError(field, "missing")
  if isinstance(vals, str):
    vals = _binary(vals, name, field)
  elif not isinstance(vals, (list, tuple, np.ndarray)):
    raise RequestError(
      field, f"must be a list or a base64 string, got {type(vals).__name__}"
    )
  if n_rows is not None and len(vals) != n_rows:
    raise RequestError(field, f"has {len(vals)} entries, expected {n_rows}")
  if name == "price":
    arr = _floats(vals)
    if arr is None:
      arr = _slow_price(vals, field)
    if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0):
      ok = np.isfinite(arr) & (arr >= 0)
      _name_first(~ok, vals, field, lambda v: "is not a price (finite, >= 0)")
    return arr.astype(np.float32)
  if name == "action":
    arr = _ints(vals)
    if arr is None:
      arr = _slow_action(vals, field)
    _check_range(
      arr,
      vals,
      field,
      len(ACTIONS),
      lambda v: f"is not an action (one of {ACTIONS})",
    )
    return arr.astype(np.int8)
  arr = _ints(vals)
  if arr is None:
    arr = _slow_ids(vals, field, table)
  _check_range(
    arr,
    vals,
    field,
    table,
    lambda v: "is negative" if v < 0 else f"is outside [0, {table})",
  )
  return arr


def _binary(text: str, name: str, field: str) -> np.ndarray:
  """A column's binary form -> its values (read-only, no copy). pybase64
  decodes a 2K history's 66 KB of base64 in a few microseconds, binascii
  in about 0.2 ms (its byte loop dominates the validation of the whole
  request), so pybase64 is used when installed."""
  dtype = BINARY[name]
  try:
    raw = _b64decode(text)
  except ValueError as e:  # binascii.Error is one
    raise RequestError(field, f"is neither a list nor base64: {e}") from None
  if len(raw) % dtype.itemsize:
    raise RequestError(
      field,
      f"{len(raw)} bytes are not a whole number of {dtype.name} values "
      f"({dtype.itemsize} bytes each)",
    )
  return np.frombuffer(raw, dtype)


def encode_column(values, name: str) -> str:
  """A column's binary form (base64 of its `BINARY` dtype): the client's
  side of `_binary`. Prices are rounded to float32 as the list form's are;
  an integer that the column's dtype cannot hold raises (it would wrap)."""
  dtype = BINARY[name]
  arr = np.asarray(values)
  with np.errstate(all="ignore"):  # a value out of range: refused below
    out = arr.astype(dtype)
  if dtype.kind == "i" and arr.size and not np.array_equal(out, arr):
    raise ValueError(f"{name}: values do not fit {dtype.name}")
  return base64.b64encode(out.tobytes()).decode("ascii")


def _check_range(arr, vals, field, hi, what):
  """Every entry of `arr` in [0, hi), else the first one that is not is
  named (`what(value)` says why): two reductions when all is well."""
  if arr.size and (arr.min() < 0 or arr.max() >= hi):
    _name_first((arr < 0) | (arr >= hi), vals, field, what)


def _name_first(bad: np.ndarray, vals, field: str, what):
  """Raise naming the first entry where `bad` holds, as the client sent
  it (`vals`)."""
  j = int(np.argmax(bad))
  v = vals[j]
  v = v.item() if isinstance(v, np.generic) else v
  raise RequestError(f"{field}[{j}]", f"{v!r} {what(v)}")


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


def _slow_price(vals, field):
  """Prices that `array.array` refused: name the first entry that is not
  a number; numbers past the float range become inf (refused after)."""
  for j, p in enumerate(vals):
    if not _is_number(p):
      raise RequestError(f"{field}[{j}]", f"{p!r} is not a price (a number)")
  return np.array([p if _finite(p) else math.inf for p in vals], np.float64)


def _slow_action(vals, field):
  """Actions given by name (or some by name): name the first entry that
  is neither a known name nor an integer; integers out of range become -1
  (refused after, by their value as sent)."""
  for j, a in enumerate(vals):
    if not ((isinstance(a, str) and a in ACTION_ID) or _is_int(a)):
      raise RequestError(
        f"{field}[{j}]", f"{a!r} is not an action (one of {ACTIONS})"
      )
  n = len(ACTIONS)
  return np.array(
    [
      ACTION_ID[a] if isinstance(a, str) else a if 0 <= a < n else -1
      for a in vals
    ],
    np.int64,
  )


def _slow_ids(vals, field, table):
  """Ids that `array.array` refused: name the first entry that is not an
  integer or is past int64 (out of every table)."""
  for j, v in enumerate(vals):
    if not _is_int(v):
      raise RequestError(f"{field}[{j}]", f"{v!r} is not an integer")
    if not -(1 << 63) <= v < (1 << 63):
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


def request_dicts(log: EventLog, req: Requests, binary=False) -> list[dict]:
  """The JSON form of training's requests (inverse of the conversion
  above, for tests, benchmarks and the notebook); `binary`: every column
  in its binary form (`encode_column`)."""
  start, end, _, known = log.history_windows(req.user, req.ts)
  cols = {
    "history": {k: getattr(log, k) for k in HISTORY},
    "candidates": {k: getattr(req, f"cand_{k}") for k in CANDIDATES},
  }

  def wire(v, k):
    return encode_column(v, k) if binary else v.tolist()

  out = []
  for i in range(len(req)):
    lo, hi = int(start[i]), int(end[i])
    if not known[i]:
      lo = hi = 0
    c0, c1 = int(req.cand_offsets[i]), int(req.cand_offsets[i + 1])
    spans = {"history": (lo, hi), "candidates": (c0, c1)}
    d = {
      "user_row": int(req.user_row[i]),
      "ts": int(req.ts[i]),
      "dense": req.dense[i].tolist(),
    }
    for part, (a, b) in spans.items():
      d[part] = {k: wire(v[a:b], k) for k, v in cols[part].items()}
    out.append(d)
  return out
