"""`benchmarks/serve.py --smoke` runs on CPU end to end (every path, the
library and the HTTP service) and writes well-formed records."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.slow
def test_serve_benchmark_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  subprocess.run(
    [sys.executable, "benchmarks/serve.py", "--smoke", "--out", str(tmp_path)],
    check=True,
    cwd=ROOT,
    env=env,
    timeout=300,
  )
  records = json.loads((tmp_path / "serve.json").read_text())
  metrics = {(r["impl"], r["metric"].split(" at ")[0]) for r in records}
  for want in [
    ("m_falcon", "qps (device)"),
    ("m_falcon", "qps (device) vs padded"),
    ("per_candidate", "latency_ms (device, one call)"),
    ("padded", "latency_ms (device, one call)"),
    ("library (m_falcon)", "qps (end to end, one host thread)"),
    ("http", "qps (saturation)"),
    ("http", "latency_ms p99"),
    ("library, history cached", "latency_ms (one request)"),
  ]:
    assert want in metrics, want
  for r in records:
    assert r["value"] > 0 and r["benchmark"] == "serve"
