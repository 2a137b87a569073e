"""Row-wise Adagrad for tables, AdamW for dense parameters."""

import jax.numpy as jnp
import numpy as np
import optax

from gemjax.config import TrainConfig
from gemjax.train.optim import make_optimizer, rowwise_adagrad


def test_rowwise_adagrad_leaves_untouched_rows_alone():
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  grad = np.zeros((6, 4), np.float32)
  grad[[1, 4]] = rng.normal(size=(2, 4))
  tx = rowwise_adagrad(0.1, initial_accumulator=0.1)
  state = tx.init(table)
  assert state.shape == (6,)  # one accumulator per row
  updates, state2 = tx.update(jnp.asarray(grad), state)
  moved = np.nonzero(np.any(np.asarray(updates) != 0, axis=1))[0]
  np.testing.assert_array_equal(moved, [1, 4])
  np.testing.assert_array_equal(
    np.asarray(state2)[[0, 2, 3, 5]], np.float32(0.1)
  )
  acc = 0.1 + np.mean(grad[1] ** 2)
  np.testing.assert_allclose(
    updates[1], -0.1 * grad[1] / np.sqrt(acc), rtol=1e-6
  )


def test_tables_and_dense_get_their_own_optimizer():
  params = {
    "embeddings": {"tables": {"item": jnp.ones((5, 4))}},
    "proj": {"w": jnp.ones((4, 3))},
  }
  tx = make_optimizer(TrainConfig(steps=10, warmup_steps=1))
  state = tx.init(params)
  grads = {
    "embeddings": {"tables": {"item": jnp.zeros((5, 4)).at[2].set(1)}},
    "proj": {"w": jnp.full((4, 3), 0.5)},
  }
  new = params
  for _ in range(2):  # the warm-up starts at learning rate 0
    updates, state = tx.update(grads, state, new)
    new = optax.apply_updates(new, updates)
  item = np.asarray(new["embeddings"]["tables"]["item"])
  # Only row 2 moved; the table has no weight decay (rows never shrink).
  np.testing.assert_array_equal(np.delete(item, 2, axis=0), 1.0)
  assert np.all(item[2] < 1)
  assert np.all(np.asarray(new["proj"]["w"]) < 1)
