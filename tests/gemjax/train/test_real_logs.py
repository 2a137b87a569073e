"""The per-dataset configs train and evaluate on logs of their formats,
with the baselines printed beside the model, without edits."""

import pytest

from gemjax import config, metrics
from gemjax.train.loop import train
from tests.gemjax.data.test_events import CFG, synthetic_taobao
from tests.real_data import ml100k_path

SMALL = [
  "train.steps=6",
  "train.log_every=3",
  "train.checkpoint_every=6",
  "train.progress=false",
  "model.d_model=32",
  "model.num_layers=1",
  "model.cross_layers=1",
  "data.requests_per_shard=8",
  "data.bbs_minibatch=4",
]


@pytest.mark.slow
def test_taobao_config_runs_on_a_userbehavior_log(tmp_path, capsys):
  import jax

  path = synthetic_taobao(tmp_path / "UserBehavior.csv", CFG, blocks=2)
  cfg = config.load(
    "taobao",
    [f"data.path={path}", "data.num_items=4096", "data.num_categories=256"]
    + SMALL,
  )
  result = train(cfg, tmp_path / "run", devices=jax.devices()[:1])
  table = metrics.format_table(result)
  assert "  popularity" in table and "  logreg" in table
  base = result["baselines"]
  for task in ("ctr", "cvr"):
    # The same held-out candidates for the model and each baseline.
    assert base["logreg"][task]["count"] == result[task]["count"] > 0
    assert base["popularity"][task]["count"] == result[task]["count"]
  err = capsys.readouterr().err
  assert "derived from" in err  # capacities 0: sized from the log


@pytest.mark.slow
def test_movielens_leave_one_out_reports_hr_and_ndcg(tmp_path):
  import jax

  path = ml100k_path()
  cfg = config.load(
    "movielens",
    [f"data.path={path}", "data.protocol=leave_one_out"]
    + SMALL
    # Eight held-out requests of 101 candidates per eval step, not one.
    + ["data.token_capacity=2048", "data.cand_capacity=816"],
  )
  result = train(cfg, tmp_path / "run", devices=jax.devices()[:1])
  users = 943  # one held-out request per user, 100 negatives each
  assert result["ctr"]["count"] == users * 101
  for m in (result["ctr"], result["baselines"]["popularity"]["ctr"]):
    assert 0 <= m["hr@10"] <= 1 and 0 <= m["ndcg@10"] <= m["hr@10"]
  assert "HR@10" in metrics.format_table(result)
