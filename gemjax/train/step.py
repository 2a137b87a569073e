"""The train and eval steps over a stacked batch of data-parallel shards.

A global batch is `S` jagged batches stacked on a leading axis (one per data
shard, offsets local to each). The step `vmap`s the model over that axis, so
the model only ever sees one jagged batch, and `sharding` splits the axis over
devices. Losses are summed over valid candidates of every shard and divided
by the global count, so the result does not depend on how the batch is split
across devices.

The training state is a plain dict: `params`, `opt_state`, `step`, `rng`.
"""

import jax
import jax.numpy as jnp
import optax


def candidate_mask(batch):
  """`[..., c]` True for candidate rows that hold data."""
  c = batch.labels.shape[-2]
  return jnp.arange(c) < batch.cand_offsets[..., -1:]


def forward(model_def, params, batch, *, max_len, max_cands, key=None):
  """Stacked batch -> logits `[S, c, tasks]`."""
  model = model_def.bind(params)
  s = batch.offsets.shape[0]
  keys = jax.random.split(key, s) if key is not None else None

  def one(b, k):
    return model(b, max_len=max_len, max_cands=max_cands, key=k)

  if keys is None:
    return jax.vmap(lambda b: one(b, None))(batch)
  return jax.vmap(one)(batch, keys)


def loss_fn(params, batch, key, *, model_def, max_len, max_cands):
  logits = forward(
    model_def, params, batch, max_len=max_len, max_cands=max_cands, key=key
  )
  mask = candidate_mask(batch)[..., None]  # [S, c, 1]
  per = optax.sigmoid_binary_cross_entropy(logits, batch.labels)
  count = jnp.maximum(jnp.sum(mask), 1)
  task_loss = jnp.sum(jnp.where(mask, per, 0), axis=(0, 1)) / count
  return jnp.sum(task_loss), task_loss


def train_step(state, batch, *, model_def, tx, max_len, max_cands):
  key = jax.random.fold_in(state["rng"], state["step"])
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, task_loss), grads = grad_fn(
    state["params"],
    batch,
    key,
    model_def=model_def,
    max_len=max_len,
    max_cands=max_cands,
  )
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  new_state = dict(
    state, params=params, opt_state=opt_state, step=state["step"] + 1
  )
  metrics = {
    "loss": loss,
    "task_loss": task_loss,
    "grad_norm": optax.global_norm(grads),
  }
  return new_state, metrics


def eval_step(params, batch, *, model_def, max_len, max_cands):
  """Probabilities `[S, c, tasks]` (f32)."""
  return jax.nn.sigmoid(
    forward(model_def, params, batch, max_len=max_len, max_cands=max_cands)
  )
