"""Block attention: Mosaic GPU kernels against the plain-jnp reference (G3).

Every kernel case runs twice from one body (`conftest.py`'s `interpret`):
under Pallas's GPU interpret mode on the CPU (tiny shapes with every edge
case: empty sequences, length 1, lengths that are not a multiple of the
block (zero-filled last block), sequences starting off the 8-row grid,
one long sequence among short ones, the buffer tail), and compiled under
`-m gpu` on the H200, which adds real shapes (`test_gpu_real_shapes`). A
small `num_sms` makes each persistent CTA walk several tiles.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.block_attention import (
  block_attention,
  block_attention_reference,
  sliding_window_reference,
)
from pallas_kernels.block_attention import mosaic_gpu as mg
from pallas_kernels.block_attention.op import (
  IMPLEMENTATIONS,
  block_attention_mosaic,
  block_offsets,
  rope_in_blocks,
)
from pallas_kernels.block_attention.reference import positions, rope_reference
from tests.pallas_kernels import attention_cases as cases

SMALL = mg.BlockSizes(num_sms=2)


def _check_case(lens, *, n, kh, h, dtype, tail, seed, interpret, **kw):
  off = cases.offsets(lens)
  t = int(off[-1]) + tail
  q, k, v, do = cases.inputs(seed, t, t, n, kh, h, dtype)
  kw["max_len"] = max(int(np.diff(off).max()), 1)
  block_sizes = kw.pop("block_sizes", None)

  def ours(q, k, v):
    return block_attention_mosaic(
      q, k, v, off, block_sizes=block_sizes, interpret=interpret, **kw
    )

  def ref(q, k, v):
    return block_attention_reference(q, k, v, off, **kw)

  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  got = [np.asarray(x, np.float32) for x in cases.fwd_bwd(ours)(q, k, v, do)]
  with jax.default_matmul_precision("highest"):
    want = [np.asarray(x) for x in cases.fwd_bwd(ref)(*f32)]
  for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
    assert np.isfinite(g).all(), name
    err = cases.rel_err(g, w)
    assert err < cases.REL_TOL[dtype], (name, err)
  # The buffer tail is exactly zero in the output and every gradient.
  for x in got:
    assert not x[int(off[-1]) :].any()


def test_block64_rope_gqa(interpret):
  # Blocks of 64 with RoPE fused (head dim 128), two query heads per KV
  # head (the two consumer warpgroups split them). Lengths: 70 (a full
  # block and a zero-filled partial one), 0, 1, 130 (one long), 9; starts
  # off the 8-row grid; 5 tail rows.
  _check_case(
    [70, 0, 1, 130, 9],
    n=2,
    kh=1,
    h=128,
    dtype=jnp.bfloat16,
    tail=5,
    seed=1,
    block=64,
    rope=10_000.0,
    block_sizes=SMALL,
    interpret=interpret,
  )


def test_block32_causal_fused_rope(interpret):
  # Fused RoPE (head dim 128) under both masks the kernels build: blocks
  # of 32 (block-diagonal in each 64-row tile) and causal. Positions up to
  # 199, so rotating at tile positions differs from sequence positions in
  # every value and agrees only through the scores. Rotation in f32 (the
  # other fused-RoPE case takes the default, the input dtype).
  _check_case(
    [200, 1, 37],
    n=2,
    kh=1,
    h=128,
    dtype=jnp.bfloat16,
    tail=4,
    seed=4,
    block=32,
    rope=10_000.0,
    causal=True,
    block_sizes=dataclasses.replace(SMALL, rope_f32=True),
    interpret=interpret,
  )


def test_rope_f32_setting_picks_the_rotation_arithmetic(interpret):
  # `BlockSizes.rope_f32` reaches the kernel: the forward rotates Q and K
  # in f32 or in the input dtype (default), whose outputs differ by the
  # second rounding of the rotated rows, the f32 ones nearer the
  # reference; both within the bf16 tolerance.
  off = cases.offsets([70, 9])
  t = int(off[-1]) + 3
  q, k, v, _ = cases.inputs(6, t, t, 2, 1, 128, jnp.bfloat16)
  with jax.default_matmul_precision("highest"):
    want = block_attention_reference(
      *(x.astype(jnp.float32) for x in (q, k, v)), off, rope=1e4
    )
  errs, outs = {}, {}
  for f32 in (True, False):
    bs = dataclasses.replace(SMALL, rope_f32=f32)
    o = jax.jit(
      lambda q, k, v, bs=bs: block_attention_mosaic(
        q, k, v, off, rope=1e4, block_sizes=bs, interpret=interpret
      )
    )(q, k, v)
    outs[f32] = np.asarray(o, np.float32)
    errs[f32] = cases.rel_err(outs[f32], np.asarray(want))
  assert not np.array_equal(outs[True], outs[False])
  assert errs[True] < errs[False] < cases.REL_TOL[jnp.bfloat16]


def test_block32_causal_odd_group(interpret):
  # Blocks of 32 (two per 64-row tile, block-diagonal mask), causal, fp16,
  # 3 query heads per KV head (uneven split over the warpgroups), head dim
  # 64 (RoPE applied by XLA before the kernel).
  _check_case(
    [45, 1, 0, 100],
    n=3,
    kh=1,
    h=64,
    dtype=jnp.float16,
    tail=3,
    seed=2,
    block=32,
    rope=500.0,
    causal=True,
    block_sizes=SMALL,
    interpret=interpret,
  )


def test_block32_one_head(interpret):
  # Multi-head (not grouped) attention: the forward runs one consumer
  # warpgroup per CTA, the backward's two share each tile's one head (a
  # group of one). Blocks of 32, not
  # causal: the zero-filled keys of each half-tile block are subtracted
  # per row (lengths 3, 64, 65 and 40: partial first or second half).
  _check_case(
    [3, 64, 65, 40],
    n=1,
    kh=1,
    h=64,
    dtype=jnp.bfloat16,
    tail=0,
    seed=3,
    block=32,
    block_sizes=SMALL,
    interpret=interpret,
  )


@pytest.mark.slow
def test_block128_through_the_jagged_kernel(interpret):
  # Blocks of 128 run the jagged-attention kernel on the blocks as
  # sequences of their own (RoPE by XLA first), at head dim 128 with the
  # settings the op picks (`jagged_block_sizes`: 64-key steps). Lengths
  # 130 (a full block and a partial one), 1, 0, 70 (one partial block,
  # starting off the 8-row grid), an empty last sequence; 5 tail rows.
  _check_case(
    [130, 1, 0, 70, 0],
    n=2,
    kh=1,
    h=128,
    dtype=jnp.bfloat16,
    tail=5,
    seed=7,
    block=128,
    rope=10_000.0,
    interpret=interpret,
  )
  off = cases.offsets([3])
  x = jnp.zeros((3, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="jagged-attention kernel"):
    block_attention_mosaic(x, x, x, off, block=128, block_sizes=SMALL)


@pytest.mark.parametrize("block", [32, 64, 128])
def test_block_offsets_cut_every_sequence_into_blocks(block):
  rng = np.random.default_rng(block)
  lens = [0, 1, block, block + 1, 2 * block - 1, 5, 0, 3 * block]
  lens += list(rng.integers(0, 4 * block, 9))
  off = cases.offsets(lens)
  t = int(off[-1]) + 7
  max_len = max(lens)
  got = np.asarray(block_offsets(off, block, t, max_len))
  want = [0]
  for start, n in zip(off[:-1], lens):
    want += [int(start) + min(j + block, n) for j in range(0, n, block)]
  # Static length: the tighter of the two bounds; past the last block,
  # empty blocks at the end of the data.
  nb = min(len(lens) * -(-max_len // block), len(lens) + -(-t // block))
  assert len(want) - 1 <= nb and got.shape == (nb + 1,)
  np.testing.assert_array_equal(got[: len(want)], want)
  assert (got[len(want) :] == off[-1]).all()


@pytest.mark.parametrize("n", [2, 1])
def test_no_races_interpret(n):
  # The interpreter's race detector over the forward (two consumer
  # warpgroups with n=2, one with n=1) and the backward: raw tiles and
  # the query rings are refilled only after release, and the RoPE table
  # (loaded once) is read only after its load.
  off = cases.offsets([70, 0, 1, 9])
  t = int(off[-1]) + 5
  ks = jax.random.split(jax.random.key(5), 4)
  q = jax.random.normal(ks[0], (t, n, 128), jnp.bfloat16)
  k = jax.random.normal(ks[1], (t, 1, 128), jnp.bfloat16)
  v = jax.random.normal(ks[2], (t, 1, 128), jnp.bfloat16)
  do = jax.random.normal(ks[3], (t, n, 128), jnp.bfloat16)

  attn = lambda q, k, v: block_attention_mosaic(
    q,
    k,
    v,
    off,
    rope=1e4,
    max_len=128,
    block_sizes=SMALL,
    interpret=cases.RACE_PARAMS,
  )
  cases.assert_no_races(attn, q, k, v, do)


def test_work_items_cover_every_row_once():
  lens = [70, 0, 1, 130, 9, 64]
  off = cases.offsets(lens)
  t = int(off[-1]) + 11
  table, num_real = mg.work_items(off, t)
  table = np.asarray(table)[: int(num_real)]
  covered = np.zeros(t, int)
  for row, valid, tail in table:
    covered[row : row + valid] += 1
    seq = np.searchsorted(off, row, side="right") - 1
    if not tail:  # tiles start at block boundaries
      assert (row - off[seq]) % mg.TILE == 0
  np.testing.assert_array_equal(covered, 1)


def test_rope_table_matches_reference():
  h, theta = 128, 10_000.0
  cs = mg.rope_table(h, theta)
  assert cs.shape == (4, mg.TILE, h // 2) and cs.dtype == jnp.float16
  # Two f16 terms per value carry it to f32-like accuracy.
  planes = np.asarray(cs, np.float64)
  ang = np.arange(mg.TILE)[:, None] * theta ** (-np.arange(0, h, 2) / h)
  for fn, hi, lo in ((np.cos, *planes[0::2]), (np.sin, *planes[1::2])):
    assert np.abs(hi + lo - fn(ang)).max() < 2.0**-22
    assert np.abs(hi - fn(ang)).max() > 2.0**-14  # one term would not do
  # The high terms come first: the backward (and the default forward)
  # loads `cs[:2]` alone and rotates with f16-rounded cos and sin.
  exact = np.stack([np.cos(ang), np.sin(ang)])
  np.testing.assert_array_equal(planes[:2], exact.astype(np.float16))
  assert np.abs(planes[:2] - exact).max() < 2.0**-12
  # The rotation it gives (in f32, as the kernels' `rope_f32`) is the
  # reference's.
  pos = jnp.arange(mg.TILE)
  x = jax.random.normal(jax.random.key(0), (mg.TILE, 1, h))
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  f32 = cs.astype(jnp.float32)
  cos, sin = (f32[0] + f32[2])[:, None], (f32[1] + f32[3])[:, None]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  np.testing.assert_allclose(
    rotated, rope_reference(x, pos, theta), rtol=0, atol=1e-5
  )


@pytest.mark.parametrize(
  "block,causal", [(64, False), (32, False), (64, True), (128, True)]
)
def test_rope_at_block_positions_is_the_same_attention(block, causal):
  # Scores depend only on position differences, and both rows of a score
  # share a block, so Q and K may be rotated by their position inside a
  # block (XLA's `rope_in_blocks`: blocks of 128, head dim 64) or, for
  # blocks of 32 and 64, inside a 64-row tile (the fused kernels) instead
  # of in the sequence. Both must give the reference's outputs (f32,
  # positions up to 1,200, whose f32 angles are off by up to ~1e-4 rad in
  # the reference).
  off = cases.offsets([1200, 70, 1, 0, 130])
  t = int(off[-1]) + 3
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (t, 4, 128))
  k = jax.random.normal(ks[1], (t, 2, 128))
  v = jax.random.normal(ks[2], (t, 2, 128))
  kw = dict(block=block, causal=causal)
  rotated = {"block": rope_in_blocks(off, block, 1e4, q, k)}
  if block <= mg.TILE:
    pos = positions(jnp.asarray(off), t) % mg.TILE
    rotated["tile"] = [rope_reference(x, pos, 1e4) for x in (q, k)]
  with jax.default_matmul_precision("highest"):
    want = block_attention_reference(q, k, v, off, rope=1e4, **kw)
    for name, (q_r, k_r) in rotated.items():
      got = block_attention_reference(q_r, k_r, v, off, **kw)
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=name)


def test_sliding_window_reference_matches_dense():
  # Sliding window from dense masked attention, on the jagged layout.
  lens = [70, 0, 1, 20]
  off = cases.offsets(lens)
  t = int(off[-1]) + 2
  ks = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(ks[0], (t, 2, 16))
  k = jax.random.normal(ks[1], (t, 1, 16))
  v = jax.random.normal(ks[2], (t, 1, 16))
  pos = np.asarray(positions(off, t))
  seq = np.searchsorted(off, np.arange(t), side="right") - 1
  real = np.arange(t) < off[-1]
  for causal in (False, True):
    got = sliding_window_reference(q, k, v, off, window=8, causal=causal)
    d = pos[None, :] - pos[:, None]
    mask = (seq[:, None] == seq[None, :]) & (np.abs(d) <= 8) & real[None, :]
    if causal:
      mask &= d <= 0
    s = jnp.einsum("qnh,jh->nqj", q, k[:, 0]) / 4.0
    s = jnp.where(mask, s, -jnp.inf)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    want = jnp.einsum("nqj,jh->qnh", p, v[:, 0]) * real[:, None, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch():
  assert set(IMPLEMENTATIONS) == {"xla", "mosaic"}
  fn = dispatch.pick("block_attention", IMPLEMENTATIONS, None, "mosaic")
  want = "mosaic" if dispatch.hopper() else "xla"
  assert fn is IMPLEMENTATIONS[want]
  off = np.array([0, 3, 4], np.int32)
  x = jax.random.normal(jax.random.key(0), (4, 2, 8))
  # Head dim 8 has no kernel (for any block): the reference runs anywhere.
  np.testing.assert_allclose(
    block_attention(x, x[:, :1], x[:, :1], off, block=128),
    block_attention_reference(x, x[:, :1], x[:, :1], off, block=128),
  )
  with pytest.raises(ValueError, match="block=48"):
    block_attention(x, x[:, :1], x[:, :1], off, block=48)
  with pytest.raises(ValueError, match="unknown implementation"):
    block_attention(x, x[:, :1], x[:, :1], off, implementation="nope")


@pytest.mark.gpu
@pytest.mark.parametrize(
  "h,block,rope,causal,dtype",
  [
    (128, 64, 10_000.0, False, jnp.bfloat16),
    (128, 64, None, False, jnp.bfloat16),
    (128, 32, 10_000.0, True, jnp.bfloat16),
    (64, 64, None, False, jnp.float16),
    (64, 64, 10_000.0, True, jnp.bfloat16),
    (128, 128, 10_000.0, False, jnp.bfloat16),
    (64, 128, None, True, jnp.float16),
  ],
)
def test_gpu_real_shapes(h, block, rope, causal, dtype):
  """Compiled at real shapes (16 sequences of up to 2,048 rows, 8 heads),
  far too slow to interpret, with the default settings (132 CTAs)."""
  rng = np.random.default_rng(h + block)
  lens = rng.integers(1, 2048, 16)
  lens[:3] = [0, 1, 2048]
  _check_case(
    list(lens),
    n=8,
    kh=2,
    h=h,
    dtype=dtype,
    tail=37,
    seed=11,
    block=block,
    rope=rope,
    causal=causal,
    interpret=False,
  )
