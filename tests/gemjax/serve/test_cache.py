"""The history cache: same scores as without it, hits for a repeated
history, a miss for any change of stage 1's inputs, bounded bytes."""

import numpy as np
import pytest

from gemjax.data import synthetic
from gemjax.serve.cache import HistoryCache
from gemjax.serve.ranker import Ranker
from gemjax.serve.requests import request_dicts
from tests.gemjax.serve.conftest import SHAPES

TOL = dict(rtol=2e-5, atol=2e-6)


def test_cached_scores_equal_uncached(run_dir):
  plain = Ranker.from_checkpoint(run_dir, shapes=SHAPES)
  cached = Ranker.from_checkpoint(run_dir, shapes=SHAPES, cache_bytes=1 << 20)
  cached.warmup()
  assert cached.compilations == 2 * len(cached.buckets)  # encode, cross
  log, req, _ = synthetic.generate_raw(plain.cfg.data, synthetic.EVAL, 0, 6, 3)
  dicts = request_dicts(log, req)
  want = plain.score(dicts)
  first = cached.score(dicts)
  assert (cached.cache.hits, cached.cache.misses) == (0, 3)
  # The same users again with other candidates (next page): all hits.
  page2 = [
    dict(d, candidates={k: v[::-1] for k, v in d["candidates"].items()})
    for d in dicts
  ]
  second = cached.score(page2)
  assert (cached.cache.hits, cached.cache.misses) == (3, 3)
  for f, s, w in zip(first, second, want, strict=True):
    np.testing.assert_allclose(f, w, **TOL)
    np.testing.assert_allclose(s, w[::-1], **TOL)
  # A later request time moves the ts_to_req buckets: a new key.
  later = [dict(dicts[0], ts=dicts[0]["ts"] + 86_400)]
  np.testing.assert_allclose(
    cached.score(later)[0], plain.score(later)[0], **TOL
  )
  assert cached.cache.misses == 4
  assert cached.compilations == 2 * len(cached.buckets)
  from gemjax.serve.http import Metrics

  text = Metrics().render(0, cached.compilations, cached.cache)
  assert "gemjax_serve_cache_hit_rate 0.42857" in text  # 3 of 7
  assert "gemjax_serve_cache_saved_seconds_total" in text


def test_lru_bound():
  c = HistoryCache(max_bytes=1000)  # two entries of 400 bytes
  for i in range(5):
    c.put(i, np.zeros((24, 4), np.float32), np.zeros(4, np.float32))
  assert c.bytes == 800 and c.evictions == 3 and list(c.entries) == [3, 4]
  assert c.get_all([3]) is not None and c.get_all([0, 4]) is None
  assert (c.hits, c.misses) == (1, 2)
  with pytest.raises(ValueError):
    HistoryCache(0)
