"""The library: scores equal training's `eval_step`, do not depend on the
other candidates of a request, and come from a fixed set of compiled
shapes."""

import json

import jax
import numpy as np
import pytest

from gemjax.data import bbs, build, synthetic
from gemjax.data.jagged import stack
from gemjax.serve.ranker import Ranker, load_run_config
from gemjax.serve.requests import request_dicts
from gemjax.train import step as step_lib
from gemjax.train.checkpoint import Checkpointer
from gemjax.train.loop import Trainer
from tests.gemjax.serve.conftest import SHAPES, tiny_config
from tests.gemjax.test_config import flat_layout

TOL = dict(rtol=2e-5, atol=2e-6)


@pytest.fixture(scope="module")
def ranker(run_dir):
  return Ranker.from_checkpoint(run_dir, shapes=SHAPES)


def requests(cfg, r, block=0):
  log, req, _ = synthetic.generate_raw(cfg.data, synthetic.EVAL, 0, block, r)
  return log, req


def eval_probs(run_dir, cfg, log, req):
  """Training's eval step on the same requests, built as the loader does."""
  tr = Trainer.create(cfg, run_dir, devices=jax.devices()[:1])
  ckpt = Checkpointer(tr.run_dir / "checkpoints")
  state, _ = ckpt.restore(ckpt.latest_step(), tr.abstract_state)
  ckpt.close()
  offsets, cols, seg = build.build_sequences(log, req, cfg.data)
  pool = build.assemble(req, offsets, cols, seg, cfg.data)
  d = cfg.data
  batch = bbs.gather(
    [(pool, np.arange(len(req)))],
    d.requests_per_shard,
    d.token_capacity,
    d.cand_capacity,
  )
  probs = step_lib.eval_step(
    state["params"],
    stack([batch]),
    model_def=tr.model_def,
    max_len=d.max_seq_len,
    max_cands=d.max_cands,
  )
  return np.asarray(probs)[0, : len(req.cand_item)]


def test_config_from_run_log(run_dir):
  cfg, step = load_run_config(run_dir)
  assert step == 2 and cfg == tiny_config()


def test_score_equals_eval_step(run_dir, ranker):
  log, req = requests(ranker.cfg, 4)
  want = eval_probs(run_dir, tiny_config(), log, req)
  got = ranker.score_log(log, req)
  assert [g.shape for g in got] == [(n, 2) for n in np.diff(req.cand_offsets)]
  np.testing.assert_allclose(np.concatenate(got), want, **TOL)
  # The JSON form goes through the same builder.
  from_json = ranker.score(request_dicts(log, req))
  np.testing.assert_allclose(
    np.concatenate(from_json), np.concatenate(got), **TOL
  )
  assert ranker.counters["empty_history"] >= 0


def test_candidates_are_independent(ranker):
  log, req = requests(ranker.cfg, 3, block=1)
  base = request_dicts(log, req)
  want = ranker.score(base)
  rng = np.random.default_rng(0)
  one = base[0]
  n = len(one["candidates"]["item"])
  perm = rng.permutation(n)

  def with_cands(idx, extra=0):
    c = one["candidates"]
    new = {k: [c[k][i] for i in idx] for k in c}
    for _ in range(extra):  # more candidates, drawn from another request
      for k in c:
        new[k].append(base[1]["candidates"][k][0])
    return dict(one, candidates=new)

  permuted = ranker.score([with_cands(perm)])[0]
  np.testing.assert_allclose(permuted, want[0][perm], **TOL)
  added = ranker.score([with_cands(range(n), extra=9)])[0]
  np.testing.assert_allclose(added[:n], want[0], **TOL)
  removed = ranker.score([with_cands([2])])[0]
  np.testing.assert_allclose(removed, want[0][[2]], **TOL)
  # ... and nor on the other requests of its batch.
  alone = ranker.score([base[1]])[0]
  np.testing.assert_allclose(alone, want[1], **TOL)


def test_large_requests_split_and_steady_traffic_never_compiles(ranker):
  """Over the largest bucket: split (candidates in chunks, history cut by
  the training rule), never rejected; after warm-up no compilation."""
  ranker.warmup()
  assert ranker.compilations == len(ranker.buckets)
  log, req = requests(ranker.cfg, 8, block=2)
  dicts = request_dicts(log, req)
  big = dict(dicts[0])
  c = big["candidates"]
  reps = 12  # 12 x 4+ candidates > 32, the largest bucket
  big["candidates"] = {k: v * reps for k, v in c.items()}
  h = big["history"]
  old = {  # 40 older clicks: past max_seq_len, cut (newest kept)
    "ts": list(range(40)),
    "item": list(range(40)),
    "category": [1] * 40,
    "action": ["click"] * 40,
    "price": [1.0] * 40,
  }
  big["history"] = {k: old[k] + h[k] for k in h}
  cut = ranker.counters.get("truncated_requests", 0)
  out = ranker.score([big] + dicts)
  assert ranker.counters["truncated_requests"] > cut
  assert out[0].shape == (len(c["item"]) * reps, 2)
  one = ranker.score([dict(big, candidates=c)])[0]
  np.testing.assert_allclose(out[0], np.tile(one, (reps, 1)), **TOL)
  # Steady traffic: many mixes of sizes, no new program.
  rng = np.random.default_rng(1)
  for _ in range(5):
    pick = rng.choice(len(dicts), rng.integers(1, 8), replace=True)
    ranker.score([dicts[i] for i in pick])
  assert ranker.compilations == len(ranker.buckets)


@pytest.mark.parametrize("layout", ["current", "flat"])
def test_config_item_in_checkpoint_is_preferred(
  run_dir, ranker, tmp_path, layout
):
  """A checkpoint that stores its config as an Orbax JSON item "config"
  needs no run log; the item wins. One stored in the flat model layout of
  older checkpoints loads the same (`config.upgrade`)."""
  import dataclasses

  import orbax.checkpoint as ocp

  from gemjax import config

  cfg = tiny_config()
  tr = Trainer.create(cfg, run_dir, devices=jax.devices()[:1])
  ckpt = Checkpointer(tr.run_dir / "checkpoints")
  state, data = ckpt.restore(2, tr.abstract_state)
  ckpt.close()
  marked = dataclasses.replace(
    cfg, train=dataclasses.replace(cfg.train, steps=7)
  )
  stored = flat_layout if layout == "flat" else lambda d: d
  mgr = ocp.CheckpointManager(
    tmp_path / "run" / "checkpoints",
    options=ocp.CheckpointManagerOptions(create=True),
  )
  mgr.save(
    5,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(data),
      config=ocp.args.JsonSave(
        stored(json.loads(json.dumps(config.to_dict(marked))))
      ),
    ),
  )
  mgr.wait_until_finished()
  mgr.close()
  got_cfg, step = load_run_config(tmp_path / "run")
  assert (got_cfg, step) == (marked, 5)
  other = Ranker.from_checkpoint(tmp_path / "run", shapes=SHAPES)
  log, req = requests(cfg, 3, block=5)
  np.testing.assert_allclose(
    np.concatenate(other.score_log(log, req)),
    np.concatenate(ranker.score_log(log, req)),
    **TOL,
  )
