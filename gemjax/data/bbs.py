"""Batch planning (random, or Base Batch Shuffling, G10) and token packing.

Why balance at all: with data parallelism every step waits for the slowest
rank. Histories are log-normal, so a rank that happens to draw long ones is a
straggler. The straggler ratio of a step is

  max over ranks of its cost / mean over ranks of its cost  (1.0 = balanced).

Base Batch Shuffling (GEM): each rank, on its own (no cross-rank traffic),
takes a pool of `g` full batches' worth of requests in stream order, cuts it
into mini-batches of `m` requests (the seed: 128), sorts the mini-batches by
weight and pairs the heaviest with the lightest. Pairs have nearly equal
weight, and they are dealt to the `g` full batches, each unit to the lightest
batch that still has room (`plan_bbs`). Every full batch then weighs about
the pool's mean; the rank-to-rank difference left is the difference of pool
means, ~sqrt(g) smaller than that of single random batches. With `g = 1`
pairing would only reorder one batch, so `bbs_pool_batches` must be > 1 for
any effect. Example of the seed: mini-batches weighing 16..1 pair into eight
pairs of 17; two batches of four pairs each weigh 68.

What to balance (`bbs_weight`): step time is not proportional to tokens.
Per OneTrans layer (d = 512, GQA 8/2 so K and V are d/4 wide, SwiGLU of
width 8d/3) a history of length L costs about

  2 (2.5 d^2 + 8 d^2) L  (projections and FFN)  +  4 d L^2  (QK^T and PV),

i.e. proportional to L + L^2 / 2688 ("cost", the default: it is what the
step time follows, so it is what we balance and report). "tokens" (the
seed's total length) balances the linear part only; "attn" (sum of L^2) the
attention only; at 2K lengths the two parts are of the same order (attention
is ~40% of the linear part at L = 1,100), so both matter.

Packing: a planned batch goes into buffers of static capacity (b requests, t
tokens, c candidates). `first_fit` takes requests in order while they fit and
defers the others to the next batch (counted by the loader); nothing is
dropped. The packed-buffer waste is 1 - used tokens / t.
"""

import numpy as np

from gemjax.data.events import ranges
from gemjax.data.jagged import JaggedBatch

COST_LEN = 21 * 512 / 4  # L at which attention costs as much as the rest


def sample_weight(lengths, kind: str) -> np.ndarray:
  """Per-request weight (float64) for planning and straggler ratios."""
  x = np.asarray(lengths, np.float64)
  if kind == "tokens":
    return x
  if kind == "attn":
    return x * x
  if kind == "cost":
    return x + x * x / COST_LEN
  raise ValueError(f"unknown weight {kind!r}: tokens, attn or cost")


def plan_random(n: int, batch: int) -> list[np.ndarray]:
  """Consecutive chunks of `batch` requests, in stream order."""
  return [np.arange(i, min(i + batch, n)) for i in range(0, n, batch)]


def plan_bbs(weights, batch: int, minibatch: int) -> list[np.ndarray]:
  """Base Batch Shuffling of a pool of `len(weights)` = g * batch requests.

  Returns g index arrays of `batch` requests each. Mini-batches are
  consecutive runs of `minibatch` requests of the stream; when a batch holds
  an odd number of mini-batches, the g middle-weight ones stay single.
  """
  w = np.asarray(weights, np.float64)
  n = w.size
  if n % batch or batch % minibatch:
    raise ValueError(f"pool {n} / batch {batch} / minibatch {minibatch}")
  g, per = n // batch, batch // minibatch
  mb = np.arange(n).reshape(-1, minibatch)  # [g * per, minibatch]
  mw = w.reshape(-1, minibatch).sum(1)
  order = np.argsort(-mw, kind="stable")  # heaviest first
  units = []
  if per % 2:
    mid = order.size // 2 - g // 2
    singles, order = (
      order[mid : mid + g],
      np.concatenate([order[:mid], order[mid + g :]]),
    )
    units += [[s] for s in singles]
  half = order.size // 2
  units += [[order[i], order[-1 - i]] for i in range(half)]
  # Deal units, heaviest first, to the lightest batch with room.
  unit_w = np.array([mw[u].sum() for u in units])
  total = np.zeros(g)
  room = np.full(g, per)
  out = [[] for _ in range(g)]
  for i in np.argsort(-unit_w, kind="stable"):
    size = len(units[i])
    ok = np.flatnonzero(room >= size)
    j = ok[np.argmin(total[ok])]
    out[j] += units[i]
    total[j] += unit_w[i]
    room[j] -= size
  return [mb[np.array(o)].reshape(-1) for o in out]


def first_fit(lengths, ncands, batch: int, tokens: int, cands: int):
  """Split a queue: (positions that fit, positions deferred), both in order."""
  take, rest = [], []
  n_t = n_c = 0
  for i, (ln, nc) in enumerate(zip(lengths, ncands, strict=True)):
    if len(take) < batch and n_t + ln <= tokens and n_c + nc <= cands:
      take.append(i)
      n_t += ln
      n_c += nc
    else:
      rest.append(i)
  return take, rest


def gather(parts, batch: int, tokens: int, cands: int) -> JaggedBatch:
  """Pack requests into one shard's buffers of static capacity.

  parts: list of (pool JaggedBatch with exact capacities, int index array);
  requests keep their order. Unused rows are zeros; unused request slots have
  empty histories and no candidates.
  """
  seqs, cnds, labels, users, dense, lens, clens = {}, {}, [], [], [], [], []
  for pool, idx in parts:
    idx = np.asarray(idx, np.int64)
    o, co = pool.offsets.astype(np.int64), pool.cand_offsets.astype(np.int64)
    t_idx = ranges(o[idx], o[idx + 1])
    c_idx = ranges(co[idx], co[idx + 1])
    for k, v in pool.seq.items():
      seqs.setdefault(k, []).append(v[t_idx])
    for k, v in pool.cand.items():
      cnds.setdefault(k, []).append(v[c_idx])
    labels.append(pool.labels[c_idx])
    users.append(pool.user_id[idx])
    dense.append(pool.dense[idx])
    lens.append(o[idx + 1] - o[idx])
    clens.append(co[idx + 1] - co[idx])
  lens, clens = np.concatenate(lens), np.concatenate(clens)
  n = lens.size
  if n > batch or lens.sum() > tokens or clens.sum() > cands:
    raise ValueError("requests do not fit the buffers (first_fit first)")

  def pad(chunks, size, dtype, tail=()):
    out = np.empty((size,) + tail, dtype)
    m = 0
    for c in chunks:
      out[m : m + c.shape[0]] = c
      m += c.shape[0]
    out[m:] = 0
    return out

  def offsets(ls):
    off = np.zeros(batch + 1, np.int32)
    off[1 : n + 1] = np.cumsum(ls)
    off[n + 1 :] = off[n]
    return off

  f = dense[0].shape[1] if dense else 0
  return JaggedBatch(
    offsets=offsets(lens),
    seq={k: pad(v, tokens, np.int32) for k, v in seqs.items()},
    cand_offsets=offsets(clens),
    cand={k: pad(v, cands, np.int32) for k, v in cnds.items()},
    labels=pad(labels, cands, np.float32, (labels[0].shape[1],)),
    user_id=pad(users, batch, np.int32),
    dense=pad(dense, batch, np.float32, (f,)),
  )


def straggler_ratio(costs_steps_ranks) -> float:
  """Mean over steps of max / mean over ranks (costs float[steps, ranks])."""
  c = np.asarray(costs_steps_ranks, np.float64)
  return float(np.mean(c.max(1) / c.mean(1)))
