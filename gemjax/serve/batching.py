"""Capacity buckets and packing of score requests into jagged batches.

XLA compiles one program per input shape. A serving batch is a jagged batch
(`gemjax.data.jagged`) of static capacities (requests b, history tokens t,
candidates c), so the shapes a server ever runs are exactly its buckets:
compile them at start-up (`Ranker.warmup`) and steady traffic never
compiles again, whatever its mix of history lengths and candidate counts.

A bucket is (requests, candidates[, candidates of one request[, tokens]]).
Tokens default to `b * max_seq_len`, which b built histories always fit
(the training builder cuts each to `max_seq_len`, newest kept); a smaller
token capacity saves stage-1 work on padding rows for traffic whose
histories are shorter on average, and needs one bucket of at least
`max_seq_len` tokens, so that any single history fits. Packing is greedy in
arrival order: a unit joins the open batch while some bucket holds the
batch (requests, candidates, the largest request's candidates, tokens);
the batch runs in the smallest such bucket. A request with more candidates
than any bucket takes from one request is split into chunks of candidates,
each a unit with the same history (candidates are independent: one
candidate's score never depends on another's, see `paths`), so no request
is rejected for its size.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
  requests: int  # b
  cands: int  # c, candidate rows of the batch
  tokens: int  # t, history rows of the batch
  # Most candidates of one request (`max_cands` of the kernels: the padded
  # and reference paths pad each request's queries to it).
  request_cands: int = 0  # 0 = cands

  def __post_init__(self):
    if not self.request_cands:
      object.__setattr__(self, "request_cands", self.cands)

  @property
  def name(self) -> str:
    return (
      f"b{self.requests}_c{self.cands}_r{self.request_cands}_t{self.tokens}"
    )

  def holds(self, n_requests, n_cands, request_cands, n_tokens) -> bool:
    return (
      self.requests >= n_requests
      and self.cands >= n_cands
      and self.request_cands >= request_cands
      and self.tokens >= n_tokens
    )


# (requests, candidates) per bucket: single large requests, and several
# smaller ones batched together.
DEFAULT_SHAPES = ((1, 128), (1, 512), (1, 2048), (8, 512), (8, 2048))


def make_buckets(shapes, max_seq_len: int) -> tuple[Bucket, ...]:
  out = set()
  for shape in shapes:
    if not 2 <= len(shape) <= 4:
      raise ValueError(
        f"bucket {tuple(shape)}: (requests, candidates[, candidates of one "
        "request[, tokens]])"
      )
    b, c, r, t = (tuple(int(x) for x in shape) + (0, 0))[:4]
    t = t or b * max_seq_len
    if b < 1 or c < 1 or not 0 <= r <= c or t < 1:
      raise ValueError(
        f"bucket {tuple(shape)}: requests, candidates and tokens must be "
        "positive, candidates of one request at most the candidates"
      )
    out.add(Bucket(b, c, t, r))
  if max(k.tokens for k in out) < max_seq_len:
    raise ValueError(
      f"no bucket holds a history of max_seq_len={max_seq_len} tokens"
    )
  return tuple(sorted(out, key=lambda k: (k.cands * k.requests, k)))


def split_units(cand_counts, max_cands: int):
  """Units (request, first candidate, end candidate): every request cut
  into runs of at most `max_cands` candidates."""
  units = []
  for i, n in enumerate(np.asarray(cand_counts).tolist()):
    for lo in range(0, n, max_cands):
      units.append((i, lo, min(n, lo + max_cands)))
  return units


def plan(unit_cands, unit_tokens, buckets) -> list[tuple[list[int], Bucket]]:
  """Greedy packing in order: (unit positions, bucket) per batch. A unit
  joins the open batch while some bucket still holds the batch."""
  batches, cur, n_c, n_t, top = [], [], 0, 0, 0
  for u, (c, t) in enumerate(zip(unit_cands, unit_tokens, strict=True)):
    if pick(1, c, c, t, buckets, strict=False) is None:
      raise ValueError(
        f"unit {u} ({c} candidates, {t} tokens): no bucket holds it"
      )
    grown = (len(cur) + 1, n_c + c, max(top, c), n_t + t)
    if cur and pick(*grown, buckets, strict=False) is None:
      batches.append((cur, pick(len(cur), n_c, top, n_t, buckets)))
      cur, n_c, n_t, top = [], 0, 0, 0
    cur.append(u)
    n_c, n_t, top = n_c + c, n_t + t, max(top, c)
  if cur:
    batches.append((cur, pick(len(cur), n_c, top, n_t, buckets)))
  return batches


def pick(n_requests, n_cands, request_cands, n_tokens, buckets, strict=True):
  """The smallest bucket (in candidate slots) that holds the batch; None
  (or with `strict` an error) when none does."""
  fits = [
    k for k in buckets if k.holds(n_requests, n_cands, request_cands, n_tokens)
  ]
  if not fits:
    if not strict:
      return None
    raise ValueError(
      f"no bucket holds {n_requests} requests with {n_cands} candidates "
      f"({request_cands} in one request) and {n_tokens} tokens"
    )
  return min(fits, key=lambda k: (k.cands * k.requests, k.tokens, k))
