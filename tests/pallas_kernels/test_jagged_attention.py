"""Jagged attention: Mosaic GPU kernels against the plain-jnp reference.

Every kernel case runs twice from one body (`conftest.py`'s `interpret`):
under Pallas's GPU interpret mode on the CPU (slow, so shapes are tiny but
keep every edge case: empty sequences, length 1, lengths that are not a
multiple of the tile or of the 8-row TMA alignment, one long sequence
among short ones, the buffer tail, cross-attention with empty key or query
sides, GQA with even and odd groups), and compiled under `-m gpu` on the
H200, which adds real shapes (`test_gpu_real_shapes`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch, jagged_attention, mosaic, schedule
from pallas_kernels.block_attention.reference import sliding_window_reference
from pallas_kernels.jagged_attention import mosaic_gpu as mg
from pallas_kernels.jagged_attention import op as jagged_op
from pallas_kernels.jagged_attention.op import (
  IMPLEMENTATIONS,
  jagged_attention_mosaic,
  mosaic_supports,
)
from pallas_kernels.jagged_attention.reference import (
  jagged_attention_reference,
)
from tests.pallas_kernels import attention_cases as cases


def _fwd_bwd(fn, q, k, v, do, q_off, kv_off, causal, **kw):
  max_len_q = max(int(np.diff(q_off).max()), 1)
  max_len_kv = max(int(np.diff(kv_off).max()), 1)

  def f(q, k, v):
    return fn(
      q,
      k,
      v,
      q_off,
      kv_off,
      causal=causal,
      max_len_q=max_len_q,
      max_len_kv=max_len_kv,
      **kw,
    )

  return [np.asarray(x, np.float32) for x in cases.fwd_bwd(f)(q, k, v, do)]


def _check_case(
  q_lens,
  kv_lens,
  *,
  n,
  kh,
  h,
  dtype,
  causal,
  tail,
  seed,
  block_sizes=None,
  window=None,
  interpret=True,
):
  q_off = cases.offsets(q_lens)
  kv_off = q_off if kv_lens is None else cases.offsets(kv_lens)
  t = int(q_off[-1]) + tail
  s = int(kv_off[-1]) + tail
  q, k, v, do = cases.inputs(seed, t, s, n, kh, h, dtype)
  got = _fwd_bwd(
    jagged_attention_mosaic,
    *(q, k, v, do, q_off, kv_off, causal),
    block_sizes=block_sizes,
    window=window,
    interpret=interpret,
  )
  with jax.default_matmul_precision("highest"):  # no TF32 in the oracle
    want = _fwd_bwd(
      jagged_attention_reference,
      *(x.astype(jnp.float32) for x in (q, k, v, do)),
      q_off,
      kv_off,
      causal,
      window=window,
    )
  for name, g, w in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
    assert np.isfinite(g).all(), name
    err = cases.rel_err(g, w)
    assert err < cases.REL_TOL[dtype], (name, err)
  # Rows the reference defines as zero are exactly zero (not just small):
  # the buffer tail, rows of sequences without keys, keys without queries.
  o, dq, dk, dv = got
  q_zero = np.ones(t, bool)
  kv_zero = np.ones(s, bool)
  for i in range(len(q_lens)):
    has_kv = kv_off[i + 1] > kv_off[i]
    has_q = q_off[i + 1] > q_off[i]
    q_zero[q_off[i] : q_off[i + 1]] = not has_kv
    kv_zero[kv_off[i] : kv_off[i + 1]] = not has_q
  assert not o[q_zero].any() and not dq[q_zero].any()
  assert not dk[kv_zero].any() and not dv[kv_zero].any()


# Interpret mode (CPU): tiny shapes, every edge case. Lengths: 70 (not a
# multiple of the 64-row tile), 0, 1, 9, and a long 130 among short ones;
# sequence starts land off the 8-row grid; 5 tail rows past offsets[-1].
SELF_LENS = [70, 0, 1, 130, 9]


def _check_self(seed, block_sizes, interpret, causal=True, window=None):
  """Self-attention over `SELF_LENS`, 2 heads over 1 KV head, D=64, fp16."""
  _check_case(
    SELF_LENS,
    None,
    n=2,
    kh=1,
    h=64,
    dtype=jnp.float16,
    causal=causal,
    tail=5,
    seed=seed,
    block_sizes=block_sizes,
    window=window,
    interpret=interpret,
  )


@pytest.mark.parametrize(
  "block_sizes",
  [
    mg.BlockSizes(num_sms=1),
    mg.BlockSizes(num_sms=1, bwd_pipeline=False, bwd_registers=240),
    mg.BlockSizes(dq_f32=True),
    mg.BlockSizes(dq_f32=True, dq_swizzle=False),
    mg.BlockSizes(
      fused_bwd=False, block_kv_dq=128, num_sms=1, fwd_overlap=True
    ),
    mg.BlockSizes(
      fused_bwd=False, block_kv_dq=64, persistent=False, bwd_pipeline=False
    ),
  ],
  ids=[
    "fused",
    "fused-serial",
    "fused-f32",
    "fused-f32-plain",
    "dq128-overlap",
    "dq64-per-item-serial",
  ],
)
def test_causal_self_attention(block_sizes, interpret):
  # Default: persistent forward (with one SM, one CTA walks every item: Q
  # prefetch, K/V ring and output stores run across item boundaries) and
  # the fused backward (dQ by reduce-add from the dK/dV kernel, in the
  # inputs' dtype or in f32, then with its staging swizzled or plain; dS
  # halves exchanged between the consumers;
  # by default two wgmmas per wait, dQ
  # queued behind dV and dK, or one at a time: "serial"). The unfused
  # backward's dQ kernel with 128-key steps reuses the forward's work list
  # and side tiles, with 64 it builds its own; one forward CTA per item.
  # "overlap": the forward's software-pipelined key loop (head dim 128's
  # default): its first tile alone, the last tile's P V after the loop.
  _check_self(1, block_sizes, interpret)


@pytest.mark.parametrize(
  "block_sizes,window",
  [
    (None, None),
    (mg.BlockSizes(fold_heads=False, fwd_overlap=True), None),
    (None, 6),
  ],
  ids=["heads_folded", "heads_apart-overlap", "window"],
)
def test_cross_attention_odd_group(block_sizes, window, monkeypatch, interpret):
  # Few candidate queries over a longer history (stage 2), with the same
  # edge cases on the key side: a sequence with keys but no queries (zero
  # dK/dV), one with queries but no keys (zero output), length 1, a long one;
  # a group of 3 query heads per KV head (one head per CTA). At most 5
  # queries: by default the 3 heads fold into rows (`schedule.fold_factor`
  # 3), so each sequence's queries fill one tile per KV head; not under a
  # sliding window (positions from each side's start), which reads rows'
  # positions.
  folds = cases.record_folds(monkeypatch)
  _check_case(
    [3, 0, 5, 2, 1],
    [140, 7, 0, 64, 1],
    n=3,
    kh=1,
    h=64,
    dtype=jnp.bfloat16,
    causal=False,
    tail=3,
    seed=3,
    block_sizes=block_sizes,
    window=window,
    interpret=interpret,
  )
  assert set(folds) == (set() if block_sizes or window else {3})


@pytest.mark.parametrize(
  "window,causal,block_sizes",
  [
    (5, False, mg.BlockSizes(num_sms=1)),
    (70, True, mg.BlockSizes(fused_bwd=False, block_kv_dq=64, num_sms=1)),
    (
      12,
      False,
      mg.BlockSizes(
        fused_bwd=False, block_kv_dq=128, num_sms=1, fwd_overlap=True
      ),
    ),
  ],
  ids=["w5-fused", "w70-causal-dq64", "w12-dq128-overlap"],
)
def test_sliding_window(window, causal, block_sizes, interpret):
  # A window narrower than a tile (rows of one query tile reach different
  # key tiles; some rows see no key of a tile they visit) and one wider,
  # causal, through the dQ kernel's 64-key steps (its own key range) or
  # its 128-key steps (the forward's); the sequence of 130 has query tiles
  # whose windows start past its first key tile.
  _check_self(3, block_sizes, interpret, causal=causal, window=window)


def test_window_reference_matches_banded_reference():
  """The jagged reference's window equals the block module's banded XLA
  sliding window (two independent formulations), causal and not."""
  off = cases.offsets(SELF_LENS)
  t = int(off[-1]) + 3
  q, k, v, _ = cases.inputs(5, t, t, 4, 2, 16, jnp.float32)
  for causal in (False, True):
    for window in (0, 3, 64):
      want = sliding_window_reference(
        q, k, v, off, window=window, causal=causal, max_len=130
      )
      got = jagged_attention_reference(
        q, k, v, off, causal=causal, window=window, max_len_q=130,
        max_len_kv=130,
      )  # fmt: skip
      np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  with pytest.raises(ValueError, match="window"):
    jagged_attention_reference(q, k, v, off, window=-1)


def _surplus_identity(s_x, z):
  """Zero-fill + surplus subtraction, in f32 numpy, stabilized form.

  `s_x`: scores `c * q . k` of one row (log2 units), `z` zero-filled keys.
  Returns the normalized weights of the real keys.
  """
  s_all = np.concatenate([s_x, np.zeros(z, np.float32)]).astype(np.float32)
  m = s_all.max()  # may be one of the zero-fill scores
  e = np.exp2(s_all - m)
  l_true = e.sum(dtype=np.float32) - np.float32(z) * np.exp2(-m)
  return e[: len(s_x)] / l_true


@pytest.mark.parametrize(
  "bs",
  [
    mg.BlockSizes(num_sms=3, q_deal_swaps=2, kv_deal_swaps=2),
    mg.BlockSizes(
      num_sms=3,
      q_deal_swaps=2,
      kv_deal_swaps=2,
      fused_bwd=False,
      block_kv_dq=128,
      fwd_overlap=True,
    ),  # fmt: skip
  ],
  ids=["fused", "dq128-overlap"],
)
def test_swapped_deal(bs, interpret):
  # `q_deal_swaps`, `kv_deal_swaps`: items move between the persistent
  # CTAs of the forward, the dQ kernel (unfused, as head dim 128's default)
  # and the dK/dV kernel (three CTAs for these lengths; the deal is checked
  # to change), so a CTA walks them in no particular order.
  lens = [94, 102, 151, 190, 6]
  off = cases.offsets(lens)
  t = -(-(int(off[-1]) + 5) // 8) * 8
  items, sched = schedule.query_items(
    off, off, t, block_q=64, block_kv=128, causal=False
  )
  k_items = schedule.key_items(
    off, off, t, sched.tile_start_b, block_q=64, block_kv=128, causal=False
  )
  for table, swaps, steps in (
    (items, bs.q_deal_swaps, 1),
    (k_items, bs.kv_deal_swaps, 2),
  ):
    assert not np.array_equal(
      schedule.deal_items(table, 1, True, bs.num_sms, swaps, steps)[1],
      schedule.deal_items(table, 1, True, bs.num_sms, 0, steps)[1],
    )
  _check_case(
    lens, None, n=2, kh=1, h=64, dtype=jnp.bfloat16, causal=False, tail=5,
    seed=8, block_sizes=bs, interpret=interpret,
  )  # fmt: skip


@pytest.mark.parametrize("causal,window", [(True, None), (False, 6)])
def test_forward_overlap_equals_ping_pong(causal, window, interpret):
  # The software-pipelined key loop (`fwd_overlap`) reorders when the
  # wgmmas run, not the arithmetic: same output and lse bit for bit, with
  # the causal diagonal and a window (every tile masked, some rows see no
  # key of a tile). The 300-long sequence walks three key tiles, so later
  # tiles raise rows' maxima and each overlapped step's rescale matters
  # (SELF_LENS's longest, 130, reaches a second tile for 9 rows only: a
  # dropped rescale passed its causal case).
  q_off = cases.offsets([70, 0, 1, 300, 9])
  t = int(q_off[-1]) + 5
  q, k, v, _ = cases.inputs(6, t, t, 2, 1, 64, jnp.bfloat16)
  outs = []
  for overlap in (False, True):
    static = mg._Static(
      causal=causal,
      scale=0.125,
      block_sizes=mg.BlockSizes(num_sms=1, fwd_overlap=overlap),
      interpret=mosaic.interpret_params(interpret),
      window=window,
    )
    # The op's forward rule, whose residuals hold the lse.
    _, res = jagged_op._fwd(static, q, k, v, q_off, q_off)
    o, lse = res[3:5]
    outs.append((o, lse))
  for a, b in zip(*outs, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("causal,fused", [(False, True), (True, False)])
def test_no_races_interpret(causal, fused):
  # The interpreter's race detector over the forward, dQ and dK/dV kernels:
  # every ring slot (K/V in the forward and dQ, Q/dO/lse/delta in dK/dV) is
  # handed back to the producer only after a proxy fence, and the
  # persistent backward kernels (fused here non-causal, unfused causal)
  # reload K/V or Q/dO/O only after their last reader. The unfused case
  # takes head dim 128's forward (`fwd_overlap`), whose software-pipelined
  # key loop releases each K slot after its Q K^T and each V slot after
  # the next step's.
  q_off = cases.offsets(SELF_LENS)
  t = int(q_off[-1]) + 5
  q, k, v, do = cases.inputs(4, t, t, 2, 1, 64, jnp.bfloat16)

  # One SM: the persistent CTAs (forward and backward kernels) walk
  # several items each, their rings and buffers running across items.
  attn = lambda q, k, v: jagged_attention_mosaic(
    q,
    k,
    v,
    q_off,
    causal=causal,
    block_sizes=mg.BlockSizes(
      num_sms=1, fused_bwd=fused, fwd_overlap=not fused
    ),
    interpret=cases.RACE_PARAMS,
  )
  cases.assert_no_races(attn, q, k, v, do)


def test_surplus_subtraction_identity():
  # Exact softmax of the real scores vs zero-fill + subtraction, with the true
  # max far above the fill (surplus ~ 2^-60, no effect), just above it, and
  # below it (the fill's 0 is the row max; cancellation stays tiny).
  rng = np.random.default_rng(0)
  for shift in (60.0, 0.5, -3.0, -8.0):
    s_x = (rng.normal(size=37) + shift).astype(np.float32)
    want = np.exp2(s_x - s_x.max())
    want /= want.sum()
    got = _surplus_identity(s_x, z=27)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=0)


def test_surplus_subtraction_kernel(interpret):
  # The kernel's zero-filled keys give score 0; make real scores either far
  # above 0 (the stabilized max removes the fill's weight) or all below 0
  # (the fill's 0 is the running max, the subtraction must be exact).
  lens = [45, 3, 20]  # the last key tiles are mostly fill, some lead rows
  off = cases.offsets(lens)
  t = int(off[-1])
  h = 64
  q0, k0, v, _ = cases.inputs(7, t, t, 2, 1, h, jnp.float32)
  direction = jnp.ones((h,), jnp.float32) / np.sqrt(h)
  k = 0.1 * k0 + direction  # every key points along `direction`
  for shift in (40.0, -4.0):  # real scores ~ shift, in log2 units
    q = 0.1 * q0 + direction * (shift * np.sqrt(h) / np.log2(np.e))
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = jax.jit(
      lambda *a: jagged_attention_mosaic(*a, off, interpret=interpret)
    )(q16, k16, v16)
    want = jagged_attention_reference(
      *(x.astype(jnp.float32) for x in (q16, k16, v16)), off
    )
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    assert cases.rel_err(got, want) < cases.REL_TOL[jnp.bfloat16], shift


def test_vmap(interpret):
  # The model may vmap the op over a leading data-shard axis, gradients
  # included (the fused backward writes dQ into a `jax.new_ref` buffer,
  # which must be batched too).
  lens = np.array([[9, 0, 5], [1, 7, 4]])
  off = np.stack([cases.offsets(x) for x in lens])
  t = 16
  q, k, v, do = cases.inputs(5, 2 * t, 2 * t, 2, 1, 64, jnp.bfloat16)
  q, k, v, do = (x.reshape(2, t, *x.shape[1:]) for x in (q, k, v, do))

  def fwd_bwd(fn, q, k, v, off, do):
    o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, off, causal=True), q, k, v)
    return (o, *vjp(do))

  ours = functools.partial(jagged_attention_mosaic, interpret=interpret)
  got = jax.jit(jax.vmap(lambda *a: fwd_bwd(ours, *a)))(q, k, v, off, do)
  for i in range(2):
    want = fwd_bwd(
      jagged_attention_reference,
      *(x[i].astype(jnp.float32) for x in (q, k, v)),
      off[i],
      do[i].astype(jnp.float32),
    )
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
      err = cases.rel_err(np.asarray(g[i], np.float32), np.asarray(w))
      assert err < cases.REL_TOL[jnp.bfloat16], (name, err)


@pytest.mark.parametrize("causal", [False, True])
def test_schedule_covers_every_row_once(causal):
  lens = [70, 0, 1, 130, 9, 2048, 5]
  kv_lens = [3, 140, 0, 64, 9, 2048, 8]
  q_off, kv_off = cases.offsets(lens), cases.offsets(kv_lens)
  t, s = int(q_off[-1]) + 11, int(kv_off[-1]) + 4
  table, sched = schedule.query_items(
    q_off, kv_off, t, block_q=64, block_kv=128, causal=causal
  )
  table = np.asarray(table)
  assert table.shape[0] == schedule.max_items(t, len(lens), 64, mosaic.ALIGN)
  covered = np.zeros(t, int)
  for q_row, lo, hi in table[:, :3]:
    assert q_row % mosaic.ALIGN == 0
    covered[q_row + lo : q_row + hi] += 1
  np.testing.assert_array_equal(covered, 1)  # every row, once, tail too
  cost = table[:, 7]
  real = table[:, 2] > table[:, 1]
  assert (np.diff(cost[real]) <= 0).all()  # longest first
  assert not real[real.sum() :].any()  # padding items last
  kv_table = np.asarray(
    schedule.key_items(
      q_off,
      kv_off,
      s,
      sched.tile_start_b,
      block_q=64,
      block_kv=128,
      causal=causal,
    )
  )
  covered = np.zeros(s, int)
  for kv_row, lo, hi in kv_table[:, :3]:
    covered[kv_row + lo : kv_row + hi] += 1
  np.testing.assert_array_equal(covered, 1)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 5, 64, 200])
def test_window_work_lists_reach_exactly_the_visible_pairs(
  window, causal, cross
):
  """Under a sliding window, a query tile's key tiles `[first, first +
  steps)` (forward, dQ) hold every key one of its valid rows sees and
  start and end on tiles holding one; a key tile's query tiles (dK/dV)
  likewise. Checked pair by pair against the positions, in numpy; `cross`:
  key sequences of other lengths (positions count from each side's start).
  """
  lens = [70, 0, 1, 130, 9, 700, 5]
  kv_lens = [3, 40, 0, 300, 9, 650, 0] if cross else lens
  off, kv_off = cases.offsets(lens), cases.offsets(kv_lens)
  t, s = int(off[-1]) + 11, int(kv_off[-1]) + 6
  bq, bkv = 64, 128
  table, sched = schedule.query_items(
    off, kv_off, t, block_q=bq, block_kv=bkv, causal=causal, window=window
  )
  table = np.asarray(table)

  def sees(p, j, n):
    ok = (0 <= j < n) and abs(p - j) <= window
    return ok and (j <= p or not causal)

  for row in table:
    q_row, lo, hi, q_pos, _, kv_len, kv_lead, steps = row[:8]
    first = row[11]
    if hi <= lo:
      continue
    rows = range(q_pos + lo, q_pos + hi)
    # The key-grid tile of every key some row sees.
    need = {
      (j + kv_lead) // bkv
      for p in rows
      for j in range(p - window, p + window + 1)
      if sees(p, j, kv_len)
    }
    got = set(range(first, first + steps))
    assert need == got, (row, need, got)
  kv_table = np.asarray(
    schedule.key_items(
      off, kv_off, s, sched.tile_start_b, block_q=bq, block_kv=bkv,
      causal=causal, window=window,
    )
  )  # fmt: skip
  for row in kv_table:
    kv_row, lo, hi, kv_pos, _, q_lead, first, steps, n_masked = row[:9]
    if hi <= lo:
      continue
    seq = row[10]
    n_q = lens[seq] if seq < len(lens) else 0
    n_kv = kv_lens[seq] if seq < len(lens) else 0
    need = {
      (p + q_lead) // bq
      for j in range(kv_pos + lo, kv_pos + hi)
      for p in range(j - window, j + window + 1)
      if 0 <= p < n_q and sees(p, j, n_kv)
    }
    assert need == set(range(first, first + steps)), (row, need)
    assert n_masked == steps


def test_dispatch():
  assert set(IMPLEMENTATIONS) == {"xla", "mosaic"}
  fn = dispatch.pick("jagged_attention", IMPLEMENTATIONS, None, "mosaic")
  want = "mosaic" if dispatch.hopper() else "xla"
  assert fn is IMPLEMENTATIONS[want]
  # f32 activations are not a Mosaic shape: the default falls back to XLA.
  q32 = jnp.ones((4, 2, 64), jnp.float32)
  assert not mosaic_supports(q32, q32[:, :1])
  assert mosaic_supports(
    q32.astype(jnp.bfloat16), q32[:, :1].astype(jnp.bfloat16)
  )
  out = jagged_attention(
    q32, q32[:, :1], q32[:, :1], np.array([0, 4], np.int32)
  )
  np.testing.assert_allclose(out, 1.0, rtol=1e-6)
  with pytest.raises(ValueError, match="unknown implementation"):
    jagged_attention(
      jnp.zeros((4, 2, 64)),
      jnp.zeros((4, 1, 64)),
      jnp.zeros((4, 1, 64)),
      np.array([0, 4], np.int32),
      implementation="nope",
    )
  # Head dims the kernels do not fit (192 and 256 lower for CUDA with
  # 298 / 396 KB of shared memory): a clear error, not a compile failure;
  # the default dispatch takes the reference for them.
  q192 = jnp.ones((4, 2, 192), jnp.bfloat16)
  with pytest.raises(ValueError, match="head dim 64 or 128, got 192"):
    jagged_attention_mosaic(
      q192, q192[:, :1], q192[:, :1], np.array([0, 4], np.int32)
    )
  assert not mosaic_supports(q192, q192[:, :1])
  with pytest.raises(ValueError, match="q_deal_swaps=-1 must be >= 0"):
    mg.BlockSizes(q_deal_swaps=-1)
  with pytest.raises(ValueError, match="kv_deal_swaps=-1 must be >= 0"):
    mg.BlockSizes(kv_deal_swaps=-1)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "h,dtype,causal,cross,window,block_sizes",
  [
    (64, jnp.bfloat16, False, False, None, None),
    (64, jnp.bfloat16, False, False, None, mg.BlockSizes(dq_f32=True)),
    (64, jnp.float16, True, False, None, None),
    (128, jnp.bfloat16, True, False, None, None),
    (128, jnp.float16, False, False, None, None),
    (64, jnp.bfloat16, False, True, None, None),
    (128, jnp.bfloat16, True, True, None, None),
    (128, jnp.bfloat16, False, "cands", None, None),
    (64, jnp.bfloat16, False, False, 64, None),
    (128, jnp.bfloat16, True, False, 200, None),
  ],
  ids=[
    "d64",
    "d64-dq-f32",
    "d64-causal-fp16",
    "d128-causal",
    "d128-fp16",
    "d64-cross",
    "d128-causal-cross",
    "d128-cands-folded",
    "d64-window64",
    "d128-causal-window200",
  ],
)
def test_gpu_real_shapes(h, dtype, causal, cross, window, block_sizes):
  """Compiled at real shapes (12 sequences of up to 2,048 rows, 8 heads),
  far too slow to interpret: the kernels' default settings (tiles, SM
  count, head dim 128's pipelines) over many tiles per CTA."""
  # In "d64-causal-fp16" the last sequence's last 64-row query tile ends 8
  # rows past the buffer: the fused backward's fp16 reduce-add into dQ
  # itself (no spare rows) relies on TMA dropping those rows.
  rng = np.random.default_rng(h + causal + 2 * bool(cross))
  b = 12
  q_lens = rng.integers(1, 1100, b)
  q_lens[:3] = [0, 1, 2048]
  kv_lens = None
  if cross:
    # "cands": at most 16 queries, so the 4 heads of a KV group fold into
    # rows (`schedule.fold_factor` 4); 40 do not fold.
    q_lens = rng.integers(0, 17 if cross == "cands" else 40, b)
    kv_lens = rng.integers(0, 1500, b)
    kv_lens[:2] = [0, 2048]
  _check_case(
    list(q_lens),
    None if kv_lens is None else list(kv_lens),
    n=8,
    kh=2,
    h=h,
    dtype=dtype,
    causal=causal,
    tail=37,
    seed=11,
    window=window,
    block_sizes=block_sizes,
    interpret=False,
  )
