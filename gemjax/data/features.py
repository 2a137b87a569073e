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

import functools

import numpy as np


def bucket_edges(base: float, num_buckets: int) -> np.ndarray:
  """Lower edges of buckets 1..num_buckets-1 (float64[num_buckets-1])."""
  return np.power(float(base), np.arange(num_buckets - 1)) - 1.0


def log_bucket(x, base: float, num_buckets: int) -> np.ndarray:
  """Bucket ids (int32, same shape as x); x < 0 (missing) -> 0.

  Equal to `searchsorted(bucket_edges(base, num_buckets), x, "right")`, but
  ~10x faster than that or than `np.log1p` (both ~25-90 ns per element
  here); this runs on every history event of every request:
    integers with base 2: bucket = floor(log2(1 + x)) + 1, read from the
      exponent bits of float64(1 + x) (exact for |x| < 2^53);
    float32: a table indexed by the top 18 bits of the float (sign,
      exponent, 10 mantissa bits) gives the bucket of each cell's lowest
      value; an edge inside a cell is handled by one comparison with the
      edges rounded up to float32 (exact for float32 inputs);
    anything else goes through searchsorted.
  """
  x = np.asarray(x)
  top = num_buckets - 1
  if base == 2.0 and np.issubdtype(x.dtype, np.integer):
    f = (np.maximum(x, -1) + 1).astype(np.float64)  # missing -> 0.0
    k = (f.view(np.int64) >> 52) - 1022  # 1 + x = m 2^(k) with m in [.5, 1)
    np.clip(k, 0, top, out=k)  # f = 0.0 (missing) gives -1022 -> 0
    return k.astype(np.int32)
  if x.dtype == np.float32 and base - 1 > 2.0**-8:
    table, edges_up = _f32_table(float(base), num_buckets)
    bits = x.view(np.int32)
    k = table[np.maximum(bits, 0) >> _SHIFT]
    k += x >= edges_up[k]  # edges_up[top] = inf
    k[x < 0] = 0
    return k.astype(np.int32)
  edges = bucket_edges(base, num_buckets)
  return np.searchsorted(edges, x, side="right").astype(np.int32)


_SHIFT = 13  # float32 bits dropped: cells of 2^-10 relative width


@functools.lru_cache(maxsize=16)
def _f32_table(base: float, num_buckets: int):
  edges = bucket_edges(base, num_buckets)
  up = edges.astype(np.float32)
  low = up < edges  # rounded down: the first float32 >= edge is the next one
  up[low] = np.nextafter(up[low], np.float32(np.inf))
  # A cell whose lowest value is in bucket k (>= 1) holds values of bucket
  # k + 1 from edges[k] on; edges_up[k] = edges[k] rounded up, inf for top.
  edges_up = np.concatenate([up, [np.inf]]).astype(np.float32)
  cells = np.arange(1 << (31 - _SHIFT), dtype=np.int64) << _SHIFT
  lows = cells.astype(np.int32).view(np.float32)
  with np.errstate(invalid="ignore"):  # NaN bit patterns: any bucket
    table = np.searchsorted(edges, lows.astype(np.float64), side="right")
  dtype = np.int8 if num_buckets < 127 else np.int32
  return table.astype(dtype), edges_up


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
