"""Benchmark results: partial runs keep what they did not re-measure, dry
runs never touch results/, and the report judges ratios against goals."""

import json
import time

import pytest

from benchmarks import common, report


def _rec(case, value, goal=None, lower=False):
  r = common.record("b", case, "ours", "ms", value, goal=goal,
                    lower_is_better=lower)  # fmt: skip
  return r


def test_partial_run_replaces_only_its_records(tmp_path, monkeypatch):
  monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
  common.write_results("b", [_rec("D128", 1.0), _rec("D64", 2.0)])
  common.write_results("b", [_rec("D64", 3.0)], tmp_path / "out")
  saved = json.loads((tmp_path / "results" / "b.json").read_text())
  assert [(r["case"], r["value"]) for r in saved] == [
    ("D128", 1.0),
    ("D64", 3.0),
  ]
  assert json.loads((tmp_path / "out" / "b.json").read_text()) == saved


def test_dry_run_writes_only_out_dir(tmp_path, monkeypatch):
  monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
  path = common.write_results("b", [_rec("x", 1.0)], tmp_path / "out",
                              dry_run=True)  # fmt: skip
  assert path == tmp_path / "out" / "b.json"
  assert not (tmp_path / "results").exists()
  assert common.write_results("b", [_rec("x", 1.0)], dry_run=True) is None


def test_goal_is_judged_on_ratio():
  assert common.record("b", "c", "i", "m", 9.0)["ratio"] == 9.0
  assert report.met(_rec("c", 1.4, goal=1.3)) == "yes"
  assert report.met(_rec("c", 1.2, goal=1.3)) == "**no**"
  assert report.met(_rec("c", 0.02, goal=0.03, lower=True)) == "yes"
  assert report.met(_rec("c", 0.04, goal=0.03, lower=True)) == "**no**"
  assert report.met(_rec("c", 1.0)) == ""


def test_headline_keeps_goals_and_named_metrics_not_checks():
  recs = [
    _rec("c", 1.4, goal=1.3),
    _rec("c", 1.0),
    dict(_rec("c", 0.01, goal=0.02, lower=True), metric="rel_err_o"),
    dict(_rec("c", 5.0), metric="step_ms"),
  ]
  assert report.headline("b", recs) == [recs[0]]
  assert report.headline("train_step", recs) == [recs[0], recs[3]]
  assert report.checks_line(recs).startswith("Correctness: 1 of 1 checks")


def test_benchmarks_md_is_generated_from_the_results():
  """BENCHMARKS.md and docs/benchmarks_history.md are report.py's output:
  a new results JSON needs `python benchmarks/report.py`."""
  assert report.main(["--check"]) == 0


def test_trace_summary_splits_device_time(tmp_path):
  # On CPU the trace has host threads only; the same parser reads the
  # GPU's streams in scaling.py --profile.
  import jax
  import jax.numpy as jnp

  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((256, 256))
  f(x).block_until_ready()
  with jax.profiler.trace(tmp_path, create_perfetto_trace=True):
    for _ in range(2):
      f(x).block_until_ready()
  out = common.trace_summary(tmp_path, steps=2, device="/host:CPU")
  assert out, "no thread of the host process found"
  for t in out.values():
    assert t["collective_ms"] >= 0 and t["other_ms"] >= 0
    assert all(ms > 0 for _, ms in t["top"])
  assert sum(t["other_ms"] for t in out.values()) > 0
  assert common.trace_summary(tmp_path / "missing", steps=1) == {}


def test_table_shows_dates_when_runs_differ():
  a, b = _rec("x", 1.0), _rec("y", 2.0)
  a["date"], b["date"] = "2026-11-29", "2026-11-30"
  header, _, row_a, row_b = report.table([a, b], with_date=True).splitlines()
  assert header.endswith("| date | met |")
  assert "| 2026-11-29 |" in row_a and "| 2026-11-30 |" in row_b
  assert "date" not in report.table([a]).splitlines()[0]


def test_fwd_bwd_keeps_the_forward_kernel():
  # Block attention's backward recomputes its scores from Q and K and saves
  # no output, so with the gradients alone JAX drops the forward kernel
  # (one Mosaic kernel lowered instead of two) and a "fwd+bwd" time would
  # be the backward's. Lowered for CUDA on CPU, abstract shapes only.
  import jax
  import jax.numpy as jnp
  from jax import export

  from pallas_kernels.block_attention.op import block_attention_mosaic

  spec = jax.ShapeDtypeStruct
  q = spec((256, 2, 128), jnp.bfloat16)
  offsets = spec((3,), jnp.int32)

  def program(q, k, v, do, offsets):
    attn = lambda q, k, v: block_attention_mosaic(
      q, k, v, offsets, rope=1e4, max_len=256, interpret=False
    )
    return common.fwd_bwd(attn)(q, k, v, do)

  lowered = export.export(jax.jit(program), platforms=["cuda"])
  module = lowered(q, q, q, q, offsets).mlir_module()
  assert module.count("custom_call @mosaic_gpu") == 2  # forward, backward


def test_time_interleaved_alternates_and_takes_medians(monkeypatch):
  """Rounds time every run once, the order rotated; each run's figure is
  the median of its own rounds, all timed by the method decided for it
  once before the rounds. A run whose first call fails raises, or with
  `skip_failures` is left out."""
  order, fake = [], iter([5.0, 1.0, 2.0, 9.0, 3.0, 4.0])
  decided = []

  def timing_method(runs, calls):
    assert calls == 10
    decided.append(sorted(runs))
    return "trace"

  def device_time(fn, arg_sets, *, calls, repeats, method):
    assert (calls, repeats, method) == (10, 1, "trace")
    order.append(fn.__name__)
    return next(fake)

  monkeypatch.setattr(common, "timing_method", timing_method)
  monkeypatch.setattr(common, "device_time", device_time)

  def a(x):
    return x

  def b(x):
    return x

  def fails(x):
    raise ValueError("no such shape")

  runs = {"a": (a, [(1,)]), "c": (fails, [(1,)]), "b": (b, [(2,)])}
  with pytest.raises(ValueError, match="no such shape"):
    common.time_interleaved(runs, rounds=3, calls=10)
  got = common.time_interleaved(runs, rounds=3, calls=10, skip_failures=True)
  assert decided == [["a", "b"]]  # once, for the runs left
  assert order == ["a", "b", "b", "a", "a", "b"]
  # a: 5, 9, 3 -> 5; b: 1, 2, 4 -> 2
  assert got == {"a": 5.0, "b": 2.0}
  assert (
    common.time_interleaved({"c": runs["c"]}, rounds=3, skip_failures=True)
    == {}
  )


def test_time_sets_interleaved_times_all_sets_per_call(monkeypatch):
  """Each run is timed as one program over all its sets (`all_sets`, the
  program `time_sets` times), with TIMING's rounds and batch size and
  failures skipped; its figure is per set."""
  seen = {}

  def time_interleaved(runs, *, rounds, calls, skip_failures):
    assert (rounds, calls, skip_failures) == (7, 20, True)
    assert set(runs) == {"a", "b"}
    for key, (fn, arg_sets) in runs.items():
      (sets,) = arg_sets[0]
      seen[key] = fn(sets)
    return {"a": 6.0}  # "b" failed

  monkeypatch.setattr(common, "time_interleaved", time_interleaved)
  monkeypatch.setitem(common.TIMING, "rounds", 7)
  monkeypatch.setitem(common.TIMING, "iters", 20)
  got = common.time_sets_interleaved(
    {
      "a": (lambda x: x + 1, [(1,), (2,), (3,)]),
      "b": (lambda x: -x, [(5,)]),
    }
  )
  assert [int(x) for x in seen["a"]] == [2, 3, 4]
  assert [int(x) for x in seen["b"]] == [-5]
  assert got == {"a": 2.0}


def test_timed_sets_share_one_work_list():
  """The attention benchmarks time R input sets with the same offsets in
  one program (`all_sets`): XLA builds their work list once, as it builds
  one for all layers of a model (the benchmarks' docstrings say so)."""
  import re

  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels import schedule

  off = jnp.asarray(common.offsets(np.array([70, 5, 130], np.int32)))

  def one(q):
    # Causal: items cost differently within a sequence, so they are
    # sorted, and the sort's scatter is counted.
    items, _ = schedule.query_items(
      off, off, 256, block_q=64, block_kv=128, causal=True
    )
    return items, q.sum()

  def scatters(r):
    sets = [(jnp.full((256,), i, jnp.float32),) for i in range(r)]
    txt = common.all_sets(one).lower(sets).compile().as_text()
    return len(re.findall(r"= \S+ scatter\(", txt))

  assert scatters(1) == scatters(4) == 1


def test_device_time_drops_the_fixed_cost_of_a_batch(monkeypatch):
  """On a fake clock where every call costs `per_call` and every batch
  also pays `fixed` at its sync, `device_time` returns `per_call` (the
  difference of a `2n`- and an `n`-call batch), where the mean of one
  batch would carry `fixed / n` (8% more here, far outside `approx`)."""
  now = [0.0]
  per_call, fixed, calls = 3e-4, 5e-4, 20
  seen = []

  def fn(x):
    now[0] += per_call
    seen.append(x)
    return x

  def sync(out):
    now[0] += fixed
    return out

  monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
  monkeypatch.setattr(common.jax, "block_until_ready", sync)
  got = common.device_time(fn, [(1,), (2,)], calls=calls, repeats=3)
  assert got == pytest.approx(per_call)
  # One warm-up call per input set, then per repeat batches of n and 2n
  # calls, rotating over the sets.
  assert len(seen) == 2 + 3 * (calls + 2 * calls)
  assert seen[2:6] == [1, 2, 1, 2]


def test_host_bound_programs_are_timed_from_a_trace(monkeypatch):
  """When dispatching a call takes the host about as long as the call
  takes (a GPU program of many small ops), the clock times the host; then
  `device_time` returns the device's busy time from a trace."""
  now = [0.0]

  def fn(x):
    now[0] += 3e-4  # all of it host time: the device keeps up
    return x

  monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
  monkeypatch.setattr(common.jax, "block_until_ready", lambda out: out)
  monkeypatch.setattr(common.jax, "default_backend", lambda: "gpu")
  traced = []

  def busy(fn_, arg_sets, calls):
    traced.append(calls)
    return 1e-4

  monkeypatch.setattr(common, "trace_busy_time", busy)
  assert common.device_time(fn, [(1,)], calls=10, repeats=2) == 1e-4
  assert traced == [10]
  # A trace without device ops keeps the clock's figure.
  monkeypatch.setattr(common, "trace_busy_time", lambda *a: 0.0)
  got = common.device_time(fn, [(1,)], calls=10, repeats=2)
  assert got == pytest.approx(3e-4)
  monkeypatch.setattr(common.jax, "default_backend", lambda: "cpu")
  got = common.device_time(fn, [(1,)], calls=10, repeats=2)
  assert got == pytest.approx(3e-4)


def test_timing_method_is_chosen_as_device_time_would(monkeypatch):
  """A program is host-bound when its dispatch takes 90% of the device's
  busy time (from a trace); `timing_method` answers "trace" for a group
  when `device_time`'s "auto" would trace any of its programs, else
  "clock"; "clock" and "trace" force one method."""
  # Each call takes the host `host_us` to dispatch; the device runs it in
  # `dev_us` (busy, as the trace reports it) once the host has sent it.
  now, queued, host_us, dev_us = [0.0], [0], [300.0], 100.0

  def fn(x):
    now[0] += host_us[0] * 1e-6
    queued[0] += 1
    return x

  def sync(out):  # wait out the device's queue, if it lags the host
    now[0] += max(0.0, dev_us - host_us[0]) * 1e-6 * queued[0]
    queued[0] = 0
    return out

  monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
  monkeypatch.setattr(common.jax, "block_until_ready", sync)
  monkeypatch.setattr(common.jax, "default_backend", lambda: "gpu")
  busy = [1e-4]  # dev_us, in seconds
  monkeypatch.setattr(common, "trace_busy_time", lambda *a: busy[0])
  slow_host = {"x": (fn, [(1,)])}
  assert common.timing_method(slow_host, calls=10) == "trace"
  assert common.device_time(fn, [(1,)], calls=10) == 1e-4
  assert common.device_time(fn, [(1,)], calls=10, method="trace") == 1e-4
  clock = common.device_time(fn, [(1,)], calls=10, method="clock")
  assert clock == pytest.approx(3e-4)  # the host's rate
  # Dispatch at 92% of the busy time: the clock would read the device
  # (the host only just keeps up), but gaps come and go; still traced.
  host_us[0] = 92.0
  assert common.timing_method(slow_host, calls=10) == "trace"
  # Dispatch far ahead of the device: the clock, with no trace taken.
  host_us[0] = 10.0
  busy[0] = None  # a trace would fail the comparison
  assert common.timing_method(slow_host, calls=10) == "clock"
  assert common.device_time(fn, [(1,)], calls=10) == pytest.approx(1e-4)
  # One host-bound program makes the whole group traced.
  busy[0] = 1e-4

  def slow(x):
    now[0] += 300e-6
    return x

  group = {"fast": (fn, [(1,)]), "slow": (slow, [(1,)])}
  assert common.timing_method(group, calls=10) == "trace"
  # A trace without device ops keeps the clock.
  busy[0] = 0.0
  assert common.timing_method(group, calls=10) == "clock"
  with pytest.raises(ValueError, match="method='wall'"):
    common.device_time(fn, [(1,)], calls=10, method="wall")


def test_busy_time_is_the_union_of_op_intervals(monkeypatch):
  assert common.union_length([]) == 0
  assert common.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
  # A real trace (on CPU: the host's threads stand in for the device).
  import jax
  import jax.numpy as jnp

  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((256, 256))
  f(x).block_until_ready()
  t0 = time.perf_counter()
  t = common.trace_busy_time(f, [(x,)], calls=3, device="/host:CPU")
  assert 0 < t <= (time.perf_counter() - t0) / 3
  # No trace written (or no op of that device): no busy time, which
  # `device_time` answers with the clock's figure.
  assert common.trace_busy_time(f, [(x,)], calls=3, device="/nothing") == 0
  monkeypatch.setattr(common, "_trace_events", lambda log_dir: None)
  assert common.trace_busy_time(f, [(x,)], calls=3) == 0


def test_kernel_profile_reads_each_kernels_newest_trace(tmp_path):
  """Per-SM tail balance from the Mosaic GPU profiler's Perfetto traces:
  top-level "item" ranges only (not the profiler's "Init", other names, or
  an "item" nested in one), per SM the last end, from the first start."""

  def trace(name, spans):
    # spans: (pid, tid, ph, region, ts), in the order the profiler writes.
    events = [
      {"name": r, "ph": ph, "ts": ts, "pid": pid, "tid": tid}
      for pid, tid, ph, r, ts in spans
    ]
    path = tmp_path / "dkv" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))

  trace(
    "kernel-1-trace.json", [(1, 1, "B", "item", 0), (1, 1, "E", "item", 99)]
  )
  trace(
    "kernel-2-trace.json",
    [
      (1, 1, "B", "Init", 0),
      (1, 1, "E", "Init", 0.5),
      (1, 1, "B", "item", 1),
      (1, 1, "B", "item", 2),  # nested: not counted
      (1, 1, "E", "item", 3),
      (1, 1, "E", "item", 5),
      (1, 1, "B", "item", 5),
      (1, 1, "E", "item", 9),
      (1, 2, "B", "item", 1),
      (1, 2, "E", "item", 8),
      (2, 4, "B", "item", 1.5),
      (2, 4, "E", "item", 6),
      (2, 5, "B", "other", 0),
      (2, 5, "E", "other", 12),
    ],
  )
  (tmp_path / "empty").mkdir()
  got = common.kernel_profile(tmp_path)
  assert list(got) == ["dkv"]
  # SM 1 ends at 9, SM 2 at 6; the first start is 1.
  assert got["dkv"] == pytest.approx(
    {
      "span_us": 8.0,
      "sms": 2,
      "regions": 4,
      "end_mean_us": 6.5,
      "end_max_over_mean": 8 / 6.5,
      "idle_share": 1 - 6.5 / 8,
    }
  )
