"""Capacity buckets and packing of score requests into jagged batches.

XLA compiles one program per input shape. A serving batch is a jagged batch
(`gemjax.data.jagged`) of static capacities (requests b, history tokens t,
candidates c), so the shapes a server ever runs are exactly its buckets:
compile them at start-up (`Ranker.warmup`) and steady traffic never
compiles again, whatever its mix of history lengths and candidate counts.

A bucket's token capacity is `b * max_seq_len`: the training builder cuts
every history to `max_seq_len` (newest kept), so b requests always fit and
only candidates and request slots decide the packing. Packing is greedy in
arrival order under the largest bucket's budgets; the batch then runs in
the smallest bucket that holds it. A request with more candidates than the
largest bucket is split into chunks of candidates, each a unit of its own
with the same history (candidates are independent: one candidate's score
never depends on another's, see `paths`), so no request is rejected for its
size.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
  requests: int  # b
  cands: int  # c, candidate rows of the batch
  tokens: int  # t = b * max_seq_len
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


# (requests, candidates[, candidates of one request]) per bucket: single
# large requests, and several smaller ones batched together.
DEFAULT_SHAPES = ((1, 128), (1, 512), (1, 2048), (8, 512), (8, 2048))


def make_buckets(shapes, max_seq_len: int) -> tuple[Bucket, ...]:
  out = set()
  for shape in shapes:
    b, c, r = (tuple(shape) + (0,))[:3]
    if b < 1 or c < 1 or r < 0 or r > c:
      raise ValueError(
        f"bucket {tuple(shape)}: requests and candidates must be positive, "
        "candidates of one request at most the candidates"
      )
    out.add(Bucket(int(b), int(c), int(b) * max_seq_len, int(r)))
  return tuple(sorted(out, key=lambda k: (k.cands * k.requests, k)))


def split_units(cand_counts, max_cands: int):
  """Units (request, first candidate, end candidate): every request cut
  into runs of at most `max_cands` candidates."""
  units = []
  for i, n in enumerate(np.asarray(cand_counts).tolist()):
    for lo in range(0, n, max_cands):
      units.append((i, lo, min(n, lo + max_cands)))
  return units


def plan(unit_cands, buckets) -> list[tuple[list[int], Bucket]]:
  """Greedy packing in order: (unit positions, bucket) per batch. A unit
  joins the open batch while some bucket still holds the batch."""
  batches, cur, n_c, top = [], [], 0, 0
  for u, c in enumerate(unit_cands):
    if pick(1, c, c, buckets, strict=False) is None:
      raise ValueError(f"unit {u} has {c} candidates: no bucket holds it")
    if cur and pick(len(cur) + 1, n_c + c, max(top, c), buckets, False) is None:
      batches.append((cur, pick(len(cur), n_c, top, buckets)))
      cur, n_c, top = [], 0, 0
    cur.append(u)
    n_c += c
    top = max(top, c)
  if cur:
    batches.append((cur, pick(len(cur), n_c, top, buckets)))
  return batches


def pick(n_requests, n_cands, request_cands, buckets, strict: bool = True):
  """The smallest bucket (in candidate slots) that holds the batch; None
  (or with `strict` an error) when none does."""
  fits = [
    k
    for k in buckets
    if k.requests >= n_requests
    and k.cands >= n_cands
    and k.request_cands >= request_cands
  ]
  if not fits:
    if not strict:
      return None
    raise ValueError(
      f"no bucket holds {n_requests} requests with {n_cands} candidates "
      f"({request_cands} in one request)"
    )
  return min(fits, key=lambda k: (k.cands * k.requests, k))
