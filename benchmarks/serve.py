"""Serving benchmark (O13): M-Falcon against the per-candidate path and a
padded cuDNN batch, and the HTTP service against the library.

  PYTHONPATH=. python benchmarks/serve.py              # GPU, onetrans_v31
  PYTHONPATH=. python benchmarks/serve.py --smoke      # CPU dry run (CI)

The model is `onetrans_v31` (d_model 512, 7 SeqFormer layers, GQA 8/2,
bf16) with random weights: speed does not depend on training. Requests are
the synthetic 2K traffic (log-normal histories, median 1,100 events, cut at
2,048 by the training builder) with 100, 500 or 2,000 candidates each; a
program call scores up to `max(1, 2000 // candidates)` requests (one
capacity bucket per case, its history rows 1.25x the mean of a full call).

Figures, per candidate count:
1. Device QPS and latency of one program call for the three cross-attention
   paths (`gemjax.serve.paths`: "m_falcon", "per_candidate", "padded"),
   same weights, same batches, timed in alternation (`common.
   time_interleaved`). Goal: M-Falcon >= 2.0x the per-candidate QPS (the
   seed: +97%). The padded cuDNN batch is shown beside it, without goal.
2. The library end to end (`Ranker.score_log`: history building on the
   host, packing, the program, results back), requests per second on one
   host thread.
3. The history cache (`gemjax.serve.cache`): one request's library
   latency when its user's encoded history is cached (the next page of a
   feed) against the same request uncached. No goal (optional in O13).
4. The HTTP service (`gemjax.serve.http`, uvicorn in this process; the load
   generator is a separate process on localhost, so its JSON encoding does
   not share this interpreter): QPS at saturation (closed loop, several
   clients in several generator processes) against the library's (goal:
   >= 0.85x), and latency p50/p99 at a fixed offered load of half the
   saturated QPS, and the server's CPU time per request. Bounded in
   requests and seconds. Both figures score the same requests in the same
   process. The generator sends the columns in `--request-format`: binary
   (base64 typed arrays, the default) or JSON lists.
5. The host cost of each stage of the HTTP path, milliseconds per request
   (`host_stages`): JSON decoding and validation of both request forms,
   conversion to training's structures, history building and packing,
   response encoding, and the load generator's request encoding. They need
   no device, so

     PYTHONPATH=. python benchmarks/serve.py --host-stages --cands 500

   times them alone on any machine (the config's data settings, a tiny
   model: the model does not enter these stages), and

     PYTHONPATH=. python benchmarks/serve.py --stub-device --cands 500

   runs figures 2 and 4 with program calls that return host zeros
   (`--stub-device-ms`: a device time per call), so that the library's
   and the service's host work can be compared on a machine without the
   device.
"""

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import sys
import time

from benchmarks import smoke

os.environ["XLA_FLAGS"] = smoke.xla_flags(sys.argv)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from gemjax import config as config_lib  # noqa: E402
from gemjax.data import synthetic  # noqa: E402
from gemjax.data.events import Requests  # noqa: E402
from gemjax.serve.paths import PATHS  # noqa: E402
from gemjax.serve.ranker import Ranker, _one_device  # noqa: E402
from gemjax.serve.requests import request_dicts  # noqa: E402
from gemjax.train.state import build  # noqa: E402

NAME = "serve"
# Request forms of the load generator (`gemjax.serve.requests`): columns as
# JSON lists, or in the binary form (base64 typed arrays).
FORMS = ("lists", "binary")
SMOKE = [
  "model.d_model=32",
  "model.num_layers=1",
  "model.num_heads=4",
  "model.num_kv_heads=2",
  "model.head_hidden=32",
  "data.max_seq_len=64",
  "data.len_median=24",
  "data.num_items=500",
  "data.num_categories=20",
  "data.num_users=400",
]


def make_requests(cfg, r: int, n_cands: int, block: int):
  """`r` synthetic requests (log-normal histories) with `n_cands`
  candidates each, drawn from the generator's candidate distribution."""
  log, req, _ = synthetic.generate_raw(cfg.data, synthetic.EVAL, 0, block, r)
  rng = np.random.default_rng([7, block, n_cands])
  pool = len(req.cand_item)
  pick = rng.integers(0, pool, r * n_cands)
  req = Requests(
    user=req.user,
    ts=req.ts,
    user_row=req.user_row,
    dense=req.dense,
    cand_offsets=np.arange(r + 1, dtype=np.int64) * n_cands,
    cand_item=req.cand_item[pick],
    cand_category=req.cand_category[pick],
    cand_price=req.cand_price[pick],
    labels=np.zeros((r * n_cands, 2), np.float32),
  )
  return log, req


def device_figures(rankers, log, req, case, records):
  """Figure 1: every path's program on the same device batches (the two
  fullest calls of the requests); returns requests/s by path."""
  first = next(iter(rankers.values()))
  packed = sorted(
    first.batches(log, req),
    key=lambda p: -int(np.count_nonzero(np.diff(p[1].cand_offsets))),
  )[:2]
  per_call = float(
    np.mean(
      [np.count_nonzero(np.diff(b.cand_offsets)) for _, b, _, _ in packed]
    )
  )
  sets = [(k, jax.device_put(jax.tree.leaves(b))) for k, b, _, _ in packed]
  runs = {}
  for path, r in rankers.items():
    prog, params = r.program(sets[0][0]), r.param_leaves
    runs[path] = (
      lambda *leaves, prog=prog, params=params: prog(params, list(leaves)),
      [tuple(leaves) for _, leaves in sets],
    )
  sec = common.time_interleaved(
    runs,
    rounds=common.TIMING["rounds"],
    calls=common.TIMING["iters"],
    skip_failures=True,
  )
  qps = {p: per_call / s for p, s in sec.items()}
  for p in sec:
    records.append(
      common.record(
        NAME,
        case,
        p,
        "latency_ms (device, one call)",
        sec[p] * 1e3,
        lower_is_better=True,
      )
    )
  if "m_falcon" in qps and "per_candidate" in qps:
    records.append(
      common.record(
        NAME,
        case,
        "m_falcon",
        "qps (device)",
        qps["m_falcon"],
        baseline="per_candidate",
        baseline_value=qps["per_candidate"],
        goal=2.0,
      )
    )
  if "m_falcon" in qps and "padded" in qps:
    records.append(
      common.record(
        NAME,
        case,
        "m_falcon",
        "qps (device) vs padded",
        qps["m_falcon"],
        baseline="padded cuDNN/XLA",
        baseline_value=qps["padded"],
      )
    )
  return qps


def cache_figures(ranker, log, req, case, records, reps: int):
  """Figure 4: one request's library latency with its encoded history
  cached (a repeated user: the next page) against the same request
  uncached (stage 1 runs, its rows are copied into the cache)."""
  one = req.take([0])
  ranker.score_log(log, one)  # warm both paths
  ranker.score_log(log, one)
  miss, hit = [], []
  for _ in range(reps):
    ranker.cache.entries.clear()
    ranker.cache.bytes = 0
    t0 = time.perf_counter()
    ranker.score_log(log, one)
    miss.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ranker.score_log(log, one)
    hit.append(time.perf_counter() - t0)
  records.append(
    common.record(
      NAME,
      case,
      "library, history cached",
      "latency_ms (one request)",
      float(np.median(hit)) * 1e3,
      baseline="library, not cached",
      baseline_value=float(np.median(miss)) * 1e3,
      lower_is_better=True,
    )
  )


def host_stages(ranker, log, req, per_call, case, records, reps: int):
  """Figure 5: host milliseconds per request of each stage of the HTTP
  path, on the case's requests (one per body, as the load generator sends
  them), through the functions the server runs. Median of `reps`."""
  from gemjax.serve import http
  from gemjax.serve.requests import to_log_and_requests

  data = ranker.cfg.data
  forms = {f: request_dicts(log, req, binary=f == "binary") for f in FORMS}
  bodies = {
    f: [json.dumps({"requests": [d]}).encode() for d in ds]
    for f, ds in forms.items()
  }
  decoded = {f: [http.decode_json(b) for b in bs] for f, bs in bodies.items()}
  dicts = forms["lists"]
  parsed = [
    http.parse_body(b, data, data.num_dense, 1000.0)[0][0]
    for b in decoded["lists"]
  ]
  calls = [parsed[i : i + per_call] for i in range(0, len(parsed), per_call)]
  converted = [to_log_and_requests(c, len(ranker.tasks)) for c in calls]
  probs = [
    np.zeros((len(d["candidates"]["item"]), 2), np.float32) for d in dicts
  ]
  stages = {}
  for f in FORMS:
    stages[f"client: encode request ({f})"] = lambda f=f: [
      json.dumps({"requests": [d]}).encode() for d in forms[f]
    ]
    stages[f"decode JSON ({f})"] = lambda f=f: [
      http.decode_json(b) for b in bodies[f]
    ]
    stages[f"validate ({f})"] = lambda f=f: [
      http.parse_body(b, data, data.num_dense, 1000.0) for b in decoded[f]
    ]
  stages |= {
    "convert": lambda: [
      to_log_and_requests(c, len(ranker.tasks)) for c in calls
    ],
    "build + pack": lambda: [list(ranker.batches(*lr)) for lr in converted],
    "encode response": lambda: [
      http.encode_scores([p], ranker.tasks, 0) for p in probs
    ],
  }
  out = {}
  for name, fn in stages.items():
    fn()
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    out[name] = float(np.median(times)) / len(dicts) * 1e3
    records.append(
      common.record(
        NAME,
        case,
        f"host: {name}",
        "ms per request (host)",
        out[name],
        lower_is_better=True,
      )
    )
  sizes = {f: np.mean([len(b) for b in bs]) / 1e3 for f, bs in bodies.items()}
  print(
    "  host ms/request: "
    + ", ".join(f"{k} {v:.3f}" for k, v in out.items())
    + "; body KB: "
    + ", ".join(f"{f} {v:.0f}" for f, v in sizes.items()),
    flush=True,
  )
  return out


class _StubDevice:
  """`--stub-device`: a ranker's program calls replaced by zeros of their
  output shape made on the host, nothing compiled, so the library and
  HTTP figures time host work. With `ms` > 0 the stub is a device that
  runs one call at a time for `ms` each: a call's result is ready `ms`
  after the previous call's (or its own dispatch), and reading it before
  then sleeps, releasing the GIL as a wait for a real device does."""

  def __init__(self, ranker, ms: float):
    self.seconds, self.free_at = ms / 1e3, 0.0
    self.tasks = len(ranker.tasks)
    ranker.run = self.run

  def run(self, bucket, batch):
    self.free_at = max(self.free_at, time.perf_counter()) + self.seconds
    return _Pending(
      np.zeros((bucket.cands, self.tasks), np.float32), self.free_at
    )


class _Pending:
  def __init__(self, value, ready: float):
    self.value, self.ready = value, ready

  def __array__(self, dtype=None, copy=None):
    wait = self.ready - time.perf_counter()
    if wait > 0:  # (sleep(0) would give the core away)
      time.sleep(wait)
    return self.value


def library_qps(ranker, log, req, seconds: float) -> float:
  """Figure 2: requests/s of `score_log` end to end, repeated for about
  `seconds`."""
  ranker.score_log(log, req)  # warm
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds or n == 0:
    ranker.score_log(log, req)
    n += len(req)
  return n / (time.perf_counter() - t0)


def _load(url, bodies, part, parts, threads, total, start, seconds, rate):
  """One load-generator process, part `part` of `parts`: POSTs its share
  of `bodies` (request i for i = part, part + parts, ...) from `threads`
  threads, each on its own keep-alive connection (`http.client`: a
  fraction of httpx's CPU per request). Closed loop (`rate` None): each
  thread sends its next request when the last is answered; open loop:
  request i is due at `start + i / rate` (wall clock, shared by all
  parts) and its latency counts from then, so time spent waiting for a
  free thread is not hidden. Stops after `total` requests in all or at
  `start + seconds`. Returns (latencies s of 200s, statuses, first send,
  last answer), times in `time.time()`."""
  import http.client
  import threading
  import urllib.parse

  host = urllib.parse.urlsplit(url)
  lat, codes, lock = [], {}, threading.Lock()
  stop = start + seconds
  mine = iter(range(part, total, parts))
  conns = threading.local()
  ends = []

  def one(i, due):
    c = getattr(conns, "c", None)
    if c is None:
      c = conns.c = http.client.HTTPConnection(host.hostname, host.port)
    c.request(
      "POST",
      "/v1/score",
      body=bodies[i % len(bodies)],
      headers={"content-type": "application/json"},
    )
    r = c.getresponse()
    r.read()
    end = time.time()
    with lock:
      codes[r.status] = codes.get(r.status, 0) + 1
      if r.status == 200:
        lat.append(end - due)
      ends.append(end)

  def closed():
    for i in mine:
      if time.time() > stop:
        return
      one(i, time.time())

  time.sleep(max(0.0, start - time.time()))
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    if rate is None:
      list(pool.map(lambda _: closed(), range(threads)))
    else:
      futs = []
      for i in mine:
        due = start + i / rate
        if due > stop:
          break
        time.sleep(max(0.0, due - time.time()))
        futs.append(pool.submit(one, i, due))
      for f in futs:
        f.result()
  return lat, codes, start, max(ends, default=start)


def _offer(gen, url, bodies, parts, threads, total, seconds, rate):
  """Run `_load` in `parts` generator processes at once; returns
  (latencies, statuses, elapsed s from the common start to the last
  answer)."""
  start = time.time() + 0.5  # every process started and waiting
  futs = [
    gen.submit(
      _load, url, bodies, k, parts, threads, total, start, seconds, rate
    )
    for k in range(parts)
  ]
  lat, codes, end = [], {}, start
  for f in futs:
    a, c, _, e = f.result()
    lat += a
    for k, v in c.items():
      codes[k] = codes.get(k, 0) + v
    end = max(end, e)
  return lat, codes, end - start


@contextlib.contextmanager
def _restore_env(saved: dict):
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def http_figures(
  ranker, log, req, case, lib_qps, per_call, bound, form, records
):
  """Figure 3: saturation QPS and latency at a fixed offered load, the
  requests sent in `form`; with the server's CPU time per request (this
  process, every thread: the generator runs in other processes)."""
  from gemjax.serve.http import in_thread, make_app

  bodies = [
    json.dumps({"requests": [d]}).encode()
    for d in request_dicts(log, req, binary=form == "binary")
  ]
  ctx = multiprocessing.get_context("spawn")
  total, seconds = bound
  # Generator processes, so that the load offered is never bounded by one
  # client interpreter: closed loop with four connections per request slot
  # of a program call, spread over the processes (a call's requests being
  # built, on the device, answered, and the next ones on their way: with
  # two, the worker waits for clients between calls).
  parts = max(1, min(4, (os.cpu_count() or 1) // 2))
  threads = max(1, -(-4 * per_call // parts))
  # The generator imports this module, so JAX too: keep it off the GPU
  # that this process holds (the children inherit the environment).
  env = {k: os.environ.get(k) for k in ("JAX_PLATFORMS",)}
  os.environ["JAX_PLATFORMS"] = "cpu"
  with (
    in_thread(
      make_app(ranker, max_wait_ms=5, max_queue=4 * per_call + 8)
    ) as url,
    concurrent.futures.ProcessPoolExecutor(parts, mp_context=ctx) as gen,
    _restore_env(env),
  ):
    # Warm the path once per process (imports, connections, the worker).
    _offer(gen, url, bodies, parts, 1, parts, 60.0, None)
    cpu0 = os.times()
    lat, codes, el = _offer(
      gen, url, bodies, parts, threads, total, seconds, None
    )
    cpu1 = os.times()
    sat = len(lat) / el
    cpu_ms = (
      (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / max(len(lat), 1)
    ) * 1e3
    rate = max(sat / 2, 1e-3)
    lat2, codes2, _ = _offer(
      gen, url, bodies, parts, threads, total, seconds, rate
    )
  print(
    f"  http ({form}) saturation: {sat:.1f} req/s, server CPU "
    f"{cpu_ms:.2f} ms/request, statuses {codes}; at {rate:.1f} req/s: "
    f"statuses {codes2}",
    flush=True,
  )
  records.append(
    common.record(
      NAME,
      case,
      f"http ({form})",
      "server CPU ms per request (saturation)",
      cpu_ms,
      lower_is_better=True,
    )
  )
  records.append(
    common.record(
      NAME,
      case,
      f"http ({form})",
      "qps (saturation)",
      sat,
      baseline="library",
      baseline_value=lib_qps,
      goal=0.85,
    )
  )
  for q in (50, 99):
    if lat2:
      records.append(
        common.record(
          NAME,
          case,
          f"http ({form})",
          f"latency_ms p{q} at {rate:.3g} req/s offered",
          float(np.percentile(lat2, q)) * 1e3,
          lower_is_better=True,
        )
      )


def _http_stack() -> bool:
  """Whether the `[serve]` extra is installed; without it the
  HTTP figures are skipped, said so, and the device figures still run."""
  try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
  except ImportError as e:
    print(f"  http figures skipped: {e}", flush=True)
    return False
  return True


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true", help="CPU dry run")
  ap.add_argument("--config", default="onetrans_v31")
  ap.add_argument("--cands", default="100,500,2000")
  ap.add_argument("--paths", default=",".join(PATHS))
  ap.add_argument(
    "--chunk",
    type=int,
    default=128,
    help="candidates per step of the per-candidate path",
  )
  ap.add_argument("--no-http", action="store_true")
  ap.add_argument("--no-cache", action="store_true")
  ap.add_argument(
    "--http-bound",
    default=None,
    help="REQUESTS,SECONDS per HTTP load run (default 2000,20; smoke 24,5)",
  )
  ap.add_argument(
    "--host-stages",
    action="store_true",
    help="only figure 5 (host ms per stage), with a tiny model",
  )
  ap.add_argument(
    "--stub-device",
    action="store_true",
    help="no device: program calls return zeros made on the host, so the "
    "library and HTTP figures time host work only (a tiny model)",
  )
  ap.add_argument(
    "--stub-device-ms",
    type=float,
    default=0.0,
    help="with --stub-device: device milliseconds per program call",
  )
  ap.add_argument(
    "--request-format",
    default="binary",
    help=f"how the HTTP load generator sends the columns: one or more of "
    f"{','.join(FORMS)}, each form its own figures",
  )
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  forms = args.request_format.split(",")
  if not forms or not set(forms) <= set(FORMS):
    ap.error(f"--request-format {args.request_format}: one or more of {FORMS}")
  if args.stub_device:
    args.paths = "m_falcon"
  if (args.host_stages or args.stub_device) and not args.smoke:
    tiny = [s for s in SMOKE if s.startswith("model.")]
    cfg = config_lib.load(args.config, tiny)
    cands = [int(c) for c in args.cands.split(",")]
    budget = 2000
    bound, lib_s = (2000, 20.0), 5.0
  elif args.smoke:
    cfg = config_lib.load("smoke", SMOKE)
    cands = [8, 40]
    budget = 80
    common.TIMING.update(iters=1, repeats=1, rounds=1)
    bound, lib_s = (24, 5.0), 0.5
  else:
    cfg = config_lib.load(args.config)
    cands = [int(c) for c in args.cands.split(",")]
    budget = 2000
    bound, lib_s = (2000, 20.0), 5.0
  if args.http_bound:
    n, sec = args.http_bound.split(",")
    bound = (int(n), float(sec))
  cfg = _one_device(cfg)
  model_def, params = build(cfg, cfg.train.seed)
  params = jax.device_put(params, jax.devices()[0])
  paths = args.paths.split(",")
  records = []
  for block, n in enumerate(cands):
    per_call = max(1, budget // n)
    case = (
      f"{n} cands/request, {per_call} requests/call, "
      f"log-normal histories <= {cfg.data.max_seq_len}"
    )
    print(case, flush=True)
    # Tokens: 1.25x the mean built history of a call, at least one full
    # history (the bucket's stage-1 rows; a call that would overflow them
    # leaves requests to the next call).
    mean = cfg.data.expected_tokens_per_request()
    tokens = max(cfg.data.max_seq_len, int(1.25 * per_call * mean))
    rankers = {
      p: Ranker.from_params(
        cfg,
        params,
        model_def,
        shapes=((per_call, per_call * n, n, tokens),),
        path=p,
        chunk=args.chunk,
      )
      for p in paths
    }
    log, req = make_requests(cfg, 4 * per_call, n, block)
    host_stages(
      rankers[paths[0]],
      log,
      req,
      per_call,
      case,
      records,
      3 if args.smoke else 7,
    )
    if args.host_stages:
      continue
    if args.stub_device:
      _StubDevice(rankers["m_falcon"], args.stub_device_ms)
    else:
      t = time.perf_counter()
      for r in rankers.values():
        r.warmup()
      print(
        f"  compiled {len(rankers)} programs in "
        f"{time.perf_counter() - t:.1f} s",
        flush=True,
      )
      device_figures(rankers, log, req, case, records)
    if "m_falcon" in rankers:
      lib = library_qps(rankers["m_falcon"], log, req, lib_s)
      records.append(
        common.record(
          NAME,
          case,
          "library (m_falcon)",
          "qps (end to end, one host thread)",
          lib,
        )
      )
      print(f"  library: {lib:.1f} req/s", flush=True)
      if not (args.no_cache or args.stub_device):
        cached = Ranker.from_params(
          cfg,
          params,
          model_def,
          shapes=((per_call, per_call * n, n, tokens),),
          cache_bytes=1 << 30,
        )
        cached.warmup()
        cache_figures(cached, log, req, case, records, 3 if args.smoke else 20)
      if not args.no_http and _http_stack():
        for form in forms:
          http_figures(
            rankers["m_falcon"],
            log,
            req,
            case,
            lib,
            per_call,
            bound,
            form,
            records,
          )
  # Host-only runs are CPU figures: only to --out, like a smoke run.
  common.write_results(
    NAME,
    records,
    args.out,
    dry_run=args.smoke or args.host_stages or args.stub_device,
  )


if __name__ == "__main__":
  main()
