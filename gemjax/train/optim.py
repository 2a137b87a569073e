"""Optimizers: AdamW for dense parameters, row-wise Adagrad for tables.

Embedding tables are huge and sparsely touched: a step updates only the rows
its batch looked up. Row-wise Adagrad keeps one accumulator per row (the mean
of the squared gradient over the row's columns), so its state is `[v]`
instead of Adam's `2 x [v, e]`, and an untouched row (zero gradient) neither
moves nor changes its accumulator.

Gradients are clipped by their global norm first, then dense parameters get
AdamW with linear warm-up and cosine decay.
"""

import jax
import jax.numpy as jnp
import optax


def rowwise_adagrad(
  learning_rate: float, initial_accumulator: float = 0.1, eps: float = 1e-10
) -> optax.GradientTransformation:
  def init(params):
    return jax.tree.map(
      lambda p: jnp.full(p.shape[:1], initial_accumulator, jnp.float32), params
    )

  def update(grads, acc, params=None):
    del params
    acc = jax.tree.map(
      lambda a, g: a + jnp.mean(jnp.square(g.astype(jnp.float32)), axis=-1),
      acc,
      grads,
    )
    updates = jax.tree.map(
      lambda g, a: (-learning_rate * g / jnp.sqrt(a + eps)[:, None]).astype(
        g.dtype
      ),
      grads,
      acc,
    )
    return updates, acc

  return optax.GradientTransformation(init, update)


def is_table(path) -> bool:
  return any(getattr(k, "key", None) == "tables" for k in path)


def make_optimizer(cfg) -> optax.GradientTransformation:
  """`cfg` is a `TrainConfig`."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    cfg.learning_rate,
    max(cfg.warmup_steps, 1),
    max(cfg.steps, cfg.warmup_steps + 1),
    end_value=cfg.learning_rate * 0.05,
  )
  labels = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, _: "table" if is_table(path) else "dense", params
  )
  return optax.chain(
    optax.clip_by_global_norm(cfg.grad_clip_norm),
    optax.multi_transform(
      {
        "dense": optax.adamw(schedule, weight_decay=cfg.weight_decay),
        "table": rowwise_adagrad(
          cfg.embedding_learning_rate, cfg.embedding_initial_accumulator
        ),
      },
      labels,
    ),
  )
