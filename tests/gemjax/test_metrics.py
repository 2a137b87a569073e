"""gemjax.metrics against brute force on fresh random data."""

import math

import numpy as np
import pytest

from gemjax import metrics as M

# ------------------------------------------------------------- brute force


def brute_auc(y, s, w=None):
  """Every (positive, negative) pair; ties count 1/2."""
  y, s = np.asarray(y), np.asarray(s, np.float64)
  w = np.ones(len(y)) if w is None else np.asarray(w, np.float64)
  num = den = 0.0
  pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
  for i in pos:
    gt = (s[i] > s[neg]) + 0.5 * (s[i] == s[neg])
    num += w[i] * np.dot(w[neg], gt)
    den += w[i] * w[neg].sum()
  return num / den if den > 0 else math.nan


def brute_uauc(y, s, users, weighted=False):
  aucs, sizes = [], []
  for u in sorted(set(users.tolist())):
    rows = users == u
    if 0 < y[rows].sum() < rows.sum():
      aucs.append(brute_auc(y[rows], s[rows]))
      sizes.append(rows.sum())
  if not aucs:
    return math.nan, 0
  if weighted:
    return float(np.dot(aucs, sizes) / sum(sizes)), len(aucs)
  return float(np.mean(aucs)), len(aucs)


def direct_log_loss(y, q, eps=1e-7):
  total = 0.0
  for yi, qi in zip(y.tolist(), q.tolist(), strict=True):
    qi = min(max(qi, eps), 1 - eps)
    total -= math.log(qi) if yi == 1 else math.log(1 - qi)
  return total / len(y)


def direct_ne(y, q, eps=1e-7):
  p = sum(y.tolist()) / len(y)
  h = -(p * math.log(p) + (1 - p) * math.log(1 - p))
  return direct_log_loss(y, q, eps) / h


def random_data(rng, n, ties, pos_rate=0.3):
  """Labels, probs in [0, 1]; `ties` = number of distinct scores (0: none)."""
  if ties:
    q = rng.integers(0, ties, n) / (ties - 1 if ties > 1 else 1)
  else:
    q = rng.random(n)
  # Labels correlated with the score so the AUC is far from 1/2.
  y = (rng.random(n) < 0.5 * q + pos_rate * 0.5).astype(np.float32)
  return y, q


# --------------------------------------------------------------------- AUC


@pytest.mark.parametrize("ties", [0, 2, 3, 7, 50])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_pairs(seed, ties):
  rng = np.random.default_rng([seed, ties])
  n = int(rng.integers(50, 400))
  y, q = random_data(rng, n, ties)
  assert M.auc(y, q) == pytest.approx(brute_auc(y, q), abs=1e-12)


@pytest.mark.parametrize("ties", [0, 4])
def test_auc_weighted_matches_pairs(ties):
  rng = np.random.default_rng(ties + 10)
  y, q = random_data(rng, 300, ties)
  w = rng.random(300) * 3
  w[rng.random(300) < 0.1] = 0.0  # zero weight = row dropped
  got = M.auc(y, q, w)
  assert got == pytest.approx(brute_auc(y, q, w), rel=1e-12)
  keep = w > 0
  assert got != pytest.approx(M.auc(y, q))  # the weights matter
  # Integer weights equal repeating rows.
  wi = rng.integers(0, 4, 300)
  rep = np.repeat(np.arange(300), wi)
  assert M.auc(y, q, wi) == pytest.approx(M.auc(y[rep], q[rep]), abs=1e-12)
  assert M.auc(y, q, keep) == pytest.approx(M.auc(y[keep], q[keep]), abs=1e-12)


def test_auc_known_values():
  y = np.array([0, 0, 1, 1])
  assert M.auc(y, [0.1, 0.2, 0.3, 0.4]) == 1.0
  assert M.auc(y, [0.4, 0.3, 0.2, 0.1]) == 0.0
  assert M.auc(y, [0.5, 0.5, 0.5, 0.5]) == 0.5
  # One pair of four tied, one pair won: (3 + 0.5) / 4.
  assert M.auc(y, [0.1, 0.3, 0.3, 0.4]) == 0.875


def test_auc_order_and_scale_invariant():
  rng = np.random.default_rng(3)
  y, q = random_data(rng, 500, 9)
  perm = rng.permutation(500)
  a = M.auc(y, q)
  assert M.auc(y[perm], q[perm]) == a
  # Logits (a monotone map) give the same AUC; any real score is allowed.
  logit = np.log(np.clip(q, 1e-6, 1 - 1e-6) / np.clip(1 - q, 1e-6, 1))
  assert M.auc(y, logit) == pytest.approx(a, abs=1e-12)
  assert M.auc(y, -q) == pytest.approx(1 - a, abs=1e-12)


def test_auc_one_class_is_nan():
  assert math.isnan(M.auc(np.ones(5), np.linspace(0, 1, 5)))
  assert math.isnan(M.auc(np.zeros(5), np.linspace(0, 1, 5)))
  assert math.isnan(M.auc(np.zeros(0), np.zeros(0)))
  # All positives weighted to zero: no positive mass, no pairs.
  y = np.array([1, 0, 1, 0])
  assert math.isnan(M.auc(y, [0.1, 0.2, 0.3, 0.4], [0, 1, 0, 1]))


def test_auc_exact_at_scale():
  """1e5 rows, 11 distinct scores: compare with counts per score value."""
  rng = np.random.default_rng(4)
  y, q = random_data(rng, 100_000, 11)
  vals = np.unique(q)
  pos = np.array([np.sum((q == v) & (y == 1)) for v in vals], np.int64)
  neg = np.array([np.sum((q == v) & (y == 0)) for v in vals], np.int64)
  below = np.concatenate([[0], np.cumsum(neg)[:-1]])
  two_u = int(np.sum(pos * (2 * below + neg)))
  want = two_u / (2 * int(pos.sum()) * int(neg.sum()))
  assert M.auc(y, q) == pytest.approx(want, abs=1e-14)


# -------------------------------------------------------------------- UAUC


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ties", [0, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_uauc_matches_loop(seed, ties, weighted):
  rng = np.random.default_rng([seed, ties, 7])
  n = 600
  y, q = random_data(rng, n, ties)
  # Sparse, negative and interleaved ids; user sizes 1 .. ~40.
  users = rng.choice(np.array([-7, 3, 10**9, 42, 5, 8, 11, 99, 100, 1000]), n)
  users[:3] = [123, 124, 125]  # single-row users: one class only
  single = rng.integers(0, n, 30)
  users[single] = 777
  y[single] = 1  # a user with positives only
  got, count = M.uauc(y, q, users, weighted=weighted)
  want, want_count = brute_uauc(y, q, users, weighted)
  assert count == want_count
  assert got == pytest.approx(want, abs=1e-12)


def test_uauc_excludes_one_class_users_and_counts():
  y = np.array([1, 0, 1, 1, 0, 0, 1, 0])
  s = np.array([0.9, 0.1, 0.2, 0.3, 0.4, 0.5, 0.2, 0.2])
  u = np.array([1, 1, 2, 2, 3, 3, 4, 4])
  # user 1: 1.0; user 2 all positive, user 3 all negative: skipped;
  # user 4: tie -> 0.5.
  assert M.uauc(y, s, u) == (0.75, 2)
  assert M.uauc(y, s, u, weighted=True) == (0.75, 2)
  v, c = M.uauc(np.ones(4), s[:4], u[:4])
  assert math.isnan(v) and c == 0
  v, c = M.uauc(np.zeros(0), np.zeros(0), np.zeros(0, int))
  assert math.isnan(v) and c == 0


def test_uauc_weighted_differs_from_mean():
  y = np.array([1, 0, 1, 0, 0, 0, 0])
  s = np.array([0.9, 0.1, 0.1, 0.2, 0.3, 0.05, 0.4])
  u = np.array([1, 1, 2, 2, 2, 2, 2])
  # user 1: AUC 1 over 2 rows; user 2: 1 of 4 negatives below -> 0.25, 5 rows.
  assert M.uauc(y, s, u) == (pytest.approx(0.625), 2)
  assert M.uauc(y, s, u, weighted=True) == (
    pytest.approx((2 * 1.0 + 5 * 0.25) / 7),
    2,
  )


def test_uauc_at_scale_matches_per_user_auc():
  """1e5 rows, 2,000 users: the vectorised path equals a loop of `auc`."""
  rng = np.random.default_rng(5)
  n = 100_000
  y, q = random_data(rng, n, 20)
  users = rng.integers(0, 2000, n) * 13 - 5000
  aucs = []
  order = np.argsort(users, kind="stable")
  bounds = np.flatnonzero(np.diff(users[order])) + 1
  for rows in np.split(order, bounds):
    a = M.auc(y[rows], q[rows])
    if not math.isnan(a):
      aucs.append(a)
  got, count = M.uauc(y, q, users)
  assert count == len(aucs)
  assert got == pytest.approx(np.mean(aucs), abs=1e-12)


# --------------------------------------------- NE, log loss, calibration


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ne_log_loss_calibration_direct(seed):
  rng = np.random.default_rng([seed, 11])
  n = int(rng.integers(20, 500))
  y, q = random_data(rng, n, 0, pos_rate=0.1)
  q[:3] = [0.0, 1.0, 0.5]  # exercise the clipping
  y[:2] = [1, 0]  # confident mistakes: -log(eps) each
  assert M.log_loss(y, q) == pytest.approx(direct_log_loss(y, q), rel=1e-12)
  assert M.normalized_entropy(y, q) == pytest.approx(direct_ne(y, q), rel=1e-12)
  assert M.normalized_entropy(y, q, eps=1e-3) == pytest.approx(
    direct_ne(y, q, 1e-3), rel=1e-12
  )
  assert M.calibration(y, q) == pytest.approx(
    sum(q.tolist()) / sum(y.tolist()), rel=1e-12
  )


def test_ne_of_base_rate_is_one_and_better_model_is_below():
  rng = np.random.default_rng(12)
  p = rng.uniform(0.05, 0.95, 2000)
  y = (rng.random(2000) < p).astype(np.int32)
  base = np.full(2000, y.mean())
  assert M.normalized_entropy(y, base) == pytest.approx(1.0, rel=1e-12)
  assert M.calibration(y, base) == pytest.approx(1.0, rel=1e-12)
  assert M.normalized_entropy(y, p) < 1.0
  assert M.normalized_entropy(y, 1 - p) > 1.0


def test_single_class_edge_cases():
  q = np.array([0.2, 0.4])
  assert math.isnan(M.normalized_entropy(np.zeros(2), q))
  assert math.isnan(M.normalized_entropy(np.ones(2), q))
  assert math.isnan(M.calibration(np.zeros(2), q))
  assert M.calibration(np.ones(2), q) == pytest.approx(0.3)
  assert M.log_loss(np.zeros(2), q) == pytest.approx(
    -(math.log(0.8) + math.log(0.6)) / 2
  )
  assert math.isnan(M.log_loss(np.zeros(0), np.zeros(0)))


# -------------------------------------------------------------- multi-task


def _task_data(rng, n, tasks=2):
  y = np.stack([random_data(rng, n, 5)[0] for _ in range(tasks)], 1)
  q = rng.random((n, tasks)).astype(np.float32)
  q = np.where(y == 1, 0.5 + 0.5 * q, q)  # some signal
  users = rng.integers(0, 25, n)
  return y, q, users


def test_task_metrics_with_mask_ignores_padding():
  rng = np.random.default_rng(20)
  y, q, users = _task_data(rng, 400)
  mask = rng.random(400) < 0.7
  # Padded slots hold garbage that would fail validation if looked at.
  y[~mask] = -1
  q[~mask] = np.nan
  m = M.task_metrics(y, q, users, ("ctr", "cvr"), mask=mask)
  assert list(m) == ["ctr", "cvr"]
  for k, task in enumerate(("ctr", "cvr")):
    yk, qk, uk = y[mask, k], q[mask, k], users[mask]
    want_uauc, want_users = brute_uauc(yk, qk, uk)
    got = m[task]
    assert got["auc"] == pytest.approx(brute_auc(yk, qk), abs=1e-12)
    assert got["uauc"] == pytest.approx(want_uauc, abs=1e-12)
    assert got["uauc_users"] == want_users
    assert got["ne"] == pytest.approx(direct_ne(yk, qk), rel=1e-9)
    assert got["log_loss"] == pytest.approx(direct_log_loss(yk, qk), rel=1e-9)
    assert got["calibration"] == pytest.approx(qk.sum() / yk.sum(), rel=1e-6)
    assert got["count"] == mask.sum()
    assert got["positives"] == int(yk.sum())
    assert isinstance(got["count"], int) and isinstance(got["auc"], float)


def test_format_table():
  rng = np.random.default_rng(21)
  y, q, users = _task_data(rng, 300)
  m = M.task_metrics(y, q, users)
  m["cvr"]["auc"] = math.nan
  text = M.format_table(m)
  lines = text.splitlines()
  assert len(lines) == 4
  assert len({len(line) for line in lines}) == 1  # fixed width
  for col in ("AUC", "UAUC", "NE", "calibration", "count"):
    assert col in lines[0]
  assert lines[2].split()[0] == "ctr" and lines[3].split()[0] == "cvr"
  assert lines[2].split()[1] == f"{m['ctr']['auc']:.4f}"
  assert lines[3].split()[1] == "nan"
  assert lines[2].split()[-1] == "300"


def test_accumulator_equals_one_shot():
  rng = np.random.default_rng(22)
  y, q, users = _task_data(rng, 900)
  mask = rng.random(900) < 0.8
  y[~mask] = 7
  acc = M.MetricAccumulator(("ctr", "cvr"))
  assert acc.count == 0
  # Uneven batches, one with a leading shard axis [2, c, k].
  acc.add(y[:100], q[:100], users[:100], mask[:100])
  acc.add(
    y[100:500].reshape(2, 200, 2),
    q[100:500].reshape(2, 200, 2),
    users[100:500].reshape(2, 200),
    mask[100:500].reshape(2, 200),
  )
  acc.add(y[500:], q[500:], users[500:], mask[500:])
  assert acc.count == mask.sum() and acc.batches == 3
  assert acc.result() == M.task_metrics(y, q, users, mask=mask)
  acc.reset()
  empty = acc.result()
  assert empty["ctr"]["count"] == 0 and math.isnan(empty["ctr"]["auc"])


def test_accumulator_takes_jax_arrays():
  jnp = pytest.importorskip("jax.numpy")
  rng = np.random.default_rng(23)
  y, q, users = _task_data(rng, 64)
  acc = M.MetricAccumulator()
  acc.add(jnp.asarray(y), jnp.asarray(q), jnp.asarray(users))
  want = M.task_metrics(y, q, users)
  assert acc.result()["ctr"]["auc"] == pytest.approx(want["ctr"]["auc"])


def test_candidate_rows():
  user_b = np.array([[10, 11, 12], [20, 21, 22]], np.int32)
  off = np.array([[0, 2, 2, 3], [0, 1, 4, 4]], np.int32)
  users, mask = M.candidate_rows(user_b, off, 5)
  np.testing.assert_array_equal(
    users, [[10, 10, 12, -1, -1], [20, 21, 21, 21, -1]]
  )
  np.testing.assert_array_equal(mask, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])


# -------------------------------------------------------------- validation


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: M.auc([0, 1, 1], [0.1, 0.2]), r"scores has 2 rows .* labels"),
    (lambda: M.auc([0, 2, 1], [0.1, 0.2, 0.3]), r"labels\[1\] = .*2"),
    (lambda: M.auc([0, 1, np.nan], [0.1, 0.2, 0.3]), r"labels\[2\]"),
    (lambda: M.auc([0, 1], [0.1, np.nan]), r"scores\[1\] is NaN"),
    (lambda: M.auc([0, 1], [0.1, 0.2], [1.0, -1.0]), r"weights\[1\]"),
    (lambda: M.auc([0, 1], [0.1, 0.2], [1.0]), r"weights has 1 rows"),
    (lambda: M.auc([[0, 1]], [[0.1, 0.2]]), r"labels must be 1-D"),
    (lambda: M.uauc([0, 1], [0.1, 0.2], [1]), r"user_ids has 1 rows"),
    (lambda: M.log_loss([0, 1], [0.1, 1.5]), r"probs\[1\] = .*1.5"),
    (lambda: M.log_loss([0, 1], [-0.1, 0.5]), r"probs\[0\]"),
    (lambda: M.normalized_entropy([0, 1], [np.nan, 0.5]), r"probs\[0\]"),
    (lambda: M.calibration([0, 1, 0], [0.5, 0.5]), r"probs has 2 rows"),
    (lambda: M.calibration([0, 3], [0.5, 0.5]), r"labels\[1\]"),
  ],
)
def test_validation_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_task_metrics_validation_names_row_and_task():
  y = np.zeros((4, 2))
  y[0] = 1
  q = np.full((4, 2), 0.5)
  u = np.arange(4)
  y[2, 1] = 0.5
  with pytest.raises(ValueError, match=r"labels\[2, 1\] = .*0.5"):
    M.task_metrics(y, q, u)
  y[2, 1] = 0
  q[3, 0] = 1.01
  with pytest.raises(ValueError, match=r"probs\[3, 0\]"):
    M.task_metrics(y, q, u)
  # Masked out, the same row is fine.
  M.task_metrics(y, q, u, mask=np.array([True, True, True, False]))
  with pytest.raises(ValueError, match=r"user_ids has 3 rows"):
    M.task_metrics(y, q, u[:3])
  with pytest.raises(ValueError, match=r"mask has 2 rows"):
    M.task_metrics(y, q, u, mask=np.ones(2, bool))
  with pytest.raises(ValueError, match=r"mask must be bool"):
    M.task_metrics(y, q, u, mask=np.ones(4, int))
  with pytest.raises(
    ValueError, match=r"tasks .* has 3 names but labels has 2 columns"
  ):
    M.task_metrics(y, q, u, tasks=("a", "b", "c"))
  with pytest.raises(ValueError, match=r"labels has 2 tasks but probs has 1"):
    M.task_metrics(y, q[:, :1], u)


def test_accumulator_validation_names_batch():
  acc = M.MetricAccumulator(("ctr", "cvr"))
  ok = (np.zeros((3, 2)), np.full((3, 2), 0.5), np.arange(3))
  acc.add(*ok)
  with pytest.raises(ValueError, match=r"batch 1: probs\[2, 1\]"):
    acc.add(ok[0], np.array([[0.5, 0.5]] * 2 + [[0.5, 2.0]]), ok[2])
  with pytest.raises(ValueError, match=r"batch 1: .*2 tasks"):
    acc.add(np.zeros((3, 1)), np.zeros((3, 1)), ok[2])
  with pytest.raises(ValueError, match=r"batch 1: .*do not match"):
    acc.add(*ok[:2], np.arange(4))
  with pytest.raises(ValueError, match=r"batch 1: mask"):
    acc.add(*ok, mask=np.ones(2, bool))
  assert acc.batches == 1 and acc.count == 3
