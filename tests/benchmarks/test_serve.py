"""`benchmarks/serve.py --smoke` runs on CPU end to end (every path, the
library and the HTTP service) and writes well-formed records."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def run(tmp_path, *flags):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  subprocess.run(
    [sys.executable, "benchmarks/serve.py", "--smoke", "--out", str(tmp_path)]
    + list(flags),
    check=True,
    cwd=ROOT,
    env=env,
    timeout=300,
  )
  records = json.loads((tmp_path / "serve.json").read_text())
  for r in records:
    assert r["value"] > 0 and r["benchmark"] == "serve"
  return {(r["impl"], r["metric"].split(" at ")[0]) for r in records}


@pytest.mark.slow
def test_serve_benchmark_smoke(tmp_path):
  metrics = run(tmp_path)
  for want in [
    ("m_falcon", "qps (device)"),
    ("m_falcon", "qps (device) vs padded"),
    ("per_candidate", "latency_ms (device, one call)"),
    ("padded", "latency_ms (device, one call)"),
    ("library (m_falcon)", "qps (end to end, one host thread)"),
    ("http (binary)", "qps (saturation)"),
    ("http (binary)", "latency_ms p99"),
    ("http (binary)", "server CPU ms per request (saturation)"),
    ("library, history cached", "latency_ms (one request)"),
    ("host: validate (binary)", "ms per request (host)"),
    ("host: validate (lists)", "ms per request (host)"),
  ]:
    assert want in metrics, want


@pytest.mark.slow
def test_serve_benchmark_stub_device(tmp_path):
  """`--stub-device`: no program compiled, the library and both request
  forms through HTTP on host zeros."""
  metrics = run(
    tmp_path,
    "--stub-device",
    "--stub-device-ms",
    "1",
    "--request-format",
    "binary,lists",
  )
  for form in ("binary", "lists"):
    assert (f"http ({form})", "qps (saturation)") in metrics, form
  assert ("library (m_falcon)", "qps (end to end, one host thread)") in metrics
  assert not any(impl == "per_candidate" for impl, _ in metrics)
