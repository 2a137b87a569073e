"""The HTTP service, started for real on 127.0.0.1 and spoken to with a
real HTTP client (httpx): scores equal the library's, bad input answers
4xx naming the field, overload 503 with Retry-After, late jobs 504, and
/metrics reports what happened. Every call is bounded in time."""

import concurrent.futures
import copy
import time

import httpx
import numpy as np
import pytest

from gemjax.data import synthetic
from gemjax.serve.http import in_thread, make_app
from gemjax.serve.ranker import Ranker
from gemjax.serve.requests import encode_column, request_dicts
from tests.gemjax.serve.conftest import SHAPES

TIMEOUT = 60.0


def running(ranker, **kw):
  return in_thread(make_app(ranker, **kw))


@pytest.fixture(scope="module")
def ranker(run_dir):
  r = Ranker.from_checkpoint(run_dir, shapes=SHAPES)
  r.warmup()
  return r


@pytest.fixture(scope="module")
def dicts(ranker):
  log, req, _ = synthetic.generate_raw(ranker.cfg.data, synthetic.EVAL, 0, 4, 6)
  return request_dicts(log, req)


def test_score_health_metrics(ranker, dicts):
  want = ranker.score(dicts)
  compiled = ranker.compilations
  with running(ranker, max_wait_ms=2) as url:
    h = httpx.get(f"{url}/healthz", timeout=TIMEOUT).json()
    assert h["status"] == "ok" and h["step"] == 2
    # Concurrent clients, one request each: micro-batched together.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      resp = list(
        pool.map(
          lambda d: httpx.post(
            f"{url}/v1/score", json={"requests": [d]}, timeout=TIMEOUT
          ),
          dicts,
        )
      )
    for r, w in zip(resp, want, strict=True):
      assert r.status_code == 200, r.text
      s = r.json()["scores"][0]
      got = np.stack([s["ctr"], s["cvr"]], 1)
      np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-6)
    m = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
  assert ranker.compilations == compiled  # steady state: nothing compiled
  assert 'gemjax_serve_responses_total{code="200"} 6' in m
  assert "gemjax_serve_latency_seconds_count 6" in m
  assert f"gemjax_serve_compilations_total {compiled}" in m
  for name in ("qps", "queue_depth", "batch_fill_count", "batches_total"):
    assert f"gemjax_serve_{name}" in m


def test_binary_columns_score_as_the_lists(ranker):
  """The same requests sent with JSON-list columns and in the binary
  column form get the same scores, bit for bit (one body each, so the
  same batches)."""
  log, req, _ = synthetic.generate_raw(ranker.cfg.data, synthetic.EVAL, 0, 5, 3)
  with running(ranker, max_wait_ms=1) as url:
    got = [
      httpx.post(
        f"{url}/v1/score",
        json={"requests": request_dicts(log, req, binary=b)},
        timeout=TIMEOUT,
      )
      for b in (False, True)
    ]
  assert [r.status_code for r in got] == [200, 200], got[1].text
  lists, binary = (r.json()["scores"] for r in got)
  assert lists == binary
  # The library on the same requests: the same batch, the same float32s
  # (the answer writes each float32's shortest round-trip decimal).
  want = ranker.score_log(log, req)
  for s, w in zip(binary, want, strict=True):
    got = np.array([s["ctr"], s["cvr"]], np.float32).T
    np.testing.assert_array_equal(got, w)


def bad_bodies(d):
  """(body, field named in the answer), each one problem."""

  def edit(path, value, drop=False):
    b = copy.deepcopy(d)
    obj = b
    for k in path[:-1]:
      obj = obj[k]
    if drop:
      del obj[path[-1]]
    else:
      obj[path[-1]] = value
    return {"requests": [d, b]}

  n_c = len(d["candidates"]["item"])
  hist_ts = list(d["history"]["ts"])
  hist_ts[1], hist_ts[2] = hist_ts[2], hist_ts[1] - 1
  return [
    ({"nope": 1}, "requests"),
    ({"requests": []}, "requests"),
    (edit(["ts"], None, drop=True), "requests[1].ts"),
    (edit(["user_row"], "seven"), "requests[1].user_row"),
    (edit(["candidates", "item"], [1, -3]), "requests[1].candidates.item[1]"),
    (edit(["candidates", "item"], [10**9]), "requests[1].candidates.item[0]"),
    (edit(["candidates", "price", 0], float("nan")), None),
    (
      edit(["candidates"], {"item": [], "category": [], "price": []}),
      "requests[1].candidates.item",
    ),
    (edit(["history", "ts"], hist_ts), "requests[1].history.ts[2]"),
    (edit(["history", "action", 0], "like"), "requests[1].history.action[0]"),
    (edit(["dense"], [1.0]), "requests[1].dense"),
    (edit(["candidates", "category"], [1]), "requests[1].candidates.category"),
    ({"requests": [d], "deadline_ms": -5}, "deadline_ms"),
    ([d], "body"),
    (edit(["ts"], 2**63), "requests[1].ts"),
    (edit(["history", "ts", 0], 10**30), "requests[1].history.ts[0]"),
    (edit(["history"], [1, 2]), "requests[1].history"),
    # The binary column form: the same checks, the same names.
    (edit(["candidates", "item"], "@@"), "requests[1].candidates.item"),
    (
      edit(["candidates", "price"], encode_column([1.0] * (n_c + 1), "price")),
      "requests[1].candidates.price",  # one entry too many
    ),
    (
      edit(
        ["candidates", "item"], encode_column([3] * (n_c - 1) + [-1], "item")
      ),
      f"requests[1].candidates.item[{n_c - 1}]",
    ),
    (
      edit(
        ["candidates", "price"],
        encode_column(np.array([1.0, np.nan] * n_c)[:n_c], "price"),
      ),
      "requests[1].candidates.price[1]",
    ),
  ]


def test_bad_input_answers_4xx_naming_the_field(ranker, dicts):
  d = dicts[0]
  with running(ranker) as url:
    r = httpx.post(
      f"{url}/v1/score",
      content=b"{not json",
      headers={"content-type": "application/json"},
      timeout=TIMEOUT,
    )
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    for body, field in bad_bodies(d):
      if field is None:  # NaN: JSON that only Python's parser accepts
        import json

        raw = json.dumps(body).encode()
        r = httpx.post(
          f"{url}/v1/score",
          content=raw,
          headers={"content-type": "application/json"},
          timeout=TIMEOUT,
        )
        field = "requests[1].candidates.price[0]"
      else:
        r = httpx.post(f"{url}/v1/score", json=body, timeout=TIMEOUT)
      assert r.status_code == 422, (field, r.text)
      assert r.json()["field"] == field, r.text
      assert field in r.json()["error"]
    # Still serving.
    ok = httpx.post(f"{url}/v1/score", json={"requests": [d]}, timeout=TIMEOUT)
    assert ok.status_code == 200


def test_overload_and_deadline(ranker, dicts):
  d = dicts[0]
  # The worker waits 3 s for company; a queue of one job: a second job
  # sent while the first waits in the queue is turned away at once. The
  # second is sent once /metrics shows the first queued (not after a fixed
  # sleep, which a loaded machine can outlast).
  with running(
    ranker, max_wait_ms=3000, max_queue=1, deadline_ms=30_000
  ) as url:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      first = pool.submit(
        httpx.post, f"{url}/v1/score", json={"requests": [d]}, timeout=TIMEOUT
      )
      give_up = time.monotonic() + 2.5
      while time.monotonic() < give_up:
        m = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
        if "gemjax_serve_queue_depth 1" in m:
          break
        time.sleep(0.01)
      else:
        raise AssertionError("the first job never showed in the queue")
      second = httpx.post(
        f"{url}/v1/score", json={"requests": [d]}, timeout=TIMEOUT
      )
      assert second.status_code == 503
      assert second.headers["retry-after"] == "1"
      assert first.result().status_code == 200
    # A deadline shorter than the batching wait: 504, and the server goes on.
    late = httpx.post(
      f"{url}/v1/score",
      json={"requests": [d], "deadline_ms": 50},
      timeout=TIMEOUT,
    )
    assert late.status_code == 504
    assert (
      httpx.post(
        f"{url}/v1/score", json={"requests": [d]}, timeout=TIMEOUT
      ).status_code
      == 200
    )
    m = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
  assert 'gemjax_serve_responses_total{code="503"} 1' in m
  assert 'gemjax_serve_responses_total{code="504"} 1' in m


@pytest.mark.slow
def test_cli_serves_a_run(run_dir, dicts, ranker):
  """`python -m gemjax.serve http RUN_DIR --port 0`: a real process."""
  import pathlib
  import re
  import subprocess
  import sys

  root = pathlib.Path(__file__).parents[3]
  cmd = [sys.executable, "-m", "gemjax.serve", "http", str(run_dir)]
  cmd += ["--port", "0", "--shapes", ",".join(f"{b}x{c}" for b, c in SHAPES)]
  proc = subprocess.Popen(
    cmd, cwd=root, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
  )
  try:
    url, t0 = None, time.monotonic()
    while url is None and time.monotonic() - t0 < 120:
      line = proc.stderr.readline()
      assert line or proc.poll() is None, "server exited"
      m = re.search(r"running on (http://\S+)", line)
      url = m and m.group(1)
    assert url, "no 'running on' line"
    r = httpx.post(f"{url}/v1/score", json={"requests": dicts}, timeout=60)
    assert r.status_code == 200
    got = np.concatenate(
      [np.stack([s["ctr"], s["cvr"]], 1) for s in r.json()["scores"]]
    )
    np.testing.assert_allclose(
      got, np.concatenate(ranker.score(dicts)), rtol=2e-5, atol=2e-6
    )
  finally:
    proc.terminate()
    proc.wait(timeout=30)
    proc.stderr.close()
