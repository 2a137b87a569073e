"""The per-candidate and padded cross-attention paths equal M-Falcon: as
ops against the jagged reference, and as whole rankers."""

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
