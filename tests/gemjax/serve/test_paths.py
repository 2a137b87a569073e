"""The per-candidate and padded cross-attention paths equal M-Falcon: as
ops against the jagged reference, and as whole rankers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemjax.data import synthetic
from gemjax.serve.paths import padded_attention, per_candidate_attention
from gemjax.serve.ranker import Ranker
from pallas_kernels import jagged_attention_reference
from tests.gemjax.serve.conftest import SHAPES


@pytest.mark.parametrize("op", [per_candidate_attention, padded_attention])
def test_ops_equal_jagged_reference(op):
  # Requests with 3, 0, 5 candidates over histories of 4, 6, 0 events (a
  # request without history reads zeros), plus unused buffer rows.
  q_off = jnp.array([0, 3, 3, 8], jnp.int32)
  kv_off = jnp.array([0, 4, 10, 10], jnp.int32)
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (10, 4, 8))
  k = jax.random.normal(kk, (12, 2, 8))
  v = jax.random.normal(kv, (12, 2, 8))
  kw = dict(max_len_q=5, max_len_kv=6)
  want = jagged_attention_reference(q, k, v, q_off, kv_off, **kw)
  extra = dict(chunk=3) if op is per_candidate_attention else {}
  got = op(q, k, v, q_off, kv_off, **kw, **extra)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert not np.asarray(got[3:8]).any()  # no history: zeros
  assert not np.asarray(got[8:]).any()  # past the data


def test_rankers_equal_m_falcon(run_dir):
  falcon = Ranker.from_checkpoint(run_dir, shapes=SHAPES)
  log, req, _ = synthetic.generate_raw(falcon.cfg.data, synthetic.EVAL, 0, 0, 5)
  want = np.concatenate(falcon.score_log(log, req))
  for path in ("per_candidate", "padded"):
    r = Ranker.from_checkpoint(run_dir, shapes=SHAPES, path=path, chunk=4)
    got = np.concatenate(r.score_log(log, req))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=path)


@pytest.mark.gpu
def test_paths_agree_on_gpu_bf16():
  """On the H200: M-Falcon through the Mosaic jagged kernel (bf16, head
  dim 64), the per-candidate path and padded cuDNN give the same
  probabilities, hundreds of candidates per request."""
  from gemjax import config
  from gemjax.serve.ranker import _one_device
  from gemjax.train.state import build

  cfg = _one_device(
    config.load(
      "smoke",
      [
        "model.dtype=bfloat16",
        "model.head_dim=64",
        "data.max_seq_len=512",
        "data.len_median=300",
      ],
    )
  )
  model_def, params = build(cfg, 0)
  log, req, _ = synthetic.generate_raw(cfg.data, synthetic.EVAL, 0, 0, 4)
  # 300 candidates per request, drawn from the block's candidates.
  pick = np.random.default_rng(0).integers(0, len(req.cand_item), 1200)
  reqs = dataclasses.replace(
    req,
    cand_offsets=np.arange(5, dtype=np.int64) * 300,
    cand_item=req.cand_item[pick],
    cand_category=req.cand_category[pick],
    cand_price=req.cand_price[pick],
    labels=np.zeros((1200, 2), np.float32),
  )
  out = {}
  for path in ("m_falcon", "per_candidate", "padded"):
    r = Ranker.from_params(
      cfg, params, model_def, shapes=((4, 1200, 300),), path=path
    )
    out[path] = np.concatenate(r.score_log(log, reqs))
  for path in ("per_candidate", "padded"):
    np.testing.assert_allclose(
      out[path], out["m_falcon"], atol=2e-2, err_msg=path
    )
