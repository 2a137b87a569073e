"""The train and eval steps over a stacked batch of data-parallel shards.

A global batch is `S` jagged batches stacked on a leading axis (one per data
shard, offsets local to each). The step `vmap`s the model over that axis, so
the model only ever sees one jagged batch, and `sharding` splits the axis over
devices. Losses are summed over valid candidates of every shard and divided
by the global count, so the result does not depend on how the batch is split
across devices.

The training state is a plain dict: `params`, `opt_state`, `step`, `rng`.

Placement (`sharding.Placement`, optional): embedding rows are looked up for
all shards at once before the `vmap` (sharded tables, G7), and the DHEN
experts run on the stacked candidate features with one expert per GPU of a
node pair (G6). Without it every shard reads replicated tables itself.
"""

import jax
import jax.numpy as jnp
import optax

from gemjax.model.embeddings import gather_rows
from gemjax.model.layers import fp8_weight_hook, fp8_weight_mask


def candidate_mask(batch):
  """`[..., c]` True for candidate rows that hold data."""
  c = batch.labels.shape[-2]
  return jnp.arange(c) < batch.cand_offsets[..., -1:]


def forward(
  model_def, params, batch, *, max_len, max_cands, key=None, placement=None
):
  """Stacked batch -> logits `[S, c, tasks]`."""
  model = model_def.bind(params)
  s = batch.offsets.shape[0]
  keys = jax.random.split(key, s) if key is not None else None
  if placement is not None:
    # FSDP (G5): dense weights all-gathered for use, so every device runs
    # its shards data-parallel; tables and experts keep their own layouts,
    # FP8 layers' weights are gathered in 8 bits by the FP8 hook (G4).
    keep = fp8_weight_mask(model)
    has_fp8 = any(jax.tree.leaves(keep))

    def features(params, batch):
      # Per device, on its own shards (see `Placement.per_shard`).
      hook = placement.fp8_hook(manual=True) if has_fp8 else None
      with fp8_weight_hook(hook):
        local = model_def.bind(params)
        return jax.vmap(
          lambda b: local.features(b, max_len=max_len, max_cands=max_cands)
        )(batch)

    model = model_def.bind(
      placement.gather_dense(params, model_def.logical_axes, keep)
    )
    hook = placement.fp8_hook() if has_fp8 else None
    tables = params["embeddings"]["tables"]
    with fp8_weight_hook(hook):
      batch = gather_rows(tables, batch, placement.lookup)
      feats = placement.per_shard(features, model_def.logical_axes, keep)(
        params, batch
      )
      if model.dhen is not None:
        feats = model.dhen(feats, placement.run_experts)
      if keys is None:
        return jax.vmap(model.head)(feats)
      return jax.vmap(lambda f, k: model.head(f, key=k))(feats, keys)

  def one(b, k):
    return model(b, max_len=max_len, max_cands=max_cands, key=k)

  if keys is None:
    return jax.vmap(lambda b: one(b, None))(batch)
  return jax.vmap(one)(batch, keys)


def loss_fn(
  params, batch, key, *, model_def, max_len, max_cands, placement=None
):
  logits = forward(
    model_def,
    params,
    batch,
    max_len=max_len,
    max_cands=max_cands,
    key=key,
    placement=placement,
  )
  mask = candidate_mask(batch)[..., None]  # [S, c, 1]
  labels = batch.labels[..., model_def.label_columns]  # [S, c, tasks]
  per = optax.sigmoid_binary_cross_entropy(logits, labels)
  count = jnp.maximum(jnp.sum(mask), 1)
  task_loss = jnp.sum(jnp.where(mask, per, 0), axis=(0, 1)) / count
  return jnp.sum(task_loss), task_loss


def train_step(
  state, batch, *, model_def, tx, max_len, max_cands, placement=None
):
  key = jax.random.fold_in(state["rng"], state["step"])
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, task_loss), grads = grad_fn(
    state["params"],
    batch,
    key,
    model_def=model_def,
    max_len=max_len,
    max_cands=max_cands,
    placement=placement,
  )
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  new_state = dict(
    state, params=params, opt_state=opt_state, step=state["step"] + 1
  )
  metrics = {
    "loss": loss,
    "task_loss": task_loss,
    "grad_norm": optax.tree.norm(grads),
  }
  return new_state, metrics


def eval_step(params, batch, *, model_def, max_len, max_cands, placement=None):
  """Probabilities `[S, c, tasks]` (f32)."""
  return jax.nn.sigmoid(
    forward(
      model_def,
      params,
      batch,
      max_len=max_len,
      max_cands=max_cands,
      placement=placement,
    )
  )
