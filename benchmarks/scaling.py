"""Weak scaling of `onetrans_v31` training: 2 H200s vs 1 (G11), and what the
sharding strategy and the XLA / NCCL settings for communication overlap do
(G8).

  cd <repo> && PYTHONPATH=. python3 benchmarks/scaling.py --out "$OUT"  # 2 GPUs

Each GPU trains one data shard per step (32 requests of the 2K traffic, a
38,912-token buffer), so 2 GPUs do twice the work of 1 in a step:

  scaling ratio = 2-GPU throughput / (2 x 1-GPU throughput)
                = 1-GPU step time / 2-GPU step time        (goal >= 0.9)

Batches are built on the host before timing and rotated (3 of them), and a
step is timed as the median over rounds of several steps with a
`block_until_ready` per round: this measures the device's training step, not
the data pipeline. Losses are checked finite.

A variant is `strategy[+setting]`, trained on a 1 x 1 x 2 mesh:
- strategies (`sharding.rules`): `replicated` (DDP: every weight and table on
  both GPUs, one gradient all-reduce; what `onetrans_v31` uses), `fsdp`
  (dense weights all-gathered for use and gradients reduce-scattered, tables
  row-sharded with the bucketed all-to-all lookup);
- settings (XLA and NCCL read them at start, so each variant is a fresh
  process):
  - `nccl_1ch`: `NCCL_MAX_NCHANNELS=1`, NCCL runs its collectives on one
    channel (one SM per ring) instead of many: fewer SMs taken from compute
    (GEM moved its all-gathers from 24 SMs to 1), slower transfers;
  - `overlap`: XLA flags that pipeline the FSDP all-gathers / reduce-scatters
    / all-reduces across loop iterations and give collectives the highest-
    priority stream (`--xla_gpu_enable_pipelined_*`,
    `--xla_gpu_enable_highest_priority_async_stream`);
  - `memcpy_p2p`: `--xla_gpu_use_memcpy_local_p2p`, local (NVLink) transfers
    by the copy engines instead of NCCL kernels on SMs.
  Without a setting: XLA's defaults (its latency-hiding scheduler already
  overlaps async collectives with compute on GPU).
The 1-GPU baseline uses the config's strategy. Every run starts at once, so
their compilations (~2 minutes each on the H200 host) overlap; the timed
part runs one at a time under a file lock, with nothing else on the GPUs.
`--set KEY=VALUE` (repeatable) overrides the config in every run, as
`python -m gemjax.train --set` does (e.g. `model.fp8.format=deepseek`); a single
run is `--worker --gpus 1 [--set ...]`, which prints its step time.
`--profile` also traces 3 steps of every run and prints device ms/step per
stream, collectives apart from the rest, with the costliest kernels
(`common.trace_summary`): where a step's time goes. If the config's own run
fails (e.g. a Pallas kernel does not compile), it is retried with XLA
attention on 4-request shards (the dense reference attention would not fit
2K-token shards of 32 requests), and the results say so.
"""

import argparse
import contextlib
import fcntl
import functools
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
  "nccl_1ch": {"NCCL_MAX_NCHANNELS": "1"},
  "overlap": {
    "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true "
    "--xla_gpu_enable_pipelined_all_gather=true "
    "--xla_gpu_enable_pipelined_reduce_scatter=true "
    "--xla_gpu_enable_pipelined_all_reduce=true "
    "--xla_gpu_enable_highest_priority_async_stream=true"
  },
  "memcpy_p2p": {"XLA_FLAGS": "--xla_gpu_use_memcpy_local_p2p=true"},
}
GOAL = 0.9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_LOCK = "/tmp/gemjax-scaling.lock"


@contextlib.contextmanager
def _gpus_alone():
  """Hold the GPUs: one run times at a time, while the others compile."""
  with open(GPU_LOCK, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def worker(
  n,
  steps,
  rounds,
  attention,
  config="onetrans_v31",
  strategy="",
  profile=False,
  overrides=(),
):
  import dataclasses

  import jax
  import numpy as np

  jax.config.update("jax_compilation_cache_dir", "/tmp/gemjax-scaling-cache")
  sys.path.insert(0, ROOT)
  from gemjax import config as config_lib
  from gemjax.config import MeshConfig
  from gemjax.data import loader
  from gemjax.train.loop import Trainer

  base = config_lib.load(config, overrides)
  data = dataclasses.replace(base.data, workers=0, prefetch=0)
  if attention == "xla":  # the reference attention is dense: small shards
    data = dataclasses.replace(
      data, requests_per_shard=4, token_capacity=4_864, bbs_minibatch=4
    )
  base = dataclasses.replace(
    base,
    data=data,
    train=dataclasses.replace(base.train, progress=False),
    model=dataclasses.replace(
      base.model,
      attention=dataclasses.replace(
        base.model.attention, implementation=attention or None
      ),
    ),
  )
  t_start = time.perf_counter()
  strategy = strategy or base.mesh.strategy
  name = f"{strategy}@{n}"
  log = lambda msg: print(
    f"  [{name} {time.perf_counter() - t_start:6.1f} s] {msg}",
    file=sys.stderr,
    flush=True,
  )
  log(f"jax {jax.__version__}, {jax.device_count()} devices")
  cfg = dataclasses.replace(base, mesh=MeshConfig(1, 1, n, strategy))
  tr = Trainer.create(cfg, "/tmp/scaling-run", devices=jax.devices()[:n])
  it = loader.Loader(
    cfg.data, num_shards=n, split="train", process_index=0, process_count=1
  )
  host = [next(it) for _ in range(3)]
  it.close()
  staged = [tr.to_device(b) for b in host]
  state = tr.init_state()
  log(f"{n} GPU: model, state and 3 batches ready; compiling")
  t0 = time.perf_counter()
  step = tr.train_step.lower(state, staged[0]).compile()
  compile_s = time.perf_counter() - t0
  log(f"{n} GPU: compiled in {compile_s:.1f} s")
  with _gpus_alone():
    for i in range(3):  # warm-up
      state, m = step(state, staged[i % 3])
    jax.block_until_ready(m["loss"])
    times, losses = [], []
    for r in range(rounds):
      t0 = time.perf_counter()
      for i in range(steps):
        state, m = step(state, staged[(r + i) % 3])
      losses.append(float(m["loss"]))
      times.append((time.perf_counter() - t0) / steps)
    assert all(np.isfinite(losses)), losses
    trace = None
    if profile:  # where a step's time goes (1 GPU: the same without comms)
      from benchmarks import common

      log_dir = f"/tmp/scaling-trace/{os.getpid()}-{n}"
      with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for i in range(3):
          state, m = step(state, staged[i % 3])
        jax.block_until_ready(m["loss"])
      trace = common.trace_summary(log_dir, steps=3)
      for k, v in trace.items():
        log(
          f"{k}: collectives {v['collective_ms']:.2f} ms, other"
          f" {v['other_ms']:.2f} ms per step; top "
          + ", ".join(f"{kern[:40]} {ms:.2f}" for kern, ms in v["top"][:6])
        )
  out = {
    "devices": n,
    "step_s": statistics.median(times),
    "step_s_all": times,
    "compile_s": compile_s,
    "requests_per_step": int(
      sum((np.diff(b.cand_offsets, axis=-1) > 0).sum() for b in host) / 3
    ),
    "tokens_per_step": int(sum(b.offsets[:, -1].sum() for b in host) / 3),
    "loss": losses[-1],
    "attention": attention or "default",
    "trace": trace,
  }
  log(f"{n} GPU: {out['step_s'] * 1e3:.2f} ms/step")
  print("RESULT " + json.dumps(out), flush=True)


def _start(variant, gpus, args):
  """A worker process for `strategy[+setting]` ("" = the config's)."""
  strategy, _, setting = variant.partition("+")
  env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
  env["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (KINDS.md)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # runs share the GPUs
  for k, v in SETTINGS[setting].items() if setting else ():
    env[k] = f"{env[k]} {v}" if k == "XLA_FLAGS" and env.get(k) else v
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--worker",
    "--gpus",
    str(gpus),
    "--steps",
    str(args.steps),
    "--rounds",
    str(args.rounds),
    "--attention",
    args.attention,
    "--config",
    args.config,
    "--strategy",
    strategy,
  ] + (["--profile"] if args.profile else [])
  cmd += [f"--set={kv}" for kv in args.set]
  print(
    f"{variant or 'config'} on {gpus} GPU(s): "
    + " ".join(f"{k}={v}" for k, v in SETTINGS.get(setting, {}).items()),
    file=sys.stderr,
    flush=True,
  )
  # The worker's stderr (phase timings) goes straight to ours, live, so a
  # run cut short still shows how far it got.
  return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def _finish(p, deadline):
  try:
    out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    p.kill()
    p.communicate()
    return None, "timed out (the time budget ran out)"
  line = [x for x in out.splitlines() if x.startswith("RESULT ")]
  if p.returncode or not line:
    return None, f"exit {p.returncode} (see the worker's stderr above)"
  return json.loads(line[0][len("RESULT ") :]), None


def _check_variant(v):
  from sharding import rules

  strategy, _, setting = v.partition("+")
  if strategy not in rules.STRATEGIES:
    raise SystemExit(f"unknown strategy in {v!r}: {sorted(rules.STRATEGIES)}")
  if setting and setting not in SETTINGS:
    raise SystemExit(f"unknown setting {setting!r} in {v!r}: {list(SETTINGS)}")
  return v


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--worker", action="store_true")
  p.add_argument("--gpus", type=int, default=2, help="worker: GPUs")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--attention", default="")
  p.add_argument("--config", default="onetrans_v31", help="smoke: CPU check")
  p.add_argument("--budget-s", type=float, default=480.0)
  p.add_argument("--out", default=None)
  p.add_argument("--strategy", default="", help="worker: mesh strategy")
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="config override for every run (as `python -m gemjax.train`)",
  )
  p.add_argument(
    "--profile",
    action="store_true",
    help="also trace 3 steps of every run: device ms/step by kernel",
  )
  p.add_argument(
    "--variants",
    default="fsdp,fsdp+overlap,fsdp+nccl_1ch,fsdp+memcpy_p2p",
    help="strategy[+setting], run on 2 GPUs besides the config's own",
  )
  args = p.parse_args()
  if args.worker:
    worker(
      args.gpus,
      args.steps,
      args.rounds,
      args.attention,
      args.config,
      args.strategy,
      args.profile,
      args.set,
    )
    return
  sys.path.insert(0, ROOT)
  import jax

  from benchmarks import common
  from gemjax import config as config_lib

  own = config_lib.load(args.config, args.set).mesh.strategy
  deadline = time.monotonic() + args.budget_s
  variants = [_check_variant(v) for v in args.variants.split(",") if v]
  variants = [v for v in variants if v != own]
  notes = {}

  def run_all():
    procs = {"1 GPU": _start("", 1, args)}
    procs.update({v: _start(v, 2, args) for v in [own, *variants]})
    return {v: _finish(proc, deadline) for v, proc in procs.items()}

  done = run_all()
  err = done["1 GPU"][1]
  if err and not args.attention and "timed out" not in err:
    notes["pallas attention"] = err
    # Fall back from the Pallas attention kernels to XLA's (dense, so with
    # 4-request shards of a 4,864-token buffer).
    args.attention = "xla"
    done = run_all()
  raw = {v: res for v, (res, _) in done.items()}
  notes.update({v: err for v, (_, err) in done.items() if err})
  one = raw["1 GPU"]
  records = []
  case = " ".join([args.config, *args.set]) + f"/2x{common.device_name()}"
  for v, two in raw.items():
    if v == "1 GPU" or two is None or one is None:
      continue
    thr1 = one["requests_per_step"] / one["step_s"]
    thr2 = two["requests_per_step"] / two["step_s"]
    impl = v if v != own else f"{own} (config)"
    record = functools.partial(common.record, "scaling", case, impl)
    records += [
      record("scaling_ratio", thr2 / (2 * thr1), goal=GOAL),
      record(
        "requests_per_s",
        thr2,
        baseline="1 GPU x 2",
        baseline_value=2 * thr1,
      ),
      record(
        "step_ms",
        two["step_s"] * 1e3,
        baseline="1 GPU",
        baseline_value=one["step_s"] * 1e3,
        lower_is_better=True,
      ),
    ]
  for r in records:
    r["command"] = "python3 benchmarks/scaling.py"
  # A CPU check (`--config smoke`) never touches benchmarks/results.
  smoke = jax.default_backend() == "cpu"
  common.write_results("scaling", records, args.out, dry_run=smoke)
  if args.out:
    with open(os.path.join(args.out, "scaling_raw.json"), "w") as f:
      json.dump({"runs": raw, "notes": notes}, f, indent=1)
  print(json.dumps({"notes": notes}, indent=1))


if __name__ == "__main__":
  main()
