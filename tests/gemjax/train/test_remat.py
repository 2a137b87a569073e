"""Per-region activation checkpointing (G9): same numbers, less memory,
policies chosen under a budget."""

import jax
import numpy as np
import pytest

from gemjax import config
from gemjax.model import remat as model_remat
from gemjax.train import remat
from gemjax.train import step as step_lib
from gemjax.train.state import build
from tests.batches import random_batch

REGIONS = ("input", "seq", "cross", "heads")
# Many short histories and 4 blocks: the saved activations, not one
# block's working set, decide the peak.
SMALL = [
  "model.d_model=64",
  "model.num_layers=4",
  "data.max_seq_len=32",
  "data.len_median=24",
  "data.max_cands=4",
  "data.min_cands=1",
  "data.token_capacity=512",
  "data.cand_capacity=64",
]


def _cfg(*more):
  return config.load("smoke", SMALL + list(more))


def _batch(cfg):
  lens = [32, 30, 28, 32] * 4
  return jax.tree.map(
    lambda x: x[None],
    random_batch(cfg.data.vocab_sizes(), lens, [4] * 16, token_capacity=512,
                 cand_capacity=64, num_dense=cfg.data.num_dense),
  )  # fmt: skip


def _grad_step(cfg, batch):
  model_def, params = build(cfg, 0)
  loss = lambda p: step_lib.loss_fn(
    p, batch, None, model_def=model_def, max_len=32, max_cands=4
  )[0]
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
  return compiled, compiled(params)


@pytest.mark.slow
def test_remat_keeps_loss_and_grads():
  cfg = _cfg()
  batch = _batch(cfg)
  _, (loss0, g0) = _grad_step(cfg, batch)
  for policy in ("dots", "nothing"):
    c = _cfg(f"model.remat={','.join(f'{r}={policy}' for r in REGIONS)}")
    _, (loss, g) = _grad_step(c, batch)
    assert float(loss) == pytest.approx(float(loss0), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_compiled_memory_falls_with_the_budget():
  cfg = _cfg()
  batch = _batch(cfg)
  full = sum(v["all"][0] for v in remat.estimates(cfg).values())
  temps, plans = [], []
  for frac in (2.0, 0.5, 0.0):
    c = _cfg(f"train.activation_budget_gb={max(frac * full, 1) / 1e9}")
    plans.append(remat.choose(c))
    compiled, _ = _grad_step(c, batch)
    temps.append(compiled.memory_analysis().temp_size_in_bytes)
  assert set(plans[0].values()) == {"all"}
  assert set(plans[-1].values()) == {"nothing"}
  assert temps[0] >= temps[1] >= temps[2], temps
  print("temp bytes by budget (2x, 0.5x, 0 of the full estimate):", temps)
  assert temps[2] < 0.7 * temps[0], temps


def test_greedy_takes_most_recompute_per_byte_first():
  cfg = _cfg()
  est = remat.estimates(cfg)
  base = sum(v["nothing"][0] for v in est.values())
  ratios = {
    r: (v["nothing"][1] - v["dots"][1]) / (v["dots"][0] - v["nothing"][0])
    for r, v in est.items()
  }
  best = max(ratios, key=ratios.get)
  extra = est[best]["dots"][0] - est[best]["nothing"][0]
  # A budget with room for exactly that first upgrade.
  c = _cfg(f"train.activation_budget_gb={(base + extra) / 1e9}")
  plan = remat.choose(c)
  assert plan[best] == "dots"
  assert sum(p != "nothing" for p in plan.values()) == 1
  # Explicit entries stay as given.
  c = _cfg("model.remat=seq=all", "train.activation_budget_gb=1e-9")
  plan = remat.choose(c)
  assert all(plan[r] == "all" for r in plan if r.startswith("seq"))
  assert plan["heads"] == "nothing"
  resolved = remat.resolve(c)
  assert model_remat.policy(resolved.model.remat, "seq2") == "all"
  assert "seq0=all" in remat.describe(resolved)


def test_bad_remat_entry_is_named():
  with pytest.raises(ValueError, match="'seq=most'"):
    config.load("smoke", ["model.remat=seq=most"])
  with pytest.raises(ValueError, match="'tail=all'"):
    config.load("smoke", ["model.remat=tail=all"])
  assert model_remat.policy(("seq=dots", "seq1=all"), "seq1") == "all"
  assert model_remat.policy(("seq=dots",), "seq4") == "dots"
  assert model_remat.policy((), "heads") == "all"


def test_progress_prints_and_records_the_plan(capsys):
  from gemjax.train import loop

  cfg = _cfg("train.activation_budget_gb=1e-9")
  p = loop.Progress(cfg, total=2, start=0, enabled=True)
  assert "seq0=nothing" in capsys.readouterr().err
  p.add(_batch(cfg))
  first, second = p.show(1, 0.5), p.show(2, 0.5)
  assert "input=nothing" in first["remat"]
  assert "remat" not in second
  # Everything recomputed: hardware FLOPs = model FLOPs + one forward,
  # but the candidate and dense projections (outside every region).
  hw, model = first["hardware_tflops_per_s"], first["model_tflops_per_s"]
  assert 0.99 * model * 4 / 3 < hw < model * 4 / 3
