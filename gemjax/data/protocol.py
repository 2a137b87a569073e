"""Offline evaluation protocols for real logs: requests, negatives, splits.

A real log says what each user did and when; ranking needs requests ("rank
these candidates for this user at this time") and a held-out set that a
practitioner would trust. This module turns a sorted `EventLog` into train
and eval `Requests` under one of three protocols (`DataConfig.protocol`):

- "temporal" (default for real logs): a cut time splits the log; requests
  before it train, requests at or after it evaluate, for the same users
  (their histories hold everything before each request, across the cut, as
  a serving system would see it). The cut is `split_time`, or the time
  before which `1 - eval_frac` of the events fall.
- "leave_one_out": the next-item protocol of SASRec and BERT4Rec. Each
  user's last event is the held-out positive, ranked among `loo_negatives`
  sampled items (HR@K and NDCG@K beside AUC); every earlier event trains.
- "user": users whose hash falls in `eval_frac` are held out whole. Their
  features carry nothing learned about them to evaluation: a cold-start
  protocol, kept for comparison, named as such.

Requests. A user's events are cut into requests at session gaps longer
than `session_gap_s`, at the cut time, and after every `k = max_cands -
neg_per_request` distinct items. A request's time is its first event's, so
its history (built later by `build.py`, strictly before that time) holds
every earlier request's events; its candidates are its distinct items,
labelled by what the user did with them (click = any action but an
impression, conversion = an order). A user's first request has an empty
history; it is kept (counted as `empty_history` when built).

Negatives. Items a user never touched, anywhere in the log, sampled per
request (`negatives`: "popularity", by training-period event counts, or
"uniform" over the log's items): never the user's history, never another
candidate of the request, so no model can learn "already seen" instead of
preference. Real impressions (events whose action is an impression, e.g.
low MovieLens ratings) are candidates with label 0 as they come: they are
production ranking's negatives. Counters: `cand_clicked`,
`cand_impressions` (real negatives), `cand_sampled`, and `neg_unfilled`
(slots left empty for a user who touched almost every item).

Legend: `n` events, `r` requests, `c` candidates.
"""

import numpy as np

from gemjax.data.config import ACTION_ID, DataConfig
from gemjax.data.events import EventLog, Requests, hash_rows

PROTOCOLS = ("temporal", "leave_one_out", "user")


def split_requests(
  log: EventLog, cfg: DataConfig, source: str = "", counters=None
) -> tuple[Requests, Requests]:
  """(train, eval) `Requests` of `log` under `cfg.protocol`."""
  if len(log) == 0:
    raise ValueError(f"{source or 'event log'}: no events to build requests")
  counters = {} if counters is None else counters
  n = len(log)
  users, starts = log.users
  last = starts[1:] - 1  # each user's last event
  train_ev = np.ones(n, bool)
  cut = None
  if cfg.protocol == "temporal":
    cut = temporal_cut(log, cfg)
    counters["split_time"] = cut
    train_ev = log.ts < cut
  elif cfg.protocol == "leave_one_out":
    train_ev[last] = False
  elif cfg.protocol == "user":
    held_user = _held_users(users, cfg)
    train_ev = ~np.repeat(held_user, np.diff(starts))
  else:
    raise ValueError(f"protocol={cfg.protocol!r}: one of {PROTOCOLS}")

  popular = np.flatnonzero(train_ev)  # events whose items negatives copy
  if not popular.size:
    raise ValueError(
      f"{source or 'event log'}: protocol {cfg.protocol!r} leaves no "
      "training events"
    )
  sampler = _NegativeSampler(log, popular, cfg)
  k = cfg.max_cands - cfg.neg_per_request
  if cfg.protocol == "leave_one_out":
    train = _chunk_requests(log, train_ev, k, cfg, cut=None)
    eval_ = _last_event_requests(log, last)
    n_eval_neg = cfg.loo_negatives
  else:
    every = _chunk_requests(log, np.ones(n, bool), k, cfg, cut=cut)
    held = ~train_ev[every.first_event]
    train, eval_ = (
      every.take(np.flatnonzero(~held)),
      every.take(np.flatnonzero(held)),
    )
    n_eval_neg = cfg.neg_per_request
  if not len(train.user):
    raise ValueError(f"{source or 'event log'}: no training requests")
  if not len(eval_.user):
    raise ValueError(
      f"{source or 'event log'}: protocol {cfg.protocol!r} leaves no "
      "held-out requests; lower the split time or raise eval_frac"
    )
  out = []
  for name, part, neg, tag in (
    ("train", train, cfg.neg_per_request, 1),
    ("eval", eval_, n_eval_neg, 2),
  ):
    req = sampler.add(part, neg, tag, counters, name)
    counters[f"requests_{name}"] = len(req)
    out.append(_finish(req, log, cfg, source))
  return out[0], out[1]


def temporal_cut(log: EventLog, cfg: DataConfig) -> int:
  """The split time: `cfg.split_time`, or the `1 - eval_frac` quantile of
  the events' times (at least one event on each side when it can)."""
  if cfg.split_time:
    return int(cfg.split_time)
  ts = np.sort(log.ts)
  i = int(np.clip(round(len(ts) * (1 - cfg.eval_frac)), 1, len(ts) - 1))
  return int(ts[i])


def _held_users(users, cfg) -> np.ndarray:
  return hash_rows(users ^ 0x5EED, 1000) < round(1000 * cfg.eval_frac)


class _Chunks:
  """Requests before negatives: per request its user, time, first event,
  and its candidate events (one per distinct item, with labels)."""

  def __init__(self, user, ts, first_event, cand_offsets, cand_event, labels):
    self.user, self.ts, self.first_event = user, ts, first_event
    self.cand_offsets, self.cand_event, self.labels = (
      cand_offsets,
      cand_event,
      labels,
    )

  def take(self, idx) -> "_Chunks":
    lo, hi = self.cand_offsets[idx], self.cand_offsets[idx + 1]
    from gemjax.data.events import ranges

    cidx = ranges(lo, hi)
    return _Chunks(
      self.user[idx],
      self.ts[idx],
      self.first_event[idx],
      np.r_[0, np.cumsum(hi - lo)].astype(np.int64),
      self.cand_event[cidx],
      self.labels[cidx],
    )


def _chunk_requests(log, use, k, cfg, cut) -> _Chunks:
  """Requests of the events marked `use`: sessions (and the cut) split a
  user's timeline; each session's distinct items, in order of first
  appearance, form requests of at most `k` items."""
  u, t = log.user, log.ts
  ev = np.flatnonzero(use)
  uu, tt = u[ev], t[ev]
  m = ev.size
  brk = np.ones(m, bool)
  if m > 1:
    brk[1:] = (uu[1:] != uu[:-1]) | (tt[1:] - tt[:-1] > cfg.session_gap_s)
    if cut is not None:
      brk[1:] |= (tt[1:] >= cut) & (tt[:-1] < cut)
  sess = np.cumsum(brk) - 1
  # Distinct (session, item), first appearance first; labels are the max
  # over the item's events in the session.
  item = log.item[ev].astype(np.int64)
  order = np.lexsort((np.arange(m), item, sess))
  ks, ki = sess[order], item[order]
  grp = np.ones(m, bool)
  if m > 1:
    grp[1:] = (ks[1:] != ks[:-1]) | (ki[1:] != ki[:-1])
  gs = np.flatnonzero(grp)
  act = log.action[ev][order].astype(np.int64)
  click = np.maximum.reduceat(act > ACTION_ID["impression"], gs)
  conv = np.maximum.reduceat(act == ACTION_ID["order"], gs)
  first = order[gs]  # index into ev of each (session, item)'s first event
  o2 = np.argsort(first, kind="stable")  # back to time order
  first, click, conv = first[o2], click[o2], conv[o2]
  c_sess = sess[first]
  new_sess = np.ones(first.size, bool)
  new_sess[1:] = c_sess[1:] != c_sess[:-1]
  pos = np.arange(first.size)
  rank = pos - np.maximum.accumulate(np.where(new_sess, pos, 0))
  new_req = new_sess | (rank % k == 0)
  c_req = np.cumsum(new_req) - 1
  req_first = ev[first[new_req]]  # log index of each request's first event
  counts = np.bincount(c_req, minlength=req_first.size)
  labels = np.stack([click, conv], 1).astype(np.float32)
  return _Chunks(
    user=u[req_first],
    ts=t[req_first],
    first_event=req_first,
    cand_offsets=np.r_[0, np.cumsum(counts)].astype(np.int64),
    cand_event=ev[first],
    labels=labels,
  )


def _last_event_requests(log, last) -> _Chunks:
  """One request per user: the last event, labelled a click (the next item
  the user chose) and a conversion if it was an order."""
  r = last.size
  labels = np.ones((r, 2), np.float32)
  labels[:, 1] = log.action[last] == ACTION_ID["order"]
  return _Chunks(
    user=log.user[last],
    ts=log.ts[last],
    first_event=last,
    cand_offsets=np.arange(r + 1, dtype=np.int64),
    cand_event=last,
    labels=labels,
  )


class _NegativeSampler:
  """Items a user never touched, by popularity or uniformly."""

  ROUNDS = 32  # redraws of slots that hit a touched item

  def __init__(self, log: EventLog, popular_events, cfg: DataConfig):
    self.log, self.cfg = log, cfg
    users, starts = log.users
    rank = np.repeat(np.arange(users.size, dtype=np.int64), np.diff(starts))
    self.users = users
    # Sorted (user rank, item) keys of every event: "touched" lookups.
    self.touched = np.unique((rank << 32) | log.item.astype(np.int64))
    if cfg.negatives == "popularity":
      self.pool = popular_events  # one event per draw: popularity-weighted
    else:  # uniform over the log's distinct items (one event each)
      _, first = np.unique(log.item, return_index=True)
      self.pool = first
    self.seed = cfg.seed

  def add(self, ch: _Chunks, neg: int, tag: int, counters, name) -> Requests:
    r = ch.user.size
    log = self.log
    npos = np.diff(ch.cand_offsets)
    imp = ch.labels[:, 0] == 0
    counters[f"cand_clicked_{name}"] = int((~imp).sum())
    counters[f"cand_impressions_{name}"] = int(imp.sum())
    rank = np.searchsorted(self.users, ch.user)
    rng = np.random.default_rng([self.seed, 11, tag])
    draw = np.full((r, neg), -1, np.int64)  # event index of each negative
    todo = np.ones((r, neg), bool)
    for _ in range(self.ROUNDS):
      if not todo.any():
        break
      rows, cols = np.nonzero(todo)
      ev = self.pool[rng.integers(0, self.pool.size, rows.size)]
      key = (rank[rows] << 32) | log.item[ev].astype(np.int64)
      at = np.minimum(np.searchsorted(self.touched, key), self.touched.size - 1)
      ok = self.touched[at] != key
      # Two draws of one request may pick the same item: keep the first.
      if neg > 1:
        taken = draw[rows]
        same = (taken >= 0) & (
          log.item[np.maximum(taken, 0)] == log.item[ev][:, None]
        )
        ok &= ~same.any(1)
        dup = np.zeros(rows.size, bool)
        pair = rows * (1 << 32) + log.item[ev].astype(np.int64)
        _, first = np.unique(pair, return_index=True)
        dup[:] = True
        dup[first] = False
        ok &= ~dup
      draw[rows[ok], cols[ok]] = ev[ok]
      todo[rows[ok], cols[ok]] = False
    filled = ~todo
    counters[f"cand_sampled_{name}"] = int(filled.sum())
    if todo.any():
      counters[f"neg_unfilled_{name}"] = int(todo.sum())
    nneg = filled.sum(1)
    per = npos + nneg
    off = np.r_[0, np.cumsum(per)].astype(np.int64)
    total = int(off[-1])
    cand_ev = np.empty(total, np.int64)
    labels = np.zeros((total, 2), np.float32)
    req_of_pos = np.repeat(np.arange(r), npos)
    pos_slot = off[req_of_pos] + (
      np.arange(npos.sum()) - ch.cand_offsets[req_of_pos]
    )
    cand_ev[pos_slot] = ch.cand_event
    labels[pos_slot] = ch.labels
    # Negatives follow each request's positives, in draw order.
    neg_rank = np.cumsum(filled, 1) - 1
    rows, cols = np.nonzero(filled)
    cand_ev[off[rows] + npos[rows] + neg_rank[rows, cols]] = draw[rows, cols]
    return Requests(
      user=ch.user.astype(np.int64),
      ts=ch.ts.astype(np.int64),
      user_row=np.zeros(r, np.int32),  # set by _finish
      dense=np.zeros((r, 0), np.float32),
      cand_offsets=off,
      cand_item=log.item[cand_ev].astype(np.int32),
      cand_category=log.category[cand_ev].astype(np.int32),
      cand_price=log.price[cand_ev].astype(np.float32),
      labels=labels,
      line=ch.first_event,  # replaced by source lines in _finish
    )


def _finish(req: Requests, log: EventLog, cfg, source) -> Requests:
  """User rows, dense context (hour of day, day of week) and source lines."""
  r = len(req)
  ts = req.ts
  dense = np.zeros((r, cfg.num_dense), np.float32)
  if cfg.num_dense > 0:
    dense[:, 0] = (ts % 86_400) / 86_400
  if cfg.num_dense > 1:
    dense[:, 1] = ((ts // 86_400 + 3) % 7) / 7  # 1970-01-01 was a Thursday
  lines = log.extra.get("line")
  first = req.line
  return Requests(
    **{
      **req.__dict__,
      "user_row": hash_rows(req.user, cfg.num_users),
      "dense": dense,
      "source": source,
      "line": None if lines is None else lines[first],
    }
  )
