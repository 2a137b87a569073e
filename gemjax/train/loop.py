"""The training loop, top to bottom.

1. Build the mesh from the config's tiers and the loader for this process's
   data shards (one shard per device).
2. Build the model, place parameters by the strategy's logical-axis rules,
   lock the run directory, and restore its newest checkpoint that reads
   (parameters, optimizer state, step, RNG and every process's data
   position: an exact resume), if its stored config is this run's.
3. Step: jitted train step on the stacked batch, a live progress line, a
   `metrics.jsonl` record every `log_every` steps, a checkpoint every
   `checkpoint_every` steps, at the end and on SIGTERM.
4. Evaluate on the held-out set and print per-task AUC, UAUC, NE, calibration.
"""

import contextlib
import dataclasses
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import sharding
from gemjax import config as config_lib
from gemjax import metrics
from gemjax.data import loader as data_loader
from gemjax.train import checkpoint as ckpt_lib
from gemjax.train import flops as flops_lib
from gemjax.train import remat as remat_lib
from gemjax.train import runtime
from gemjax.train import step as step_lib
from gemjax.train.checkpoint import CannotResume, config_changes
from gemjax.train.optim import make_optimizer
from gemjax.train.state import build

# (Config, Mesh) -> (train step, eval step), least recently used first; see
# `Trainer._steps`. Everything the steps close over (model definition,
# optimizer, shardings) is a function of the config and the mesh.
_STEPS: dict = {}
_STEPS_KEPT = 4


@dataclasses.dataclass
class Trainer:
  """Everything a run needs, built once from a `Config`."""

  cfg: object
  run_dir: pathlib.Path
  # A run directory per process (`{process}` in its name): each process
  # keeps its own checkpoints (`checkpoint.ProcessCheckpointer`).
  per_process: bool
  mesh: object
  num_shards: int
  model_def: object
  tx: object
  # The state's shapes, dtypes and placement (`jax.ShapeDtypeStruct`
  # leaves): the restore target, which initializes nothing.
  abstract_state: dict
  batch_sharding: object

  @classmethod
  def create(cls, cfg, run_dir=None, devices=None):
    """`devices`: default all (tests pass a subset, e.g. one device)."""
    mesh = sharding.make_mesh(
      cfg.mesh.cluster, cfg.mesh.zone, cfg.mesh.node, devices
    )
    num_shards = cfg.mesh.data_shards or mesh.size
    if num_shards % mesh.size:
      raise ValueError(
        f"mesh.data_shards={num_shards} is not a multiple of the "
        f"{mesh.size} devices"
      )
    template = str(run_dir or cfg.train.run_dir)
    run_dir = pathlib.Path(
      template.replace("{config}", cfg.name).replace(
        "{process}", str(jax.process_index())
      )
    )
    data = data_loader.resolve_capacities(
      cfg.data,
      num_shards,
      data_loader.local_shards(
        num_shards, jax.process_index(), jax.process_count()
      ),
    )
    if data != cfg.data:
      cfg = dataclasses.replace(cfg, data=data)
      if jax.process_index() == 0:
        print(
          f"data: token_capacity={data.token_capacity} cand_capacity="
          f"{data.cand_capacity} (derived from {data.path})",
          file=sys.stderr,
        )
    # Shapes only: placing the state needs no initialized parameters.
    model_def, params = build(cfg, cfg.train.seed, abstract=True)
    tx = make_optimizer(cfg.train)
    state = jax.eval_shape(lambda p: fresh_state(p, tx, cfg.train.seed), params)
    axes = sharding.state_axes(state, model_def.logical_axes)
    shardings = sharding.tree_shardings(axes, state, mesh, cfg.mesh.strategy)
    return cls(
      cfg,
      run_dir,
      "{process}" in template,
      mesh,
      num_shards,
      model_def,
      tx,
      jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state,
        shardings,
      ),
      sharding.batch_sharding(mesh, cfg.mesh.strategy),
    )

  def checkpointer(self, keep: int = 2):
    """The run directory's checkpoints, in the layout its name asks for
    (see `gemjax.train.checkpoint`)."""
    layout = (
      ckpt_lib.ProcessCheckpointer
      if self.per_process
      else ckpt_lib.Checkpointer
    )
    return layout(
      self.run_dir / "checkpoints", keep, gather=runtime.allgather_json
    )

  def init_state(self):
    _, params = build(self.cfg, self.cfg.train.seed)
    state = fresh_state(params, self.tx, self.cfg.train.seed)
    return jax.device_put(state, self.state_shardings)

  @functools.cached_property
  def state_shardings(self):
    return jax.tree.map(lambda x: x.sharding, self.abstract_state)

  @property
  def train_step(self):
    return self._steps[0]

  @property
  def eval_step(self):
    return self._steps[1]

  @functools.cached_property
  def _steps(self):
    """The jitted train and eval steps, shared by every `Trainer` of an
    equal config on the same mesh in this process (`_STEPS`): a second run
    of a config (a resume, a notebook cell run again) reuses their traces
    and compiled programs instead of compiling again."""
    key = (self.cfg, self.mesh)
    if key in _STEPS:
      _STEPS[key] = _STEPS.pop(key)  # now the newest
    else:
      d = self.cfg.data
      static = dict(
        model_def=self.model_def,
        max_len=d.max_seq_len,
        max_cands=d.max_cands,
        placement=sharding.Placement(self.mesh, self.cfg.mesh.strategy),
      )
      _STEPS[key] = (
        jax.jit(
          functools.partial(step_lib.train_step, tx=self.tx, **static),
          in_shardings=(self.state_shardings, self.batch_sharding),
          out_shardings=(self.state_shardings, None),
          donate_argnums=0,
        ),
        jax.jit(
          functools.partial(step_lib.eval_step, **static),
          in_shardings=(self.state_shardings["params"], self.batch_sharding),
        ),
      )
      while len(_STEPS) > _STEPS_KEPT:
        _STEPS.pop(next(iter(_STEPS)))  # the oldest
    return _STEPS[key]

  def to_device(self, batch):
    """This process's shards (numpy) -> global arrays split over the mesh."""
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x),
      batch,
    )

  def loader(self, split="train"):
    return data_loader.Loader(
      self.cfg.data,
      num_shards=self.num_shards,
      split=split,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )

  def evaluate(self, params, max_batches: int = 0) -> dict:
    acc = metrics.MetricAccumulator(self.cfg.model.tasks)
    seen = 0  # requests so far: each request is a group for HR@k
    batches = data_loader.eval_batches(
      self.cfg.data,
      num_shards=self.num_shards,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
    for i, batch in enumerate(batches):
      if max_batches and i >= max_batches:
        break
      probs = self.eval_step(params, self.to_device(batch))
      probs = multihost_utils.process_allgather(probs, tiled=True)
      full = (
        multihost_utils.process_allgather(batch, tiled=True)
        if (jax.process_count() > 1)
        else batch
      )
      users, mask = metrics.candidate_rows(
        full.user_id, full.cand_offsets, full.cand_capacity
      )
      b = full.offsets.shape[-1] - 1
      req_ids = seen + np.arange(full.offsets.shape[0] * b).reshape(-1, b)
      seen += req_ids.size
      groups, _ = metrics.candidate_rows(
        req_ids, full.cand_offsets, full.cand_capacity
      )
      labels = np.asarray(full.labels)[..., self.model_def.label_columns]
      acc.add(labels, np.asarray(probs), users, mask, groups)
    return acc.result(rank_at(self.cfg.data))

  def baselines(self) -> dict:
    """{baseline: {task: metrics}} on this run's held-out examples (real
    logs, one process): see `gemjax.baselines`."""
    from gemjax import baselines

    source = data_loader.make_source(
      self.cfg.data, self.num_shards, range(self.num_shards)
    )
    test, scores = baselines.score_all(
      source.train_pools(), source.eval_pools()[0]
    )
    cols = list(self.model_def.label_columns)  # the model's tasks' labels
    test = dataclasses.replace(test, labels=test.labels[:, cols])
    scores = {k: v[:, cols] for k, v in scores.items()}
    return baselines.baseline_metrics(
      test, scores, self.cfg.model.tasks, rank_at(self.cfg.data)
    )


def rank_at(data_cfg) -> tuple[int, ...]:
  """Cut-offs of HR@k / NDCG@k: the next-item protocol reports k = 10."""
  is_loo = data_cfg.source != "synthetic" and (
    data_cfg.protocol == "leave_one_out"
  )
  return (10,) if is_loo else ()


def fresh_state(params, tx, seed: int) -> dict:
  """A train state at step 0 around `params`: a new optimizer state and
  the config's seed (a new run, or a run up-scaled from another)."""
  return {
    "params": params,
    "opt_state": tx.init(params),
    "step": jnp.zeros((), jnp.int32),
    "rng": jax.random.PRNGKey(seed),
  }


class Progress:
  """One live line on stderr: step, loss, samples/s, tokens/s, model
  TFLOP/s, local MFU (G11), ETA; `show` returns the figures for the
  `train` record.

  Rates are over the steps since the previous `show` (the first interval
  includes compilation). Samples are candidates, tokens real history
  events, FLOPs the model FLOPs of the batches run (`flops.step_flops`,
  3x forward), all of this process's shards; with activation
  checkpointing, hardware TFLOP/s (recompute included) beside them.
  Local MFU is per device: this process's FLOP/s over its devices' dense
  bf16 peak (`flops.device_peak`); a device without a known peak (CPU)
  gets none.
  With several processes, each one's seconds per step over the interval
  are gathered: their max and mean (GEM's straggler signal) go into the
  record; a collective, so every process calls `show`.
  """

  def __init__(self, cfg, total: int, start: int, enabled: bool):
    self.cfg, self.total, self.start = cfg, total, start
    self.enabled = enabled
    device = jax.local_devices()[0]
    self.peak = flops_lib.device_peak(device.device_kind)
    self.devices = jax.local_device_count()
    self.t0 = self.t_last = time.perf_counter()
    self.step_last = start
    self.samples = self.tokens = self.flops = self.hw_flops = 0
    # G9: the checkpoint policies in force, printed now and recorded in
    # the first `train` record; their recompute counts as hardware FLOPs.
    resolved = remat_lib.resolve(cfg)
    self.model_cfg = resolved.model
    used = cfg.model.remat or cfg.train.activation_budget_gb > 0
    self.remat = remat_lib.describe(resolved) if used else None
    if self.remat and enabled:
      print(self.remat, file=sys.stderr, flush=True)

  def add(self, batch) -> None:
    """Count one step's host batch (this process's stacked shards)."""
    self.samples += int(np.sum(batch.cand_offsets[..., -1]))
    self.tokens += int(np.sum(batch.offsets[..., -1]))
    counted = flops_lib.step_flops(self.cfg, batch)
    self.flops += counted.train
    self.hw_flops += counted.train + counted.recompute(self.model_cfg)

  def show(self, step: int, loss: float) -> dict:
    now = time.perf_counter()
    dt = max(now - self.t_last, 1e-9)
    steps = max(step - self.step_last, 1)
    eta = (now - self.t0) / max(step - self.start, 1) * (self.total - step)
    rates = {
      "samples_per_s": self.samples / dt,
      "tokens_per_s": self.tokens / dt,
      "model_tflops_per_s": self.flops / dt / 1e12,
      "step_s": dt / steps,
    }
    if self.hw_flops > self.flops:
      rates["hardware_tflops_per_s"] = self.hw_flops / dt / 1e12
    if self.peak is not None:
      rates["mfu"] = self.flops / dt / (self.peak * self.devices)
    if jax.process_count() > 1:
      per = multihost_utils.process_allgather(np.float64(dt / steps))
      rates["step_s_max"] = float(np.max(per))
      rates["step_s_mean"] = float(np.mean(per))
    if self.remat:
      rates["remat"], self.remat = self.remat, None
    self.t_last, self.step_last = now, step
    self.samples = self.tokens = self.flops = self.hw_flops = 0
    if self.enabled:
      mfu = f"  MFU {rates['mfu']:.1%}" if "mfu" in rates else ""
      print(
        f"\rstep {step}/{self.total}  loss {loss:.4f}  "
        f"{rates['samples_per_s']:,.0f} samples/s  "
        f"{rates['tokens_per_s']:,.0f} tokens/s  "
        f"{rates['model_tflops_per_s']:,.2f} TFLOP/s{mfu}  ETA {eta:4.0f}s",
        end="",
        file=sys.stderr,
        flush=True,
      )
    return rates

  def close(self):
    if self.enabled:
      print(file=sys.stderr, flush=True)


def train(
  cfg, run_dir=None, *, stop_at: int | None = None, devices=None
) -> dict:
  """Train `cfg` (resuming from `run_dir` if it holds a checkpoint).

  `stop_at` ends the run early after that step (with a checkpoint), as if
  the job had been killed there; the resume test uses it. `devices`: default
  all (tests pass a subset). Returns the final evaluation metrics ({} when
  stopped early). SIGTERM saves a checkpoint at the next step and raises
  `Preempted`.

  A resume continues the run the checkpoint's config describes: a model or
  data config that differs is refused (naming the fields), unless
  `train.allow_config_change`. A different `train.steps` extends the run,
  or, when the checkpoint is already there, only evaluates. (The learning
  rate schedule is a function of `train.steps`: an extended run follows the
  longer schedule from its resume step on, so it is not bit-identical to a
  run that had the longer `train.steps` from the start.)
  """
  tr = Trainer.create(cfg, run_dir, devices)
  cfg = tr.cfg  # with capacities derived from the data, if any
  main = jax.process_index() == 0
  say = functools.partial(print, file=sys.stderr) if main else _silent
  with (
    runtime.RunDir(tr.run_dir, tr.per_process),
    contextlib.closing(tr.checkpointer(cfg.train.keep_checkpoints)) as ckpt,
    contextlib.closing(tr.loader()) as loader,
    jax.set_mesh(tr.mesh),
    runtime.StopSignal() as stop,
  ):
    found = ckpt.restore_latest(
      tr.abstract_state,
      functools.partial(_check_resume, cfg, tr.run_dir),
      log=say,
    )
    if found is None:
      step, state = 0, tr.init_state()
    else:
      step, state, data_state, _ = found
      loader.restore(_this_process(data_state, tr.run_dir))
      say(f"resumed {tr.run_dir} at step {step}")
    total = cfg.train.steps
    if step >= total:
      say(f"already at step {step} (train.steps={total}): evaluating only")
    last = min(total, stop_at) if stop_at is not None else total
    progress = Progress(cfg, total, step, cfg.train.progress and main)
    with runtime.RunLog(
      tr.run_dir / "metrics.jsonl", main, after=step, redo_eval=step >= total
    ) as log:
      log.write(
        event="start",
        config=config_lib.to_dict(cfg),
        step=step,
        devices=tr.mesh.size,
        processes=jax.process_count(),
      )
      while step < last:
        batch = next(loader)
        progress.add(batch)
        state, m = tr.train_step(state, tr.to_device(batch))
        step += 1
        if step % cfg.train.log_every == 0 or step == last:
          loss = float(m["loss"])
          if not np.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
          log.write(
            event="train",
            step=step,
            loss=loss,
            task_loss=np.asarray(m["task_loss"]).tolist(),
            grad_norm=float(m["grad_norm"]),
            **progress.show(step, loss),
            data=runtime.sum_counters(runtime.allgather_json(loader.counters)),
          )
        stopping = stop.requested(step)
        if stopping or step % cfg.train.checkpoint_every == 0 or step == last:
          ckpt.save(
            step,
            state,
            {"processes": runtime.gathered_by_process(loader.state())},
            config_lib.to_dict(cfg),
          )
        if stopping:
          progress.close()
          ckpt.wait()
          raise runtime.Preempted(step)
      progress.close()
      ckpt.wait()
      if step < total:
        return {}
      result = tr.evaluate(state["params"], cfg.train.eval_batches)
      if (
        cfg.train.baselines
        and cfg.data.source != "synthetic"
        and jax.process_count() == 1
        and not cfg.train.eval_batches
      ):
        result["baselines"] = tr.baselines()
      log.write(event="eval", step=step, metrics=result)
  return result


def _silent(*args, **kwargs) -> None:
  pass


def _check_resume(cfg, run_dir, saved: dict | None) -> None:
  """Refuse to resume a checkpoint written under another model or data
  config (see `checkpoint.config_changes`)."""
  if cfg.train.allow_config_change:
    return
  if saved is None:
    changes = ["the checkpoint stores no config"]
  else:
    # Compared as stored: JSON (tuples read back as lists), an older
    # checkpoint's flat model layout moved to the current one.
    current = json.loads(json.dumps(config_lib.to_dict(cfg)))
    changes = config_changes(config_lib.upgrade(saved), current)
  if changes:
    raise CannotResume(
      f"{run_dir} holds a run of another config ({', '.join(changes)}): "
      "use a new --run-dir, or --allow-config-change "
      "(train.allow_config_change=true) to continue it anyway"
    )


def _this_process(data_state: dict, run_dir) -> dict:
  """This process's loader position from a checkpoint's `data` item."""
  held = data_state.get("processes", {})
  if len(held) != jax.process_count():
    raise CannotResume(
      f"{run_dir}: the checkpoint holds the data positions of "
      f"{len(held)} process(es), this run has {jax.process_count()}; "
      "resume with the same number of processes"
    )
  return held[str(jax.process_index())]
