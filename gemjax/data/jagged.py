"""The jagged batch: packed, unpadded user sequences plus their candidates.

JAX needs static shapes, so a batch is a flat token buffer of fixed capacity
`T` with `offsets: int32[B+1]` (cumulative history lengths, like
`cu_seqlens`): request `i` owns tokens `offsets[i]:offsets[i+1]`. Only the
tail past `offsets[-1]` is unused, and the packer keeps that tail small.

Candidates are packed the same way (listwise, O12): request `i` owns candidate
rows `cand_offsets[i]:cand_offsets[i+1]` of a buffer of capacity `C`, so the
model computes a user's sequence once and every candidate of that request
attends to it. Requests past the real ones (a batch that is not full) have
empty histories and no candidates.

Fields (legend: `b` requests, `t` tokens, `c` candidates, `f` dense features):
  offsets        int32[b+1]
  seq            {name: int32[t]}   per history event (item, category, action,
                                    context buckets, ...)
  cand_offsets   int32[b+1]
  cand           {name: int32[c]}   per candidate
  labels         float32[c, tasks]  (CTR, CVR, ...) in {0, 1}
  user_id        int32[b]
  dense          float32[b, f]      non-sequence request features

A batch of `S` data-parallel shards stacks `S` such batches on a new leading
axis (each shard's offsets are local to it); see `stack`.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class JaggedBatch:
  offsets: jax.Array
  seq: Mapping[str, jax.Array]
  cand_offsets: jax.Array
  cand: Mapping[str, jax.Array]
  labels: jax.Array
  user_id: jax.Array
  dense: jax.Array

  @property
  def num_requests(self) -> int:
    return self.offsets.shape[-1] - 1

  @property
  def token_capacity(self) -> int:
    return next(iter(self.seq.values())).shape[-1]

  @property
  def cand_capacity(self) -> int:
    return self.labels.shape[-2]

  def validate(self, vocab_sizes: Mapping[str, int] | None = None) -> None:
    """Raise `ValueError` naming the field and index of the first problem.

    Checks dtypes, shapes, offsets (start at 0, non-decreasing, within
    capacity), ids inside their tables (`vocab_sizes`: feature name -> rows,
    applied to `seq` and `cand` columns of that name), labels in {0, 1}.
    Works on one batch or a stacked one; needs concrete (host) values.
    """
    arrays = {k: np.asarray(v) for k, v in _flat_fields(self).items()}
    lead = arrays["offsets"].shape[:-1]
    for name, a in arrays.items():
      want = np.float32 if name in ("labels", "dense") else np.int32
      if a.dtype != want:
        raise ValueError(
          f"JaggedBatch.{name} must be {want.__name__}, got {a.dtype}"
        )
      if a.shape[: len(lead)] != lead:
        raise ValueError(
          f"JaggedBatch.{name} has leading shape {a.shape[: len(lead)]}, "
          f"offsets have {lead}"
        )
    t, c = self.token_capacity, self.cand_capacity
    for name in arrays:
      if name.startswith("seq."):
        _check_len(arrays, name, t)
      elif name.startswith("cand."):
        _check_len(arrays, name, c)
    _check_offsets(arrays["offsets"], t, "offsets")
    _check_offsets(arrays["cand_offsets"], c, "cand_offsets")
    if arrays["cand_offsets"].shape != arrays["offsets"].shape:
      raise ValueError(
        f"cand_offsets shape {arrays['cand_offsets'].shape} != offsets shape "
        f"{arrays['offsets'].shape}"
      )
    b = self.num_requests
    for name in ("user_id", "dense"):
      if arrays[name].shape[len(lead)] != b:
        raise ValueError(
          f"JaggedBatch.{name} must have {b} rows (one per request)"
        )
    labels = arrays["labels"]
    bad = np.argwhere((labels != 0) & (labels != 1))
    if bad.size:
      i = tuple(bad[0])
      raise ValueError(f"labels must be 0 or 1; labels[{_idx(i)}]={labels[i]}")
    for name, a in arrays.items():
      feature = name.split(".", 1)[-1]
      if (
        vocab_sizes and name[:4] in ("seq.", "cand") and feature in vocab_sizes
      ):
        rows = vocab_sizes[feature]
        bad = np.argwhere((a < 0) | (a >= rows))
        if bad.size:
          i = tuple(bad[0])
          raise ValueError(
            f"JaggedBatch.{name}[{_idx(i)}]={a[i]} is outside its table of "
            f"{rows} rows"
          )


def _idx(i) -> str:
  return ", ".join(str(int(x)) for x in i)


def _flat_fields(batch: JaggedBatch) -> dict:
  out = {
    "offsets": batch.offsets,
    "cand_offsets": batch.cand_offsets,
    "labels": batch.labels,
    "user_id": batch.user_id,
    "dense": batch.dense,
  }
  out.update({f"seq.{k}": v for k, v in batch.seq.items()})
  out.update({f"cand.{k}": v for k, v in batch.cand.items()})
  return out


def _check_len(arrays, name, capacity):
  n = arrays[name].shape[-1] if name.startswith(("seq.", "cand.")) else None
  if n != capacity:
    raise ValueError(f"JaggedBatch.{name} has {n} rows, expected {capacity}")


def _check_offsets(o: np.ndarray, capacity: int, name: str) -> None:
  for idx in np.ndindex(o.shape[:-1]):
    row = o[idx]
    where = f"{name}{list(idx) if idx else ''}"
    if row[0] != 0:
      raise ValueError(f"{where}[0] must be 0, got {row[0]}")
    bad = np.nonzero(np.diff(row) < 0)[0]
    if bad.size:
      i = int(bad[0])
      raise ValueError(
        f"{where} must be non-decreasing: [{i}]={row[i]} > "
        f"[{i + 1}]={row[i + 1]}"
      )
    if row[-1] > capacity:
      raise ValueError(
        f"{where}[-1]={row[-1]} is beyond the buffer capacity {capacity}"
      )


def stack(batches: Sequence[JaggedBatch]) -> JaggedBatch:
  """Stack per-shard batches on a new leading (data-parallel shard) axis."""
  return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def to_padded(values_t, offsets_b, max_len: int, fill=0):
  """Packed `[t, ...]` -> (`[b, max_len, ...]`, valid mask `[b, max_len]`).

  Host-side (numpy) helper for tests and debugging. A sequence longer than
  `max_len` is an error, not a silent cut.
  """
  values_t, offsets_b = np.asarray(values_t), np.asarray(offsets_b)
  lengths = np.diff(offsets_b)
  if lengths.size and lengths.max() > max_len:
    raise ValueError(f"sequence of length {lengths.max()} > max_len {max_len}")
  b = lengths.size
  out = np.full((b, max_len) + values_t.shape[1:], fill, values_t.dtype)
  mask = np.arange(max_len)[None, :] < lengths[:, None]
  for i in range(b):
    out[i, : lengths[i]] = values_t[offsets_b[i] : offsets_b[i + 1]]
  return out, mask


def from_padded(values_bl, lengths_b, capacity: int | None = None):
  """Padded `[b, l, ...]` + lengths -> (packed `[capacity, ...]`, offsets)."""
  values_bl, lengths_b = np.asarray(values_bl), np.asarray(lengths_b)
  offsets = np.concatenate([[0], np.cumsum(lengths_b)]).astype(np.int32)
  total = int(offsets[-1])
  capacity = total if capacity is None else capacity
  if total > capacity:
    raise ValueError(f"{total} tokens do not fit a buffer of {capacity}")
  out = np.zeros((capacity,) + values_bl.shape[2:], values_bl.dtype)
  for i, n in enumerate(lengths_b):
    out[offsets[i] : offsets[i + 1]] = values_bl[i, :n]
  return out, offsets


def segment_ids(offsets_b, capacity: int):
  """Request index of every packed row; rows past the data get `b` (none)."""
  rows = jnp.arange(capacity)
  seg = jnp.searchsorted(offsets_b, rows, side="right") - 1
  return jnp.where(rows < offsets_b[-1], seg, offsets_b.shape[0] - 1)
