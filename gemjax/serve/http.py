"""The HTTP service: Starlette on uvicorn, dynamic micro-batching.

  python -m gemjax.serve http runs/smoke --port 8000

Routes:
  POST /v1/score   {"requests": [request, ...], "deadline_ms": 500}
                   -> {"scores": [{"ctr": [...], "cvr": [...]}, ...]}
                   (request format: `gemjax.serve.requests`)
  GET  /healthz    {"status": "ok", "step": ..., "buckets": ...}
  GET  /metrics    Prometheus text format

Micro-batching: handlers validate their body on the event loop (bad input
answers 422 naming the field, never reaches the device) and put a job on a
bounded queue; one worker thread takes the oldest job, waits at most
`max_wait_ms` for more (or until the largest bucket's candidates are
there), and scores them together (`Ranker.score_log`: one build, buckets,
compiled programs). A full queue answers 503 with Retry-After, so overload
never becomes an unbounded backlog; a job whose deadline passed before its
turn is dropped and answered 504, and a handler stops waiting at its
deadline. The worker compiles nothing after start-up (`Ranker.warmup`).
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import threading
import time

import numpy as np

try:  # The `serve` extra's fast JSON codec; Python's json without it.
  import orjson
except ImportError:
  orjson = None

from gemjax.serve.requests import (
  RequestError,
  parse_request,
  to_log_and_requests,
)

LATENCY_BUCKETS = (
  0.001,
  0.0025,
  0.005,
  0.01,
  0.025,
  0.05,
  0.1,
  0.25,
  0.5,
  1.0,
  2.5,
  5.0,
  10.0,
)
FILL_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class Overloaded(Exception):
  pass


class DeadlineExceeded(Exception):
  pass


@dataclasses.dataclass
class _Job:
  parsed: list
  deadline: float  # time.monotonic()
  future: concurrent.futures.Future
  cands: int


class _Histogram:
  def __init__(self, bounds):
    self.bounds = bounds
    self.counts = [0] * (len(bounds) + 1)
    self.sum = 0.0
    self.n = 0

  def add(self, x: float) -> None:
    i = next((j for j, b in enumerate(self.bounds) if x <= b), len(self.bounds))
    self.counts[i] += 1
    self.sum += x
    self.n += 1

  def lines(self, name: str) -> list[str]:
    out, acc = [], 0
    for b, c in zip(self.bounds, self.counts, strict=False):
      acc += c
      out.append(f'{name}_bucket{{le="{b}"}} {acc}')
    out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
    out.append(f"{name}_sum {self.sum}")
    out.append(f"{name}_count {self.n}")
    return out


class Metrics:
  """Counters of the service, rendered in the Prometheus text format."""

  def __init__(self, window_s: float = 10.0):
    self.lock = threading.Lock()
    self.responses = collections.Counter()  # by status code
    self.latency = _Histogram(LATENCY_BUCKETS)
    self.fill = _Histogram(FILL_BUCKETS)
    self.batches = 0
    self.candidates = 0
    self.done = collections.deque()  # completion times for the QPS window
    self.window_s = window_s

  def response(self, status: int, seconds: float, n_requests: int) -> None:
    with self.lock:
      self.responses[status] += 1
      if status == 200:
        self.latency.add(seconds)
        now = time.monotonic()
        self.done.extend([now] * n_requests)
        while self.done and self.done[0] < now - self.window_s:
          self.done.popleft()

  def batch(self, bucket, n_requests: int, n_cands: int) -> None:
    with self.lock:
      self.batches += 1
      self.candidates += n_cands
      self.fill.add(n_cands / bucket.cands)

  def render(self, queue_depth: int, compilations: int, cache=None) -> str:
    with self.lock:
      now = time.monotonic()
      recent = sum(1 for t in self.done if t >= now - self.window_s)
      lines = [
        "# HELP gemjax_serve_responses_total HTTP responses by status.",
        "# TYPE gemjax_serve_responses_total counter",
      ]
      for code, n in sorted(self.responses.items()):
        lines.append(f'gemjax_serve_responses_total{{code="{code}"}} {n}')
      lines += [
        "# HELP gemjax_serve_qps Scored requests per second, last "
        f"{self.window_s:g} s.",
        "# TYPE gemjax_serve_qps gauge",
        f"gemjax_serve_qps {recent / self.window_s}",
        "# HELP gemjax_serve_latency_seconds Latency of POST /v1/score.",
        "# TYPE gemjax_serve_latency_seconds histogram",
        *self.latency.lines("gemjax_serve_latency_seconds"),
        "# HELP gemjax_serve_batch_fill Used share of a program's "
        "candidate slots.",
        "# TYPE gemjax_serve_batch_fill histogram",
        *self.fill.lines("gemjax_serve_batch_fill"),
        "# TYPE gemjax_serve_batches_total counter",
        f"gemjax_serve_batches_total {self.batches}",
        "# TYPE gemjax_serve_candidates_total counter",
        f"gemjax_serve_candidates_total {self.candidates}",
        "# HELP gemjax_serve_queue_depth Jobs waiting for the worker.",
        "# TYPE gemjax_serve_queue_depth gauge",
        f"gemjax_serve_queue_depth {queue_depth}",
        "# HELP gemjax_serve_compilations_total XLA programs compiled.",
        "# TYPE gemjax_serve_compilations_total counter",
        f"gemjax_serve_compilations_total {compilations}",
      ]
    if cache is not None:
      looked = cache.hits + cache.misses
      lines += [
        "# HELP gemjax_serve_cache_hits_total Requests whose encoded "
        "history was cached.",
        "# TYPE gemjax_serve_cache_hits_total counter",
        f"gemjax_serve_cache_hits_total {cache.hits}",
        "# TYPE gemjax_serve_cache_misses_total counter",
        f"gemjax_serve_cache_misses_total {cache.misses}",
        "# TYPE gemjax_serve_cache_hit_rate gauge",
        f"gemjax_serve_cache_hit_rate {cache.hits / max(looked, 1)}",
        "# TYPE gemjax_serve_cache_bytes gauge",
        f"gemjax_serve_cache_bytes {cache.bytes}",
        "# TYPE gemjax_serve_cache_evictions_total counter",
        f"gemjax_serve_cache_evictions_total {cache.evictions}",
        "# HELP gemjax_serve_cache_saved_seconds_total Stage-1 time not "
        "spent: per all-hit batch, its bucket's last measured stage 1.",
        "# TYPE gemjax_serve_cache_saved_seconds_total counter",
        f"gemjax_serve_cache_saved_seconds_total {cache.saved_s}",
      ]
    return "\n".join(lines) + "\n"


class Batcher:
  """The bounded queue and the worker thread that scores micro-batches."""

  def __init__(self, ranker, *, max_wait_ms=5.0, max_queue=64):
    self.ranker = ranker
    self.max_wait = max_wait_ms / 1000
    self.max_queue = max_queue
    self.budget = max(b.cands for b in ranker.buckets)
    self.queue: collections.deque[_Job] = collections.deque()
    self.cv = threading.Condition()
    self.metrics = Metrics()
    ranker.on_batch = self.metrics.batch
    self.stopping = False
    self.thread = threading.Thread(target=self._work, daemon=True)

  def start(self):
    self.thread.start()

  def stop(self):
    with self.cv:
      self.stopping = True
      self.cv.notify_all()
    self.thread.join(timeout=10)

  def depth(self) -> int:
    return len(self.queue)

  def submit(self, parsed, deadline) -> concurrent.futures.Future:
    fut = concurrent.futures.Future()
    cands = sum(p["cand_item"].size for p in parsed)
    with self.cv:
      if len(self.queue) >= self.max_queue:
        # Jobs whose handlers gave up (deadline) free their places.
        live = [j for j in self.queue if not j.future.cancelled()]
        self.queue = collections.deque(live)
      if len(self.queue) >= self.max_queue:
        raise Overloaded
      self.queue.append(_Job(parsed, deadline, fut, cands))
      self.cv.notify()
    return fut

  def _take(self, wait: bool = True) -> list[_Job]:
    """The oldest job and those that arrive within `max_wait` of it, up to
    the largest bucket's candidate slots; with `wait=False` only the jobs
    already queued (maybe none)."""
    with self.cv:
      while wait and not self.queue and not self.stopping:
        self.cv.wait()
      if self.stopping or not self.queue:
        return []
      until = time.monotonic() + (self.max_wait if wait else 0.0)
      while (
        sum(j.cands for j in self.queue) < self.budget
        and (left := until - time.monotonic()) > 0
        and not self.stopping
      ):
        self.cv.wait(left)
      jobs, n = [], 0
      while self.queue and (not jobs or n + self.queue[0].cands <= self.budget):
        n += self.queue[0].cands
        jobs.append(self.queue.popleft())
      return jobs

  def _work(self):
    """Take jobs, dispatch their program calls, and deliver the previous
    jobs' results only then: the host builds batch k + 1 while the device
    runs batch k. With calls in flight, jobs already queued are taken
    without waiting for more."""
    pending = None  # (jobs, results function) in flight
    while True:
      jobs = self._take(wait=pending is None)
      if not jobs and pending is None and self.stopping:
        return
      live = self._live(jobs)
      started = None
      if live:
        try:
          parsed = [p for j in live for p in j.parsed]
          log, req = to_log_and_requests(parsed, len(self.ranker.tasks))
          started = (live, self.ranker.dispatch(log, req))
        except Exception as e:  # answered 500 by each handler
          _fail(live, e)
      if pending is not None:
        _deliver(*pending)
      pending = started

  @staticmethod
  def _live(jobs):
    """Jobs still wanted: not given up by their handler, deadline ahead."""
    now = time.monotonic()
    live = []
    for j in jobs:
      # A handler that stopped waiting cancelled its future: skip it.
      if not j.future.set_running_or_notify_cancel():
        continue
      if j.deadline < now:
        j.future.set_exception(DeadlineExceeded())
      else:
        live.append(j)
    return live


def _fail(jobs, e):
  for j in jobs:
    j.future.set_exception(e)


def _deliver(jobs, results):
  try:
    probs = results()
  except Exception as e:  # answered 500 by each handler; keep serving
    _fail(jobs, e)
    return
  k = 0
  for j in jobs:
    j.future.set_result(probs[k : k + len(j.parsed)])
    k += len(j.parsed)


class BadJSON(ValueError):
  """A body that is not JSON (answered 400)."""


def decode_json(raw: bytes):
  """The request body's JSON value: orjson when installed (about 4x
  Python's parser on a body of a few thousand numbers), else Python's
  json. A body orjson refuses is read again by Python's json, which also
  takes NaN and Infinity, so that a NaN price is answered 422 naming its
  field rather than 400 for the whole body."""
  if orjson is not None:
    try:
      return orjson.loads(raw)
    except orjson.JSONDecodeError:
      pass
  try:
    return json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadJSON(f"body is not JSON: {e}") from e


def parse_body(body, data_cfg, num_dense: int, deadline_ms: float):
  """A decoded `/v1/score` body -> (checked requests, deadline seconds);
  `RequestError` names the first bad field."""
  if not isinstance(body, dict):
    raise RequestError("body", "must be a JSON object")
  reqs = body.get("requests")
  if not isinstance(reqs, list):
    raise RequestError("requests", "missing or not a list")
  if not reqs:
    raise RequestError("requests", "empty")
  dl = body.get("deadline_ms", deadline_ms)
  if (
    not isinstance(dl, (int, float))
    or isinstance(dl, bool)
    or not math.isfinite(dl)
    or dl <= 0
  ):
    raise RequestError("deadline_ms", f"{dl!r} is not a positive number")
  parsed = [
    parse_request(r, data_cfg, num_dense, f"requests[{i}]")
    for i, r in enumerate(reqs)
  ]
  return parsed, dl / 1000


def encode_scores(probs, tasks, step) -> bytes:
  """The 200 answer's body: per request, per task, the candidates'
  probabilities. orjson writes the float32 arrays directly (shortest
  round-trip form of each float32); Python's json goes through lists."""
  if orjson is not None:
    cols = [np.ascontiguousarray(np.asarray(p, np.float32).T) for p in probs]
    return orjson.dumps(
      {
        "scores": [dict(zip(tasks, c, strict=True)) for c in cols],
        "step": step,
      },
      option=orjson.OPT_SERIALIZE_NUMPY,
    )
  return json.dumps(
    {
      "scores": [
        {t: np.asarray(p[:, i]).tolist() for i, t in enumerate(tasks)}
        for p in probs
      ],
      "step": step,
    },
    allow_nan=False,
    separators=(",", ":"),
  ).encode()


def _error(status: int, message: str, field: str | None = None, headers=None):
  from starlette.responses import JSONResponse

  body = {"error": message}
  if field is not None:
    body["field"] = field
  return JSONResponse(body, status_code=status, headers=headers)


def make_app(ranker, *, max_wait_ms=5.0, max_queue=64, deadline_ms=1000.0):
  """The Starlette app; the batcher's worker runs for the app's lifetime."""
  from starlette.applications import Starlette
  from starlette.responses import JSONResponse, PlainTextResponse, Response
  from starlette.routing import Route

  batcher = Batcher(ranker, max_wait_ms=max_wait_ms, max_queue=max_queue)
  data_cfg, num_dense = ranker.cfg.data, ranker.cfg.data.num_dense

  async def score(request):
    t0 = time.monotonic()
    status, n = 500, 0
    try:
      try:
        body = decode_json(await request.body())
      except BadJSON as e:
        status = 400
        return _error(400, str(e))
      try:
        parsed, deadline_s = parse_body(body, data_cfg, num_dense, deadline_ms)
      except RequestError as e:
        status = 422
        return _error(422, str(e), e.field)
      try:
        fut = batcher.submit(parsed, t0 + deadline_s)
      except Overloaded:
        status = 503
        return _error(
          503, "overloaded: the queue is full", headers={"Retry-After": "1"}
        )
      try:
        probs = await asyncio.wait_for(
          asyncio.wrap_future(fut), timeout=deadline_s
        )
      except (TimeoutError, DeadlineExceeded):
        status = 504
        return _error(504, f"deadline of {deadline_s * 1000:g} ms exceeded")
      except Exception as e:
        status = 500
        return _error(500, f"scoring failed: {type(e).__name__}: {e}")
      status, n = 200, len(parsed)
      return Response(
        encode_scores(probs, ranker.tasks, ranker.step),
        media_type="application/json",
      )
    finally:
      batcher.metrics.response(status, time.monotonic() - t0, n)

  async def healthz(request):
    return JSONResponse(
      {
        "status": "ok",
        "step": ranker.step,
        "tasks": list(ranker.tasks),
        "buckets": [b.name for b in ranker.buckets],
      }
    )

  async def metrics(request):
    return PlainTextResponse(
      batcher.metrics.render(
        batcher.depth(), ranker.compilations, ranker.cache
      ),
      media_type="text/plain; version=0.0.4",
    )

  @contextlib.asynccontextmanager
  async def lifespan(app):
    batcher.start()
    try:
      yield
    finally:
      batcher.stop()

  app = Starlette(
    routes=[
      Route("/v1/score", score, methods=["POST"]),
      Route("/healthz", healthz, methods=["GET"]),
      Route("/metrics", metrics, methods=["GET"]),
    ],
    lifespan=lifespan,
  )
  app.state.batcher = batcher
  return app


@contextlib.contextmanager
def in_thread(app, host="127.0.0.1", port=0, start_timeout_s=30.0):
  """Run `app` on uvicorn in a background thread (port 0: a free one);
  yields its base URL, stops the server on exit. Tests and the benchmark's
  load generator use it."""
  import uvicorn

  server = uvicorn.Server(
    uvicorn.Config(app, host=host, port=port, log_level="error")
  )
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  t0 = time.monotonic()
  while not server.started:
    if not thread.is_alive() or time.monotonic() - t0 > start_timeout_s:
      raise RuntimeError(f"server on {host}:{port} did not start")
    time.sleep(0.02)
  port = server.servers[0].sockets[0].getsockname()[1]
  try:
    yield f"http://{host}:{port}"
  finally:
    server.should_exit = True
    thread.join(timeout=30)


def serve(ranker, host="127.0.0.1", port=8000, **kw):
  """Compile every bucket, then serve until interrupted."""
  import uvicorn

  ranker.warmup()
  uvicorn.run(make_app(ranker, **kw), host=host, port=port, log_level="info")
