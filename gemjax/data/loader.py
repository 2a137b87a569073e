"""The training and evaluation iterators: blocks -> planned batches -> buffers.

Each data-parallel shard (global index `s` of `num_shards`) owns an
independent, infinite stream of *blocks*: block `k` of shard `s` is
`bbs_pool_batches * requests_per_shard` requests, a pure function of
(cfg.seed, split, s, k). A block is built (request builder, labels) once,
planned into `bbs_pool_batches` full batches (BBS or stream order, see
`bbs.py`) and consumed one batch per step. A process only ever builds its
own shards' blocks, so hosts read disjoint data without talking.

Packing never loses a request: the planned batch of a step is appended to the
shard's *carry* (requests deferred earlier, first in line) and `first_fit`
takes what fits the static buffers (b requests, t tokens, c candidates); the
rest is carried to the next step (counter `carried_over`, one per deferral).

State. A position is (block, step in block, carried request ids as
[block, index] pairs, counters): small and JSON-serializable. `restore`
rebuilds the referenced blocks from the seed, so a resumed loader yields
exactly the batches the uninterrupted one would have. With `prefetch > 0` a
background thread produces batches ahead; `state()` always describes the
position after the last batch *returned*, not produced.

Sources: `SyntheticSource` (generated logs, one per block) or `LogSource`
(a MovieLens / Taobao / event-CSV file, `cfg.source`, read once per process
keeping only its shards' users). With `cfg.workers > 0`, synthetic blocks
are built ahead in spawned processes; blocks are pure functions of their
key, so the batches are the same.

Eval (`eval_batches`) packs the fixed held-out requests (synthetic split 1,
`cfg.eval_requests` of them, disjoint streams from training) greedily in
order: step by step, shard by shard. Its batches depend on `num_shards` but
the set of requests does not; every process computes the same plan and
keeps its own shards.
"""

import concurrent.futures
import copy
import dataclasses
import multiprocessing
import queue
import sys
import threading
from collections.abc import Iterator

import numpy as np

from gemjax.data import bbs, build, events, protocol, synthetic
from gemjax.data.config import DataConfig
from gemjax.data.jagged import JaggedBatch, stack

_STATE_VERSION = 1


def resolve_capacities(
  cfg: DataConfig, num_shards: int, shards: range, headroom: float = 1.15
) -> DataConfig:
  """`cfg` with `token_capacity` / `cand_capacity` of 0 derived from the
  log: `requests_per_shard` requests of the mean built history length
  (candidates) plus `headroom`, in multiples of 128 (16), and never below
  one full-length history (the largest request's candidates). Nothing to do
  for synthetic traffic or set capacities."""
  if cfg.source == "synthetic" or (cfg.token_capacity and cfg.cand_capacity):
    return cfg
  src = make_source(cfg, num_shards, shards)
  req = src.req
  take = np.random.default_rng([cfg.seed, 5]).permutation(len(req))[:4096]
  sample = req.take(np.sort(take))
  off, _, _ = build.build_sequences(src.log, sample, cfg, None)
  b = cfg.requests_per_shard
  mean_len = float(np.diff(off).mean())
  mean_c = float(np.diff(sample.cand_offsets).mean())
  up = lambda x, m: int(-(-x // m) * m)
  tokens = cfg.token_capacity or max(
    cfg.max_seq_len, up(b * mean_len * headroom, 128)
  )
  cands = cfg.cand_capacity or max(
    cfg.max_request_cands, up(b * mean_c * headroom, 16)
  )
  src.counters["derived_token_capacity"] = tokens
  src.counters["derived_cand_capacity"] = cands
  return dataclasses.replace(cfg, token_capacity=tokens, cand_capacity=cands)


def local_shards(num_shards, process_index, process_count) -> range:
  if num_shards % process_count:
    raise ValueError(
      f"num_shards {num_shards} is not a multiple of process_count "
      f"{process_count}"
    )
  per = num_shards // process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} of {process_count}")
  return range(process_index * per, (process_index + 1) * per)


class SyntheticSource:
  """Generated traffic: block k of shard s is a function of (seed, s, k)."""

  def __init__(self, cfg: DataConfig):
    self.cfg = cfg
    self.counters: dict[str, int] = {}

  def block(self, shard: int, block: int, size: int, counters) -> JaggedBatch:
    return synthetic.make_block(
      self.cfg, synthetic.TRAIN, shard, block, size, counters
    )

  def eval_pools(self) -> tuple[list[JaggedBatch], bool]:
    """(pools, global): global pools are the same on every process."""
    return list(synthetic.eval_blocks(self.cfg)), True


class LogSource:
  """A real event log (`cfg.source` other than "synthetic", see READERS).

  Users are spread over the `num_shards` shards by a hash of the user id;
  this process keeps only its shards' users while reading (memory holds its
  part only). Train and held-out requests come from the offline protocol
  of `cfg.protocol` (`gemjax.data.protocol`). The training stream of a
  shard is an endless sequence of epochs, each a permutation of the
  shard's requests seeded by (seed, shard, epoch); block k is the k-th run
  of `size` requests of that stream. The eval set of a process is its own
  users' held-out requests (so with several processes, their numbers of
  eval steps can differ). A temporal split needs one cut for all
  processes: with several, `split_time` must be set, since each process
  sees only its users' events; negatives are sampled from the process's
  own part of the log.
  """

  READERS = {
    "movielens": events.read_movielens,
    "taobao": events.read_taobao,
    "recbole": events.read_recbole,
    "events": events.read_events_csv,
    "parquet": events.read_events_parquet,
  }

  def __init__(self, cfg: DataConfig, num_shards: int, shards: range):
    self.cfg = cfg
    self.counters: dict[str, int] = {}
    mine = np.zeros(num_shards, bool)
    mine[list(shards)] = True
    if (
      len(shards) < num_shards
      and cfg.protocol == "temporal"
      and not cfg.split_time
    ):
      raise ValueError(
        "data.split_time must be set when several processes read a log "
        "under the temporal protocol (each process sees only its users)"
      )
    keep = lambda u: mine[events.hash_rows(u, num_shards)]
    self.log = self.READERS[cfg.source](cfg.path, cfg, self.counters, keep)
    if 0 in shards:  # one summary per run: the process holding shard 0
      for line in events.describe(cfg.path, self.counters, cfg):
        print(line, file=sys.stderr)
    self.req, self.held_req = protocol.split_requests(
      self.log, cfg, cfg.path, self.counters
    )
    shard_of = events.hash_rows(self.req.user, num_shards)
    self.train = {}
    for s in shards:
      idx = np.flatnonzero(shard_of == s)
      if not idx.size:
        raise ValueError(f"{cfg.path}: shard {s} has no training requests")
      self.train[s] = idx

  def _built(self, req, counters) -> JaggedBatch:
    offsets, cols, seg = build.build_sequences(
      self.log, req, self.cfg, counters
    )
    return build.assemble(req, offsets, cols, seg, self.cfg)

  def block(self, shard: int, block: int, size: int, counters) -> JaggedBatch:
    reqs = self.train[shard]
    n = reqs.size
    pos = np.arange(block * size, (block + 1) * size)
    idx = np.empty(size, np.int64)
    for epoch in np.unique(pos // n):
      perm = np.random.default_rng(
        [self.cfg.seed, 3, shard, int(epoch)]
      ).permutation(n)
      here = pos // n == epoch
      idx[here] = reqs[perm[pos[here] % n]]
    return self._built(self.req.take(idx), counters)

  def eval_pools(self) -> tuple[list[JaggedBatch], bool]:
    blk = synthetic.EVAL_BLOCK
    n = len(self.held_req)
    return [
      self._built(self.held_req.take(np.arange(i, min(i + blk, n))), None)
      for i in range(0, n, blk)
    ], False

  def train_pools(self, size: int = 1024) -> list[JaggedBatch]:
    """Every training request of the local shards once, built in pools of
    `size` (what the baselines fit on)."""
    idx = np.sort(np.concatenate(list(self.train.values())))
    return [
      self._built(self.req.take(idx[i : i + size]), None)
      for i in range(0, idx.size, size)
    ]


# Log sources read a file and build the protocol's requests: the train and
# eval loaders of a run (and its baselines) share one per process. Buffer
# capacities do not change what a source holds, so they are not in its key.
_SOURCES: dict = {}


def make_source(cfg: DataConfig, num_shards: int, shards: range):
  if cfg.source == "synthetic":
    return SyntheticSource(cfg)
  key = (
    dataclasses.replace(cfg, token_capacity=0, cand_capacity=0),
    num_shards,
    shards,
  )
  if key not in _SOURCES:
    _SOURCES.clear()  # one log in memory at a time
    _SOURCES[key] = LogSource(cfg, num_shards, shards)
  return _SOURCES[key]


class _Blocks:
  """Built blocks of the local shards, with their plans, cached while needed."""

  def __init__(self, cfg: DataConfig, source, shards: range):
    self.cfg = cfg
    self.source = source
    self.shards = shards
    self.pool = cfg.bbs_pool_batches * cfg.requests_per_shard
    self._cache: dict[tuple[int, int], tuple] = {}
    self._futures: dict = {}
    self._executor = None
    if cfg.workers > 0 and isinstance(source, SyntheticSource):
      # Spawned processes (JAX and fork do not mix); each builds whole
      # blocks, which are pure functions of their key, so order and
      # determinism are unchanged.
      self._executor = concurrent.futures.ProcessPoolExecutor(
        cfg.workers, mp_context=multiprocessing.get_context("spawn")
      )

  def _submit(self, block: int) -> None:
    """Start building blocks block.. ahead, enough to keep workers busy."""
    ahead = max(1, -(-self.cfg.workers // len(self.shards)))
    for b in range(block, block + ahead + 1):
      for s in self.shards:
        if (s, b) not in self._cache and (s, b) not in self._futures:
          self._futures[s, b] = self._executor.submit(
            _build_block, self.source, s, b, self.pool
          )

  def close(self) -> None:
    if self._executor is not None:
      for f in self._futures.values():
        f.cancel()
      self._executor.shutdown(wait=True)
      self._executor = None
      self._futures = {}

  def get(self, shard: int, block: int, counters=None):
    """(pool, plan) of a block; adds its build counters to `counters`."""
    key = (shard, block)
    if key not in self._cache:
      cfg = self.cfg
      if self._executor is not None:
        self._submit(block)
        pool, built = self._futures.pop(key).result()
      else:
        pool, built = _build_block(self.source, shard, block, self.pool)
      if cfg.batching == "bbs":
        w = bbs.sample_weight(np.diff(pool.offsets), cfg.bbs_weight)
        plan = bbs.plan_bbs(w, cfg.requests_per_shard, cfg.bbs_minibatch)
      else:
        plan = bbs.plan_random(self.pool, cfg.requests_per_shard)
      self._cache[key] = (pool, plan, built)
    pool, plan, built = self._cache[key]
    if counters is not None:
      for k, v in built.items():
        counters[k] = counters.get(k, 0) + v
    return pool, plan

  def keep_only(self, needed: set) -> None:
    for key in list(self._cache):
      if key not in needed:
        del self._cache[key]


def _build_block(source, shard: int, block: int, size: int):
  built = {}
  return source.block(shard, block, size, built), built


class Loader:
  """Iterator of numpy JaggedBatches stacked to [local shards, ...]."""

  def __init__(
    self,
    cfg: DataConfig,
    *,
    num_shards: int,
    split: str = "train",
    process_index: int = 0,
    process_count: int = 1,
  ):
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    self.cfg = cfg
    self.num_shards = num_shards
    self.split = split
    self.shards = local_shards(num_shards, process_index, process_count)
    self.source = make_source(cfg, num_shards, self.shards)
    self._blocks = _Blocks(cfg, self.source, self.shards)
    self._eval = None
    self._pos = self._initial_position()
    self._visible = copy.deepcopy(self._pos)
    self._thread = None
    self._queue = None
    self._stop = None

  # -- position -------------------------------------------------------------

  def _initial_position(self) -> dict:
    return {
      "version": _STATE_VERSION,
      "split": self.split,
      "num_shards": self.num_shards,
      "step": 0,  # batches yielded so far
      "block": 0,
      "step_in_block": 0,
      "carry": {str(s): [] for s in self.shards},
      "counters": dict(self.source.counters),  # reading counters
    }

  def state(self) -> dict:
    """JSON-serializable position after the last batch returned."""
    return copy.deepcopy(self._visible)

  def restore(self, state: dict) -> None:
    """Continue exactly where `state` was taken."""
    if state.get("version") != _STATE_VERSION:
      raise ValueError(f"loader state version {state.get('version')}")
    want = {
      "split": self.split,
      "num_shards": self.num_shards,
      "shards": sorted(self.shards),
    }
    got = {
      "split": state.get("split"),
      "num_shards": state.get("num_shards"),
      "shards": sorted(int(s) for s in state.get("carry", {})),
    }
    diff = [f"{k} {got[k]} (this loader: {want[k]})" for k in want]
    diff = [d for d, k in zip(diff, want, strict=True) if got[k] != want[k]]
    if diff:
      raise ValueError(f"loader state is for another loader: {'; '.join(diff)}")
    self._stop_thread()
    self._pos = copy.deepcopy(state)
    self._visible = copy.deepcopy(state)
    self._eval = None

  @property
  def counters(self) -> dict[str, int]:
    """Build and packing counters (truncations, carries, dedup, quota, ...)."""
    return dict(self._visible["counters"])

  # -- iteration ------------------------------------------------------------

  def __iter__(self):
    return self

  def __next__(self) -> JaggedBatch:
    if self.cfg.prefetch <= 0:
      batch, pos = self._produce()
      self._visible = pos
      return batch
    if self._thread is None:
      self._start_thread()
    item = self._queue.get()
    if isinstance(item, BaseException):
      self._thread = None
      raise item
    batch, pos = item
    self._visible = pos
    return batch

  def close(self) -> None:
    """Stop the prefetch thread and the worker processes."""
    self._stop_thread()
    self._blocks.close()

  def _start_thread(self):
    self._queue = queue.Queue(maxsize=self.cfg.prefetch)
    self._stop = threading.Event()
    stop, q = self._stop, self._queue

    def work():
      while not stop.is_set():
        try:
          item = self._produce()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
          item = e
        while not stop.is_set():
          try:
            q.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
        if isinstance(item, BaseException):
          return

    self._thread = threading.Thread(target=work, daemon=True, name="loader")
    self._thread.start()

  def _stop_thread(self):
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
      # Produced but not returned batches are dropped; the position goes
      # back to what the consumer saw.
      self._pos = copy.deepcopy(self._visible)

  def _produce(self) -> tuple[JaggedBatch, dict]:
    if self.split == "eval":
      return self._produce_eval()
    cfg, pos = self.cfg, self._pos
    counters = pos["counters"]
    k, j = pos["block"], pos["step_in_block"]
    out = []
    for s in self.shards:
      pool, plan = self._blocks.get(s, k, counters if j == 0 else None)
      carry = pos["carry"][str(s)]
      queue_ = [tuple(x) for x in carry] + [(k, int(i)) for i in plan[j]]
      lens, ncands = [], []
      for b, i in queue_:
        p = self._blocks.get(s, b)[0]
        lens.append(int(p.offsets[i + 1] - p.offsets[i]))
        ncands.append(int(p.cand_offsets[i + 1] - p.cand_offsets[i]))
      take, rest = bbs.first_fit(
        lens,
        ncands,
        cfg.requests_per_shard,
        cfg.token_capacity,
        cfg.cand_capacity,
      )
      counters["carried_over"] = counters.get("carried_over", 0) + len(rest)
      counters["requests"] = counters.get("requests", 0) + len(take)
      counters["tokens"] = counters.get("tokens", 0) + sum(
        lens[i] for i in take
      )
      parts = _group_by_block([queue_[i] for i in take], self._blocks, s)
      if not parts:
        parts = [(pool, np.zeros(0, np.int64))]
      out.append(
        bbs.gather(
          parts, cfg.requests_per_shard, cfg.token_capacity, cfg.cand_capacity
        )
      )
      pos["carry"][str(s)] = [list(queue_[i]) for i in rest]
      if len(rest) > 4 * cfg.requests_per_shard:
        raise RuntimeError(
          f"shard {s}: {len(rest)} requests waiting; token_capacity "
          f"{cfg.token_capacity} / cand_capacity {cfg.cand_capacity} are "
          f"too small for {cfg.requests_per_shard} requests per shard "
          "(set them to 0 to derive them from a log)"
        )
    pos["step"] += 1
    pos["step_in_block"] += 1
    if pos["step_in_block"] == cfg.bbs_pool_batches:
      pos["block"] += 1
      pos["step_in_block"] = 0
    needed = {(s, pos["block"]) for s in self.shards}
    needed |= {(s, b) for s in self.shards for b, _ in pos["carry"][str(s)]}
    self._blocks.keep_only(needed)
    return stack(out), copy.deepcopy(pos)

  def _produce_eval(self):
    if self._eval is None:
      pools, is_global = self.source.eval_pools()
      n = self.num_shards if is_global else len(self.shards)
      plan = _eval_plan(self.cfg, pools, n)
      cols = list(self.shards) if is_global else list(range(n))
      self._eval = plan, pools, cols
    plan, pools, cols = self._eval
    pos = self._pos
    if pos["step"] >= len(plan):
      raise StopIteration
    batch = stack(
      [_eval_shard(self.cfg, plan[pos["step"]][s], pools) for s in cols]
    )
    pos["step"] += 1
    return batch, copy.deepcopy(pos)


def _group_by_block(refs, blocks: _Blocks, shard: int):
  parts = []
  for b, i in refs:
    if parts and parts[-1][0] == b:
      parts[-1][1].append(i)
    else:
      parts.append((b, [i]))
  return [(blocks.get(shard, b)[0], np.array(ix, np.int64)) for b, ix in parts]


def _eval_plan(cfg: DataConfig, pools, num_shards: int):
  """Greedy in-order packing of the eval set: plan[step][shard] = refs."""
  refs = [(b, i) for b, p in enumerate(pools) for i in range(p.num_requests)]
  plan, cur, shard = [], [], []
  n_t = n_c = 0
  for b, i in refs:
    p = pools[b]
    ln = int(p.offsets[i + 1] - p.offsets[i])
    nc = int(p.cand_offsets[i + 1] - p.cand_offsets[i])
    if (
      len(shard) == cfg.requests_per_shard
      or n_t + ln > cfg.token_capacity
      or n_c + nc > cfg.cand_capacity
    ):
      cur.append(shard)
      shard, n_t, n_c = [], 0, 0
      if len(cur) == num_shards:
        plan.append(cur)
        cur = []
    shard.append((b, i))
    n_t += ln
    n_c += nc
  if shard:
    cur.append(shard)
  if cur:
    cur += [[] for _ in range(num_shards - len(cur))]
    plan.append(cur)
  return plan


def _eval_shard(cfg, refs, pools) -> JaggedBatch:
  parts = []
  for b, i in refs:
    if parts and parts[-1][0] == b:
      parts[-1][1].append(i)
    else:
      parts.append((b, [i]))
  parts = [(pools[b], np.array(ix, np.int64)) for b, ix in parts]
  if not parts:
    parts = [(pools[0], np.zeros(0, np.int64))]
  return bbs.gather(
    parts, cfg.requests_per_shard, cfg.token_capacity, cfg.cand_capacity
  )


def eval_batches(
  cfg: DataConfig,
  *,
  num_shards: int,
  process_index: int = 0,
  process_count: int = 1,
) -> Iterator[JaggedBatch]:
  """The held-out set, once, as batches stacked to [local shards, ...]."""
  loader = Loader(
    cfg,
    num_shards=num_shards,
    split="eval",
    process_index=process_index,
    process_count=process_count,
  )
  try:
    yield from loader
  finally:
    loader.close()
