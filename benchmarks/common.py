"""Shared benchmark plumbing: timing on the device and the results format.

Every benchmark runs our implementation and its baselines in one process,
prints a table and writes `benchmarks/results/<name>.json`, a list of records
(see `record`). Only figures a run printed are recorded.
"""

import datetime
import json
import pathlib
import sys
import time

import jax
import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"


def device_name() -> str:
  d = jax.devices()[0]
  return getattr(d, "device_kind", d.platform)


def time_fn(fn, *arg_sets, warmup: int = 3, iters: int = 20) -> float:
  """Median seconds of `fn(*args)`, rotating over `arg_sets` (avoids caching).

  Each call is synchronized with `block_until_ready`, so this measures the
  device time of one call plus launch overhead.
  """
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  times = []
  for i in range(iters):
    args = arg_sets[i % len(arg_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


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


def write_results(name: str, records: list[dict], out_dir=None) -> pathlib.Path:
  """Write records to results/<name>.json (and to `out_dir` too, if given)."""
  print_table(records)
  paths = [RESULTS / f"{name}.json"]
  if out_dir:
    paths.append(pathlib.Path(out_dir) / f"{name}.json")
  for p in paths:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(records, indent=1) + "\n")
  return paths[0]


def _fmt(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)
