"""Serving: score candidates with a trained ranking model (O13, M-Falcon).

A ranking request is one user, their history and hundreds to thousands of
candidates. The model's stage 1 (SeqFormer) encodes the history once per
request; stage 2 lets every candidate attend to that encoding. M-Falcon
(OneTrans V3.1) runs stage 2 as one attention call per batch: all
candidates of a request are a flattened query set beside the request's
K/V, with a mask by which each candidate sees the whole history and no
other candidate. It is numerically the per-candidate computation (no
retraining), but reads K/V once per request instead of once per candidate
(the seed: +97% QPS). Our jagged attention with candidate offsets as query
offsets *is* that mask (`paths`).

Three ways to serve (`Ranker`):
- the library: `Ranker.from_checkpoint(run_dir).score(requests)`;
- an exported artifact: `python -m gemjax.serve export RUN_DIR OUT_DIR`,
  then `Ranker.from_export(OUT_DIR)` (serialized StableHLO, no model code);
- HTTP: `python -m gemjax.serve http RUN_DIR --port 8000` (`http`).

Modules: `requests` (format, validation), `batching` (capacity buckets,
packing, splitting), `paths` (M-Falcon, per-candidate and padded cross
attention), `cache` (encoded histories of repeated users), `ranker`,
`http`.
"""

from gemjax.serve.ranker import Ranker, load_run_config
from gemjax.serve.requests import RequestError

__all__ = ["Ranker", "RequestError", "load_run_config"]
