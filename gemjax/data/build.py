"""Request building: history windows, dedup, action quota, context features.

For a batch of requests (user, request time, candidates) this builds each
user's history as a jagged sequence (O1-O4). All requests of a block are
handled together, vectorised over the concatenation of their histories; `s`
below is the request index of every history event (a segment id).

1. Anti-leakage. The history is the user's events strictly before the request
   time. The log is sorted by (user, ts), so that is one slice per request,
   found by one `searchsorted` (`EventLog.history_windows`); events at or
   after the request time are counted (`leakage_excluded`).
2. Dedup (`cfg.dedup`): "consecutive" drops an event whose item and action
   equal the previous event of the same history (double logging, refreshes);
   "item_action" / "item" keep only the newest event per (item, action) /
   item. Dropped events are counted (`dedup_dropped`).
3. Action quota (O2). Per request, with n_a events of action a and the
   configured caps q_a in priority order (default order 512 > cart 512 >
   click 924 > impression 100):

     carry = 0
     for a in priority order:
       allow_a = q_a            if a never backfills (impressions)
               = q_a + carry    otherwise
       keep_a  = min(n_a, allow_a)          the newest keep_a events of a
       carry   = carry + q_a - keep_a       if a never backfills
               = allow_a - keep_a           otherwise

   so unused order quota flows to carts, then clicks; impressions stay at
   their hard cap of 100 whatever is left over. Actions not in the quota are
   dropped. Kept events stay in time order (a mask, not a re-sort).
4. Truncation to `max_seq_len`, newest kept (counted: `truncated_requests`,
   `truncated_events`).
5. One gather of every column at the surviving indices, then the context
   features of O3 (`features.context_features`).

Index-only building (O4): steps 1-4 only ever produce masks over (or
positions in) the history windows, and read the one or two columns they
need (action, item); step 5 turns the kept window positions into log
positions and is the single gather of all feature columns. Segments are
tracked by their offsets, not by a segment id per event. The naive
version (`build_sequences_naive`, kept for the benchmark and as a test
oracle) materialises every column after each of steps 1, 2 and 3 - three
full copies of `n_columns x events`, which is what OneTrans V3.1 removed.

Counters are plain ints in a dict that the caller owns and accumulates.
"""

import numpy as np

from gemjax.data import features
from gemjax.data.config import ACTION_ID, ACTIONS, DataConfig
from gemjax.data.events import EventLog, Requests, ranges


def _add(counters, key, n):
  if counters is not None and n:
    counters[key] = counters.get(key, 0) + int(n)


def _offsets(lengths) -> np.ndarray:
  """Offsets int64[r+1] of segments of `lengths`."""
  out = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=out[1:])
  return out


def segment_counts(keep: np.ndarray, starts: np.ndarray) -> np.ndarray:
  """int64[r]: True entries of `keep` in each segment (offsets `starts`)."""
  lens = np.diff(starts)
  nz = lens > 0
  counts = np.zeros(lens.shape[0], np.int64)
  counts[nz] = np.add.reduceat(keep, starts[:-1][nz], dtype=np.int32)
  return counts


def segment_ids(starts: np.ndarray) -> np.ndarray:
  """int64[t]: the segment of every element, from offsets `starts`."""
  return np.repeat(
    np.arange(starts.shape[0] - 1, dtype=np.int64), np.diff(starts)
  )


def dedup_mask(starts, item, action, rule: str) -> np.ndarray:
  """bool[t]: events that survive the dedup rule (inputs in time order,
  segments at offsets `starts`)."""
  n = item.shape[0]
  if rule == "none" or n == 0:
    return np.ones(n, bool)
  if rule == "consecutive":
    keep = np.empty(n, bool)
    np.not_equal(item[1:], item[:-1], out=keep[1:])
    keep[1:] |= action[1:] != action[:-1]
    first = starts[:-1]
    keep[first[first < n]] = True  # a segment's first event
    return keep
  # Keep the newest per group: sort by (seg, group, position), last of a run.
  seg = segment_ids(starts)
  keys = (seg, item) if rule == "item" else (seg, item, action)
  pos = np.arange(n)
  order = np.lexsort((pos,) + keys[::-1])
  last = np.ones(n, bool)
  same = np.ones(n - 1, bool)
  for k in keys:
    ks = k[order]
    same &= ks[1:] == ks[:-1]
  last[:-1] = ~same
  keep = np.zeros(n, bool)
  keep[order[last]] = True
  return keep


def quota_keep(counts_ra: np.ndarray, cfg: DataConfig) -> np.ndarray:
  """Events to keep per (request, action), int64[r, A], from counts [r, A]."""
  keep = np.zeros_like(counts_ra)
  carry = np.zeros(counts_ra.shape[0], counts_ra.dtype)
  for name, cap in cfg.quota:
    a = ACTION_ID[name]
    if name in cfg.no_backfill:
      keep[:, a] = np.minimum(counts_ra[:, a], cap)
      carry = carry + cap - keep[:, a]
    else:
      allow = cap + carry
      keep[:, a] = np.minimum(counts_ra[:, a], allow)
      carry = allow - keep[:, a]
  return keep


def _quota_and_truncate(starts, action, cfg, counters):
  """(bool[t], int64[r]): the events kept by the action quota, then the
  max length cut (newest kept), and the kept count of every segment.
  Events whose action is not an action id (-1: dropped before) are not.

  Per action a, `flatnonzero(action == a)` lists its events in array
  order, so a segment's a-events are a slice of that list (found by
  `searchsorted` at the segment offsets) and the newest k of them are the
  slice's last k: no per-event segment ids, no sort."""
  n = action.shape[0]
  pos = [np.flatnonzero(action == i) for i in range(len(ACTIONS))]
  hi = np.stack([np.searchsorted(p, starts) for p in pos], 1)  # [r+1, A]
  counts = np.diff(hi, axis=0)
  keep = quota_keep(counts, cfg)
  for i, name in enumerate(ACTIONS):
    _add(counters, f"quota_dropped_{name}", (counts[:, i] - keep[:, i]).sum())
  mask = np.zeros(n, bool)
  for i, p in enumerate(pos):
    mask[p[ranges(hi[1:, i] - keep[:, i], hi[1:, i])]] = True
  del pos
  kept = keep.sum(1)
  over = np.flatnonzero(kept > cfg.max_seq_len)
  if over.size:
    # Max length, newest kept: drop each long segment's oldest kept events.
    cut = kept[over] - cfg.max_seq_len
    _add(counters, "truncated_requests", over.size)
    _add(counters, "truncated_events", cut.sum())
    first = (np.cumsum(kept) - kept)[over]
    mask[np.flatnonzero(mask)[ranges(first, first + cut)]] = False
    kept = np.minimum(kept, cfg.max_seq_len)
  return mask, kept


def _windows(log: EventLog, req: Requests, cfg, counters):
  start, end, future, known = log.history_windows(req.user, req.ts)
  _add(counters, "leakage_excluded", future.sum())
  _add(counters, "empty_history", (end == start).sum())
  if not known.all():
    i = int(np.flatnonzero(~known)[0])
    raise ValueError(
      f"{req.where(i)}: user {req.user[i]} has no events in the log"
    )
  return start, end


def build_sequences(
  log: EventLog,
  req: Requests,
  cfg: DataConfig,
  counters=None,
  method: str = "auto",
):
  """Index-only building (O4). Returns (offsets int64[r+1], columns, seg).

  columns: the log's columns gathered once at the kept events (`ts`, `item`,
  `category`, `action`, `price`, extras); seg int64[t]: request of each event.
  method: "mask" (any dedup rule: masks over the windows' columns),
  "positions" (dedup "none" / "consecutive": per-action position lists of
  the log, see `_build_positions`), "auto" (positions when it applies).
  """
  if method == "auto":
    method = "positions" if cfg.dedup in ("none", "consecutive") else "mask"
  if method == "positions":
    return _build_positions(log, req, cfg, counters)
  start, end = _windows(log, req, cfg, counters)
  # Steps 2-4 are masks over the windows, laid end to end; only the two
  # columns they read are copied out of the log, by slices.
  wstart = _offsets(end - start)
  action = _window_column(log.action, start, end)
  if cfg.dedup != "none":
    item = _window_column(log.item, start, end)
    m = dedup_mask(wstart, item, action, cfg.dedup)
    del item
    _add(counters, "dedup_dropped", m.size - m.sum())
    # Dropped events leave the quota's per-action lists: no compaction.
    np.copyto(action, -1, where=~m)
    del m
  m, kept = _quota_and_truncate(wstart, action, cfg, counters)
  del action
  return _gather_kept(log, m, wstart[:-1] - start, kept)


def _gather_kept(log, keep_w, shift, kept):
  """(offsets, columns, seg) of the events marked in `keep_w` (bool over
  the requests' windows laid end to end; window r's index = log position
  + `shift[r]`; `kept[r]` marked in window r): their log positions, then
  the one gather of every column."""
  idx = np.flatnonzero(keep_w)
  idx -= np.repeat(shift, kept)  # log positions
  cols = {k: v[idx] for k, v in log.columns().items()}  # the one gather
  del idx
  offsets = _offsets(kept)
  return offsets, cols, segment_ids(offsets)


def _window_column(col, start, end) -> np.ndarray:
  """`col` over the windows `[start, end)`, laid end to end."""
  parts = [col[s:e] for s, e in zip(start.tolist(), end.tolist(), strict=True)]
  return np.concatenate(parts) if parts else col[:0].copy()


def action_positions(log: EventLog, dedup: str) -> list[np.ndarray]:
  """Per action, the sorted log positions of its events that survive dedup.

  A property of the log (cached on it): "consecutive" dedup compares an
  event with the previous one of the same user, and every history window
  starts at its user's first event, so it is the same for all windows.
  """
  cache = log.__dict__.setdefault("_positions", {})
  if dedup not in cache:
    n = len(log)
    valid = np.ones(n, bool)
    if dedup == "consecutive" and n:
      valid[1:] = (
        (log.user[1:] != log.user[:-1])
        | (log.item[1:] != log.item[:-1])
        | (log.action[1:] != log.action[:-1])
      )
    elif dedup != "none":
      raise ValueError(f"no position index for dedup {dedup!r}")
    cache[dedup] = [
      np.flatnonzero(valid & (log.action == a)) for a in range(len(ACTIONS))
    ]
  return cache[dedup]


def _build_positions(log, req, cfg, counters):
  """Index-only building from per-action position lists (O2 + O4).

  Let P_a be the sorted log positions of the (dedup-surviving) events of
  action a. For a request with window [s, e), `searchsorted(P_a, e)` -
  `searchsorted(P_a, s)` counts its a-events, and the quota keeps the newest
  k_a of them: the slice P_a[hi_a - k_a : hi_a]. The max-length cut is a
  binary search, per request, for the position q above which exactly
  `max_seq_len` kept events remain (f(q) = sum_a hi_a - max(lo_a,
  searchsorted(P_a, q)) drops by one at each kept event). All of this is
  O(requests x log n); no pass over the raw window is needed except one
  over a byte mask to restore time order: kept positions are set in a
  per-window bool buffer and read back with `flatnonzero`.
  """
  start, end = _windows(log, req, cfg, counters)
  pos = action_positions(log, cfg.dedup)
  hi = np.stack([np.searchsorted(p, end) for p in pos], 1)  # [r, A]
  lo0 = np.stack([np.searchsorted(p, start) for p in pos], 1)
  counts = hi - lo0
  _add(counters, "dedup_dropped", (end - start).sum() - counts.sum())
  keep = quota_keep(counts, cfg)
  for i, name in enumerate(ACTIONS):
    _add(counters, f"quota_dropped_{name}", (counts[:, i] - keep[:, i]).sum())
  lo = hi - keep
  total = keep.sum(1)
  over = np.flatnonzero(total > cfg.max_seq_len)
  if over.size:
    _add(counters, "truncated_requests", over.size)
    _add(counters, "truncated_events", (total[over] - cfg.max_seq_len).sum())
    qa, qb = start[over].copy(), end[over].copy()
    lo_o, hi_o = lo[over], hi[over]

    def kept_from(q):  # kept events at positions >= q, per over-request
      f = np.zeros(q.shape, np.int64)
      for a, p in enumerate(pos):
        f += hi_o[:, a] - np.maximum(lo_o[:, a], np.searchsorted(p, q))
      return f

    # Largest q with kept_from(q) >= max_seq_len; then it equals it.
    while (qa < qb).any():
      mid = (qa + qb + 1) // 2
      ok = kept_from(mid) >= cfg.max_seq_len
      qa = np.where(ok, mid, qa)
      qb = np.where(ok, qb, mid - 1)
    lo[over] = np.maximum(
      lo_o, np.stack([np.searchsorted(p, qa) for p in pos], 1)
    )
  n_keep = (hi - lo).sum(1)
  # Time order: mark kept positions in a bool buffer over all windows.
  wstart = _offsets(end - start)
  shift = wstart[:-1] - start  # window buffer index = log position + shift
  buf = np.zeros(int(wstart[-1]), bool)
  for a, p in enumerate(pos):
    n_a = hi[:, a] - lo[:, a]
    kept = p[ranges(lo[:, a], hi[:, a])]
    buf[kept + np.repeat(shift, n_a)] = True
  return _gather_kept(log, buf, shift, n_keep)


def build_sequences_naive(log, req, cfg, counters=None):
  """Same result as `build_sequences`, copying every column after each step."""
  start, end = _windows(log, req, cfg, counters)
  idx = ranges(start, end)
  starts = _offsets(end - start)
  cols = {k: v[idx] for k, v in log.columns().items()}  # copy 1: anti-leakage
  del idx
  if cfg.dedup != "none":
    m = dedup_mask(starts, cols["item"], cols["action"], cfg.dedup)
    _add(counters, "dedup_dropped", m.size - m.sum())
    cols = {k: np.compress(m, v) for k, v in cols.items()}  # copy 2: dedup
    starts = _offsets(segment_counts(m, starts))
  m, kept = _quota_and_truncate(starts, cols["action"], cfg, counters)
  cols = {k: np.compress(m, v) for k, v in cols.items()}  # copy 3: quota
  starts = _offsets(kept)
  return starts, cols, segment_ids(starts)


def seq_features(offsets, cols, seg, req_ts, cfg) -> dict[str, np.ndarray]:
  """The `seq` columns of a JaggedBatch from built columns (int32[t] each)."""
  first = np.zeros(seg.shape[0], bool)
  first[offsets[:-1][np.diff(offsets) > 0]] = True
  ctx = features.context_features(
    cols["ts"], first, np.asarray(req_ts, np.int64)[seg], cols["price"], cfg
  )
  return {
    "item_id": cols["item"].astype(np.int32, copy=False),
    "category_id": cols["category"].astype(np.int32, copy=False),
    "action": cols["action"].astype(np.int32),
    "ts_delta": ctx["ts_delta"],
    "ts_to_req": ctx["ts_to_req"],
    "price": ctx["price"],
  }


def assemble(req: Requests, offsets, cols, seg, cfg, labels=None):
  """A JaggedBatch with exact capacities from built sequences and requests."""
  from gemjax.data.jagged import JaggedBatch

  return JaggedBatch(
    offsets=offsets.astype(np.int32),
    seq=seq_features(offsets, cols, seg, req.ts, cfg),
    cand_offsets=req.cand_offsets.astype(np.int32),
    cand=cand_features(req, cfg),
    labels=(req.labels if labels is None else labels).astype(np.float32),
    user_id=req.user_row.astype(np.int32),
    dense=req.dense.astype(np.float32),
  )


def cand_features(req: Requests, cfg) -> dict[str, np.ndarray]:
  return {
    "item_id": req.cand_item.astype(np.int32),
    "category_id": req.cand_category.astype(np.int32),
    "price": features.log_bucket(
      req.cand_price, cfg.price_bucket_base, cfg.price_buckets
    ),
  }
