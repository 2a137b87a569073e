"""Ranking metrics: AUC, UAUC, NE, calibration, log loss (O14), on the host.

These are evaluation metrics, computed exactly in numpy (float64 / int64) from
labels and predicted probabilities pulled off the device, at evaluation time
and once per logging interval. One sort per call, so ~1e6 predictions take a
fraction of a second.

AUC (ROC area under the curve)
  The probability that a random positive scores above a random negative,
  ties counting one half:

    AUC = sum_{i in pos, j in neg} w_i w_j ([s_i > s_j] + 1/2 [s_i = s_j])
          / (W_pos W_neg)

  Enumerating all pairs is O(P N). Sorting once makes it O(n log n): walk
  the distinct scores upward in tie groups g; every positive of group g beats
  all negatives of lower groups and ties with the negatives of its own group,

    U = sum_g pos_g (neg_below_g + neg_g / 2),   AUC = U / (W_pos W_neg).

  With unit weights this is the Mann-Whitney U statistic computed from
  average ranks (each tied row gets the mean of the ranks its group spans):
  U = R_pos - P (P + 1) / 2 with R_pos the sum of the positives' average
  ranks. Counting per tie group gives the same number without forming ranks.
  AUC is only defined when both classes are present; otherwise it is NaN.
  AUC only looks at the order of scores, so logits work as well as
  probabilities.

UAUC (user AUC, "per-user AUC averaged")
  A ranking model orders the candidates of one user, so comparing one user's
  positive with another user's negative says little about serving. UAUC
  computes AUC inside each user and averages over the users that have both a
  positive and a negative (others have no pairs and are skipped; the count of
  users that did contribute is returned too). The seeds' UAUC is the plain
  mean over users; `weighted=True` gives the impression-weighted mean (each
  user weighted by its number of rows), which is what some papers call GAUC.
  Vectorised: one lexsort by (user, score), tie groups inside users, then
  per-user sums with `np.add.reduceat`; counts stay int64, so it is exact.

NE (normalized entropy, Meta's quality metric)
  The mean log loss divided by the entropy of the base rate p = mean(y):

    NE = mean_i(-y_i log q_i - (1 - y_i) log(1 - q_i))
         / (-p log p - (1 - p) log(1 - p))

  The denominator is the log loss of the best constant prediction, q_i = p.
  So NE = 1 means "no better than predicting the click rate", NE < 1 beats
  it, and lower is better. Unlike AUC, NE also punishes miscalibration.
  Probabilities are clipped to [eps, 1 - eps] so a confident mistake costs
  -log(eps) instead of infinity. NE is NaN when all labels are equal (the
  base-rate entropy is 0).

Calibration
  mean(q) / mean(y): 1 means the model predicts as many events as happen;
  > 1 over-predicts. NaN when there are no positives.

Shapes (legend): `n` rows (predictions), `k` tasks (CTR, CVR, ...),
`b` requests, `c` candidate slots. Multi-task helpers take labels and probs
as [n, k], user ids as [n] and an optional bool `mask` [n] that selects the
real rows (padded candidate slots of a jagged batch must be excluded: see
`candidate_rows`). Inputs may be numpy or (fully addressable) JAX arrays; for
a multi-host run gather them first (e.g.
`jax.experimental.multihost_utils.process_allgather`).

Bad input raises `ValueError` naming the argument and the first bad index:
mismatched lengths, labels outside {0, 1}, probabilities outside [0, 1] or
NaN, NaN scores, negative or non-finite weights.
"""

from collections.abc import Mapping, Sequence

import numpy as np

Metrics = dict[str, dict[str, float | int]]


# ---------------------------------------------------------------- validation


def _first_bad(bad: np.ndarray) -> tuple[int, ...] | int | None:
  """Index of the first True in `bad` (an int for 1-D), or None."""
  if not bad.any():
    return None
  idx = tuple(int(i) for i in np.argwhere(bad)[0])
  return idx[0] if len(idx) == 1 else idx


def _fmt_index(idx) -> str:
  if isinstance(idx, tuple):
    return ", ".join(str(i) for i in idx)
  return str(idx)


def _as_array(name: str, x, ndim: int) -> np.ndarray:
  a = np.asarray(x)
  if a.ndim != ndim:
    raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
  return a


def _check_same_rows(**arrays: np.ndarray) -> None:
  (first, a0), *rest = arrays.items()
  for name, a in rest:
    if a.shape[0] != a0.shape[0]:
      raise ValueError(
        f"{name} has {a.shape[0]} rows but {first} has {a0.shape[0]}"
      )


def _check_labels(y: np.ndarray, name: str = "labels", where=None) -> None:
  bad = (y != 0) & (y != 1)  # NaN is bad too
  if where is not None:
    bad &= where
  i = _first_bad(bad)
  if i is not None:
    raise ValueError(f"{name}[{_fmt_index(i)}] = {y[i].item()!r} is not 0 or 1")


def _check_probs(q: np.ndarray, name: str = "probs", where=None) -> None:
  bad = ~((q >= 0) & (q <= 1))  # NaN fails both comparisons
  if where is not None:
    bad &= where
  i = _first_bad(bad)
  if i is not None:
    raise ValueError(
      f"{name}[{_fmt_index(i)}] = {q[i].item()!r} is not a probability "
      "in [0, 1]"
    )


def _check_scores(s: np.ndarray, name: str = "scores") -> None:
  i = _first_bad(np.isnan(s))
  if i is not None:
    raise ValueError(f"{name}[{_fmt_index(i)}] is NaN")


def _check_weights(w: np.ndarray, name: str = "weights") -> None:
  i = _first_bad(~(np.isfinite(w) & (w >= 0)))
  if i is not None:
    raise ValueError(
      f"{name}[{_fmt_index(i)}] = {w[i].item()!r} is not a finite weight >= 0"
    )


def _binary_inputs(labels, probs, name_q="probs", check=_check_probs):
  y = _as_array("labels", labels, 1)
  q = _as_array(name_q, probs, 1)
  _check_same_rows(labels=y, **{name_q: q})
  _check_labels(y)
  check(q, name_q)
  return y.astype(np.float64), q.astype(np.float64)


# ------------------------------------------------------------------- metrics


def auc(labels, scores, weights=None) -> float:
  """ROC AUC of `scores` [n] for binary `labels` [n]; ties count 1/2.

  `weights` [n] (optional, >= 0) weight each row; a pair counts w_i w_j.
  Returns NaN when one class (or both) has zero total weight.
  """
  y, s = _binary_inputs(labels, scores, "scores", _check_scores)
  if weights is None:
    w = np.ones_like(y)
  else:
    w = _as_array("weights", weights, 1)
    _check_same_rows(labels=y, weights=w)
    _check_weights(w)
    w = w.astype(np.float64)
  if y.size == 0:
    return float("nan")
  order = np.argsort(s, kind="stable")
  s, y, w = s[order], y[order], w[order]
  # Tie groups: runs of equal scores in sorted order.
  starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
  pos_g = np.add.reduceat(w * y, starts)
  neg_g = np.add.reduceat(w * (1.0 - y), starts)
  w_pos, w_neg = pos_g.sum(), neg_g.sum()
  if w_pos <= 0 or w_neg <= 0:
    return float("nan")
  neg_below = np.cumsum(neg_g) - neg_g
  u = np.dot(pos_g, neg_below + 0.5 * neg_g)
  return float(u / (w_pos * w_neg))


def _per_user_auc(y: np.ndarray, s: np.ndarray, user: np.ndarray):
  """(AUC, rows) of each user with both classes; int labels y, scores s."""
  order = np.lexsort((s, user))  # by user, then score
  y, s, user = y[order], s[order], user[order]
  new_user = np.concatenate([[True], user[1:] != user[:-1]])
  new_group = new_user | np.concatenate([[True], s[1:] != s[:-1]])
  g_starts = np.flatnonzero(new_group)
  pos_g = np.add.reduceat(y, g_starts)  # int64 counts per tie group
  neg_g = (np.diff(np.append(g_starts, y.size))) - pos_g
  # Negatives below each group, within its user: the global running count
  # minus the running count at the user's first group.
  user_of_group = np.cumsum(new_user)[g_starts] - 1
  first_group = np.flatnonzero(new_user[g_starts])
  run = np.cumsum(neg_g) - neg_g
  neg_below = run - run[first_group][user_of_group]
  u2 = pos_g * (2 * neg_below + neg_g)  # 2U per group, exact in int64
  two_u = np.add.reduceat(u2, first_group)
  pos_u = np.add.reduceat(pos_g, first_group)
  rows_u = np.diff(np.append(np.flatnonzero(new_user), y.size))
  neg_u = rows_u - pos_u
  both = (pos_u > 0) & (neg_u > 0)
  auc_u = two_u[both] / (2.0 * pos_u[both] * neg_u[both])
  return auc_u, rows_u[both]


def uauc(labels, scores, user_ids, weighted: bool = False) -> tuple[float, int]:
  """Per-user AUC averaged over users with both classes.

  Returns (UAUC, number of users that counted). `weighted=False` is the
  plain mean over users (the seeds' definition); `weighted=True` weights
  each user by its number of rows (impressions). NaN, 0 when no user has
  both a positive and a negative.
  """
  y, s = _binary_inputs(labels, scores, "scores", _check_scores)
  user = _as_array("user_ids", user_ids, 1)
  _check_same_rows(labels=y, user_ids=user)
  if y.size == 0:
    return float("nan"), 0
  auc_u, rows_u = _per_user_auc(y.astype(np.int64), s, user)
  if auc_u.size == 0:
    return float("nan"), 0
  if weighted:
    value = np.dot(auc_u, rows_u) / rows_u.sum()
  else:
    value = auc_u.mean()
  return float(value), int(auc_u.size)


def log_loss(labels, probs, eps: float = 1e-7) -> float:
  """Mean binary cross-entropy (nats), probs clipped to [eps, 1 - eps]."""
  y, q = _binary_inputs(labels, probs)
  if y.size == 0:
    return float("nan")
  return float(_mean_log_loss(y, q, eps))


def _mean_log_loss(y: np.ndarray, q: np.ndarray, eps: float) -> float:
  q = np.clip(q, eps, 1.0 - eps)
  return float(-np.mean(y * np.log(q) + (1.0 - y) * np.log1p(-q)))


def normalized_entropy(labels, probs, eps: float = 1e-7) -> float:
  """Log loss / entropy of the base rate; < 1 beats predicting the base rate.

  NaN when all labels are equal (or there are none): the base-rate entropy
  is then 0 and there is nothing to normalize by.
  """
  y, q = _binary_inputs(labels, probs)
  if y.size == 0:
    return float("nan")
  p = y.mean()
  if p == 0.0 or p == 1.0:
    return float("nan")
  h = -(p * np.log(p) + (1.0 - p) * np.log1p(-p))
  return float(_mean_log_loss(y, q, eps) / h)


def calibration(labels, probs) -> float:
  """mean(probs) / mean(labels); 1 is calibrated, NaN with no positives."""
  y, q = _binary_inputs(labels, probs)
  positives = y.sum()
  if positives == 0:
    return float("nan")
  return float(q.sum() / positives)


def hit_rate_ndcg(labels, scores, groups, k: int) -> tuple[float, float, int]:
  """(HR@k, NDCG@k, groups counted) of ranking each group's rows by score.

  The next-item protocol (leave-one-out): each group (a request) holds one
  positive among sampled negatives. Its rank is the number of its group's
  negatives scored above it plus half of those tied with it (so a constant
  scorer is not credited with a lucky tie order); HR@k counts rank < k,
  NDCG@k adds 1 / log2(rank + 2) there. A group with several positives
  counts each against the negatives alone (as if each were the only one)
  and averages; groups without a positive or a negative are skipped.
  """
  y, s = _binary_inputs(labels, scores, "scores", _check_scores)
  g = _as_array("groups", groups, 1)
  _check_same_rows(labels=y, groups=g)
  order = np.lexsort((-s, g))
  y, s, g = y[order], s[order], g[order]
  new = np.r_[True, g[1:] != g[:-1]] if g.size else np.zeros(0, bool)
  gid = np.cumsum(new) - 1
  neg = 1.0 - y
  # Negatives strictly above each row within its group: sorted by score
  # descending, count negatives before the row's tie run.
  n_groups = int(gid[-1]) + 1 if gid.size else 0
  tie = new | np.r_[True, s[1:] != s[:-1]] if g.size else new
  run = np.cumsum(tie) - 1
  neg_run = np.bincount(run, neg, minlength=run[-1] + 1 if run.size else 0)
  before = np.cumsum(neg_run) - neg_run  # negatives in earlier runs
  start_run = run[np.flatnonzero(new)]
  before_group = np.cumsum(neg_run)[start_run] - neg_run[start_run]
  above = before[run] - before_group[gid]
  rank = above + 0.5 * neg_run[run]
  pos_g = np.bincount(gid, y, minlength=n_groups)
  neg_g = np.bincount(gid, neg, minlength=n_groups)
  ok = (pos_g > 0) & (neg_g > 0)
  hit = (rank < k) & (y > 0)
  gain = np.where(hit, 1.0 / np.log2(rank + 2.0), 0.0)
  hr_g = np.bincount(gid, hit.astype(np.float64), minlength=n_groups)
  nd_g = np.bincount(gid, gain, minlength=n_groups)
  if not ok.any():
    return float("nan"), float("nan"), 0
  hr = float(np.mean(hr_g[ok] / pos_g[ok]))
  nd = float(np.mean(nd_g[ok] / pos_g[ok]))
  return hr, nd, int(ok.sum())


# --------------------------------------------------------------- multi-task


def task_metrics(
  labels,
  probs,
  user_ids,
  tasks: Sequence[str] = ("ctr", "cvr"),
  mask=None,
) -> Metrics:
  """All metrics per task for labels/probs [n, k], user_ids [n], mask [n].

  Returns {task: {auc, uauc, uauc_users, ne, calibration, log_loss, count,
  positives}}. Rows where `mask` is False are ignored entirely (they may
  hold anything, NaN included); errors name indices of the full arrays.
  """
  y = _as_array("labels", labels, 2)
  q = _as_array("probs", probs, 2)
  user = _as_array("user_ids", user_ids, 1)
  _check_same_rows(labels=y, probs=q, user_ids=user)
  if y.shape[1] != q.shape[1]:
    raise ValueError(
      f"labels has {y.shape[1]} tasks but probs has {q.shape[1]}"
    )
  tasks = tuple(tasks)
  if len(tasks) != y.shape[1]:
    raise ValueError(
      f"tasks {tasks} has {len(tasks)} names but labels has {y.shape[1]} "
      "columns"
    )
  if mask is None:
    keep = np.ones(y.shape[0], bool)
  else:
    keep = _as_array("mask", mask, 1)
    _check_same_rows(labels=y, mask=keep)
    if keep.dtype != np.bool_:
      raise ValueError(f"mask must be bool, got {keep.dtype}")
  _check_labels(y, "labels", keep[:, None])
  _check_probs(q, "probs", keep[:, None])
  y, q, user = y[keep], q[keep], user[keep]
  out: Metrics = {}
  for k, task in enumerate(tasks):
    yk, qk = y[:, k], q[:, k]
    u, users = uauc(yk, qk, user)
    out[task] = {
      "auc": auc(yk, qk),
      "uauc": u,
      "uauc_users": users,
      "ne": normalized_entropy(yk, qk),
      "calibration": calibration(yk, qk),
      "log_loss": log_loss(yk, qk),
      "count": int(yk.size),
      "positives": int(np.count_nonzero(yk)),
    }
  return out


def format_table(metrics: Mapping) -> str:
  """Fixed-width table, one row per task: AUC, UAUC, NE, calibration, count
  (and HR@k / NDCG@k where present). With a `baselines` entry ({name:
  {task: metrics}}, see `gemjax.baselines`), each task's row is followed
  by one row per baseline scored on the same examples."""
  tasks = [t for t in metrics if t != "baselines"]
  base = metrics.get("baselines", {})
  cols = [
    ("AUC", "auc"),
    ("UAUC", "uauc"),
    ("NE", "ne"),
    ("calibration", "calibration"),
  ]
  for t in tasks:
    cols += [
      (k.upper(), k)
      for k in metrics[t]
      if k.startswith(("hr@", "ndcg@")) and (k.upper(), k) not in cols
    ]
  rows = []
  for t in tasks:
    rows.append((t, metrics[t]))
    rows += [(f"  {name}", m[t]) for name, m in base.items() if t in m]
  name_w = max([4] + [len(n) for n, _ in rows])
  head = f"{'task':<{name_w}}" + "".join(f"  {c:>11}" for c, _ in cols)
  head += f"  {'count':>12}"
  lines = [head, "-" * len(head)]
  for name, m in rows:
    row = f"{name:<{name_w}}"
    row += "".join(
      f"  {float(m.get(key, float('nan'))):>11.4f}" for _, key in cols
    )
    row += f"  {int(m['count']):>12,d}"
    lines.append(row)
  return "\n".join(lines)


def candidate_rows(user_id_b, cand_offsets, capacity: int):
  """Per candidate slot: its request's user id [..., c] and a valid mask.

  For a jagged batch (request `i` owns candidate slots
  `cand_offsets[i]:cand_offsets[i+1]`), `user_id_b` [..., b],
  `cand_offsets` [..., b+1]; leading (shard) axes are kept. Slots past
  `cand_offsets[-1]` are padding: mask False, user id -1.
  """
  user_b = np.asarray(user_id_b)
  off = np.asarray(cand_offsets)
  lead = off.shape[:-1]
  users = np.full(lead + (capacity,), -1, dtype=user_b.dtype)
  mask = np.zeros(lead + (capacity,), dtype=bool)
  for idx in np.ndindex(lead):
    o = off[idx]
    users[idx][: o[-1]] = np.repeat(user_b[idx], np.diff(o))
    mask[idx][: o[-1]] = True
  return users, mask


class MetricAccumulator:
  """Collects eval batches on the host, then computes `task_metrics`.

    acc = MetricAccumulator(("ctr", "cvr"))
    for batch in eval_batches:
      acc.add(batch_labels, jax.nn.sigmoid(logits), user_ids, mask)
    print(format_table(acc.result()))

  `add` takes labels/probs [..., c, k], user_ids and mask [..., c] (leading
  shard axes are flattened); it validates the rows the mask keeps (errors
  name the batch and its index) and stores only those.
  """

  def __init__(self, tasks: Sequence[str] = ("ctr", "cvr")):
    self.tasks = tuple(tasks)
    self.reset()

  def reset(self) -> None:
    self._labels: list[np.ndarray] = []
    self._probs: list[np.ndarray] = []
    self._users: list[np.ndarray] = []
    self._groups: list[np.ndarray] = []
    self.batches = 0

  @property
  def count(self) -> int:
    return sum(a.shape[0] for a in self._labels)

  def add(self, labels, probs, user_ids, mask=None, groups=None) -> None:
    """`groups` [..., c]: the request of each row, for HR@k / NDCG@k
    (default: the user)."""
    k = len(self.tasks)
    y = np.asarray(labels)
    q = np.asarray(probs)
    user = np.asarray(user_ids)
    if y.shape[-1:] != (k,) or q.shape[-1:] != (k,):
      raise ValueError(
        f"batch {self.batches}: labels {y.shape} and probs {q.shape} must "
        f"end in {k} tasks {self.tasks}"
      )
    if y.shape != q.shape or user.shape != y.shape[:-1]:
      raise ValueError(
        f"batch {self.batches}: labels {y.shape}, probs {q.shape}, "
        f"user_ids {user.shape} do not match"
      )
    if mask is None:
      keep = np.ones(user.shape, bool)
    else:
      keep = np.asarray(mask)
      if keep.shape != user.shape:
        raise ValueError(
          f"batch {self.batches}: mask {keep.shape} does not match "
          f"user_ids {user.shape}"
        )
      if keep.dtype != np.bool_:
        raise ValueError(
          f"batch {self.batches}: mask must be bool, got {keep.dtype}"
        )
    y, q = y.reshape(-1, k), q.reshape(-1, k)
    user, keep = user.reshape(-1), keep.reshape(-1)
    try:
      _check_labels(y, "labels", keep[:, None])
      _check_probs(q, "probs", keep[:, None])
    except ValueError as e:
      raise ValueError(f"batch {self.batches}: {e}") from None
    self._labels.append(y[keep])
    self._probs.append(q[keep])
    self._users.append(user[keep])
    g = user if groups is None else np.asarray(groups).reshape(-1)
    self._groups.append(g[keep])
    self.batches += 1

  def result(self, rank_at: Sequence[int] = ()) -> Metrics:
    """`task_metrics` of every row added, plus `hr@k` and `ndcg@k` for
    each k of `rank_at` (rows grouped by `groups`)."""
    k = len(self.tasks)
    if not self._labels:
      empty = np.zeros((0, k))
      return task_metrics(empty, empty, np.zeros(0, np.int64), self.tasks)
    y = np.concatenate(self._labels)
    q = np.concatenate(self._probs)
    out = task_metrics(y, q, np.concatenate(self._users), self.tasks)
    add_ranking(out, y, q, np.concatenate(self._groups), self.tasks, rank_at)
    return out


def add_ranking(out: Metrics, labels, scores, groups, tasks, rank_at) -> None:
  """Adds `hr@k` / `ndcg@k` per task of `out` for each k of `rank_at`."""
  for j, task in enumerate(tasks):
    for k in rank_at:
      hr, nd, _ = hit_rate_ndcg(labels[:, j], scores[:, j], groups, k)
      out[task][f"hr@{k}"] = hr
      out[task][f"ndcg@{k}"] = nd
