"""Weak scaling of `onetrans_v31` training: 2 H200s vs 1 (G11), and what the
XLA / NCCL settings for communication overlap do (G8).

  cd <repo> && NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 \\
    python3 benchmarks/scaling.py --out "$OUT"          # needs 2 GPUs

Each GPU trains one data shard per step (32 requests of the 2K traffic, a
38,912-token buffer), so 2 GPUs do twice the work of 1 in a step:

  scaling ratio = 2-GPU throughput / (2 x 1-GPU throughput)
                = 1-GPU step time / 2-GPU step time        (goal >= 0.9)

The 2-GPU run uses strategy `fsdp` on a 1 x 1 x 2 mesh: dense weights
FSDP-sharded over the 2 GPUs (all-gathered for use, gradients reduce-
scattered), tables row-sharded with the bucketed all-to-all lookup.
Batches are built on the host before timing and rotated (3 of them), and a
step is timed as the median over rounds of several steps with a
`block_until_ready` per round: this measures the device's training step, not
the data pipeline. Losses are checked finite.

Variants (each a fresh process, since XLA and NCCL read their settings at
start):
- `default`: XLA's defaults (its latency-hiding scheduler already overlaps
  async collectives with compute on GPU);
- `nccl_1ch`: `NCCL_MAX_NCHANNELS=1`, NCCL runs its collectives on one
  channel (one SM per ring) instead of many: fewer SMs taken from compute
  (GEM moved its all-gathers from 24 SMs to 1), slower transfers;
- `overlap`: XLA flags that pipeline the FSDP all-gathers / reduce-scatters
  / all-reduces across loop iterations and give collectives the highest-
  priority stream (`--xla_gpu_enable_pipelined_*`,
  `--xla_gpu_enable_highest_priority_async_stream`);
- `memcpy_p2p`: `--xla_gpu_use_memcpy_local_p2p`, local (NVLink) transfers
  by the copy engines instead of NCCL kernels on SMs;
- `ddp`: strategy `replicated` (every weight and table on both GPUs, one
  gradient all-reduce): no FSDP gathers and no id exchange, so the gap to
  `default` is what FSDP and the sharded lookup cost on 2 GPUs.
`--variants` picks which run after `default` (all, in this order, if the
time budget allows). `--profile` also traces 3 steps of every 2-GPU run and
prints device ms/step per stream, collectives apart from the rest, with the
costliest kernels (`common.trace_summary`): where a step's time goes.
A variant that would not fit the time budget is skipped and listed. If the
default run fails (e.g. a Pallas kernel does not compile), it is retried
with XLA attention on 4-request shards (the dense reference attention would
not fit 2K-token shards of 32 requests), and the results say so.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
  "default": {},
  "nccl_1ch": {"NCCL_MAX_NCHANNELS": "1"},
  "overlap": {
    "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true "
    "--xla_gpu_enable_pipelined_all_gather=true "
    "--xla_gpu_enable_pipelined_reduce_scatter=true "
    "--xla_gpu_enable_pipelined_all_reduce=true "
    "--xla_gpu_enable_highest_priority_async_stream=true"
  },
  "memcpy_p2p": {"XLA_FLAGS": "--xla_gpu_use_memcpy_local_p2p=true"},
  "ddp": {},  # strategy "replicated" (STRATEGIES)
}
STRATEGIES = {"ddp": "replicated"}  # default: fsdp
GOAL = 0.9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(
  devices,
  steps,
  rounds,
  attention,
  config="onetrans_v31",
  strategy="fsdp",
  profile=False,
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

  base = config_lib.load(config)
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
      base.model, attention_implementation=attention or None
    ),
  )
  t_start = time.perf_counter()
  log = lambda msg: print(
    f"  [{time.perf_counter() - t_start:6.1f} s] {msg}",
    file=sys.stderr,
    flush=True,
  )
  log(f"jax {jax.__version__}, {jax.device_count()} devices")
  out = []
  for n in devices:
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
    if profile and n > 1:  # where the 2-GPU step's time goes
      from benchmarks import common

      log_dir = f"/tmp/scaling-trace-{n}"
      with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for i in range(3):
          state, m = step(state, staged[i % 3])
        jax.block_until_ready(m["loss"])
      trace = common.trace_summary(log_dir, steps=3)
      for k, v in trace.items():
        log(
          f"{k}: collectives {v['collective_ms']:.2f} ms, other"
          f" {v['other_ms']:.2f} ms per step; top "
          + ", ".join(f"{name[:40]} {ms:.2f}" for name, ms in v["top"][:6])
        )
    out.append(
      {
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
    )
    print(
      f"  {n} GPU: {out[-1]['step_s'] * 1e3:.2f} ms/step "
      f"(compile {compile_s:.0f} s)",
      file=sys.stderr,
      flush=True,
    )
  print("RESULT " + json.dumps(out), flush=True)


def _run(variant, devices, args, timeout):
  env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
  env["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (KINDS.md)
  for k, v in VARIANTS[variant].items():  # add to what the caller set
    env[k] = f"{env[k]} {v}" if k == "XLA_FLAGS" and env.get(k) else v
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--worker",
    "--devices",
    ",".join(map(str, devices)),
    "--steps",
    str(args.steps),
    "--rounds",
    str(args.rounds),
    "--attention",
    args.attention,
    "--config",
    args.config,
    "--strategy",
    STRATEGIES.get(variant, "fsdp"),
  ] + (["--profile"] if args.profile else [])
  print(
    f"{variant}: {' '.join(f'{k}={v}' for k, v in VARIANTS[variant].items())}",
    file=sys.stderr,
    flush=True,
  )
  if timeout < 30:
    return None, "skipped: not enough of the time budget left"
  # The worker's stderr (phase timings) goes straight to ours, live, so a
  # run cut short still shows how far it got.
  p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
  try:
    out, _ = p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    p.kill()
    p.communicate()
    return None, f"timed out after {timeout:.0f} s"
  line = [x for x in out.splitlines() if x.startswith("RESULT ")]
  if p.returncode or not line:
    return None, f"exit {p.returncode} (see the worker's stderr above)"
  return json.loads(line[0][len("RESULT ") :]), None


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--worker", action="store_true")
  p.add_argument("--devices", default="1,2")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--attention", default="")
  p.add_argument("--config", default="onetrans_v31", help="smoke: CPU check")
  p.add_argument("--budget-s", type=float, default=480.0)
  p.add_argument("--out", default=None)
  p.add_argument("--strategy", default="fsdp", help="worker: mesh strategy")
  p.add_argument(
    "--profile",
    action="store_true",
    help="also trace 3 steps of every 2-GPU run: device ms/step by kernel",
  )
  p.add_argument(
    "--variants",
    default="ddp,overlap,nccl_1ch,memcpy_p2p",
    help="run after default, in order, while the budget allows",
  )
  args = p.parse_args()
  if args.worker:
    worker(
      [int(d) for d in args.devices.split(",")],
      args.steps,
      args.rounds,
      args.attention,
      args.config,
      args.strategy,
      args.profile,
    )
    return
  sys.path.insert(0, ROOT)
  import jax

  from benchmarks import common

  t_start = time.monotonic()
  left = lambda: args.budget_s - (time.monotonic() - t_start)
  raw, notes = {}, {}
  res, err = _run("default", [1, 2], args, left())
  if res is None and not args.attention and "timed out" not in err:
    notes["default (pallas attention)"] = err
    # Fall back from the Pallas attention kernels to XLA's (dense, so with
    # 4-request shards of a 4,864-token buffer).
    args.attention = "xla"
    res, err = _run("default", [1, 2], args, left())
  if res is None:
    notes["default"] = err
  else:
    raw["default"] = res
  # s, estimated: a 2-GPU compile took ~115 s on the H200s
  cost = 140
  for v in args.variants.split(","):
    if v not in VARIANTS or v == "default":
      raise SystemExit(f"unknown variant {v!r}: one of {list(VARIANTS)[1:]}")
    if res is None or left() < cost:
      notes[v] = "skipped: not enough of the time budget left"
      continue
    r, err = _run(v, [2], args, left())
    if r is None:
      notes[v] = err
    else:
      raw[v] = r
  records = []
  if "default" in raw:
    one = next(r for r in raw["default"] if r["devices"] == 1)
    for v, runs in raw.items():
      two = next(r for r in runs if r["devices"] == 2)
      thr1 = one["requests_per_step"] / one["step_s"]
      thr2 = two["requests_per_step"] / two["step_s"]
      records.append(
        common.record(
          "scaling",
          f"{args.config}/2x{common.device_name()}",
          v,
          "scaling_ratio",
          thr2 / (2 * thr1),
          goal=GOAL,
        )
      )
      records.append(
        common.record(
          "scaling",
          f"{args.config}/2x{common.device_name()}",
          v,
          "requests_per_s",
          thr2,
          baseline="1 GPU x 2",
          baseline_value=2 * thr1,
        )
      )
      records.append(
        common.record(
          "scaling",
          f"{args.config}/2x{common.device_name()}",
          v,
          "step_ms",
          two["step_s"] * 1e3,
          baseline="1 GPU",
          baseline_value=one["step_s"] * 1e3,
          lower_is_better=True,
        )
      )
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
