"""GDPA: Mosaic GPU kernels against the plain-jnp reference (G2).

Every kernel case runs twice from one body (`conftest.py`'s `interpret`):
under Pallas's GPU interpret mode on the CPU (slow, so shapes are tiny,
but every case packs the edge cases: sequences without queries, without
keys, of length 1, lengths off the 64-row tile and the 8-row TMA grid, one
long sequence among short ones, and the buffer tail), and compiled under
`-m gpu` on the H200, which adds real shapes (`test_gpu_real_shapes`). A
small `num_sms` makes each persistent CTA walk several tiles, so the
outer-loop pipeline and resident keys are exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch, schedule
from pallas_kernels.gdpa import gdpa, gdpa_reference
from pallas_kernels.gdpa import mosaic_gpu as mg
from pallas_kernels.gdpa import mosaic_gpu_fwd as fwd
from pallas_kernels.gdpa.op import IMPLEMENTATIONS, gdpa_mosaic
from pallas_kernels.gdpa.reference import apply_activation
from tests.pallas_kernels import attention_cases as cases


def _check_case(
  q_lens, kv_lens, *, n, kh, h, dtype, tail, seed, interpret, **kw
):
  q_off, kv_off = cases.offsets(q_lens), cases.offsets(kv_lens)
  t = int(q_off[-1]) + tail
  s = int(kv_off[-1]) + tail
  q, k, v, do = cases.inputs(seed, t, s, n, kh, h, dtype)
  bounds = dict(
    max_len_q=max(int(np.diff(q_off).max()), 1),
    max_len_kv=max(int(np.diff(kv_off).max()), 1),
  )
  block_sizes = kw.pop("block_sizes", None)

  def ours(q, k, v):
    return gdpa_mosaic(
      q, k, v, q_off, kv_off, block_sizes=block_sizes, interpret=interpret,
      **bounds, **kw,
    )  # fmt: skip

  def ref(q, k, v):
    kw_ref = {a: b for a, b in kw.items() if a != "tanh"}
    return gdpa_reference(q, k, v, q_off, kv_off, **bounds, **kw_ref)

  got = [np.asarray(x, np.float32) for x in cases.fwd_bwd(ours)(q, k, v, do)]
  with jax.default_matmul_precision("highest"):
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = [np.asarray(x) for x in cases.fwd_bwd(ref)(*f32)]
  for name, g, w in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
    assert np.isfinite(g).all(), name
    err = cases.rel_err(g, w)
    assert err < cases.REL_TOL[dtype], (name, err)
  # Rows the reference defines as zero are exactly zero: the buffer tail,
  # queries of sequences without keys, keys of sequences without queries.
  o, dq, dk, dv = got
  q_zero = np.ones(t, bool)
  kv_zero = np.ones(s, bool)
  for i in range(len(q_lens)):
    q_zero[q_off[i] : q_off[i + 1]] = kv_off[i + 1] == kv_off[i]
    kv_zero[kv_off[i] : kv_off[i + 1]] = q_off[i + 1] == q_off[i]
  assert not o[q_zero].any() and not dq[q_zero].any()
  assert not dk[kv_zero].any() and not dv[kv_zero].any()


# Several tiles per CTA (2 SMs); dQ two ways: the dQ kernel recomputing X
# and dP, or read back from the dK/dV kernel's dS^T tiles (`dq_from_ds`,
# the default for 129-256 keys).
RECOMPUTE_DQ = mg.BlockSizes(
  num_sms=2, deal_chunk=2, dq_from_ds=False, dq_fused=False
)
FROM_DS = mg.BlockSizes(num_sms=2, deal_chunk=2, dq_from_ds=True)
# Narrow key tiles (the short-KV choice) and a 3-deep Q ring; dK/dV cuts
# each key tile's query stream in 3 parts (f32 partials; a sequence with
# one query tile leaves parts without work, which must write zeros) through
# a 3-deep (Q, dO) ring, and writes dS^T for dQ.
NARROW = mg.BlockSizes(
  num_sms=2,
  deal_chunk=2,
  block_kv=16,
  q_stages=3,
  dkv_split=3,
  dkv_stages=3,
  dq_from_ds=True,
)
# Split-K: each query tile's keys in 3 parts (f32 partial outputs), and
# dK/dV's query stream in 2.
# Heads not folded into rows (`schedule.fold_factor`), so the pooled test below
# runs one path each way.
SPLIT = mg.BlockSizes(
  num_sms=2,
  deal_chunk=2,
  block_kv=32,
  kv_split=3,
  dkv_split=2,
  fold_heads=False,
)


def _two_sms(**kw):
  return mg.BlockSizes(num_sms=2, deal_chunk=2, **kw)


# Cross-attention cases: longer query sides over short key sides, with
# the edge cases on both sides. Each: (query lengths, key lengths, heads,
# KV heads, head dim, activation, block sizes, key tiles the query-side
# kernels take: the forward's, then the dQ kernel's when it runs).
CROSS_CASES = {
  # Seq 1 has keys but no queries (zero dK/dV), seq 2 queries but no keys
  # (zero output), seq 3 one query, seq 0 a long one (70 rows: two query
  # tiles, not a multiple of 64). 2 query heads per KV head: two consumer
  # warpgroups share the keys. 16-row key tiles: seq 3's 66 keys stream
  # through the ring (5 tiles), the others stay resident.
  "narrow": (
    [70, 0, 1, 9, 3], [3, 5, 0, 66, 1], 2, 1, 64, "gelu", NARROW, [16],
  ),
  # Keys of 65-256 rows: the forward takes 128-row key tiles by default
  # (`kv_block`); seq 0's 200 keys (two tiles, resident in the 2-stage
  # ring) start off the 8-row grid, seq 2's 129 keys end one row into
  # their second tile, and lengths 0 and 1 sit beside them. dQ from dS^T,
  # or by the dQ kernel, which keeps 64-row tiles.
  "wide_from_ds": (
    [70, 3, 9, 1, 0], [200, 1, 129, 0, 65], 2, 1, 64, "gelu_tanh",
    _two_sms(dq_from_ds=True), [128],
  ),
  "wide_dq_kernel": (
    [70, 3, 9, 1, 0], [200, 1, 129, 0, 65], 2, 1, 64, "gelu_tanh",
    _two_sms(dq_from_ds=False, dq_fused=False), [128, 64],
  ),
  # dQ added by the dK/dV kernel (`dq_fused`): seq 0's 200 keys span two
  # 128-key tiles (dQ gets an add from each; the first starts off the
  # 8-row grid), seq 2's 66 keys leave the second warpgroup of their tile
  # without keys (it still takes its turns at dQ's columns), seq 4 has
  # queries but no keys and seq 3 keys but no queries. Keys outside a
  # sequence (other sequences' rows inside a key tile) must add nothing.
  # Head dim 64: the one column block goes to the warpgroups in turn; 128:
  # a block each, and each key tile's query stream cut in 2 parts.
  "fused_d64": (
    [70, 3, 9, 0, 5], [200, 1, 66, 7, 0], 4, 2, 64, "gelu",
    _two_sms(dq_fused=True), [128],
  ),
  "fused_d128_split": (
    [70, 3, 9, 0, 5], [200, 1, 66, 7, 0], 4, 2, 128, "gelu",
    _two_sms(dq_fused=True, dkv_split=2), [128],
  ),
}  # fmt: skip


@pytest.mark.parametrize("case", CROSS_CASES)
def test_cross_attention(monkeypatch, case, interpret):
  q_lens, kv_lens, n, kh, h, activation, bs, key_tiles = CROSS_CASES[case]
  seen = []
  kernel = fwd.query_kernel

  def spy(q, k, v, k_side, v_side, do, items, num_real, static):
    seen.append(static.block_sizes.block_kv)
    return kernel(q, k, v, k_side, v_side, do, items, num_real, static)

  monkeypatch.setattr(fwd, "query_kernel", spy)
  _check_case(
    q_lens,
    kv_lens,
    n=n,
    kh=kh,
    h=h,
    dtype=jnp.bfloat16,
    tail=3,
    seed=sorted(CROSS_CASES).index(case),
    activation=activation,
    block_sizes=bs,
    interpret=interpret,
  )
  # In order of first use (a trace may run the forward twice).
  assert list(dict.fromkeys(seen)) == key_tiles


def test_key_tile_and_query_layout_choice():
  assert [mg.kv_block(n) for n in (None, 1, 16, 17, 32, 64, 65, 256)] == [
    64, 16, 16, 32, 32, 64, 128, 128,
  ]  # fmt: skip
  assert mg.kv_block(257) == 64 and mg.kv_block(256, dq=True) == 64
  assert mg.kv_block(256, kv_stages=3) == 64  # a deeper ring of 64 rows
  bs = mg.BlockSizes
  # Head dim 128, two heads per CTA: the deepest Q ring (up to 3) beside the K/V
  # ring (2 stages of 64 or 128 keys) and the output buffer, whose
  # swizzled whole-tile view shares its memory; f32 partials (4-byte
  # output) and dQ's (Q, dO) pairs take more room, and f32 goes plain.
  layout = fwd.query_layout
  assert layout(8, 2, 128, bs(block_kv=64), False) == (2, 3, True)
  assert layout(8, 2, 128, bs(block_kv=128), False) == (2, 2, True)
  assert layout(8, 2, 128, bs(block_kv=64), False, 4) == (2, 3, False)
  assert layout(8, 2, 128, bs(block_kv=64), True) == (2, 2, True)
  assert layout(8, 2, 128, bs(block_kv=64, q_stages=1), False) == (2, 1, True)
  assert layout(3, 1, 128, bs(block_kv=64), False) == (1, 3, True)


@pytest.mark.parametrize(
  "block_sizes", [RECOMPUTE_DQ, SPLIT], ids=["streamed", "split_keys"]
)
def test_pooled_attention_gelu_tanh(block_sizes, interpret):
  # Pooled shape: a few (learned) queries over long histories, 130 keys =
  # three 64-row key tiles, more than the 2-stage ring holds (streamed,
  # not resident). Default scale on unit-normal inputs puts the GELU
  # inputs on both sides of the polynomial's range (fallback exercised).
  # RECOMPUTE_DQ takes the dQ kernel, on the 2 heads folded into rows
  # (at most 3 queries: `schedule.fold_factor` 2). SPLIT (dQ from dS^T)
  # cuts each query tile's keys in 3 parts of 32-row tiles (seq 0: 5
  # tiles -> parts of 1, 2, 2; seq 1: 7 keys, one tile -> two empty parts,
  # which must still write their zero partials; seq 3 without keys),
  # forward and dQ from dS^T (64-row key tiles: parts of 1, 1, 1) through
  # f32 partials.
  _check_case(
    [2, 1, 0, 3],
    [130, 7, 20, 0],
    n=2,
    kh=1,
    h=64,
    dtype=jnp.bfloat16,
    tail=3,
    seed=2,
    activation="gelu_tanh",
    tanh="poly",
    block_sizes=block_sizes,
    interpret=interpret,
  )


def test_pooled_attention_folds_heads_into_rows(monkeypatch, interpret):
  # 4 query heads per KV head and at most 16 queries per sequence: the op
  # folds the group into rows (`fold_factor` 4: one 64-row tile per
  # sequence and KV head). Lengths 16 (a full folded tile), 1, 0 and 5;
  # seq 2 has queries but no keys, seq 3 keys but no queries.
  folds = cases.record_folds(monkeypatch)
  _check_case(
    [16, 1, 5, 0],
    [40, 3, 0, 9],
    n=8,
    kh=2,
    h=64,
    dtype=jnp.bfloat16,
    tail=4,
    seed=5,
    activation="silu",
    normalize="hstu",
    block_sizes=mg.BlockSizes(num_sms=2, deal_chunk=2),
    interpret=interpret,
  )
  assert folds == [4]


@pytest.mark.parametrize(
  "lens,dtype,block_sizes,path",
  [
    ([9, 0, 70, 1], jnp.float16, FROM_DS, "ds"),
    (
      [330, 0, 1, 70],
      jnp.bfloat16,
      mg.BlockSizes(num_sms=2, deal_chunk=2),
      "fused",
    ),
  ],
  ids=["from_ds", "long_keys_fused"],
)
def test_self_attention_silu_hstu_odd_group(
  monkeypatch, lens, dtype, block_sizes, path, interpret
):
  # HSTU-style silu(x)/N self-attention (the 1/N inside dS), 3 query heads
  # per KV head (one head per CTA); lengths 0 and 1 share the buffer with
  # longer ones. dQ from dS^T, or, past ~256 keys (330: 6 key tiles of 64,
  # three of 128, so three adds per dQ row), by default added by the dK/dV
  # kernel itself (`dq_path`).
  paths = []
  choose = mg.dq_path
  monkeypatch.setattr(
    mg, "dq_path", lambda *a: paths.append(choose(*a)) or paths[-1]
  )
  _check_case(
    lens,
    lens,
    n=3,
    kh=1,
    h=64,
    dtype=dtype,
    tail=2,
    seed=3,
    activation="silu",
    normalize="hstu",
    block_sizes=block_sizes,
    interpret=interpret,
  )
  assert paths == [path]


def test_no_races_interpret():
  # The interpreter's race detector over the forward, dK/dV and dQ
  # kernels (all three dQ forms): every shared-memory buffer handed back to
  # the producer (K/V and Q rings, resident keys reused across tiles, the
  # (K, dS^T) ring) is ordered before its refill, with the Q slot handed
  # back early (after its last read) and split keys; the fused backward's
  # shared dS^T tiles, and (default forward) each consumer's output views.
  q_off, kv_off = cases.offsets([70, 0, 1, 9]), cases.offsets([3, 5, 0, 130])
  q, k, v, do = cases.inputs(
    4, int(q_off[-1]) + 5, int(kv_off[-1]) + 3, 2, 1, 64, jnp.bfloat16
  )
  split = dict(num_sms=2, deal_chunk=2, block_kv=32, q_stages=3, kv_split=2)
  for bs in (
    mg.BlockSizes(**split, dq_from_ds=True),
    mg.BlockSizes(**split, dq_from_ds=False, dq_fused=False),  # dQ kernel
    mg.BlockSizes(num_sms=2, deal_chunk=2, dq_fused=True),
  ):
    attn = lambda q, k, v, bs=bs: gdpa_mosaic(
      q,
      k,
      v,
      q_off,
      kv_off,
      block_sizes=bs,
      max_len_kv=130,
      interpret=cases.RACE_PARAMS,
    )
    cases.assert_no_races(attn, q, k, v, do)


def test_tanh_polynomial_error_on_its_range():
  u = jnp.linspace(-mg.TANH_POLY_RANGE, mg.TANH_POLY_RANGE, 200_001)
  err = jnp.abs(mg.tanh_poly(u) - jnp.tanh(u)).max()
  assert err <= mg.TANH_POLY_ERROR, err
  # The unchecked mode is the polynomial alone (right only on the range).
  np.testing.assert_allclose(
    mg.act(u, "gelu_tanh", "poly_unchecked"),
    0.5 * u * (1.0 + mg.tanh_poly(0.7978845608 * (u + 0.044715 * u**3))),
    rtol=1e-6,
    atol=1e-7,
  )
  # ... and the Taylor coefficients would not do on this range.
  taylor = u - u**3 / 3 + 2 * u**5 / 15
  assert jnp.abs(taylor - jnp.tanh(u)).max() > 10 * mg.TANH_POLY_ERROR


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_kernel_activations_match_reference(name):
  # The kernels' activation and derivative formulas (erf by A&S 7.1.26,
  # tanh by polynomial + fallback) against jax.nn and autodiff, over a
  # range far wider than QK-norm allows.
  x = jnp.linspace(-30.0, 30.0, 60_001)
  want = apply_activation(x, name)
  want_grad = jax.vmap(jax.grad(lambda y: apply_activation(y, name)))(x)
  for tanh in ("poly", "exact"):
    got = mg.act(x, name, tanh)
    got_grad = mg.act_grad(x, name, tanh)
    # Absolute error, scaled by max(1, |x|) (GELU ~ x for large x).
    scale = jnp.maximum(1.0, jnp.abs(x))
    tol = 2e-4 if tanh == "poly" and name == "gelu_tanh" else 2e-6
    assert (jnp.abs(got - want) / scale).max() <= tol, tanh
    assert (jnp.abs(got_grad - want_grad) / scale).max() <= 2 * tol, tanh
    both = mg.act_and_grad(x, name, tanh)
    np.testing.assert_allclose(both[0], got, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(both[1], got_grad, rtol=1e-6, atol=1e-6)
  zero = jnp.zeros((2,), jnp.float32)
  assert not mg.act(zero, name).any()  # a zero-filled key adds exactly 0


def test_work_table_covers_every_key_tile_once():
  # Split-K items: over all workers, every real query item's key tiles
  # [0, steps) are covered exactly once by its parts; padding never runs.
  rng = np.random.default_rng(0)
  num, num_real, parts, workers = 23, 17, 3, 4
  Q = schedule.QueryItem
  items = np.zeros((num, Q.TILE_ID + 1), np.int32)
  items[:, Q.ROW] = np.arange(num) * 64  # the item's identity
  items[:, Q.SEQ] = np.arange(num) // 3
  items[:, Q.TILE_ID] = np.arange(num) + 100
  # Key tiles: one count per sequence, as query_items gives.
  items[:num_real, Q.STEPS] = rng.integers(0, 9, num)[items[:num_real, Q.SEQ]]
  wt, counts = fwd.work_table(
    jnp.asarray(items), num_real, parts, workers, chunk=2, mcs=2
  )
  wt, counts = np.asarray(wt), np.asarray(counts)
  seen = {}
  for w in range(workers):
    for row in wt[w, : counts[w]]:
      first, steps = row[fwd.W_FIRST], row[fwd.W_STEPS]
      for tile in range(first, first + steps):
        key = (row[fwd.W_QROW], tile)
        assert key not in seen
        assert row[fwd.W_TILE] == row[fwd.W_QROW] // 64 + 100
        seen[key] = row[fwd.W_PART]
  want = {
    (i * 64, j) for i in range(num_real) for j in range(items[i, Q.STEPS])
  }
  assert set(seen) == want
  assert counts.sum() == parts * num_real
  # Resident keys only within one (sequence, part) run of <= mcs tiles.
  for w in range(workers):
    row = wt[w, : counts[w]]
    for j in range(1, len(row)):
      if row[j, fwd.W_REUSE]:  # the very key tiles the ring still holds
        for c in (fwd.W_SEQ, fwd.W_PART, fwd.W_FIRST, fwd.W_STEPS):
          assert row[j, c] == row[j - 1, c]
        assert row[j, fwd.W_STEPS] <= 2
      assert row[j - 1, fwd.W_RELEASE] == 1 - row[j, fwd.W_REUSE]
    # A worker's last item hands its keys back (the producer's final wait).
    assert len(row) == 0 or row[-1, fwd.W_RELEASE] == 1


@pytest.mark.parametrize("block_kv", [0, 48, 80, 320])
def test_block_sizes_reject_key_tiles_that_cannot_lower(block_kv):
  with pytest.raises(ValueError, match="block_kv"):
    mg.BlockSizes(block_kv=block_kv)


def test_deal_covers_every_item_once():
  num_items, workers, chunk = 37, 5, 3
  for num_real in (0, 1, 20, 37):
    dealt, counts = schedule.deal(num_items, num_real, workers, chunk)
    dealt, counts = np.asarray(dealt), np.asarray(counts)
    seen = np.concatenate([dealt[w, : counts[w]] for w in range(workers)])
    np.testing.assert_array_equal(np.sort(seen), np.arange(num_real))
    # Chunks of consecutive items stay together on one worker.
    for w in range(workers):
      row = dealt[w, : counts[w]]
      starts = row[::chunk]
      assert (starts % chunk == 0).all()


def test_dispatch():
  assert set(IMPLEMENTATIONS) == {"xla", "mosaic"}
  fn = dispatch.pick("gdpa", IMPLEMENTATIONS, None, "mosaic")
  want = "mosaic" if dispatch.hopper() else "xla"
  assert fn is IMPLEMENTATIONS[want]
  off = np.array([0, 4], np.int32)
  x = jnp.ones((4, 2, 8), jnp.float32)  # head dim 8: kernels do not apply
  np.testing.assert_allclose(
    gdpa(x, x[:, :1], x[:, :1], off, off),
    gdpa_reference(x, x[:, :1], x[:, :1], off, off),
  )
  with pytest.raises(ValueError, match="unknown implementation"):
    gdpa(x, x[:, :1], x[:, :1], off, off, implementation="nope")
  with pytest.raises(ValueError, match="activation"):
    gdpa(x, x[:, :1], x[:, :1], off, off, activation="relu")


@pytest.mark.gpu
@pytest.mark.parametrize(
  "shape,activation,normalize,h",
  [
    ("cross", "gelu", None, 128),
    ("cross", "gelu_tanh", None, 64),
    ("cross_fused", "gelu_tanh", None, 64),
    ("cross_fused", "gelu_tanh", None, 128),
    ("pooled", "silu", "hstu", 128),
    ("self", "gelu", None, 128),
  ],
)
def test_gpu_real_shapes(shape, activation, normalize, h):
  """Compiled at the seed's shapes (12 sequences of up to 2,048 queries or
  keys, 8 heads), far too slow to interpret, with the default settings;
  "cross_fused" adds dQ by the dK/dV kernel through TMA reduce-add (which
  interpret mode replaces by per-item slices) where the default reads it
  back from dS^T (pooled and self-attention take it by default)."""
  rng = np.random.default_rng(h + len(shape) + len(activation))
  b = 12
  bs = mg.BlockSizes(dq_fused=True) if shape == "cross_fused" else None
  if shape.startswith("cross"):
    q_lens = rng.integers(1, 2049, b)
    kv_lens = rng.choice([16, 64, 200, 256], b)
  elif shape == "pooled":
    q_lens = rng.integers(1, 33, b)
    kv_lens = np.clip(rng.lognormal(np.log(600), 0.7, b), 1, 2048).astype(int)
  else:
    q_lens = rng.integers(1, 1100, b)
    kv_lens = q_lens.copy()
  q_lens[:2], kv_lens[:2] = [0, 1], [5, 0]
  _check_case(
    list(q_lens),
    list(kv_lens),
    n=8,
    kh=2,
    h=h,
    dtype=jnp.bfloat16,
    tail=37,
    seed=11,
    activation=activation,
    normalize=normalize,
    block_sizes=bs,
    interpret=False,
  )


def test_dq_from_ds_default_range():
  # Read-back dQ by default only where measured (up to 256 keys, 5 tiles
  # with the lead rows); it needs the caller's static key bound.
  bs = mg.BlockSizes()
  assert [mg.use_dq_from_ds(bs, n) for n in (None, 1, 16, 64, 256, 330)] == [
    False,
    True,
    True,
    True,
    True,
    False,
  ]
  assert not mg.use_dq_from_ds(mg.BlockSizes(dq_from_ds=False), 256)


def test_dq_path():
  # dS^T read back up to ~256 keys, dQ added by the dK/dV kernel past
  # them (or without a key bound), the dQ kernel only when asked for.
  bs = mg.BlockSizes
  assert [mg.dq_path(bs(), n) for n in (None, 16, 256, 330, 2048)] == [
    "fused", "ds", "ds", "fused", "fused",
  ]  # fmt: skip
  assert mg.dq_path(bs(dq_fused=True), 64) == "fused"
  assert mg.dq_path(bs(dq_from_ds=False), 64) == "fused"
  assert mg.dq_path(bs(dq_fused=False), 2048) == "kernel"
  assert mg.dq_path(bs(dq_fused=False), 64) == "ds"
  with pytest.raises(ValueError, match="one dQ path"):
    bs(dq_fused=True, dq_from_ds=True)
  with pytest.raises(ValueError, match="max_len_kv"):
    mg.use_dq_from_ds(mg.BlockSizes(dq_from_ds=True), None)
