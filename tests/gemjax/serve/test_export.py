"""`export` -> `from_export` round trip on CPU, in this process and in a
fresh one that cannot import the model's code."""

import json
import pathlib
import subprocess
import sys

import numpy as np

from gemjax.data import synthetic
from gemjax.serve.ranker import MANIFEST, Ranker
from gemjax.serve.requests import request_dicts
from tests.gemjax.serve.conftest import SHAPES
from tests.gemjax.test_config import flat_layout

ROOT = pathlib.Path(__file__).parents[3]


def test_export_round_trip(run_dir, tmp_path):
  ranker = Ranker.from_checkpoint(run_dir, shapes=SHAPES)
  out = tmp_path / "exported"
  # The CLI writes it (same code as `ranker.export`).
  subprocess.run(
    [
      sys.executable,
      "-m",
      "gemjax.serve",
      "export",
      str(run_dir),
      str(out),
      "--shapes",
      ",".join(f"{b}x{c}" for b, c in SHAPES),
    ],
    check=True,
    timeout=300,
    cwd=ROOT,
  )
  log, req, _ = synthetic.generate_raw(ranker.cfg.data, synthetic.EVAL, 0, 3, 6)
  dicts = request_dicts(log, req)
  want = np.concatenate(ranker.score(dicts))
  exported = Ranker.from_export(out)
  assert exported.buckets == ranker.buckets
  np.testing.assert_allclose(
    np.concatenate(exported.score(dicts)), want, rtol=1e-6, atol=1e-7
  )
  # An export whose manifest stores the flat model layout of older code.
  man = json.loads((out / MANIFEST).read_text())
  man["config"] = flat_layout(man["config"])
  (out / MANIFEST).write_text(json.dumps(man))
  assert Ranker.from_export(out).cfg == exported.cfg
  (tmp_path / "req.json").write_text(json.dumps(dicts))
  # A process in which the model (and Flax) cannot be imported.
  code = (
    "import sys, json, numpy as np\n"
    "sys.modules['gemjax.model'] = None\n"
    "sys.modules['flax'] = None\n"
    "from gemjax.serve.ranker import Ranker\n"
    f"r = Ranker.from_export({str(out)!r})\n"
    f"reqs = json.load(open({str(tmp_path / 'req.json')!r}))\n"
    "np.save(sys.argv[1], np.concatenate(r.score(reqs)))\n"
  )
  subprocess.run(
    [sys.executable, "-c", code, str(tmp_path / "got.npy")],
    check=True,
    timeout=300,
    cwd=ROOT,
  )
  np.testing.assert_allclose(
    np.load(tmp_path / "got.npy"), want, rtol=1e-6, atol=1e-7
  )
