"""The training-step benchmark: its padded baseline computes the same model,
batches pack the same requests, and kernels fall into categories."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import train_step
from gemjax import config
from tests.batches import random_batch


def test_concat_packs_the_same_requests():
  vocab = config.load("smoke").data.vocab_sizes()
  a = random_batch(vocab, [3, 0, 2], [1, 2, 0], token_capacity=8,
                   cand_capacity=4, seed=1)  # fmt: skip
  b = random_batch(vocab, [4, 1], [2, 1], token_capacity=6, cand_capacity=5,
                   seed=2)  # fmt: skip
  c = train_step.concat([a, b])
  c.validate()
  assert c.token_capacity == 14 and c.cand_capacity == 9
  np.testing.assert_array_equal(c.offsets, [0, 3, 3, 5, 9, 10])
  np.testing.assert_array_equal(c.cand_offsets, [0, 1, 3, 3, 5, 6])
  seq = c.seq["item_id"]
  np.testing.assert_array_equal(seq[:5], a.seq["item_id"][:5])
  np.testing.assert_array_equal(seq[5:10], b.seq["item_id"][:5])
  assert not seq[10:].any()
  np.testing.assert_array_equal(c.labels[3:6], b.labels[:3])
  pb = train_step.pad_batch(c, max_len=4, max_cands=2)
  assert pb.seq["item_id"].shape == (5, 4)
  np.testing.assert_array_equal(pb.seq["item_id"][3], b.seq["item_id"][:4])
  np.testing.assert_array_equal(pb.cand_len, [1, 2, 0, 2, 1])


def test_categories_from_kernel_names_and_hlo_metadata():
  cat = train_step.categorize
  assert cat("cudnn_generated_fort_native_sdpa_sm90", "") == "attention"
  assert cat("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "") == "gemm"
  assert cat("loop_multiply_fusion_3", 'source_file="/x/optax/_src/a.py"') == (
    "optimizer"
  )
  assert cat("input_reduce_fusion", 'op_name="jit(f)/rms_norm"') == "norm"
  assert cat("loop_gather_fusion", "") == "embedding"
  assert cat("fusion_7", 'source_file="gemjax/model/embeddings.py"') == (
    "embedding"
  )
  assert cat("loop_add_fusion", "") == "other"
  # The metadata of a compiled program's ops, by instruction name.
  f = jax.jit(lambda x, w: jnp.tanh(jnp.dot(x, w)))
  text = f.lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text()
  meta = train_step.hlo_metadata(text)
  assert any("dot_general" in m for m in meta.values()), meta


@pytest.mark.slow
def test_smoke_run_padded_equals_ours(tmp_path):
  """The CPU dry run times both variants, and at equal parameters the
  padded model's first loss is the jagged model's (f32, XLA attention)."""
  subprocess.run(
    [sys.executable, "benchmarks/train_step.py", "--smoke", "--out",
     str(tmp_path)],
    check=True,
  )  # fmt: skip
  recs = json.loads((tmp_path / "train_step.json").read_text())
  got = {(r["impl"], r["metric"]): r["value"] for r in recs}
  assert got["padded", "first_loss_rel_diff"] < 1e-5
  for impl in ("padded", "ours"):
    assert got[impl, "step_ms"] > 0 and got[impl, "tokens_per_s"] > 0
    assert (impl, "local_mfu") not in got  # no peak on CPU


def test_variant_knobs_combine():
  base = config.load("smoke")
  cfg, factor = train_step.variant_config(base, "batch4x+act8+fp8+budget2.5")
  assert factor == 4
  assert cfg.data.requests_per_shard == 4 * base.data.requests_per_shard
  assert cfg.model.saved_activations == "fp8"
  assert cfg.model.fp8.format == "deepseek"
  assert cfg.train.activation_budget_gb == 2.5
  with pytest.raises(ValueError, match="act8"):
    train_step.variant_config(base, "act16")
  assert train_step.variant_config(base, "fp8dw")[0].model.fp8.weight_grads


def test_xla_knob_lowers_that_family_on_its_reference(monkeypatch):
  """`xla-rms_norm` lowers the norms on their reference while `ours`,
  lowered before and after it with an equal config, keeps the kernel: the
  knob is not lost to (or leaked through) jit's trace cache."""
  from pallas_kernels import dispatch
  from pallas_kernels.rms_norm import op as rms_op

  calls = []
  for name, fn in list(rms_op.IMPLEMENTATIONS.items()):

    def spy(*a, _name=name, _fn=fn, **k):
      calls.append(_name)
      return _fn(*a, **k)

    monkeypatch.setitem(rms_op.IMPLEMENTATIONS, name, spy)
  base = config.load("smoke", ["model.num_layers=1", "model.cross_layers=0"])
  it = train_step.data_loader.Loader(base.data, num_shards=1)
  shards = [train_step._shard0(next(it)) for _ in range(train_step.BATCHES)]
  it.close()
  seen = {}
  # On CPU the default is the reference: make the kernel the default.
  with dispatch.default_implementation("mosaic"):
    for name in ("ours", "xla-rms_norm", "ours"):
      calls.clear()
      train_step.build_variants(base, [name], shards, smoke=True)
      seen.setdefault(name, []).append(set(calls))
  assert seen["ours"] == [{"mosaic"}, {"mosaic"}]
  assert seen["xla-rms_norm"] == [{"xla"}]
  assert train_step.xla_ops("batch2x+xla-rms_norm+xla-gdpa") == (
    "rms_norm",
    "gdpa",
  )
