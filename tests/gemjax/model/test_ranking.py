"""The ranking model on jagged batches: isolation, edge cases, gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.config import AttentionConfig, ModelConfig
from gemjax.model.ranking import RankingModel
from tests.batches import random_batch

VOCAB = dict(
  item_id=64,
  category_id=12,
  action=4,
  ts_delta=16,
  ts_to_req=16,
  price=16,
  user_id=8,
)
CFG = ModelConfig(
  d_model=32,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  emb_dim=32,
  head_hidden=(32,),
)
MAX_LEN, MAX_CANDS, T, C = 9, 4, 24, 12


def make(cfg=CFG, seed=0):
  model = RankingModel(cfg, VOCAB, 3, rngs=nnx.Rngs(seed))
  graphdef, state = nnx.split(model, nnx.Param)
  return graphdef, state


def logits(graphdef, state, batch):
  model = nnx.merge(graphdef, state)
  return model(batch, max_len=MAX_LEN, max_cands=MAX_CANDS)


# The attention options (config only, no code changes): block attention,
# the sliding window, GDPA for candidates and pooled history queries.
OPTIONS = {
  "default": {},
  "block32": dict(attention=AttentionConfig(seq="block", block_size=32)),
  "sliding": dict(attention=AttentionConfig(seq="sliding", sliding_window=2)),
  "gdpa_pooled": dict(attention=AttentionConfig(cand="gdpa"), pooled_queries=2),
}


def test_attention_settings_keep_the_parameters():
  """`model.attention` groups what leaves the parameters as they are: every
  field off its default gives the same parameter tree, value for value."""
  other = AttentionConfig(
    seq="block", block_size=32, sliding_window=8, causal=True, rope=False,
    rope_theta=500.0, cand="gdpa", gdpa_activation="silu",
    gdpa_normalize="hstu", implementation="xla",
  )  # fmt: skip
  assert all(
    getattr(other, f.name) != f.default
    for f in dataclasses.fields(AttentionConfig)
  )
  _, a = make()
  _, b = make(dataclasses.replace(CFG, attention=other))
  a, b = nnx.to_pure_dict(a), nnx.to_pure_dict(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("lengths", [[0, 1, 9, 5], [9, 0, 0, 3], [1, 1, 1, 1]])
def test_requests_do_not_see_each_other(lengths, option):
  """Changing request 0's history never moves another request's scores."""
  g, st = make(dataclasses.replace(CFG, **OPTIONS[option]))
  cand_counts = [3, 2, 4, 3]
  b1 = random_batch(
    VOCAB, lengths, cand_counts, token_capacity=T, cand_capacity=C, seed=1
  )
  seq2 = {k: v.copy() for k, v in b1.seq.items()}
  n0 = lengths[0]
  rng = np.random.default_rng(7)
  for k, v in seq2.items():
    v[:n0] = rng.integers(0, VOCAB[k], n0)
    v[sum(lengths) :] = rng.integers(0, VOCAB[k], T - sum(lengths))  # tail
  b2 = dataclasses.replace(b1, seq=seq2)
  f = jax.jit(logits, static_argnums=0)
  o1, o2 = f(g, st, b1), f(g, st, b2)
  assert np.all(np.isfinite(o1)) and np.all(np.isfinite(o2))
  first = cand_counts[0]
  np.testing.assert_array_equal(
    o1[first : sum(cand_counts)], o2[first : sum(cand_counts)]
  )
  if n0:
    assert not np.allclose(o1[:first], o2[:first])


def test_zero_length_and_tail_get_zero_gradients():
  """Rows of the buffer tail get exactly zero gradient; everything finite."""
  g, st = make()
  lengths, cands = [0, 1, 7, 0], [2, 3, 1, 2]
  b = random_batch(
    VOCAB, lengths, cands, token_capacity=T, cand_capacity=C, seed=2
  )
  used = sum(lengths)
  seq = {k: v.copy() for k, v in b.seq.items()}
  # The tail reads item rows 60..63, which nothing else reads.
  seq["item_id"][:used] %= 60
  seq["item_id"][used:] = 60 + np.arange(T - used) % 4
  cand = dict(b.cand, item_id=b.cand["item_id"] % 60)
  b = dataclasses.replace(b, seq=seq, cand=cand)

  def loss(state):
    out = logits(g, state, b)
    return jnp.sum(out[: sum(cands)] ** 2)

  grads = jax.jit(jax.grad(loss))(st)
  leaves = jax.tree.leaves(grads)
  assert all(np.all(np.isfinite(x)) for x in leaves)
  item = np.asarray(grads["embeddings"]["tables"]["item"][...])
  np.testing.assert_array_equal(item[60:], 0)
  assert np.any(item[:60] != 0)


def test_layer_order_shares_blocks():
  """A looped order (O6) reuses block weights: same parameter count."""
  looped = dataclasses.replace(CFG, layer_order=(0, 1, 1))
  _, st_plain = make()
  _, st_loop = make(looped)
  size = lambda s: sum(x.size for x in jax.tree.leaves(s))
  assert size(st_plain) == size(st_loop)
  g, st = make(looped)
  b = random_batch(VOCAB, [3, 5], [2, 2], token_capacity=T, cand_capacity=C)
  g0, _ = make()
  assert not np.allclose(logits(g, st, b), logits(g0, st, b))


def test_bad_layer_order():
  with pytest.raises(ValueError, match="layer_order"):
    make(dataclasses.replace(CFG, layer_order=(0, 2)))
