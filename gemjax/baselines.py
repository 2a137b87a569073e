"""Baselines scored on exactly the model's evaluation examples.

A ranking model is worth its cost only if it beats what a practitioner
would try first. Two baselines see the same training requests and are
scored on the same held-out candidates as the model, with no feature the
model lacks:

- popularity: a candidate's score is the number of positives (per task)
  its item got in the training examples;
- logistic regression per task on the item (one weight per item row), its
  category, and the request's history as plain aggregates: log(1 +
  history length), the history's action mix, whether the candidate's item
  and how much of its category are already in the history, and the dense
  request features. Fit by full-batch Adam with an L2 penalty on the id
  weights.

Both take `JaggedBatch`es with exact capacities (`build.assemble`), so no
padding enters the features. Legend: `n` candidates, `b` requests, `t`
history events, `f` aggregate features, `k` tasks.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gemjax.data.config import ACTIONS
from gemjax.data.jagged import JaggedBatch


@dataclasses.dataclass(frozen=True)
class Examples:
  """Candidates of some requests as flat columns, ready for a baseline."""

  item: np.ndarray  # int32[n]
  category: np.ndarray  # int32[n]
  x: np.ndarray  # float32[n, f]: the history aggregates and dense features
  labels: np.ndarray  # float32[n, k]
  request: np.ndarray  # int64[n]: request of each candidate (a group id)
  user: np.ndarray  # int32[n]: user row of each candidate


def examples(pools: list[JaggedBatch]) -> Examples:
  """Flat candidate columns of every request of `pools`, in order."""
  parts, base = [], 0
  for p in pools:
    parts.append(_pool_examples(p, base))
    base += p.num_requests
  return Examples(
    *(
      np.concatenate([getattr(e, f.name) for e in parts])
      for f in dataclasses.fields(Examples)
    )
  )


def _pool_examples(p: JaggedBatch, base: int) -> Examples:
  off = np.asarray(p.offsets, np.int64)
  coff = np.asarray(p.cand_offsets, np.int64)
  b, t, n = off.size - 1, int(off[-1]), int(coff[-1])
  lens = np.diff(off)
  seg = np.repeat(np.arange(b), lens)  # request of each history event
  req = np.repeat(np.arange(b), np.diff(coff))  # request of each candidate
  item = np.asarray(p.cand["item_id"][:n])
  cat = np.asarray(p.cand["category_id"][:n])
  h_item = np.asarray(p.seq["item_id"][:t]).astype(np.int64)
  h_cat = np.asarray(p.seq["category_id"][:t]).astype(np.int64)
  h_act = np.asarray(p.seq["action"][:t])
  denom = np.maximum(lens, 1)[:, None]
  mix = np.zeros((b, len(ACTIONS)), np.float64)
  np.add.at(mix, (seg, h_act), 1.0)
  mix /= denom
  # Membership by sorted (request, id) keys: is the candidate's item in its
  # request's history, and how many history events share its category.
  in_hist = _count_in(seg, h_item, req, item.astype(np.int64)) > 0
  cat_frac = _count_in(seg, h_cat, req, cat.astype(np.int64)) / denom[req, 0]
  x = np.concatenate(
    [
      np.log1p(lens)[req, None],
      mix[req],
      in_hist[:, None],
      cat_frac[:, None],
      np.asarray(p.dense)[req],
    ],
    1,
  ).astype(np.float32)
  return Examples(
    item=item.astype(np.int32),
    category=cat.astype(np.int32),
    x=x,
    labels=np.asarray(p.labels[:n], np.float32),
    request=(req + base).astype(np.int64),
    user=np.asarray(p.user_id)[req].astype(np.int32),
  )


def _count_in(seg, ids, req, query) -> np.ndarray:
  """Occurrences of `query[i]` among `ids` of segment `req[i]`."""
  keys = np.sort((seg.astype(np.int64) << 32) | ids)
  q = (req.astype(np.int64) << 32) | query
  return np.searchsorted(keys, q, side="right") - np.searchsorted(keys, q)


def popularity(train: Examples, test: Examples) -> np.ndarray:
  """float32[n, k]: per task, the positives of each test item in training."""
  k = train.labels.shape[1]
  rows = int(max(train.item.max(initial=0), test.item.max(initial=0))) + 1
  out = np.zeros((test.item.size, k), np.float32)
  for j in range(k):
    counts = np.bincount(train.item, train.labels[:, j], minlength=rows)
    out[:, j] = counts[test.item]
  return out


def logistic_regression(
  train: Examples,
  test: Examples,
  *,
  steps: int = 400,
  learning_rate: float = 0.05,
  l2: float = 1e-4,
  seed: int = 0,
) -> np.ndarray:
  """float32[n, k]: probabilities of a logistic regression per task."""
  rows_i = int(max(train.item.max(initial=0), test.item.max(initial=0))) + 1
  rows_c = int(max(train.category.max(initial=0), test.category.max()))
  rows_c += 1
  mu = train.x.mean(0)
  sd = train.x.std(0) + 1e-6
  k = train.labels.shape[1]
  f = train.x.shape[1]
  params = {
    "item": jnp.zeros((rows_i, k)),
    "cat": jnp.zeros((rows_c, k)),
    "w": jnp.zeros((f, k)),
    "b": jnp.zeros((k,)),
  }

  def logits(p, item, cat, x):
    x = (x - mu) / sd
    return p["item"][item] + p["cat"][cat] + x @ p["w"] + p["b"]

  def loss(p):
    z = logits(p, train.item, train.category, train.x)
    bce = optax.sigmoid_binary_cross_entropy(z, train.labels).mean()
    reg = jnp.sum(p["item"] ** 2) + jnp.sum(p["cat"] ** 2)
    return bce + l2 * reg

  tx = optax.adam(learning_rate)

  @jax.jit
  def fit(p):
    def body(carry, _):
      p, s = carry
      g = jax.grad(loss)(p)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(body, (p, tx.init(p)), None, length=steps)
    return p

  del seed  # full-batch and zero-initialised: deterministic as it is
  p = fit(params)
  z = logits(p, test.item, test.category, test.x)
  return np.asarray(jax.nn.sigmoid(z), np.float32)


BASELINES = {"popularity": popularity, "logreg": logistic_regression}


def score_all(
  train_pools, test_pools
) -> tuple[Examples, dict[str, np.ndarray]]:
  """The test examples and every baseline's scores `[n, k]` on them."""
  train, test = examples(train_pools), examples(test_pools)
  return test, {name: fn(train, test) for name, fn in BASELINES.items()}


def baseline_metrics(
  test: Examples, scores: dict[str, np.ndarray], tasks, rank_at=()
) -> dict:
  """{baseline: {task: metrics}} on the test examples. Popularity is a
  count, not a probability: it gets AUC, UAUC and ranking metrics only."""
  from gemjax import metrics

  out = {}
  for name, s in scores.items():
    if name == "popularity":
      m = {}
      for j, task in enumerate(tasks):
        u, users = metrics.uauc(test.labels[:, j], s[:, j], test.user)
        m[task] = {
          "auc": metrics.auc(test.labels[:, j], s[:, j]),
          "uauc": u,
          "uauc_users": users,
          "count": int(test.labels.shape[0]),
          "positives": int(np.count_nonzero(test.labels[:, j])),
        }
    else:
      m = metrics.task_metrics(test.labels, s, test.user, tasks)
    metrics.add_ranking(m, test.labels, s, test.request, tasks, rank_at)
    out[name] = m
  return out
