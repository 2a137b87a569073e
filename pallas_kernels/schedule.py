"""Jagged tile schedules: the work list of a ragged kernel, built on device.

A kernel over a jagged batch (sequences packed into one buffer, `offsets[b+1]`
cumulative lengths) works in tiles of `block` rows of one sequence. Launching a
dense `[b, cdiv(max_len, block)]` grid wastes most of it on tiles that lie past
a short sequence's end (G1, G2: "empty tiles skipped by a precomputed
schedule"). Instead the work list holds only the non-empty (sequence, tile)
pairs:

    n_tiles[i] = cdiv(len[i], block)          # per sequence
    tile_start = exclusive_cumsum(n_tiles)    # first tile id of each sequence
    item j of the (unsorted) list -> sequence i with
        tile_start[i] <= j < tile_start[i] + n_tiles[i]
      and tile t = j - tile_start[i]

The list is built with a handful of `jnp` ops inside `jit`, so it costs no
host round trip. Shapes must be static, so the list has a static length
`max_items` that bounds any batch of that buffer capacity `c` and `b`
sequences: `sum(cdiv(len_i + lead_i, block)) <= (c + (b + 1) * (block +
align - 2)) // block`. Items past `num_items` are padding that a kernel skips
(they report zero rows).

The buffer tail past `offsets[-1]` is appended as one more pseudo-sequence
(index `b`), so a kernel that must write every output row (zeros there) finds
that work in the same list.

Order: items are sorted by decreasing `cost` (longest first). On a GPU, the
hardware block scheduler hands the next CTA of the grid to whichever SM frees
up first, so launching the grid in longest-first order is the greedy
longest-processing-time schedule: the long tiles of one 2K sequence start
first, on different SMs, and the many short tiles fill the gaps at the end,
instead of one long tile starting last and running alone. A persistent kernel
(one CTA per SM looping over items) gets the same effect by dealing the sorted
list out zig-zag (`zigzag_assignment`, G2): SM `w` takes items `w`,
`2W - 1 - w`, `2W + w`, ..., so every SM gets one long and one short item per
round.

The second half of this module is the attention kernels' tiling on the
8-aligned row grid of the packed buffers: the work items of the forward /
dQ kernels (`query_items`, columns `QueryItem`) and of the dK/dV kernels
(`key_items`, columns `KeyItem`), the zero-filled first and last tiles of
each sequence (`side_tiles`) and the kernel-side load that picks between
them and the packed buffer (`load_kv_tile`), and the deal of the items
over persistent CTAs (`deal_items`). Jagged attention and GDPA share them.

Shapes (legend): `b` sequences, `i` items (`max_items`).
"""

import enum
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic


class TileSchedule(NamedTuple):
  """Non-empty (sequence, tile) items, longest first; see module docstring."""

  seq_i: jax.Array  # int32[i]: sequence; b is the buffer-tail pseudo-sequence
  tile_i: jax.Array  # int32[i]: tile index inside the sequence
  tile_id_i: jax.Array  # int32[i]: sequence-major tile id (before sorting)
  valid_i: jax.Array  # bool[i]: False for padding items past num_items
  num_items: jax.Array  # int32[]: number of real items
  tile_start_b: jax.Array  # int32[b+2]: first tile id of each sequence, total


def max_items(capacity: int, num_seqs: int, block: int, align: int = 1) -> int:
  """Static bound on the items of any batch (tail pseudo-sequence included).

  Each of the `num_seqs + 1` sequences wastes less than one tile, plus its
  `< align` lead rows.
  """
  return (capacity + (num_seqs + 1) * (block + align - 2)) // block


def extend_offsets(offsets, capacity: int):
  """`offsets[b+1]` -> `[b+2]`: the buffer tail as one more sequence."""
  offsets = jnp.asarray(offsets, jnp.int32)
  return jnp.concatenate([offsets, jnp.full((1,), capacity, jnp.int32)])


def lead_rows(offsets, align: int):
  """Rows between a sequence's start and the aligned row before it."""
  return jnp.asarray(offsets, jnp.int32) % align


def tiles_per_sequence(offsets_e, block: int, align: int):
  """`int32[b]`: tiles of each sequence of `offsets_e` (0 when empty), on
  its `align`-row grid (see `enumerate_tiles`)."""
  lengths_b = offsets_e[1:] - offsets_e[:-1]
  lead_b = lead_rows(offsets_e[:-1], align)
  return jnp.where(lengths_b > 0, (lengths_b + lead_b + block - 1) // block, 0)


def enumerate_tiles(offsets_e, block: int, align: int, num_items: int):
  """Unsorted items: (seq, tile, valid) for ids `0..num_items)`, and starts.

  Tile `t` of sequence `j` covers packed rows
  `offsets_e[j] - lead_j + t * block ... + block` with
  `lead_j = offsets_e[j] % align`, so every tile starts on an `align`-row
  boundary (TMA into tiled shared memory needs that; see
  jagged_attention/mosaic_gpu.py).
  """
  num_seqs = offsets_e.shape[0] - 1
  n_tiles_b = tiles_per_sequence(offsets_e, block, align)
  ends_b = jnp.cumsum(n_tiles_b)
  tile_start_b = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_b])
  j = jnp.arange(num_items, dtype=jnp.int32)
  seq = jnp.searchsorted(ends_b, j, side="right", method="compare_all")
  seq = seq.astype(jnp.int32)
  seq = jnp.minimum(seq, num_seqs - 1)
  tile = j - tile_start_b[seq]
  valid = j < ends_b[-1]
  return seq, tile, valid, tile_start_b


def jagged_tile_schedule(
  offsets,
  capacity: int,
  block: int,
  *,
  align: int = 1,
  cost: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
  seq_cost: Callable[[jax.Array], jax.Array] | None = None,
  num_items: int | None = None,
) -> TileSchedule:
  """Work list of `block`-row tiles over the sequences of `offsets`.

  Args:
    offsets: `int32[b+1]` cumulative lengths (the tail past `offsets[-1]` up
      to `capacity` becomes pseudo-sequence `b`).
    capacity: rows of the packed buffer.
    block: rows per tile.
    align: tiles start on multiples of `align` rows (see `enumerate_tiles`).
    cost: `cost(seq_i, tile_i) -> int32[i]`, the work of each item (e.g. the
      number of key tiles it visits); larger runs first. Default: one per
      item, which keeps sequence order.
    seq_cost: instead of `cost`, when every tile of a sequence costs the
      same: `seq_cost(seq_b) -> int32[b+1]` (tail pseudo-sequence
      included). The same list, built by ordering the sequences rather
      than the items (`_by_sequence`).
    num_items: static list length; default `max_items(...)`.
  """
  if cost is not None and seq_cost is not None:
    raise ValueError("give cost or seq_cost, not both")
  offsets_e = extend_offsets(offsets, capacity)
  if num_items is None:
    num_items = max_items(capacity, offsets_e.shape[0] - 2, block, align)
  if seq_cost is not None:
    if offsets_e.shape[0] - 1 <= RANK_BY_COMPARE_MAX:
      return _by_sequence(offsets_e, block, align, num_items, seq_cost)
    cost = lambda seq, tile: seq_cost(seq)  # noqa: E731
  seq, tile, valid, tile_start_b = enumerate_tiles(
    offsets_e, block, align, num_items
  )
  j = jnp.arange(num_items, dtype=jnp.int32)
  if cost is None:
    # Equal work: the list is already in order (real items are a prefix).
    order = j
  else:
    work = cost(seq, tile).astype(jnp.int32)
    # Padding items go last; ties keep sequence order (stable sort).
    key = jnp.where(valid, -work, jnp.iinfo(jnp.int32).max)
    order = stable_order(key)
  return TileSchedule(
    seq_i=seq[order],
    tile_i=tile[order],
    tile_id_i=j[order],
    valid_i=valid[order],
    num_items=tile_start_b[-1],
    tile_start_b=tile_start_b,
  )


def _by_sequence(offsets_e, block, align, num_items, seq_cost):
  """`jagged_tile_schedule` for a per-sequence cost, without sorting items.

  A stable sort of the items by decreasing cost keeps each sequence's
  tiles together and in order, and puts sequences of equal cost in index
  order; so it is the sequences, ordered that way, laid end to end. Each
  sequence's place comes from comparing all pairs of sequences, and each
  item finds its sequence by comparing its position with every sequence's
  range: `[b, b]` and `[i, b]` compare-and-sum fusions, with no sort,
  scatter or cumulative sum between them (a GPU runs each small XLA op as
  its own kernel launch).

  Against the item sort this runs fewer device ops (GDPA cross16's
  forward 11 a call instead of 16) at a timed speed within the noise,
  except jagged D=64 fwd+bwd, about 3% slower for a reason not yet
  explained (docs/kernels/schedule.md).
  """
  nb = offsets_e.shape[0] - 1  # sequences + the tail pseudo-sequence
  n_tiles_b = tiles_per_sequence(offsets_e, block, align)
  seq_b = jnp.arange(nb, dtype=jnp.int32)
  work_b = seq_cost(seq_b).astype(jnp.int32)
  m, j = seq_b[None, :], seq_b[:, None]  # [j, m]: does m come before j?
  in_order = m < j
  in_list = (work_b[None, :] > work_b[:, None]) | (
    (work_b[None, :] == work_b[:, None]) & in_order
  )
  tile_start_b = jnp.where(in_order, n_tiles_b[None, :], 0).sum(axis=1)
  list_start_b = jnp.where(in_list, n_tiles_b[None, :], 0).sum(axis=1)
  total = n_tiles_b.sum()
  p = jnp.arange(num_items, dtype=jnp.int32)
  rel = p[:, None] - list_start_b[None, :]  # [i, b]
  hit = (rel >= 0) & (rel < n_tiles_b[None, :])
  valid = p < total
  # Padding items: the tail pseudo-sequence's, past its tiles (as the
  # item sort leaves them).
  seq = jnp.where(valid, jnp.where(hit, seq_b[None, :], 0).sum(axis=1), nb - 1)
  tile_start_e = jnp.concatenate([tile_start_b, total[None]])
  tile = jnp.where(valid, p - list_start_b[seq], p - tile_start_b[nb - 1])
  return TileSchedule(
    seq_i=seq,
    tile_i=tile,
    tile_id_i=jnp.where(valid, tile_start_b[seq] + tile, p),
    valid_i=valid,
    num_items=total,
    tile_start_b=tile_start_e,
  )


# Up to this many items, `stable_order` ranks by comparing all pairs (and
# up to this many sequences, `jagged_tile_schedule`'s `seq_cost` orders
# them so, `_by_sequence`).
RANK_BY_COMPARE_MAX = 4096


def stable_order(key, compare_max: int = RANK_BY_COMPARE_MAX):
  """`jnp.argsort(key, stable=True)` for the short int32 keys of a work list.

  XLA's GPU sort of a ~1K-item list is one slow kernel (8-11 us in the
  H200 profiles of docs/kernels/schedule.md). Up to `compare_max` items
  this instead ranks every item by comparing it with all others, one `[i, i]`
  compare-and-count fusion:

      rank[j] = #{m : key[m] < key[j]} + #{m < j : key[m] == key[j]}

  (a permutation, since ties are broken by position), then scatters
  `order[rank[j]] = j`: one kernel each, about 3 us together. Longer
  lists use XLA's sort.
  """
  n = key.shape[0]
  if n > compare_max:
    return jnp.argsort(key, stable=True).astype(jnp.int32)
  j = jnp.arange(n, dtype=jnp.int32)
  km, kj = key[None, :], key[:, None]
  before = (km < kj) | ((km == kj) & (j[None, :] < j[:, None]))
  rank = before.sum(axis=1, dtype=jnp.int32)
  return jnp.zeros((n,), jnp.int32).at[rank].set(j, unique_indices=True)


def fold_factor(group: int, max_len_q: int | None, block_q: int) -> int:
  """How many query heads of a KV group to fold into rows (1: none).

  Where query rows are independent (no causal mask: GDPA, or softmax
  attention without `causal`), the `g` query heads that share a KV head
  can be relabelled as `g` times as many rows of fewer heads
  (`fold_heads`): every row still meets its own KV head's keys, so the
  math is unchanged, but a short query side fills its tiles. Pooled
  attention's 16 queries use 16 of a 64-row tile's rows per head; with the
  4 heads of a group folded, one full tile streams the keys once instead
  of four times (H200, GDPA pooled: forward+backward 1.41x faster).
  `f` is the largest divisor of `g` with `max_len_q * f <= block_q`;
  without the caller's `max_len_q`, no fold.
  """
  if max_len_q is None:
    return 1
  rows = max(max_len_q, 1)
  fits = [
    f for f in range(1, group + 1) if group % f == 0 and rows * f <= block_q
  ]
  return max(fits, default=1)


def fold_heads(x_tnh, f: int, kv_heads: int):
  """`[t, n, h]` -> `[t f, n / f, h]`: row `r` of head `j g + i` (group
  `g = n / kv_heads`) becomes row `r f + i % f` of head
  `j (g / f) + i // f`, so its KV head stays `j`. Offsets scale by `f`."""
  t, n, h = x_tnh.shape
  x = x_tnh.reshape(t, kv_heads, n // kv_heads // f, f, h)
  return x.transpose(0, 3, 1, 2, 4).reshape(t * f, n // f, h)


def unfold_heads(x, f: int, kv_heads: int):
  """Inverse of `fold_heads`."""
  tf, nf, h = x.shape
  x = x.reshape(tf // f, f, kv_heads, nf // kv_heads, h)
  return x.transpose(0, 2, 3, 1, 4).reshape(tf // f, nf * f, h)


def with_folded_heads(
  attend, q_tnh, q_offsets, kv_heads: int, *, max_len_q, block_q, enabled
):
  """`attend(q, q_offsets)` with the heads folded into rows by
  `fold_factor(group, max_len_q, block_q)` when `enabled` (the caller's
  rows are independent and it allows the fold): rows and offsets scaled by
  `f`, the `[t, n, h]` result unfolded; `f == 1` calls it as is."""
  group = q_tnh.shape[1] // kv_heads
  f = fold_factor(group, max_len_q, block_q) if enabled else 1
  if f == 1:
    return attend(q_tnh, q_offsets)
  out = attend(fold_heads(q_tnh, f, kv_heads), q_offsets * f)
  return unfold_heads(out, f, kv_heads)


def zigzag_assignment(num_items: int, num_workers: int) -> jax.Array:
  """For a persistent kernel: the sorted item each (round, worker) takes.

  Returns `int32[rounds, num_workers]` (entries >= num_items are padding):
  round `r` deals items left to right on even rounds and right to left on odd
  ones, so each worker's total is balanced when items are sorted by cost.
  """
  rounds = -(-num_items // num_workers)
  r = jnp.arange(rounds, dtype=jnp.int32)[:, None]
  w = jnp.arange(num_workers, dtype=jnp.int32)[None, :]
  lane = jnp.where(r % 2 == 0, w, num_workers - 1 - w)
  return r * num_workers + lane


def persistent_workers(num_groups: int, num_sms: int, num_items: int) -> int:
  """Persistent CTAs per group (head pair, KV head) so that all groups
  together fill about `num_sms` SMs, and never more than there are items."""
  return max(1, min(-(-num_sms // num_groups), num_items))


def deal(num_items: int, num_real, workers: int, chunk: int):
  """Zig-zag deal of `chunk`-item runs over `workers` persistent CTAs.

  Returns (`int32[w, j]` item of each worker's j-th step, `int32[w]` real
  steps per worker). Items `>= num_real` are padding; they come last in the
  sorted list, so each worker's real steps are a prefix of its row.
  """
  n_chunks = -(-num_items // chunk)
  zz = zigzag_assignment(n_chunks, workers)  # [rounds, w]
  ids = zz[:, :, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)
  ids = ids.transpose(1, 0, 2).reshape(workers, -1)  # [w, rounds * chunk]
  real = ids < num_real
  return jnp.where(real, ids, 0), real.sum(axis=1).astype(jnp.int32)


def pair_swaps(dealt, counts, cost, rounds: int = 1):
  """Even out a deal (`deal`'s outputs) by cost: each round pairs the i-th
  busiest worker with the i-th idlest and swaps the one pair of their real
  items that best halves the gap between them (no swap if none narrows
  it). Pairs are disjoint, so a round is a few array ops. Items change
  workers but each row's real steps stay a prefix of it.

  Built of compares, reductions, gathers and selects only (the workers'
  ranks by pairwise compare, no sort or scatter), so XLA fuses a round
  into a few small kernels: it runs on the device once per distinct set
  of offsets, beside the attention it schedules.

  `cost`: `[num_items]` cost of each item (padding items are never read).
  Returns the new `dealt`.
  """
  w, j = dealt.shape
  p = w // 2
  if p == 0:
    return dealt
  col = jnp.arange(j, dtype=jnp.int32)
  real = col[None, :] < counts[:, None]
  c = jnp.where(real, cost[dealt], 0)
  me = jnp.arange(w, dtype=jnp.int32)
  for _ in range(rounds):
    load = c.sum(axis=1)
    # Rank 0 is the busiest; ties go to the lower index (a stable sort).
    ahead = (load[None, :] > load[:, None]) | (
      (load[None, :] == load[:, None]) & (me[None, :] < me[:, None])
    )
    rank = ahead.sum(axis=1, dtype=jnp.int32)
    at = rank[None, :] == me[:, None]  # [rank, worker]
    order = jnp.sum(jnp.where(at, me[None, :], 0), axis=1)
    hi, lo = order[:p], order[::-1][:p]
    gap = load[hi] - load[lo]
    d = c[hi][:, :, None] - c[lo][:, None, :]  # [p, j, j]
    ok = real[hi][:, :, None] & real[lo][:, None, :] & (d > 0)
    ok &= d < gap[:, None, None]
    score = jnp.where(ok, jnp.abs(gap[:, None, None] - 2 * d), gap.max() + 1)
    score = score.reshape(p, j * j)
    best = jnp.argmin(score, axis=1)
    swap = score.min(axis=1) < gap  # some pair narrows the gap
    x, y = best // j, best % j
    # Each worker's side of its pair: the column it gives up, and the
    # partner and column it takes from.
    is_hi, is_lo = rank < p, rank >= w - p
    k = jnp.clip(jnp.where(is_hi, rank, w - 1 - rank), 0, p - 1)
    mine = jnp.where(is_hi, x[k], y[k])
    partner = jnp.where(is_hi, lo[k], hi[k])
    theirs = jnp.where(is_hi, y[k], x[k])
    moves = (is_hi | is_lo) & swap[k]
    here = moves[:, None] & (col[None, :] == mine[:, None])
    dealt, c = (
      jnp.where(here, m[partner, theirs][:, None], m) for m in (dealt, c)
    )
  return dealt


# --------------------------------------------------------------------------
# Attention tiling on the 8-aligned row grid (jagged attention, GDPA).
#
# Every sequence is cut into tiles on the 8-aligned row grid of the packed
# buffer (tiled TMA needs a window's first row on a multiple of 8): tile `f`
# of sequence `j` covers packed rows `off_j - lead_j + f * block ...` with
# `lead_j = off_j % 8`. Only the first and last tile hold rows of other
# sequences; `side_tiles` copies those two of every sequence into a
# zero-filled buffer that the kernels load instead (`load_kv_tile`), so no
# score needs a boundary mask (`jagged_attention/mosaic_gpu.py` has the
# math). The work items below are the tiles that hold rows, one table row
# each, in cost order (`jagged_tile_schedule`).


class QueryItem(enum.IntEnum):
  """Columns of a `query_items` row (the forward and dQ kernels, GDPA)."""

  ROW = 0  # first packed row of the (aligned) query tile
  LO = 1  # valid rows [LO, HI) of the tile
  HI = 2
  POS = 3  # position of tile row 0 in its sequence (< 0 in the lead rows)
  KV_ROW = 4  # first packed row of the sequence's aligned key grid
  KV_LEN = 5  # key length
  KV_LEAD = 6  # key lead rows
  STEPS = 7  # key tiles visited
  KV_TILES = 8  # key tiles in the sequence's grid
  SEQ = 9  # sequence
  TILE_ID = 10  # the tile's id in the schedule (sequence-major)
  FIRST = 11  # first key tile visited (0 unless a window: window_tile_range)


class KeyItem(enum.IntEnum):
  """Columns of a `key_items` row (the dK/dV kernels)."""

  ROW = 0  # first packed row of the (aligned) key tile
  LO = 1  # valid rows [LO, HI) of the tile
  HI = 2
  POS = 3  # position of tile row 0 in its sequence
  Q_ROW = 4  # first packed row of the sequence's aligned query grid
  Q_LEAD = 5  # query lead rows
  FIRST = 6  # first query tile visited
  STEPS = 7  # query tiles visited per head
  MASKED = 8  # of those (from FIRST), how many need the causal mask (with a
  # window: all of them, the window's)
  Q_TILE_START = 9  # forward tile id of the sequence's query tile 0
  SEQ = 10  # sequence
  TILE = 11  # tile index in the sequence's key grid
  TILES = 12  # tiles in that grid (the fused backward loads the first and
  # last from the side tiles)


# `deal_items` reads either table's valid rows and steps.
assert (QueryItem.LO, QueryItem.HI, QueryItem.STEPS) == (
  KeyItem.LO,
  KeyItem.HI,
  KeyItem.STEPS,
)


def seq_tables(offsets, capacity, other_offsets):
  """Extended offsets of the tiled side (+ tail pseudo-sequence) and of the
  other side (the pseudo-sequence gets length 0)."""
  off = extend_offsets(offsets, capacity)
  other = jnp.asarray(other_offsets, jnp.int32)
  other = jnp.concatenate([other, other[-1:]])
  return off, other


def window_tile_range(pos, lo, hi, other_len, other_lead, block, window,
                      causal=None):  # fmt: skip
  """(first, count) of the other side's `block`-row tiles (on its sequence's
  aligned grid, `other_lead` rows before position 0) that hold a position
  within `window` of one of a tile's valid rows `[lo, hi)` (row 0 at
  position `pos`); count 0 when none does. `causal`: None, or which side
  of the rows the other side must lie, "before" (keys seen by query rows)
  or "after" (queries that see key rows)."""
  first_pos = jnp.maximum(pos + lo - window, 0)
  last_pos = jnp.minimum(pos + hi - 1 + window, other_len - 1)
  if causal == "before":
    last_pos = jnp.minimum(last_pos, pos + hi - 1)
  elif causal == "after":
    first_pos = jnp.maximum(first_pos, pos + lo)
  first = lax.div(first_pos + other_lead, block)
  end = lax.div(jnp.maximum(last_pos, 0) + other_lead, block) + 1
  ok = (hi > lo) & (last_pos >= first_pos)
  return first, jnp.where(ok, end - first, 0)


def _tile_schedule(offsets, rows, block, per_tile, tile_steps, seq_steps):
  """`jagged_tile_schedule` of a kernel's tiles, ordered by cost:
  each tile's steps (`tile_steps(seq, tile)`) plus one for its loads and
  stores when `per_tile` (a mask makes tiles of a sequence differ), else
  its sequence's (`seq_steps[seq]`, the same for all its tiles)."""
  if per_tile:
    cost = {"cost": lambda a, b: tile_steps(a, b) + 1}
  else:
    cost = {"seq_cost": lambda a: seq_steps[a] + 1}
  return jagged_tile_schedule(offsets, rows, block, align=mosaic.ALIGN, **cost)


def query_items(
  q_offsets, kv_offsets, t, *, block_q, block_kv, causal, window=None
):
  """Items of the forward and dQ kernels: one per 64-row query tile.

  Returns (`int32[i, 12]` table, columns `QueryItem`, and the schedule).
  """
  q_off, kv_off = seq_tables(q_offsets, t, kv_offsets)
  q_len_b = q_off[1:] - q_off[:-1]
  kv_len_b = kv_off[1:] - kv_off[:-1]
  q_lead_b = lead_rows(q_off[:-1], mosaic.ALIGN)
  kv_lead_b = lead_rows(kv_off[:-1], mosaic.ALIGN)
  kv_total_b = jnp.where(
    kv_len_b > 0, pl.cdiv(kv_len_b + kv_lead_b, block_kv), 0
  )

  def geometry(seq, tile):
    q_pos = tile * block_q - q_lead_b[seq]
    lo = jnp.clip(-q_pos, 0, block_q)
    hi = jnp.clip(q_len_b[seq] - q_pos, 0, block_q)
    total = kv_total_b[seq]
    first = jnp.zeros_like(tile)
    if window is not None:
      first, steps = window_tile_range(
        q_pos, lo, hi, kv_len_b[seq], kv_lead_b[seq], block_kv, window,
        "before" if causal else None,
      )  # fmt: skip
    elif causal:
      last = q_pos + hi - 1  # position of the last valid row
      steps = jnp.minimum(total, (last + kv_lead_b[seq]) // block_kv + 1)
      steps = jnp.where(hi > lo, jnp.maximum(steps, 0), 0)
    else:
      steps = total
    return q_pos, lo, hi, steps, first

  # Without a mask every query tile visits all its sequence's key tiles.
  sched = _tile_schedule(
    q_offsets, t, block_q, causal or window is not None,
    lambda s, i: geometry(s, i)[3], kv_total_b,
  )  # fmt: skip
  seq, tile = sched.seq_i, sched.tile_i
  q_pos, lo, hi, steps, first = geometry(seq, tile)
  valid = sched.valid_i
  cols = {
    QueryItem.ROW: q_off[seq] - q_lead_b[seq] + tile * block_q,
    QueryItem.LO: jnp.where(valid, lo, 0),
    QueryItem.HI: jnp.where(valid, hi, 0),
    QueryItem.POS: q_pos,
    QueryItem.KV_ROW: kv_off[seq] - kv_lead_b[seq],
    QueryItem.KV_LEN: kv_len_b[seq],
    QueryItem.KV_LEAD: kv_lead_b[seq],
    QueryItem.STEPS: jnp.where(valid, steps, 0),
    QueryItem.KV_TILES: kv_total_b[seq],
    QueryItem.SEQ: seq,
    QueryItem.TILE_ID: sched.tile_id_i,
    QueryItem.FIRST: first,
  }
  table = jnp.stack([cols[c] for c in QueryItem], axis=1).astype(jnp.int32)
  return table, sched


def key_items(
  q_offsets,
  kv_offsets,
  s,
  q_tile_start_b,
  *,
  block_q,
  block_kv,
  causal,
  window=None,
):
  """Items of the dK/dV kernel: one per `block_kv`-row key tile.

  Returns `int32[i, 13]`, columns `KeyItem`.
  """
  kv_off, q_off = seq_tables(kv_offsets, s, q_offsets)
  q_len_b = q_off[1:] - q_off[:-1]
  kv_len_b = kv_off[1:] - kv_off[:-1]
  q_lead_b = lead_rows(q_off[:-1], mosaic.ALIGN)
  kv_lead_b = lead_rows(kv_off[:-1], mosaic.ALIGN)
  n_q_b = jnp.where(q_len_b > 0, pl.cdiv(q_len_b + q_lead_b, block_q), 0)
  n_kv_b = pl.cdiv(kv_len_b + kv_lead_b, block_kv)

  def geometry(seq, tile):
    kv_pos = tile * block_kv - kv_lead_b[seq]
    lo = jnp.clip(-kv_pos, 0, block_kv)
    hi = jnp.clip(kv_len_b[seq] - kv_pos, 0, block_kv)
    n_q = n_q_b[seq]
    lead = q_lead_b[seq]
    if window is not None:  # every step masked
      first, steps = window_tile_range(
        kv_pos, lo, hi, q_len_b[seq], lead, block_q, window,
        "after" if causal else None,
      )  # fmt: skip
      return kv_pos, lo, hi, first, steps, steps
    if causal:
      # First query tile holding a position >= this tile's first key; tiles
      # starting before its last key need the mask.
      first = jnp.clip((kv_pos + lo + lead) // block_q, 0, n_q)
      masked_end = jnp.clip(pl.cdiv(kv_pos + hi - 1 + lead, block_q), 0, n_q)
      n_masked = jnp.maximum(masked_end - first, 0)
    else:
      first = jnp.zeros_like(tile)
      n_masked = jnp.zeros_like(tile)
    return kv_pos, lo, hi, first, n_q - first, n_masked

  # Without a mask every key tile visits all its sequence's query tiles.
  sched = _tile_schedule(
    kv_offsets, s, block_kv, causal or window is not None,
    lambda a, b: geometry(a, b)[4], n_q_b,
  )  # fmt: skip
  seq, tile = sched.seq_i, sched.tile_i
  kv_pos, lo, hi, first, steps, n_masked = geometry(seq, tile)
  valid = sched.valid_i
  q_seq = jnp.minimum(seq, q_tile_start_b.shape[0] - 1)
  cols = {
    KeyItem.ROW: kv_off[seq] - kv_lead_b[seq] + tile * block_kv,
    KeyItem.LO: jnp.where(valid, lo, 0),
    KeyItem.HI: jnp.where(valid, hi, 0),
    KeyItem.POS: kv_pos,
    KeyItem.Q_ROW: q_off[seq] - q_lead_b[seq],
    KeyItem.Q_LEAD: q_lead_b[seq],
    KeyItem.FIRST: first,
    KeyItem.STEPS: jnp.where(valid, steps, 0),
    KeyItem.MASKED: n_masked,
    KeyItem.Q_TILE_START: q_tile_start_b[q_seq],
    KeyItem.SEQ: seq,
    KeyItem.TILE: tile,
    KeyItem.TILES: n_kv_b[seq],
  }
  return jnp.stack([cols[c] for c in KeyItem], axis=1).astype(jnp.int32)


def side_tiles(x_skh, kv_offsets, block_kv):
  """First and last key tile of each sequence, zero outside: `[b+1,2,m,k,h]`.

  Tile `f` of sequence `j` starts at packed row
  `kv_offsets[j] - lead_j + f * block_kv` (8-aligned grid); its rows outside
  the sequence are zero. Entry `b` (buffer-tail pseudo-sequence) is zeros.
  """
  kv_off = jnp.asarray(kv_offsets, jnp.int32)
  kv_off = jnp.concatenate([kv_off, kv_off[-1:]])
  length = kv_off[1:] - kv_off[:-1]
  lead = lead_rows(kv_off[:-1], mosaic.ALIGN)
  total = jnp.maximum(pl.cdiv(length + lead, block_kv), 1)
  first_pos = jnp.stack([-lead, (total - 1) * block_kv - lead], axis=1)
  pos = first_pos[:, :, None] + jnp.arange(block_kv, dtype=jnp.int32)
  valid = (pos >= 0) & (pos < length[:, None, None])  # [b+1, 2, m]
  idx = jnp.where(valid, kv_off[:-1, None, None] + pos, 0)
  return jnp.where(valid[..., None, None], x_skh[idx], 0).astype(x_skh.dtype)


def deal_items(
  items,
  groups: int,
  persistent: bool,
  num_sms: int | None,
  swaps: int = 0,
  steps_per_item=1,
):
  """(CTAs per group, `int32[w, j]` item of each CTA's j-th turn, `int32[w]`
  turns per CTA) for a kernel over a `query_items` or `key_items` table
  (items without valid rows come last). Persistent: about `num_sms` CTAs
  (`mosaic.num_sms`) over all `groups`, each walking the longest-first list
  dealt zig-zag (`deal`), then `swaps` rounds of `pair_swaps`; otherwise
  one CTA per item."""
  num_items = items.shape[0]
  real = items[:, QueryItem.HI] > items[:, QueryItem.LO]
  if not persistent:
    dealt = jnp.arange(num_items, dtype=jnp.int32)[:, None]
    return num_items, dealt, real.astype(jnp.int32)
  workers = persistent_workers(groups, mosaic.num_sms(num_sms), num_items)
  num_real = jnp.sum(real).astype(jnp.int32)
  dealt, counts = deal(num_items, num_real, workers, 1)
  if swaps:
    # Cost of an item: its steps (times the heads it walks in the dK/dV
    # kernel) plus one for its loads and stores.
    cost = items[:, QueryItem.STEPS] * steps_per_item + 1
    dealt = pair_swaps(dealt, counts, cost, swaps)
  return workers, dealt, counts


def load_kv_tile(ref, side, dst, bar, i, item, bkv, kv_head, split=1):
  """In a kernel: TMA of key/value tile `i` of an item (`(first packed
  row, _, tiles of the sequence's grid, sequence)`) into `dst`: the first
  and last tile of a sequence from its zero-filled side buffer
  (`side_tiles`), the others straight from the packed buffer. `split > 1`:
  the grid and side tiles are `split * bkv` rows and tile `i` is part
  `i % split` of grid tile `i // split` (the jagged dQ kernel's 64-key
  steps on the forward's tables).
  """
  kv_row, _, kv_total, seq = item
  big = lax.div(i, split) if split > 1 else i
  from_side = (big == 0) | (big == kv_total - 1)

  @pl.when(from_side)
  def _():
    which = jnp.where(big == 0, 0, 1)
    rows = slice(None)
    if split > 1:
      rows = pl.ds(pl.multiple_of(lax.rem(i, split) * bkv, bkv), bkv)
    plgpu.copy_gmem_to_smem(side.at[seq, which, rows, kv_head], dst, bar)

  @pl.when(jnp.logical_not(from_side))
  def _():
    rows = pl.ds(mosaic.aligned(kv_row + i * bkv), bkv)
    plgpu.copy_gmem_to_smem(ref.at[rows, kv_head], dst, bar)
