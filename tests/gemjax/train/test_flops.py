"""Model FLOPs: hand arithmetic, brute-force pair counts, and XLA's count
of the reference model's forward."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from gemjax import config
from gemjax.config import AttentionConfig, ModelConfig
from gemjax.train import flops
from gemjax.train import step as step_lib
from gemjax.train.state import build
from tests.batches import random_batch


def _cfg(model, **data):
  base = config.load("smoke")
  return dataclasses.replace(
    base, model=model, data=dataclasses.replace(base.data, **data)
  )


def test_hand_count_tiny_config():
  m = ModelConfig(
    d_model=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffn_mult=2.0,  # f = 64
    cross_layers=1,
    emb_dim=32,
    head_hidden=(16,),
    tasks=("ctr",),
  )
  cfg = _cfg(m, num_dense=8)
  # Requests of 3 and 5 events with 2 and 1 candidates, then an empty one.
  vocab = cfg.data.vocab_sizes()
  b = random_batch(vocab, [3, 5, 0], [2, 1, 0], token_capacity=12,
                   cand_capacity=4, num_dense=8)  # fmt: skip
  got = flops.step_flops(cfg, b)
  t, c, r = 8, 3, 2
  qkvo = 2 * 32 * (2 * 4 * 8 + 2 * 2 * 8)  # Q, O: 4 heads; K, V: 2 heads
  ffn = 6 * 32 * 64
  want = {
    "input_tokens": 2 * t * 6 * 32 * 32,
    "input_other": 2 * c * 3 * 32 * 32 + 2 * r * 8 * 32,
    "seq_dense": t * (qkvo + ffn),
    "seq_attention": 4 * 4 * 8 * (3 * 3 + 5 * 5),
    "cross_dense": c * (4 * 32 * 4 * 8 + ffn) + t * 4 * 32 * 2 * 8,
    "cross_attention": 4 * 4 * 8 * (3 * 2 + 5 * 1),
    "heads": 2 * c * ((2 * 32 + 32) * 16 + 16 * 1),
  }
  assert got.parts == {k: float(v) for k, v in want.items()}
  assert got.forward == 345_824
  assert got.train == 3 * 345_824
  # Recompute under remat: whole regions for `nothing`, attention for
  # `dots`; none without remat.
  assert got.recompute(m) == 0
  m2 = dataclasses.replace(m, remat=("seq=nothing", "cross=dots"))
  assert (
    got.recompute(m2)
    == want["seq_dense"] + want["seq_attention"] + (want["cross_attention"])
  )
  m3 = dataclasses.replace(m, remat=("input=nothing", "heads=nothing"))
  assert got.recompute(m3) == want["input_tokens"] + want["heads"]
  # Stacking shards adds their counts.
  two = jax.tree.map(lambda x: np.stack([x, x]), b)
  assert flops.step_flops(cfg, two).forward == 2 * got.forward


def _brute_pairs(length, causal, window, block):
  p, j = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
  keep = np.ones_like(p, bool)
  if causal:
    keep &= j <= p
  if window is not None:
    keep &= np.abs(p - j) <= window
  if block is not None:
    keep &= p // block == j // block
  return int(keep.sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
  "window,block", [(None, None), (0, None), (3, None), (None, 4), (None, 1)]
)
def test_attention_pairs_match_brute_force(causal, window, block):
  lens = [0, 1, 2, 4, 5, 9, 17]
  want = sum(_brute_pairs(n, causal, window, block) for n in lens)
  got = flops.attention_pairs(lens, causal=causal, window=window, block=block)
  assert got == want


def test_matches_xla_cost_analysis_of_reference_forward():
  """Every request fills its static bound (`max_len` events, `max_cands`
  candidates) and the buffers exactly, so the reference attention's padded
  `[b, l, m]` scores are all real pairs and XLA counts the work we count,
  plus the elementwise ops (norms, softmax, RoPE, activations) we leave
  out: within 3% at d_model 256, head dim 64."""
  m = ModelConfig(
    d_model=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    cross_layers=1,
    emb_dim=32,
    head_hidden=(64,),
    attention=AttentionConfig(implementation="xla"),
  )
  cfg = _cfg(
    m,
    max_seq_len=64,
    max_cands=4,
    min_cands=4,
    token_capacity=128,
    cand_capacity=8,
  )
  vocab = cfg.data.vocab_sizes()
  b = random_batch(vocab, [64, 64], [4, 4], token_capacity=128,
                   cand_capacity=8, num_dense=cfg.data.num_dense)  # fmt: skip
  stacked = jax.tree.map(lambda x: x[None], b)
  model_def, params = build(cfg, 0)
  fwd = functools.partial(step_lib.forward, model_def, max_len=64, max_cands=4)
  cost = jax.jit(fwd).lower(params, stacked).compile().cost_analysis()
  xla = cost["flops"]
  ours = flops.step_flops(cfg, b).forward
  assert ours <= xla <= 1.03 * ours, (ours, xla, xla / ours)


def test_peak_and_mfu_by_device_kind():
  assert flops.device_peak("NVIDIA H200") == 989e12
  assert flops.device_peak("NVIDIA H100 80GB HBM3", "fp8") == 1979e12
  assert flops.device_peak("NVIDIA H100 PCIe") is None
  assert flops.device_peak("cpu") is None
  assert flops.mfu(494.5e12, "NVIDIA H200") == pytest.approx(0.5)
  assert flops.mfu(1e12, "cpu") is None


def test_train_records_carry_throughput_and_no_cpu_mfu(tmp_path):
  """The `train` records of a CPU run: tokens/s and model TFLOP/s that
  agree with the step's counted FLOPs, and no MFU (no known peak)."""
  import json

  from gemjax.train.loop import train
  from tests.gemjax.train.test_train import TINY

  cfg = config.load(
    "smoke",
    TINY + ["train.steps=2", "mesh.data_shards=1", "data.workers=0"],
  )
  train(cfg, tmp_path, devices=jax.devices()[:1])
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  recs = [r for r in map(json.loads, lines) if r["event"] == "train"]
  assert len(recs) == 2
  for r in recs:
    assert r["tokens_per_s"] > 0 and r["model_tflops_per_s"] > 0
    assert "mfu" not in r and "step_s_max" not in r
    # TFLOP/s over tokens/s is the FLOPs per token of this config: between
    # the dense work per token and that plus a full-length attention row.
    per_token = r["model_tflops_per_s"] * 1e12 / r["tokens_per_s"]
    assert 1e5 < per_token < 1e8


def test_progress_gathers_step_times_and_mfu(monkeypatch):
  """With a known peak and several processes: MFU per device, and the
  processes' seconds per step as max and mean."""
  from gemjax.train import loop

  cfg = config.load("smoke")
  p = loop.Progress(cfg, total=10, start=0, enabled=False)
  p.peak, p.devices = 1e12, 2  # as on two devices of a 1 TFLOP/s kind
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(
    loop.multihost_utils,
    "process_allgather",
    lambda x: np.array([float(x), 3 * float(x)]),
  )
  vocab = cfg.data.vocab_sizes()
  b = random_batch(vocab, [40, 24], [3, 2], token_capacity=128,
                   cand_capacity=8, num_dense=cfg.data.num_dense)  # fmt: skip
  p.add(b)
  r = p.show(1, 0.5)
  assert r["step_s_max"] == pytest.approx(3 * r["step_s"])
  assert r["step_s_mean"] == pytest.approx(2 * r["step_s"])
  fl = flops.step_flops(cfg, b).train
  assert r["mfu"] == pytest.approx(fl / r["step_s"] / 2e12, rel=1e-6)
  assert r["tokens_per_s"] == pytest.approx(64 / r["step_s"], rel=1e-6)
