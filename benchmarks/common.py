"""Shared benchmark plumbing: timing on the device and the results format.

Every benchmark runs our implementation and its baselines in one process,
prints a table and writes `benchmarks/results/<name>.json`, a list of records
(see `record`). Only figures a run printed are recorded.
"""

import datetime
import glob
import gzip
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"


def device_name() -> str:
  d = jax.devices()[0]
  return getattr(d, "device_kind", d.platform)


# Queued calls per batch, batches of `time_sets` and rounds of
# `time_sets_interleaved`; CPU smoke runs set 1.
TIMING = {"iters": 20, "repeats": 5, "rounds": 7}


def time_sets(fn, sets, iters: int | None = None) -> float:
  """Median seconds per input set of `fn(*set)`: all sets in one jitted
  call (rotating inputs keeps caches honest), calls queued back to back
  (`device_time`), so the figure is device time, as in a training step.

  Synchronizing after every call instead adds a host round trip per call,
  ~0.25 ms on the H200 machine: 40% of a 0.16 ms memory-bound op's
  figure, while the copy ceiling it is compared with is timed queued.
  `iters` lowers `TIMING["iters"]` (a slow reference).
  """
  n = TIMING["iters"] if iters is None else min(iters, TIMING["iters"])
  sec = device_time(all_sets(fn), [(sets,)], calls=n, repeats=TIMING["repeats"])
  return sec / len(sets)


def time_sets_interleaved(runs) -> dict:
  """`time_sets` of every `runs[key] = (fn, sets)`, timed in alternation
  (`time_interleaved`: `TIMING["rounds"]` rounds of batches of
  `TIMING["iters"]` and twice that): seconds per input set, by key. A run
  that fails its first call (e.g. cuDNN rejects a shape) is printed and
  left out."""
  t = time_interleaved(
    {k: (all_sets(fn), [(sets,)]) for k, (fn, sets) in runs.items()},
    rounds=TIMING["rounds"],
    calls=TIMING["iters"],
    skip_failures=True,
  )
  return {k: t[k] / len(runs[k][1]) for k in t}


def all_sets(fn):
  """`fn(*set)` for every input set of a list, in one jitted call (the
  program `time_sets` times: one dispatch for all of them)."""
  return jax.jit(lambda sets: [fn(*s) for s in sets])


def device_time(
  fn, arg_sets, *, calls: int = 30, repeats: int = 7, method: str = "auto"
) -> float:
  """Median seconds per call on the device, launch gaps left out.

  Calls are queued back to back (rotating over `arg_sets`) and synchronized
  once per batch, so host dispatch overlaps device work. A batch also pays
  a fixed cost: the first call's dispatch before the device starts, and
  the wake-up after the last. So each repeat times a batch of `calls` and
  one of `2 * calls`, and takes the difference per added call, which is
  free of that cost; the median over `repeats` is returned. On the H200
  that cost is about 0.5 ms a batch (the measurement, and which records
  were timed the earlier way, one batch's mean: docs/benchmarks_method.md).

  A program whose host dispatch is slower than its device work would be
  timed at the host's rate. `method` says how to time: "clock" (the
  batches above), "trace" (the device's busy time in a profiler trace of
  `calls` calls, `trace_busy_time`: the time some op runs, the gaps
  between ops left out), or "auto": the clock, unless the host's dispatch
  per call reaches 90% of the device's busy time on a GPU, then the trace
  (both printed; `_busy_if_host_bound`). `timing_method` makes that
  choice once for a group of programs.
  """
  if method not in ("auto", "clock", "trace"):
    raise ValueError(f"method={method!r}: use 'auto', 'clock' or 'trace'")
  for a in arg_sets:
    jax.block_until_ready(fn(*a))
  if method == "trace":
    return trace_busy_time(fn, arg_sets, calls)
  sec, host = _clock_time(fn, arg_sets, calls, repeats)
  if method == "clock":
    return sec
  busy = _busy_if_host_bound(fn, arg_sets, calls, sec, host)
  return sec if busy is None else busy


def timing_method(runs, calls: int) -> str:
  """One method for timing every `runs[key] = (fn, arg_sets)`: "trace" if
  `device_time(method="auto")` would time any of them from a trace (a
  host-bound program), else "clock". Decided from one repeat of the
  clock's batches per run (and a trace where the host looks near its
  limit), so that rounds timed with it compare like with like and their
  medians never pool the two kinds of figure (`time_interleaved`, which
  has called each run once already: compiled, so not timed here)."""
  for fn, arg_sets in runs.values():
    sec, host = _clock_time(fn, arg_sets, calls, repeats=1)
    if _busy_if_host_bound(fn, arg_sets, calls, sec, host) is not None:
      return "trace"
  return "clock"


def _busy_if_host_bound(fn, arg_sets, calls, sec, host) -> float | None:
  """The device's busy seconds per call from a trace, if `fn` is
  host-bound on a GPU: its dispatch (`host` a call) takes at least 90% of
  the device's busy time, so the device waits on the host at times and
  the clock (`sec`) times the host. Else None (keep the clock). A trace
  is taken only when the dispatch reaches half the clock's figure, and
  one without device ops keeps the clock. Prints a host-bound finding."""
  if host < 0.5 * sec or jax.default_backend() != "gpu":
    return None
  busy = trace_busy_time(fn, arg_sets, calls)
  if busy <= 0:
    print(
      f"    (host-bound: dispatch {host * 1e6:.1f} us a call; no device "
      "op in its trace, so timed at the host's rate)"
    )
    return None
  if host < 0.9 * busy:
    return None
  print(
    f"    (host-bound: dispatch {host * 1e6:.1f} us a call, timed "
    f"{sec * 1e6:.1f}; device busy {busy * 1e6:.1f} us a call in a "
    "trace: used)",
    flush=True,
  )
  return busy


def _clock_time(fn, arg_sets, calls, repeats) -> tuple[float, float]:
  """(median seconds per call from the batches' difference, median host
  dispatch seconds per call); see `device_time`."""

  def batch(n):
    t0 = time.perf_counter()
    out = None
    for i in range(n):
      out = fn(*arg_sets[i % len(arg_sets)])
    t_host = time.perf_counter() - t0
    jax.block_until_ready(out)
    return time.perf_counter() - t0, t_host

  times, hosts = [], []
  for _ in range(repeats):
    t1, _ = batch(calls)
    t2, h2 = batch(2 * calls)
    # Tiny CPU smoke runs can come out non-positive: fall back to the mean.
    times.append((t2 - t1) / calls if t2 > t1 else t2 / (2 * calls))
    hosts.append(h2 / (2 * calls))
  return float(np.median(times)), float(np.median(hosts))


def trace_calls(fn, arg_sets, calls: int, log_dir) -> None:
  """`calls` queued calls of `fn`, inputs rotated over `arg_sets`, under
  `jax.profiler.trace(log_dir)` (a perfetto trace), finished inside it."""
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    out = None
    for i in range(calls):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)


def trace_busy_time(fn, arg_sets, calls: int, device="/device:GPU") -> float:
  """Seconds per call during which the device runs some op, from a
  profiler trace of `calls` queued calls: the union of the op intervals
  of every `device` process (streams overlap), divided by `calls`. The
  gaps between ops are left out; for a host-bound program they are the
  host's."""
  with tempfile.TemporaryDirectory() as log_dir:
    trace_calls(fn, arg_sets, calls, log_dir)
    events = _trace_events(log_dir) or []  # no trace written: no ops
  names = _process_names(events)
  spans = [
    (e["ts"], e["ts"] + e.get("dur", 0.0))
    for e in events
    if e.get("ph") == "X" and device in names.get(e.get("pid"), "")
  ]
  return union_length(spans) / 1e6 / calls  # trace times are microseconds


def union_length(spans) -> float:
  """Total length of the union of `[start, end)` intervals."""
  total, covered_to = 0.0, -np.inf
  for a, b in sorted(spans):
    total += max(0.0, b - max(a, covered_to))
    covered_to = max(covered_to, b)
  return total


def time_interleaved(
  runs, *, rounds: int = 7, calls: int = 10, skip_failures: bool = False
):
  """Median seconds per call of each `runs[key] = (fn, arg_sets)`, timed
  in alternation: every round times each run once (`device_time` with one
  repeat: batches of `calls` and `2 * calls` queued calls), the order
  rotated from round to round.

  Timing one program's batches and then the other's compares them at
  different clock states: on the H200 a sustained FP8 GEMM heats the chip
  and slows within seconds, and dense attention runs at the board's 700 W
  power cap with its SM clock lowered (the measurements:
  docs/benchmarks_method.md). Alternating gives every run the same mix of
  states.

  All runs are timed by one method, decided before the rounds
  (`timing_method`): the clock, or, if any run is host-bound, traces for
  all (whose figures leave out the gaps between kernels, for every
  program alike). So a ratio compares like with like, and a median never
  pools the two kinds of figure.

  Returns `{key: median seconds}`, and prints each run's per-round times.
  With `skip_failures`, a run whose first calls raise is printed and left
  out of the rounds and the result.
  """
  runs = dict(runs)
  for key, (fn, arg_sets) in list(runs.items()):
    try:
      for a in arg_sets:
        jax.block_until_ready(fn(*a))
    except Exception as e:
      if not skip_failures:
        raise
      print(f"{key}: {type(e).__name__} {str(e)[:300]}", flush=True)
      del runs[key]
  keys = list(runs)
  if not keys:
    return {}
  method = timing_method(runs, calls)
  times = {k: [] for k in keys}
  for r in range(rounds):
    s = r % len(keys)
    for k in keys[s:] + keys[:s]:
      fn, arg_sets = runs[k]
      times[k].append(
        device_time(fn, arg_sets, calls=calls, repeats=1, method=method)
      )
  for k, ts in times.items():
    how = " (from traces)" if method == "trace" else ""
    print(
      f"    {k}: rounds (ms){how} {np.round(np.array(ts) * 1e3, 4)}",
      flush=True,
    )
  return {k: float(np.median(ts)) for k, ts in times.items()}


def copy_bandwidths(nbytes: int = 1 << 30, **timing) -> dict[str, float]:
  """Device copy bandwidth in TB/s (bytes read + written) of two XLA ops,
  `jnp.copy` and `x + 1`, on two `[n / 2048, 2048]` bf16 arrays of
  `nbytes` each (queued calls, see `device_time`)."""
  shape = (max(nbytes // 2 // 2048, 1), 2048)
  xs = [
    jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(
      jnp.bfloat16
    )
    for i in range(2)
  ]
  moved = 2 * xs[0].nbytes
  return {
    name: moved / device_time(jax.jit(op), [(x,) for x in xs], **timing) / 1e12
    for name, op in COPY_OPS.items()
  }


# The copy ceilings' ops: a plain copy and the simplest elementwise kernel.
COPY_OPS = {
  "xla copy": jnp.copy,
  "xla x+1": lambda x: x + jnp.asarray(1, x.dtype),
}


def copy_bandwidth(nbytes: int = 1 << 30, **timing) -> float:
  """The best of `copy_bandwidths` (TB/s), printed with its parts: the
  ceiling a memory-bound kernel's bytes are compared with."""
  bws = copy_bandwidths(nbytes, **timing)
  parts = ", ".join(f"{k} {v:.2f}" for k, v in bws.items())
  print(f"copy bandwidth {max(bws.values()):.2f} TB/s ({parts})", flush=True)
  return max(bws.values())


def kernel_profile(directory, region: str = "item") -> dict:
  """Per-SM balance of each kernel profiled under
  `pallas_kernels.mosaic.profiling(directory)` (one folder per kernel,
  its newest trace): from the warpgroups' top-level `region` ranges
  (nested ones and the profiler's own "Init" left out), per SM the end of
  its last range, measured from the kernel's first range start.

  Returns `{kernel: {"span_us", "sms", "regions", "end_mean_us",
  "end_max_over_mean", "idle_share"}}`: `idle_share` is the part of the
  SMs' time within the span after their last range (the cost of
  imbalance at the tail). A persistent kernel runs one CTA per SM, so an
  SM's end is its CTA's."""
  out = {}
  for folder in sorted(pathlib.Path(directory).glob("*")):
    files = sorted(folder.glob("*-trace.json"))
    if not folder.is_dir() or not files:
      continue
    events = json.loads(files[-1].read_text())["traceEvents"]
    ranges, open_by_trace = [], {}
    for e in events:
      stack = open_by_trace.setdefault(e["tid"], [])
      if e["ph"] == "B":
        stack.append(e)
        continue
      begin = stack.pop()
      if not stack and begin["name"] == region:
        ranges.append((begin["pid"], begin["ts"], e["ts"]))
    if not ranges:
      continue
    t0 = min(r[1] for r in ranges)
    span = max(r[2] for r in ranges) - t0
    ends = {}
    for sm, _, end in ranges:
      ends[sm] = max(ends.get(sm, t0), end)
    e = np.array(list(ends.values())) - t0
    out[folder.name] = {
      "span_us": float(span),
      "sms": len(e),
      "regions": len(ranges),
      "end_mean_us": float(e.mean()),
      "end_max_over_mean": float(e.max() / e.mean()),
      "idle_share": float(1 - e.mean() / span),
    }
  return out


def trace_summary(log_dir, steps: int, top: int = 12, device="/device:GPU"):
  """Device time per step from a `jax.profiler.trace(log_dir,
  create_perfetto_trace=True)` of `steps` steps: for every device process
  (name containing `device`) and each of its threads (streams / XLA ops),
  the busy time split into collectives (NCCL kernels, collective HLOs) and
  everything else, and the `top` events by total time. Times in ms/step.
  """
  events = _trace_events(log_dir)
  if events is None:
    return {}
  names, threads = _process_names(events), {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[e["pid"], e["tid"]] = e["args"]["name"]
  comm = ("nccl", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")
  out = {}
  for e in events:
    pid = e.get("pid")
    if e.get("ph") != "X" or device not in names.get(pid, ""):
      continue
    key = f"{names[pid]} | {threads.get((pid, e.get('tid')), e.get('tid'))}"
    t = out.setdefault(key, {"collective_ms": 0.0, "other_ms": 0.0, "by": {}})
    ms = e.get("dur", 0.0) / 1e3 / steps
    kind = any(c in e["name"].lower() for c in comm)
    t["collective_ms" if kind else "other_ms"] += ms
    t["by"][e["name"]] = t["by"].get(e["name"], 0.0) + ms
  for t in out.values():
    t["top"] = sorted(t.pop("by").items(), key=lambda kv: -kv[1])[:top]
  return out


def _trace_events(log_dir):
  """The events of the newest perfetto trace under `log_dir` (None: none)."""
  path = sorted(
    glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
  )
  if not path:
    return None
  with gzip.open(path[-1]) as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def _process_names(events) -> dict:
  return {
    e["pid"]: e["args"]["name"]
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }


# Attention benchmarks: jagged inputs and their padded baselines.


def lognormal_lengths(rng, n: int, lmax: int = 2048):
  """The issues' log-normal traffic: median 1,100 (scaled by `lmax / 2048`
  in small runs), sigma 0.6, capped at `lmax`, at least 1."""
  x = np.exp(rng.normal(np.log(1100 * lmax / 2048), 0.6, n))
  return np.clip(np.round(x), 1, lmax).astype(np.int32)


def offsets(lens):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def pad(x_t, off, lmax):
  """Packed `[t, ...]` -> padded `[b, lmax, ...]` (zeros past each length)."""
  lens = np.diff(off)
  idx = off[:-1, None] + np.arange(lmax)[None, :]
  valid = np.arange(lmax)[None, :] < lens[:, None]
  idx = np.where(valid, idx, 0)
  return jnp.where(valid[:, :, None, None], x_t[idx], 0).astype(x_t.dtype)


def padded_sets(sets, q_off, kv_off, max_q, max_kv):
  """Packed `(q, k, v, do)` input sets -> padded `[b, L, ...]` copies (made
  once, outside any timed call)."""
  return [
    (
      pad(q, q_off, max_q),
      pad(k, kv_off, max_kv),
      pad(v, kv_off, max_kv),
      pad(do, q_off, max_q),
    )
    for q, k, v, do in sets
  ]


def cudnn_padded(q_lens, kv_lens, implementation="cudnn"):
  """The padded softmax-attention baseline: `fn(q, k, v)` on `[b, L, ...]`
  with per-sample lengths (`implementation="xla"` in CPU smoke runs)."""
  q_lens, kv_lens = jnp.asarray(q_lens), jnp.asarray(kv_lens)

  def fn(q, k, v):
    return jax.nn.dot_product_attention(
      q,
      k,
      v,
      implementation=implementation,
      query_seq_lengths=q_lens,
      key_value_seq_lengths=kv_lens,
    )

  return fn


def checked(benchmark, case, check, records, max_err, impl="mosaic"):
  """Run `check() -> {name: rel err}` and record each error of `impl`
  (our kernels by default) against `max_err`. A failure (an exception or
  an error over the bound) is printed, never raised: the baselines are
  still measured, so one device run tells as much as it can. Returns the
  errors (None if it raised)."""
  try:
    errs = check()
  except Exception as e:  # noqa: BLE001 - report and go on
    print(f"{case}: {impl} FAILED: {type(e).__name__}: {e}"[:3000])
    return None
  for name, err in errs.items():
    records.append(
      record(
        benchmark,
        case,
        impl,
        f"rel_err_{name}",
        err,
        goal=max_err,
        lower_is_better=True,
      )
    )
  if errs and max(errs.values()) >= max_err:
    print(f"{case}: CHECK FAILED (rel err >= {max_err})", flush=True)
  return errs


def grad_errs(got, ref, inputs) -> dict[str, float]:
  """Relative errors of `got = (o, dq, dk, dv)` (`fwd_bwd` of an op at
  `inputs = (q, k, v, do)`) against `ref`'s, run in f32 at the highest
  matmul precision."""
  with jax.default_matmul_precision("highest"):
    want = jax.jit(fwd_bwd(ref))(*(x.astype(jnp.float32) for x in inputs))
  names = ("o", "dq", "dk", "dv")
  return {n: rel_err(g, w) for n, g, w in zip(names, got, want, strict=True)}


def rel_err(got, want) -> float:
  """Relative Frobenius error of `got` against `want` (computed in f32)."""
  g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def fwd_bwd(attn):
  """`(q, k, v, do) -> (o, dq, dk, dv)` of `attn`: what forward+backward
  times, a training step's forward and backward.

  The output is returned so that the forward stays in the program: an op
  whose backward recomputes what it needs from Q and K (GDPA, block
  attention) does not save its output, and with the gradients alone JAX
  drops the forward kernel from the lowered program (seen: one of block
  attention's two kernels, two of GDPA's three), which times the backward
  only. cuDNN's backward needs its output, so baselines were whole either
  way. `tests/benchmarks/test_common.py` counts the kernels."""

  def f(q, k, v, do):
    o, vjp = jax.vjp(attn, q, k, v)
    return (o, *vjp(do))

  return f


def record(
  benchmark: str,
  case: str,
  impl: str,
  metric: str,
  value: float,
  *,
  baseline: str | None = None,
  baseline_value: float | None = None,
  goal: float | None = None,
  lower_is_better: bool = False,
  ratio: float | None = None,
) -> dict:
  """One result. `ratio` is what `goal` bounds: by default value over
  baseline_value, or the value itself when there is no baseline value; pass
  `ratio=value` for figures judged on their own (a straggler ratio, a waste
  fraction) even when a baseline is shown beside them."""
  if ratio is None:
    ratio = value / baseline_value if baseline_value else value
  return {
    "benchmark": benchmark,
    "case": case,
    "impl": impl,
    "baseline": baseline,
    "metric": metric,
    "value": value,
    "baseline_value": baseline_value,
    "ratio": ratio,
    "goal": goal,
    "lower_is_better": lower_is_better,
    "device": device_name(),
    "jax_version": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "command": " ".join(["python"] + sys.argv),
  }


def print_table(records: list[dict]) -> None:
  cols = [
    "case",
    "impl",
    "metric",
    "value",
    "baseline",
    "baseline_value",
    "ratio",
    "goal",
  ]
  rows = [[_fmt(r.get(c)) for c in cols] for r in records]
  widths = (
    [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    if rows
    else [len(c) for c in cols]
  )
  print(" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
  print("-|-".join("-" * w for w in widths))
  for row in rows:
    print(" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def write_results(
  name: str, records: list[dict], out_dir=None, *, dry_run: bool = False
):
  """Print the table and write `results/<name>.json` (and `out_dir`, if
  given, with the same content).

  Records replace earlier ones with the same (case, impl, metric) and leave
  the others, so a run that re-measures some cases (`--dims 64`, or a run
  cut short) never erases figures it did not measure; delete the file to drop
  cases that no longer exist. A `dry_run` (CPU smoke run) writes only to
  `out_dir`. Returns the first path written, or None.
  """
  print_table(records)
  path = RESULTS / f"{name}.json"
  if not dry_run and path.exists():
    key = lambda r: (r["case"], r["impl"], r["metric"])
    new = {key(r) for r in records}
    old = [r for r in json.loads(path.read_text()) if key(r) not in new]
    records = old + records
  targets = [] if dry_run else [path]
  if out_dir:
    targets.append(pathlib.Path(out_dir) / f"{name}.json")
  for p in targets:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(records, indent=1) + "\n")
  return targets[0] if targets else None


def _fmt(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)
