"""`Ranker`: score candidates with a trained model, from a checkpoint or an
exported artifact.

  ranker = Ranker.from_checkpoint("runs/smoke")        # Orbax, latest step
  probs = ranker.score([request, ...])                 # [n_cands, tasks] each
  ranker.export("serving/smoke")                       # jax.export, per bucket
  Ranker.from_export("serving/smoke").score(...)       # no model code needed

Scoring a list of requests (`requests` module for the format):
1. the requests become the training pipeline's `EventLog` + `Requests`, and
   their histories are built by `gemjax.data.build` (anti-leakage at the
   request time, dedup, action quota, `max_seq_len` cut, log buckets): the
   same code as training, so served features equal trained ones;
2. requests with more candidates than any bucket takes from one request
   are split into chunks; units are packed into batches of the capacity
   buckets (`batching`), all of a call's batches dispatched before any
   result is read;
3. each batch runs the bucket's compiled scorer: the model's forward
   (`RankingModel.__call__`: stage 1 once per request, then the candidates
   through the cross blocks as one flattened query set per request, O13),
   then a sigmoid: `eval_step` on one shard.

Programs are compiled once per bucket (`compilations` counts them;
`warmup()` compiles all), with ahead-of-time `lower().compile()`: a compiled
program only ever runs its own shapes, so nothing recompiles afterwards.
"""

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np

from gemjax import config as config_lib
from gemjax.data import bbs, build
from gemjax.data.events import Requests, ranges
from gemjax.serve import batching
from gemjax.serve.cache import HistoryCache, fingerprint
from gemjax.serve.requests import (
  PLACEHOLDER,
  parse_request,
  to_log_and_requests,
)

MANIFEST = "manifest.json"
PARAMS = "params.npz"


def load_run_config(run_dir, step: int | None = None):
  """(Config, step) of a run: the checkpoint's "config" item when it has
  one, else the `start` record of `metrics.jsonl`. `step` None = latest."""
  import orbax.checkpoint as ocp

  run_dir = pathlib.Path(run_dir)
  ckpt_dir = (run_dir / "checkpoints").absolute()
  if not ckpt_dir.is_dir():
    raise FileNotFoundError(f"{run_dir}: no checkpoints/ directory")
  mgr = ocp.CheckpointManager(ckpt_dir)
  try:
    steps = mgr.all_steps()
    if not steps:
      raise FileNotFoundError(f"{ckpt_dir}: no checkpoint")
    if step is None:
      step = max(steps)
    elif step not in steps:
      raise FileNotFoundError(f"{ckpt_dir}: no step {step} (have {steps})")
    if (ckpt_dir / str(step) / "config").is_dir():
      out = mgr.restore(
        step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
      )
      return config_lib.from_dict(out["config"]), step
  finally:
    mgr.close()
  log = run_dir / "metrics.jsonl"
  if not log.exists():
    raise FileNotFoundError(
      f"{run_dir}: the checkpoint has no config item and there is no "
      "metrics.jsonl to read it from"
    )
  with open(log) as f:
    for line in f:
      rec = json.loads(line)
      if rec.get("event") == "start":
        return config_lib.from_dict(rec["config"]), step
  raise ValueError(f"{log}: no 'start' record with the run's config")


def _one_device(cfg):
  """`cfg` placed on one device: serving runs one process per device."""
  import dataclasses

  mesh = dataclasses.replace(cfg.mesh, cluster=1, zone=1, node=1, data_shards=0)
  return dataclasses.replace(cfg, mesh=mesh)


def _model_program(model_def, max_len, bucket, path, chunk, treedefs, kind):
  """A flat program of one bucket, by `kind`:
  "score": (param leaves, batch leaves) -> probs `[c, tasks]` (f32), i.e.
  `eval_step` on one unstacked batch; "encode": -> stage 1's (sequence
  rows, user vectors); "cross": (param leaves, batch leaves, sequence
  rows, user vectors) -> probs (stage 2 on a cached stage 1)."""
  from gemjax.serve.paths import cross_op

  op = cross_op(path, chunk)
  params_def, batch_def = treedefs

  def bind(param_leaves, batch_leaves):
    model = model_def.bind(jax.tree.unflatten(params_def, param_leaves))
    return model, jax.tree.unflatten(batch_def, batch_leaves)

  def probs(param_leaves, batch_leaves, seq_td=None, user_bd=None):
    model, batch = bind(param_leaves, batch_leaves)
    logits = model(
      batch,
      max_len=max_len,
      max_cands=bucket.request_cands,
      cross_op=op,
      encoded=None if seq_td is None else (seq_td, user_bd),
    )
    return jax.nn.sigmoid(logits)

  def encode(param_leaves, batch_leaves):
    model, batch = bind(param_leaves, batch_leaves)
    return model.encode(batch, max_len=max_len)

  return {"score": probs, "cross": probs, "encode": encode}[kind]


class Ranker:
  """Scores requests with one set of parameters on one device.

  Built by `from_checkpoint`, `from_params` (whose `path` picks the
  cross-attention path, "m_falcon" by default, "per_candidate" or "padded",
  see `paths`; `chunk`: candidates per step of the per-candidate path) or
  `from_export`.
  """

  def __init__(self, cfg, param_leaves, buckets, programs, *, step=None):
    self.cfg = cfg
    self.tasks = tuple(cfg.model.tasks)
    self.param_leaves = param_leaves
    self.buckets = tuple(buckets)
    self.step = step
    self._make = programs  # bucket -> function to jit and compile
    self._compiled: dict = {}
    self.compilations = 0
    self.counters: dict[str, int] = {}
    self._examples: dict = {}
    # Called after every program run with (bucket, requests, candidates):
    # the HTTP service's batch-fill metric.
    self.on_batch = None
    self.cache = None  # HistoryCache of encoded histories, if enabled
    self._encode_s: dict = {}  # last measured stage-1 seconds per bucket
    self._encoded_spec: dict = {}  # stage 1's output shapes per bucket

  # -- Construction ---------------------------------------------------------

  @classmethod
  def from_checkpoint(
    cls,
    run_dir,
    step: int | None = None,
    *,
    shapes=batching.DEFAULT_SHAPES,
    path: str = "m_falcon",
    chunk: int = 128,
    cache_bytes: int = 0,
    device=None,
  ):
    """Restore a training run's parameters (Orbax, the trainer's abstract
    state, on one device) and its config. `cache_bytes` > 0 keeps encoded
    histories for repeated requests (`cache`)."""
    from gemjax.train.checkpoint import Checkpointer
    from gemjax.train.loop import Trainer

    cfg, step = load_run_config(run_dir, step)
    cfg = _one_device(cfg)
    device = device or jax.devices()[0]
    tr = Trainer.create(cfg, run_dir, devices=[device])
    ckpt = Checkpointer(pathlib.Path(run_dir) / "checkpoints")
    try:
      with jax.set_mesh(tr.mesh):
        state, _ = ckpt.restore(step, tr.abstract_state)
    finally:
      ckpt.close()
    return cls.from_params(
      cfg,
      jax.device_put(state["params"], device),
      tr.model_def,
      shapes=shapes,
      path=path,
      chunk=chunk,
      cache_bytes=cache_bytes,
      step=step,
    )

  @classmethod
  def from_params(
    cls,
    cfg,
    params,
    model_def,
    *,
    shapes=batching.DEFAULT_SHAPES,
    path: str = "m_falcon",
    chunk: int = 128,
    cache_bytes: int = 0,
    step=None,
  ):
    """A ranker of parameters already in memory (`state.build`'s
    `ModelDef` and params; benchmarks and notebooks)."""
    leaves, params_def = jax.tree.flatten(params)
    buckets = batching.make_buckets(shapes, cfg.data.max_seq_len)
    ranker = cls(cfg, leaves, buckets, None, step=step)
    batch_def = jax.tree.structure(ranker._example(buckets[0]))
    ranker._make = lambda b, kind="score": _model_program(
      model_def,
      cfg.data.max_seq_len,
      b,
      path,
      chunk,
      (params_def, batch_def),
      kind,
    )
    if cache_bytes:
      ranker.cache = HistoryCache(cache_bytes)
    return ranker

  @classmethod
  def from_export(cls, out_dir, device=None):
    """Serve an `export`ed artifact: serialized StableHLO per bucket plus
    the parameters; no model code is imported."""
    from jax import export as jax_export

    out_dir = pathlib.Path(out_dir)
    man = json.loads((out_dir / MANIFEST).read_text())
    cfg = config_lib.from_dict(man["config"])
    device = device or jax.devices()[0]
    with np.load(out_dir / PARAMS) as z:
      leaves = [
        jax.device_put(z[f"p{i}"], device) for i in range(man["num_params"])
      ]
    buckets = tuple(batching.Bucket(**b) for b in man["buckets"])
    files = dict(zip([b.name for b in buckets], man["files"], strict=True))

    def program(bucket, kind="score"):
      if kind != "score":
        raise ValueError("an exported ranker has no history cache")
      blob = (out_dir / files[bucket.name]).read_bytes()
      return jax_export.deserialize(bytearray(blob)).call

    return cls(cfg, leaves, buckets, program, step=man.get("step"))

  def export(self, out_dir, platforms=None) -> list[pathlib.Path]:
    """Write every bucket's scorer (`jax.export`, serialized StableHLO),
    the parameters (`params.npz`) and a manifest (config, buckets)."""
    from jax import export as jax_export

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.param_leaves]
    files = []
    for b in self.buckets:
      exp = jax_export.export(jax.jit(self._make(b)), platforms=platforms)(
        specs, self._batch_spec(b)
      )
      name = f"scorer_{b.name}.stablehlo"
      (out_dir / name).write_bytes(exp.serialize())
      files.append(name)
    np.savez(
      out_dir / PARAMS,
      **{f"p{i}": np.asarray(x) for i, x in enumerate(self.param_leaves)},
    )
    man = {
      "config": config_lib.to_dict(self.cfg),
      "step": self.step,
      "buckets": [
        {
          "requests": b.requests,
          "cands": b.cands,
          "tokens": b.tokens,
          "request_cands": b.request_cands,
        }
        for b in self.buckets
      ],
      "files": files,
      "num_params": len(self.param_leaves),
      "platforms": list(platforms or [jax.default_backend()]),
    }
    (out_dir / MANIFEST).write_text(json.dumps(man, indent=1))
    return [out_dir / f for f in files] + [out_dir / PARAMS, out_dir / MANIFEST]

  # -- Programs ----------------------------------------------------------

  def _example(self, bucket):
    """A batch of the bucket's shapes, from one empty-history request
    built by the real pipeline."""
    if bucket not in self._examples:
      one = {
        "user_row": 0,
        "ts": 0,
        "dense": [0.0] * self.cfg.data.num_dense,
        "candidates": {"item": [0], "category": [0], "price": [0.0]},
      }
      log, req = self.parse([one])
      pool = self._build(log, req, counters={})
      self._examples[bucket] = bbs.gather(
        [(pool, [0])], bucket.requests, bucket.tokens, bucket.cands
      )
    return self._examples[bucket]

  def _batch_spec(self, bucket):
    return [
      jax.ShapeDtypeStruct(x.shape, x.dtype)
      for x in jax.tree.leaves(self._example(bucket))
    ]

  def program(self, bucket, kind: str = "score"):
    """The bucket's compiled program (compiled on first use): "score", or
    with the history cache "encode" and "cross" (`_model_program`)."""
    if (bucket, kind) not in self._compiled:
      params = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        for x in self.param_leaves
      ]
      args = [params, self._batch_spec(bucket)]
      if kind == "cross":
        args += list(jax.eval_shape(self._make(bucket, "encode"), *args))
      fn = jax.jit(self._make(bucket, kind))
      self._compiled[bucket, kind] = fn.lower(*args).compile()
      self.compilations += 1
    return self._compiled[bucket, kind]

  def warmup(self) -> None:
    """Compile every bucket now, so that traffic never waits on XLA."""
    kinds = ("encode", "cross") if self.cache is not None else ("score",)
    for b in self.buckets:
      for kind in kinds:
        self.program(b, kind)

  # -- Scoring -----------------------------------------------------------

  def parse(self, requests):
    """Request dicts -> (EventLog, Requests); `RequestError` names the
    first bad field."""
    parsed = [
      parse_request(r, self.cfg.data, self.cfg.data.num_dense, f"requests[{i}]")
      for i, r in enumerate(requests)
    ]
    return to_log_and_requests(parsed, len(self.tasks))

  def score(self, requests) -> list[np.ndarray]:
    """Request dicts -> per request, probabilities `[n_cands, tasks]`."""
    return self.score_log(*self.parse(requests))

  def _build(self, log, req, counters=None):
    counters = self.counters if counters is None else counters
    offsets, cols, seg = build.build_sequences(
      log, req, self.cfg.data, counters
    )
    if PLACEHOLDER in log.extra:
      # Placeholders of empty histories are not leaked events.
      n = int(log.extra[PLACEHOLDER].sum())
      if n:
        counters["leakage_excluded"] -= n
      cols.pop(PLACEHOLDER)
    return build.assemble(req, offsets, cols, seg, self.cfg.data)

  def batches(self, log, req: Requests):
    """Yield (bucket, batch, rows, keys) for the requests: the packed
    jagged batch of each program call, the output rows (candidate positions
    of `req`) that its first `len(rows)` candidate rows score, and with the
    history cache each request's cache key (else None)."""
    counts = np.diff(req.cand_offsets)
    max_c = max(b.request_cands for b in self.buckets)
    units = batching.split_units(counts, max_c)
    ureq = _unit_requests(req, units, len(self.tasks))
    pool = self._build(log, ureq)
    unit_c = [hi - lo for _, lo, hi in units]
    unit_t = np.diff(pool.offsets).tolist()
    # Output row of each unit's first candidate.
    first = [int(req.cand_offsets[i]) + lo for i, lo, _ in units]
    for idx, bucket in batching.plan(unit_c, unit_t, self.buckets):
      batch = bbs.gather(
        [(pool, idx)], bucket.requests, bucket.tokens, bucket.cands
      )
      rows = ranges(
        [first[u] for u in idx], [first[u] + unit_c[u] for u in idx]
      )
      keys = None
      if self.cache is not None:
        o = pool.offsets
        keys = [
          fingerprint(
            pool.user_id[u],
            {k: v[o[u] : o[u + 1]] for k, v in pool.seq.items()},
            pool.dense[u],
          )
          for u in idx
        ]
      yield bucket, batch, rows, keys

  def run(self, bucket, batch):
    """One program call: probabilities `[c, tasks]` on the device."""
    return self.program(bucket)(self.param_leaves, jax.tree.leaves(batch))

  def _run_cached(self, bucket, batch, keys):
    """One call through the history cache: when every request of the
    batch is cached, stage 2 only, on the cached rows; else stage 1 on the
    batch, its rows cached, then stage 2."""
    leaves = jax.tree.leaves(batch)
    o = np.asarray(batch.offsets)
    hits = self.cache.get_all(keys)
    if hits is not None:
      if bucket not in self._encoded_spec:
        self._encoded_spec[bucket] = jax.eval_shape(
          self._make(bucket, "encode"), self.param_leaves, leaves
        )
      spec = self._encoded_spec[bucket]
      seq = np.zeros(spec[0].shape, spec[0].dtype)
      user = np.zeros(spec[1].shape, spec[1].dtype)
      for j, (s, u) in enumerate(hits):
        seq[o[j] : o[j + 1]] = s
        user[j] = u
      self.cache.saved_s += self._encode_s.get(bucket, 0.0)
      return self.program(bucket, "cross")(self.param_leaves, leaves, seq, user)
    t0 = time.perf_counter()
    seq, user = self.program(bucket, "encode")(self.param_leaves, leaves)
    seq_h, user_h = np.asarray(seq), np.asarray(user)
    self._encode_s[bucket] = time.perf_counter() - t0
    for j, k in enumerate(keys):
      self.cache.put(k, seq_h[o[j] : o[j + 1]].copy(), user_h[j].copy())
    return self.program(bucket, "cross")(self.param_leaves, leaves, seq, user)

  def score_log(self, log, req: Requests) -> list[np.ndarray]:
    """Training's structures (any number of requests over one log) ->
    per request, probabilities `[n_cands, tasks]` (float32)."""
    return self.dispatch(log, req)()

  def dispatch(self, log, req: Requests):
    """Build, pack and dispatch every program call of the requests, and
    return a function that waits for the results (`score_log`'s). Every
    call is dispatched before any result is read, so the host packs batch
    i + 1 while the device runs batch i, and a caller (the HTTP worker)
    can build its next requests before it collects these."""
    running = []
    for bucket, batch, rows, keys in self.batches(log, req):
      if keys is None:
        probs = self.run(bucket, batch)
      else:
        probs = self._run_cached(bucket, batch, keys)
      running.append((probs, rows))
      if self.on_batch is not None:
        n_req = int(np.count_nonzero(np.diff(batch.cand_offsets)))
        self.on_batch(bucket, n_req, rows.size)
    n, splits = len(req.cand_item), np.asarray(req.cand_offsets[1:-1])

    def results() -> list[np.ndarray]:
      out = np.zeros((n, len(self.tasks)), np.float32)
      for probs, rows in running:
        out[rows] = np.asarray(probs)[: rows.size]
      return np.split(out, splits)

    return results


def _unit_requests(req: Requests, units, num_tasks: int) -> Requests:
  """One request per unit (request i, candidates lo:hi of it), unlabelled."""
  ui, lo, hi = (np.array([u[j] for u in units], np.int64) for j in range(3))
  out = req.take(ui, lo, hi)
  labels = np.zeros((out.cand_item.size, num_tasks), np.float32)
  return dataclasses.replace(out, labels=labels, line=None)
