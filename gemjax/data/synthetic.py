"""Synthetic traffic like the seeds' 2K sequences, with a known signal.

A block of requests is generated as an *event log plus requests* and then goes
through the same request builder as real logs (`build.py`: anti-leakage,
dedup, action quota, truncation, context features), so there is one path.
Labels are drawn afterwards from a hidden model of the *built* history, so a
model that sees exactly the batch can in principle reach the ceiling
(the AUC of `hidden_model_probs`).

The world (fixed by `cfg.seed`; legend `I` items, `K` categories):
  - category popularity Zipf(`category_zipf`) over ids (row 0 most popular);
    every category has >= 1 item, the rest are spread by popularity;
  - item popularity Zipf-like inside a category: the j-th most popular item of
    a category (items sorted by id) is drawn with P ~ log((j+2)/(j+1)) ~
    1/(j+1); lower item ids are globally more popular;
  - item prices: a log-normal median per category, times a log-normal item
    factor; every event/candidate adds 10% price noise;
  - each user has 4 favourite categories (weights .4 .3 .2 .1), drawn by
    category popularity.

One request (vectorised over the block):
  - history length L ~ LogNormal(ln `len_median`, `len_sigma`), 0 with
    probability `zero_len_frac` (those users still have future events, so the
    log knows them); L events survive building unless L > max_seq_len;
  - of the raw events, a share U(.1, .6) are impressions (sparse users are
    impression-heavy, as in the seed) of which the quota keeps 100; the rest
    are actions: click / cart / order with probabilities .75/.15/.10 in a
    favourite category, .90/.07/.03 elsewhere; actions are in a favourite
    category with probability .75, impressions .3;
  - 2% of actions are logged twice (removed by "consecutive" dedup), and a few
    events lie at or after the request time (removed by anti-leakage);
  - event times: request time minus a log-uniform gap of 1 minute to 180 days;
  - 4-12 candidates, half from the favourite categories, half by popularity.

Hidden label model, per candidate (item i, category k, price p) of a request
whose built history has events e (action a_e, age Δ_e = request time - ts):

  w_e      = {impression .2, click 1, cart 2, order 3}[a_e] * exp(-Δ_e / 30 d)
  W        = 1 + sum_e w_e
  A_cat    = sum_{e: k_e = k} w_e / W       (share of the history's weight)
  A_item   = sum_{e: i_e = i} w_e / W
  D_cat    = sum_{e: k_e = k, a_e in {cart, order}} w_e / W
  pop      = -ln(1 + i) / ln(I)             (in [-1, 0])
  cheap    = -(ln p - ln median price of k) (price preference)
  logit_ctr       = -2.8 + 8 A_cat + 15 A_item + pop + 0.3 cheap + 0.4 dense[0]
  logit_cvr|click = -1.8 + 10 D_cat + 0.5 cheap + 0.4 dense[1]
  click ~ Bernoulli(sigmoid(logit_ctr)); conversion = click AND
  Bernoulli(sigmoid(logit_cvr|click)).

Shares (not sums) keep the signal alike for 50- and 2,000-event histories.
Ceilings (the AUC of `hidden_model_probs` on the eval set): CTR ~0.86 /
conversion ~0.90 on the smoke shapes (128 max, median 50), CTR ~0.83 / ~0.87
at 2K; base rates CTR ~0.20, conversion ~0.09. The category share alone is
worth ~0.83 CTR AUC, so a small sequence model that matches candidate and
history categories learns most of it.

`labels[:, 1]` is therefore conversion over all candidates (CTCVR), with true
probability p_ctr * p_cvr|click. dense[:, 0:2] are N(0, 1) request features
the labels use, dense[:, 2:] are N(0, 1) noise.
"""

import dataclasses
import functools

import numpy as np

from gemjax.data import build
from gemjax.data.config import ACTION_ID, TASKS, DataConfig
from gemjax.data.events import EventLog, Requests

TRAIN, EVAL = 0, 1
EVAL_BLOCK = 256  # eval requests per generated block (independent of shards)
_T0 = 1_700_000_000  # request times: train in [T0, T0+30d), eval 30 days on
_DAY = 86_400
_FAV_W = np.array([0.4, 0.3, 0.2, 0.1])
_FAV_CDF = np.cumsum(_FAV_W)[:-1]
_ACTION_W = np.array([0.2, 1.0, 2.0, 3.0])  # impression, click, cart, order
_DECAY_S = 30 * _DAY
# Coefficients of the hidden model (module docstring); tuned so that the
# ceiling CTR AUC is ~0.86 on the smoke shapes and ~0.83 at 2K.
COEF = dict(
  ctr0=-2.8,
  cat=8.0,
  item=15.0,
  pop=1.0,
  cheap=0.3,
  dense=0.4,
  cvr0=-1.8,
  deep=10.0,
  cheap_cvr=0.5,
)


@dataclasses.dataclass(frozen=True)
class World:
  cat_p: np.ndarray  # float64[K] category popularity
  item_cat: np.ndarray  # int32[I]
  cat_items: np.ndarray  # int32[I] items grouped by category, by id inside
  cat_start: np.ndarray  # int64[K+1]
  item_price: np.ndarray  # float64[I] base price
  cat_price: np.ndarray  # float64[K] median price
  user_fav: np.ndarray  # int32[U, 4]
  cat_alias: tuple  # (prob float64[K], alias int64[K]) for O(1) draws


@functools.lru_cache(maxsize=4)
def world(cfg: DataConfig) -> World:
  rng = np.random.default_rng([cfg.seed, 7])
  k, n = cfg.num_categories, cfg.num_items
  cat_p = _zipf(k, cfg.category_zipf)
  # Every category gets one item, the rest go by category popularity; item
  # ids are shuffled so that each category has popular and rare items.
  per_cat = 1 + rng.multinomial(n - k, cat_p)
  item_cat = np.repeat(np.arange(k, dtype=np.int32), per_cat)
  item_cat = item_cat[rng.permutation(n)]
  cat_items = np.argsort(item_cat, kind="stable").astype(np.int32)
  cat_start = np.concatenate([[0], np.cumsum(per_cat)]).astype(np.int64)
  cat_price = np.exp(rng.normal(3.0, 1.0, k))
  item_price = cat_price[item_cat] * np.exp(rng.normal(0.0, 0.5, n))
  user_fav = rng.choice(k, size=(cfg.num_users, 4), p=cat_p).astype(np.int32)
  return World(
    cat_p,
    item_cat,
    cat_items,
    cat_start,
    item_price,
    cat_price,
    user_fav,
    _alias_table(cat_p),
  )


def _alias_table(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Walker/Vose alias table: draw i uniformly, keep it with prob[i], else
  take alias[i]; O(1) per draw instead of a binary search over the CDF."""
  k = p.size
  scaled = p * k
  prob = np.ones(k)
  alias = np.arange(k)
  small = [i for i in range(k) if scaled[i] < 1.0]
  large = [i for i in range(k) if scaled[i] >= 1.0]
  while small and large:
    s, g = small.pop(), large.pop()
    prob[s], alias[s] = scaled[s], g
    scaled[g] -= 1.0 - scaled[s]
    (small if scaled[g] < 1.0 else large).append(g)
  return prob, alias


def _zipf(n: int, a: float) -> np.ndarray:
  p = 1.0 / np.arange(1, n + 1) ** a
  return p / p.sum()


def _sample_items(w: World, cats, rng) -> np.ndarray:
  """One item per category in `cats`, ~1/(j+1) over the category's items."""
  size = w.cat_start[cats + 1] - w.cat_start[cats]
  j = np.floor(np.exp(rng.random(cats.shape) * np.log(size + 1.0))) - 1
  j = np.clip(j, 0, size - 1).astype(np.int64)
  return w.cat_items[w.cat_start[cats] + j]


def _categories(w: World, fav_rows, is_fav, rng) -> np.ndarray:
  """Favourite category of `fav_rows` users where is_fav, else by popularity."""
  out = np.empty(is_fav.shape, np.int64)
  fav = np.flatnonzero(is_fav)
  pick = np.searchsorted(_FAV_CDF, rng.random(fav.size), side="right")
  out[fav] = w.user_fav[fav_rows[fav], pick]
  glob = np.flatnonzero(~is_fav)
  prob, alias = w.cat_alias
  i = rng.integers(0, prob.size, glob.size)
  out[glob] = np.where(rng.random(glob.size) < prob[i], i, alias[i])
  return out


def generate_raw(cfg: DataConfig, split: int, shard: int, block: int, r: int):
  """Event log and unlabelled requests of one block of `r` requests.

  The log's owner keys are the request indices 0..r-1 (a user id may appear
  twice in a block with two different histories).
  """
  w = world(cfg)
  rng = np.random.default_rng([cfg.seed, split, shard, block])
  user_row = rng.integers(0, cfg.num_users, r)
  base = _T0 + (30 * _DAY if split == EVAL else 0)
  req_ts = base + rng.integers(0, 30 * _DAY, r)

  length = np.exp(rng.normal(np.log(cfg.len_median), cfg.len_sigma, r))
  length[rng.random(r) < cfg.zero_len_frac] = 0
  # Raw past events so that about `length` survive the quota: a share s of
  # impressions of which only `imp_cap` are kept, 2% of actions repeated.
  share = rng.uniform(0.1, 0.6, r)
  imp_cap = dict(cfg.quota).get("impression", 0)
  n_past = np.where(
    length * share <= imp_cap, length, (length - imp_cap) / (1 - share)
  )
  n_past = np.round(n_past / (1 - 0.02 * (1 - share))).astype(np.int64)
  n_fut = 1 + rng.poisson(1.0, r)  # >= 1, so every user is in the log
  n_seg = n_past + n_fut
  seg = np.repeat(np.arange(r), n_seg)
  n = seg.size
  seg_start = np.cumsum(n_seg) - n_seg
  pos = np.arange(n) - seg_start[seg]  # position inside the request's events
  fut = pos >= n_past[seg]

  # Sorted times without a sort: uniform order statistics are normalised
  # cumulative sums of exponentials (m + 1 of them for m points), here one
  # extra per request; the map u -> age is decreasing, so ts increases.
  e = rng.standard_exponential(n + r)
  cs = np.cumsum(e)
  ends = np.cumsum(n_seg + 1) - 1  # the extra exponential of each request
  base_cs = np.concatenate([[0.0], cs[ends[:-1]]])
  total = cs[ends] - base_cs
  ext = np.arange(n) + seg  # index of each event in the (n + r) array
  u = (cs[ext] - base_cs[seg]) / total[seg]
  lo, hi = np.log(60.0), np.log(180.0 * _DAY)
  age = np.exp(hi - u * (hi - lo))
  ts = req_ts[seg] - age.astype(np.int64)
  # Future events (leakage bait): at or after the request time, in order.
  fpos = (pos - n_past[seg])[fut]
  ts[fut] = req_ts[seg[fut]] + fpos * 60 * (fpos > 0)

  is_imp = (rng.random(n) < share[seg]) & ~fut
  is_fav = rng.random(n) < np.where(is_imp, 0.3, 0.75)
  cat = _categories(w, user_row[seg], is_fav, rng)
  item = _sample_items(w, cat, rng)
  v = rng.random(n)
  act_fav = np.searchsorted([0.75, 0.90], v, side="right") + 1
  act_glob = np.searchsorted([0.90, 0.97], v, side="right") + 1
  action = np.where(is_fav, act_fav, act_glob)
  action[is_imp] = ACTION_ID["impression"]
  # 2% of actions are logged twice: a copy of the previous event, same
  # second (removed by "consecutive" dedup).
  dup = np.flatnonzero((rng.random(n) < 0.02) & ~is_imp & ~fut & (pos > 0))
  cat[dup], item[dup], action[dup] = (
    cat[dup - 1],
    item[dup - 1],
    action[dup - 1],
  )
  ts[dup] = ts[dup - 1]
  price = w.item_price[item] * np.exp(rng.normal(0.0, 0.1, n))
  log = EventLog(
    user=seg.astype(np.int64),
    ts=ts,
    item=item.astype(np.int32),
    category=cat.astype(np.int32),
    action=action.astype(np.int8),
    price=price.astype(np.float32),
  )

  n_cand = rng.integers(cfg.min_cands, cfg.max_cands + 1, r)
  cseg = np.repeat(np.arange(r), n_cand)
  c_fav = rng.random(cseg.size) < 0.5
  c_cat = _categories(w, user_row[cseg], c_fav, rng)
  c_item = _sample_items(w, c_cat, rng)
  c_price = w.item_price[c_item] * np.exp(rng.normal(0.0, 0.1, cseg.size))
  req = Requests(
    user=np.arange(r, dtype=np.int64),
    ts=req_ts.astype(np.int64),
    user_row=user_row.astype(np.int32),
    dense=rng.normal(0.0, 1.0, (r, cfg.num_dense)).astype(np.float32),
    cand_offsets=np.concatenate([[0], np.cumsum(n_cand)]).astype(np.int64),
    cand_item=c_item.astype(np.int32),
    cand_category=c_cat.astype(np.int32),
    cand_price=c_price.astype(np.float32),
    labels=np.zeros((cseg.size, len(TASKS)), np.float32),
    source=f"synthetic(split={split}, shard={shard}, block={block})",
  )
  return log, req, rng


def hidden_probs(cfg, req: Requests, offsets, cols, seg):
  """True (p_ctr, p_conversion) float64[c] of every candidate."""
  w = world(cfg)
  r, k = len(req), cfg.num_categories
  age = (req.ts[seg] - cols["ts"]).astype(np.float64)
  action = cols["action"].astype(np.int64)
  wt = _ACTION_W[action] * np.exp(-age / _DECAY_S)
  deep = np.where(action >= ACTION_ID["cart"], wt, 0.0)
  key_c = seg * k + cols["category"]
  a_cat = np.bincount(key_c, weights=wt, minlength=r * k)
  d_cat = np.bincount(key_c, weights=deep, minlength=r * k)
  cseg = np.repeat(np.arange(r), np.diff(req.cand_offsets))
  ci = req.cand_item.astype(np.int64)
  cc = req.cand_category.astype(np.int64)
  # Shares of the request's total weight: comparable for short and long
  # histories (+1 so that a nearly empty history has small shares).
  tot = np.bincount(seg, weights=wt, minlength=r)[cseg] + 1.0
  a_cat = a_cat[cseg * k + cc] / tot
  d_cat = d_cat[cseg * k + cc] / tot
  # Item share: look every history event up among the (few) candidate
  # (request, item) keys, then sum weights per candidate key.
  q = cseg * cfg.num_items + ci
  uq, q_inv = np.unique(q, return_inverse=True)
  key_i = seg * cfg.num_items + cols["item"]
  if uq.size:
    pos = np.minimum(np.searchsorted(uq, key_i), uq.size - 1)
    hit = uq[pos] == key_i
    sums = np.bincount(pos[hit], weights=wt[hit], minlength=uq.size)
    a_item = sums[q_inv] / tot
  else:
    a_item = np.zeros(q.shape)
  pop = -np.log1p(ci) / np.log(max(cfg.num_items, 2))
  cheap = -(np.log(req.cand_price + 1e-3) - np.log(w.cat_price[cc]))
  dense = req.dense[cseg].astype(np.float64)
  d0 = dense[:, 0] if cfg.num_dense > 0 else 0.0
  d1 = dense[:, 1] if cfg.num_dense > 1 else 0.0
  c = COEF
  ctr = (
    c["ctr0"]
    + c["cat"] * a_cat
    + c["item"] * a_item
    + c["pop"] * pop
    + c["cheap"] * cheap
    + c["dense"] * d0
  )
  cvr = c["cvr0"] + c["deep"] * d_cat + c["cheap_cvr"] * cheap + c["dense"] * d1
  p_ctr = 1 / (1 + np.exp(-ctr))
  return p_ctr, p_ctr / (1 + np.exp(-cvr))


def make_block(
  cfg: DataConfig,
  split: int,
  shard: int,
  block: int,
  r: int,
  counters=None,
  with_probs: bool = False,
):
  """One built, labelled block: a JaggedBatch with exact capacities."""
  log, req, rng = generate_raw(cfg, split, shard, block, r)
  offsets, cols, seg = build.build_sequences(log, req, cfg, counters)
  p_ctr, p_conv = hidden_probs(cfg, req, offsets, cols, seg)
  u = rng.random((p_ctr.size, 2))
  click = u[:, 0] < p_ctr
  conv = click & (u[:, 1] < p_conv / np.maximum(p_ctr, 1e-12))
  labels = np.stack([click, conv], 1).astype(np.float32)
  batch = build.assemble(req, offsets, cols, seg, cfg, labels)
  if with_probs:
    return batch, np.stack([p_ctr, p_conv], 1)
  return batch


def eval_blocks(cfg: DataConfig, with_probs: bool = False):
  """The held-out set: `cfg.eval_requests` requests in blocks of 256."""
  done = 0
  for b in range(-(-cfg.eval_requests // EVAL_BLOCK)):
    r = min(EVAL_BLOCK, cfg.eval_requests - done)
    done += r
    yield make_block(cfg, EVAL, 0, b, r, with_probs=with_probs)


def hidden_model_probs(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
  """Labels and the hidden model's true probabilities on the eval set, both
  `[candidates, tasks]`. Their AUC per task (`gemjax.metrics.auc`, which the
  caller applies: data sits below metrics) is the ceiling a model can reach."""
  labels, probs = [], []
  for batch, p in eval_blocks(cfg, with_probs=True):
    labels.append(batch.labels)
    probs.append(p)
  return np.concatenate(labels), np.concatenate(probs)
