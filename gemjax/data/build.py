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

Index-only building (O4): steps 1-4 only ever produce a new *index array*
(int64 positions into the log) and read the one or two columns they need
through it; step 5 is the single gather of all feature columns. The naive
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


def segment_starts(seg: np.ndarray, num: int) -> np.ndarray:
  """Offsets int64[num+1] of a sorted segment-id array."""
  counts = np.bincount(seg, minlength=num)
  return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def dedup_mask(seg, item, action, rule: str) -> np.ndarray:
  """bool[t]: events that survive the dedup rule (inputs in time order)."""
  n = seg.shape[0]
  if rule == "none" or n == 0:
    return np.ones(n, bool)
  if rule == "consecutive":
    keep = np.ones(n, bool)
    keep[1:] = (
      (seg[1:] != seg[:-1])
      | (item[1:] != item[:-1])
      | (action[1:] != action[:-1])
    )
    return keep
  # Keep the newest per group: sort by (seg, group, position), last of a run.
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


def newest_mask(seg, group, keep_rg, counts_rg=None) -> np.ndarray:
  """bool[t]: in each (seg, group) run keep its newest keep_rg[seg, group].

  seg: int[t] sorted, events in time order inside a segment; group: small
  ints (int8) in [0, G); keep_rg: int[r, G]. One stable counting sort by
  group (numpy's radix sort for 8-bit keys) ranks every event among all
  events of its group in array order; a (seg, group) run is then a
  contiguous rank interval ending at end[seg, group] (exclusive), so event i
  is among the newest k of its run iff rank_i >= end[seg_i, group_i] - k.
  """
  r, g = keep_rg.shape
  n = seg.shape[0]
  if counts_rg is None:
    counts_rg = np.bincount(seg * g + group, minlength=r * g).reshape(r, g)
  order = np.argsort(group, kind="stable")
  rank = np.empty(n, np.int64)
  rank[order] = np.arange(n)
  group_start = np.concatenate([[0], np.cumsum(counts_rg.sum(0))[:-1]])
  end = np.cumsum(counts_rg, axis=0) + group_start[None, :]
  thresh = (end - keep_rg).reshape(-1)
  return rank >= thresh[seg * g + group]


def _quota_and_truncate(seg, action, cfg, r, counters):
  """bool[t]: events kept by the action quota, then the max length cut."""
  a = len(ACTIONS)
  action = action.astype(np.int8)
  counts = np.bincount(seg * a + action, minlength=r * a).reshape(r, a)
  keep = quota_keep(counts, cfg)
  for i, name in enumerate(ACTIONS):
    _add(counters, f"quota_dropped_{name}", (counts[:, i] - keep[:, i]).sum())
  mask = newest_mask(seg, action, keep, counts)
  # Max length, newest kept: rank kept events inside their segment.
  kept = keep.sum(1)
  over = kept > cfg.max_seq_len
  if over.any():
    _add(counters, "truncated_requests", over.sum())
    _add(counters, "truncated_events", (kept[over] - cfg.max_seq_len).sum())
    c = np.cumsum(mask)  # kept events up to and including here
    mask &= c > (np.cumsum(kept) - cfg.max_seq_len)[seg]
  return mask


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
  method: "mask" (any dedup rule: masks over the window index array),
  "positions" (dedup "none" / "consecutive": per-action position lists of
  the log, see `_build_positions`), "auto" (positions when it applies).
  """
  if method == "auto":
    method = "positions" if cfg.dedup in ("none", "consecutive") else "mask"
  if method == "positions":
    return _build_positions(log, req, cfg, counters)
  r = len(req)
  start, end = _windows(log, req, cfg, counters)
  idx = ranges(start, end)  # the one index array
  seg = np.repeat(np.arange(r, dtype=np.int64), end - start)
  if cfg.dedup != "none":
    m = dedup_mask(seg, log.item[idx], log.action[idx], cfg.dedup)
    _add(counters, "dedup_dropped", m.size - m.sum())
    idx, seg = idx[m], seg[m]
  m = _quota_and_truncate(seg, log.action[idx], cfg, r, counters)
  idx, seg = idx[m], seg[m]
  cols = {k: v[idx] for k, v in log.columns().items()}  # the one gather
  return segment_starts(seg, r), cols, seg


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
  r = len(req)
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
  wlen = end - start
  wstart = np.cumsum(wlen) - wlen
  shift = wstart - start  # window buffer index = log position + shift[r]
  buf = np.zeros(int(wlen.sum()), bool)
  for a, p in enumerate(pos):
    n_a = hi[:, a] - lo[:, a]
    kept = p[ranges(lo[:, a], hi[:, a])]
    buf[kept + np.repeat(shift, n_a)] = True
  flat = np.flatnonzero(buf)
  del buf
  seg = np.repeat(np.arange(r, dtype=np.int64), n_keep)
  idx = flat - np.repeat(shift, n_keep)
  cols = {k: v[idx] for k, v in log.columns().items()}  # the one gather
  offsets = np.concatenate([[0], np.cumsum(n_keep)]).astype(np.int64)
  return offsets, cols, seg


def build_sequences_naive(log, req, cfg, counters=None):
  """Same result as `build_sequences`, copying every column after each step."""
  r = len(req)
  start, end = _windows(log, req, cfg, counters)
  idx = ranges(start, end)
  seg = np.repeat(np.arange(r, dtype=np.int64), end - start)
  cols = {k: v[idx] for k, v in log.columns().items()}  # copy 1: anti-leakage
  del idx
  if cfg.dedup != "none":
    m = dedup_mask(seg, cols["item"], cols["action"], cfg.dedup)
    _add(counters, "dedup_dropped", m.size - m.sum())
    cols = {k: v[m] for k, v in cols.items()}  # copy 2: dedup
    seg = seg[m]
  m = _quota_and_truncate(seg, cols["action"], cfg, r, counters)
  cols = {k: v[m] for k, v in cols.items()}  # copy 3: quota
  seg = seg[m]
  return segment_starts(seg, r), cols, seg


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
