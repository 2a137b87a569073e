"""Context features as log-bucketed ids (O3): `ts_delta`, `ts_to_req`, `price`.

OneTrans V3.1 feeds three context signals into every history event as
discrete ids (one embedding row each) rather than raw floats:

  ts_delta   seconds since the previous event of the built sequence (the
             user's rhythm); the first event of a sequence has none -> id 0
  ts_to_req  seconds from the event to the request time (recency), > 0 by
             anti-leakage
  price      the item's price (price-range preference); candidates get the
             same bucket of their own price, in the same table (O9)

A log scale spends the rows where the signal changes: a one-minute gap is very
different from a one-hour gap, a 30-day gap is much like a 31-day one. With
base `B` and `n` buckets:

  id(x) = 0                       if x is missing (x < 0)
  id(x) = k  (1 <= k <= n-1)      if B^(k-1) - 1 <= x < B^k - 1,

and the last bucket also takes everything above. So the lower edges are
`bucket_edges(B, n) = [B^0 - 1, B^1 - 1, ..., B^(n-2) - 1]`. Defaults:
seconds with B = 2 and 32 buckets: [0, 1), [1, 3), [3, 7), ..., [2^30 - 1,
inf) (~34 years); prices with B = 1.5 and 48 buckets: [0, 0.5), [0.5, 1.25),
[1.25, 2.375), ..., up to 1.5^46 ~ 1.3e8 price units. Lookup is a
`searchsorted` on these exact edges, so boundaries are exact (no rounding of
a floating log).
"""

import numpy as np


def bucket_edges(base: float, num_buckets: int) -> np.ndarray:
  """Lower edges of buckets 1..num_buckets-1 (float64[num_buckets-1])."""
  return np.power(float(base), np.arange(num_buckets - 1)) - 1.0


def log_bucket(x, base: float, num_buckets: int) -> np.ndarray:
  """Bucket ids (int32, same shape as x); x < 0 (missing) -> 0."""
  x = np.asarray(x, np.float64)
  ids = np.searchsorted(bucket_edges(base, num_buckets), x, side="right")
  return ids.astype(np.int32)


def context_features(ts, first, req_ts, price, cfg) -> dict[str, np.ndarray]:
  """`ts_delta`, `ts_to_req`, `price` ids of built history events.

  ts: int64[t] event seconds; first: bool[t], True where the event opens its
  sequence (no previous event: `ts_delta` id 0); req_ts: int64[t] the request
  time of each event's request; price: float[t]. Returns int32[t] columns.
  """
  ts = np.asarray(ts, np.int64)
  delta = np.empty_like(ts)
  delta[1:] = ts[1:] - ts[:-1]
  delta[first] = -1
  return {
    "ts_delta": log_bucket(delta, cfg.ts_bucket_base, cfg.ts_buckets),
    "ts_to_req": log_bucket(req_ts - ts, cfg.ts_bucket_base, cfg.ts_buckets),
    "price": log_bucket(price, cfg.price_bucket_base, cfg.price_buckets),
  }
