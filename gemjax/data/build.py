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


def newest_mask(seg, groups, keep_rg, num_groups: int) -> np.ndarray:
  """bool[t]: within each (seg, group) keep the newest keep_rg[seg, group].

  Inputs in time order inside each segment. Rank from the newest event of a
  (seg, group) run is computed with one cumulative sum per group value.
  """
  n = seg.shape[0]
  mask = np.zeros(n, bool)
  for g in range(num_groups):
    m = groups == g
    if not m.any():
      continue
    c = np.cumsum(m)  # events of group g up to and including here
    ends = np.cumsum(np.bincount(seg[m], minlength=keep_rg.shape[0]))
    from_newest = ends[seg] - c  # 0 for the newest event of its run
    mask |= m & (from_newest < keep_rg[seg, g])
  return mask


def _quota_and_truncate(seg, action, cfg, r, counters):
  """bool[t]: events kept by the action quota, then the max length cut."""
  a = len(ACTIONS)
  counts = np.bincount(seg * a + action, minlength=r * a).reshape(r, a)
  keep = quota_keep(counts, cfg)
  for i, name in enumerate(ACTIONS):
    _add(counters, f"quota_dropped_{name}", (counts[:, i] - keep[:, i]).sum())
  mask = newest_mask(seg, action, keep, a)
  # Max length, newest kept.
  kept = keep.sum(1)
  over = kept > cfg.max_seq_len
  if over.any():
    _add(counters, "truncated_requests", over.sum())
    _add(counters, "truncated_events", (kept[over] - cfg.max_seq_len).sum())
    cap = np.full((r, 1), cfg.max_seq_len, np.int64)
    mask &= newest_mask(seg, np.where(mask, 0, 1), cap, 1)
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
  log: EventLog, req: Requests, cfg: DataConfig, counters=None
):
  """Index-only building (O4). Returns (offsets int64[r+1], columns, seg).

  columns: the log's columns gathered once at the kept events (`ts`, `item`,
  `category`, `action`, `price`, extras); seg int64[t]: request of each event.
  """
  r = len(req)
  start, end = _windows(log, req, cfg, counters)
  idx = ranges(start, end)  # the one index array
  seg = np.repeat(np.arange(r, dtype=np.int64), end - start)
  if cfg.dedup != "none":
    m = dedup_mask(seg, log.item[idx], log.action[idx], cfg.dedup)
    _add(counters, "dedup_dropped", m.size - m.sum())
    idx, seg = idx[m], seg[m]
  m = _quota_and_truncate(
    seg, log.action[idx].astype(np.int64), cfg, r, counters
  )
  idx, seg = idx[m], seg[m]
  cols = {k: v[idx] for k, v in log.columns().items()}  # the one gather
  return segment_starts(seg, r), cols, seg


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
  m = _quota_and_truncate(
    seg, cols["action"].astype(np.int64), cfg, r, counters
  )
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
    "item_id": cols["item"].astype(np.int32),
    "category_id": cols["category"].astype(np.int32),
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
