"""Work-list helpers of pallas_kernels/schedule.py (pure jnp, any backend)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import schedule


@pytest.mark.parametrize("n", [0, 1, 7, 1057])
@pytest.mark.parametrize("by_compare", [True, False])
def test_stable_order_is_a_stable_argsort(n, by_compare):
  # compare_max=-1: the long-list path (XLA's sort).
  order = functools.partial(
    schedule.stable_order, compare_max=4096 if by_compare else -1
  )
  rng = np.random.default_rng(n)
  # Few distinct costs (many ties), negative keys, and the padding key.
  key = rng.integers(-40, 3, n).astype(np.int32)
  key[rng.random(n) < 0.2] = np.iinfo(np.int32).max
  key = jnp.asarray(key)
  jaxpr = str(jax.make_jaxpr(order)(key))
  assert (" sort[" in jaxpr) == (not by_compare)
  got = np.asarray(order(key))
  np.testing.assert_array_equal(got, np.argsort(key, kind="stable"))


def test_zigzag_balances_sorted_costs():
  cost = np.sort(np.random.default_rng(0).integers(1, 100, 40))[::-1]
  deal = np.asarray(schedule.zigzag_assignment(40, 8))
  per_worker = [cost[col[col < 40]].sum() for col in deal.T]
  assert max(per_worker) - min(per_worker) <= cost.max()


def test_fold_factor_and_layout():
  assert schedule.fold_factor(4, 16, 64) == 4
  assert schedule.fold_factor(4, 32, 64) == 2
  assert schedule.fold_factor(4, 64, 64) == 1
  assert schedule.fold_factor(3, 16, 64) == 3
  assert schedule.fold_factor(6, 16, 64) == 3  # largest divisor that fits
  assert schedule.fold_factor(4, 0, 64) == 4
  assert schedule.fold_factor(4, None, 64) == 1
  assert schedule.fold_factor(1, 2, 64) == 1
  x = jnp.arange(5 * 8 * 3).reshape(5, 8, 3)
  g = 4  # 8 query heads over 2 KV heads
  for f in (1, 2, 4):
    y = schedule.fold_heads(x, f, 2)
    assert y.shape == (5 * f, 8 // f, 3)
    np.testing.assert_array_equal(schedule.unfold_heads(y, f, 2), x)
    for r, j, i in ((0, 0, 0), (3, 1, 2), (4, 1, 3)):
      # Row r of head j g + i -> row r f + i % f of head j (g / f) + i // f,
      # whose KV head ((j (g / f) + i // f) // (g / f)) is still j.
      np.testing.assert_array_equal(
        y[r * f + i % f, j * (g // f) + i // f], x[r, j * g + i]
      )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("by_sequence", [True, False])
def test_per_sequence_cost_gives_the_item_sort_list(
  seed, by_sequence, monkeypatch
):
  """`seq_cost` (sequences ordered, no item sort) builds exactly the list
  that sorting the items by the same cost builds, padding items included:
  zero-length sequences, a buffer tail, ties, one long sequence.
  `by_sequence=False`: past `RANK_BY_COMPARE_MAX` sequences it falls back
  to the item sort."""
  if not by_sequence:
    monkeypatch.setattr(schedule, "RANK_BY_COMPARE_MAX", 0)
  rng = np.random.default_rng(seed)
  b = int(rng.integers(1, 12))
  lens = rng.integers(0, 300, b)
  lens[rng.random(b) < 0.3] = 0
  lens[0] = 2048 if seed % 2 else lens[0]
  off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  capacity = int(off[-1]) + int(rng.integers(0, 150))
  work = jnp.asarray(rng.integers(0, 4, b + 1).astype(np.int32))
  for block, align in ((64, 8), (128, 8), (64, 1)):
    got = schedule.jagged_tile_schedule(
      off, capacity, block, align=align, seq_cost=lambda s: work[s]
    )
    want = schedule.jagged_tile_schedule(
      off, capacity, block, align=align, cost=lambda s, t: work[s]
    )
    for name, g, w in zip(got._fields, got, want, strict=True):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), name)
      assert g.dtype == w.dtype, name
    build = functools.partial(
      schedule.jagged_tile_schedule,
      capacity=capacity,
      block=block,
      align=align,
      seq_cost=lambda s: work[s],
    )
    jaxpr = str(jax.make_jaxpr(build)(off))
    sorted_items = "scatter" in jaxpr or "cumsum" in jaxpr
    assert sorted_items == (not by_sequence)


def test_cost_and_seq_cost_are_exclusive():
  with pytest.raises(ValueError, match="not both"):
    schedule.jagged_tile_schedule(
      np.array([0, 5], np.int32), 8, 64, cost=lambda s, t: s,
      seq_cost=lambda s: s,
    )  # fmt: skip


def test_pair_swaps_keeps_items_and_narrows_the_busiest():
  # Costs like the dK/dV kernel's on log-normal traffic (many equal, a few
  # padding items past the real ones): every real item stays dealt exactly
  # once, each worker's real steps stay a prefix of its row (counts
  # unchanged), and no round raises the busiest worker's load.
  rng = np.random.default_rng(0)
  lens = np.clip(rng.lognormal(np.log(1100), 0.6, 32), 1, 2048).astype(int)
  costs = np.concatenate(
    [[-(-n // 64) * 4 + 1] * -(-n // 128) for n in lens]
  ).astype(np.int32)
  costs = np.sort(costs)[::-1]
  real, pad, w = len(costs), 7, 66
  dealt, counts = schedule.deal(real + pad, real, w, 1)
  cost = jnp.asarray(np.concatenate([costs, np.full(pad, 10**6, np.int32)]))

  def loads_and_items(d):
    d, c = np.asarray(d), np.asarray(counts)
    rows = [d[i, : c[i]] for i in range(w)]
    return np.array([costs[r].sum() for r in rows]), np.sort(
      np.concatenate(rows)
    )

  before, items = loads_and_items(dealt)
  assert (items == np.arange(real)).all()
  last = before.max()
  for rounds in (1, 2, 3):
    after, items_after = loads_and_items(
      schedule.pair_swaps(dealt, counts, cost, rounds)
    )
    assert (items_after == np.arange(real)).all()
    assert after.sum() == before.sum() and after.max() <= last
    last = after.max()
  assert last < before.max()  # this deal had room: 5.5% -> 2.2% over mean
