"""Embedding tables with one shared slice per feature (O9).

A feature and the same feature inside the sequence look up the same rows: the
target item's id and the history items' ids both index table `item`, so
attention compares like with like instead of learning a map between two
separately trained embeddings (the seed: CTR AUC +0.1%). Each table is one
slice of width `emb_dim` (a multiple of 32, as the seed rounds it).

Tables are `[v, e]` parameters with logical axes `("table_rows",
"table_dim")`; the embedding-sharding strategies of `sharding/` place them.

Sharded lookups (G7) need the whole stacked batch (ids of every data shard,
split over devices), while the model runs on one shard at a time. So the
train step looks rows up first, for all shards at once (`gather_rows`: one
exchange per table, history and candidate columns together, O9), and hands
the model `Rows` in place of the id columns; `Embeddings.lookup` returns
them as they are. Called with plain ids, `lookup` reads the table itself.
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.model.layers import param

# Which table each feature column reads; seq and candidate columns of the same
# name share a table.
FEATURE_TABLE = {
  "item_id": "item",
  "category_id": "category",
  "action": "action",
  "ts_delta": "ts_delta",
  "ts_to_req": "ts_to_req",
  "price": "price",
}


def table_sizes(vocab_sizes: dict[str, int]) -> dict[str, int]:
  """Rows per table from rows per feature; shared features must agree.

  Only features with a table here are embedded; others (e.g. `user_id`,
  used by the metrics) are ignored.
  """
  out: dict[str, int] = {}
  for feature, table in FEATURE_TABLE.items():
    if feature not in vocab_sizes:
      raise ValueError(f"vocab_sizes lacks feature {feature!r}")
    rows = vocab_sizes[feature]
    if out.setdefault(table, rows) != rows:
      raise ValueError(f"table {table!r}: {out[table]} rows vs {rows}")
  return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
  """Rows already looked up for one id column: `[..., e]`.

  Stands in for the id column inside a batch; `shape` is the ids' shape, so
  code that sizes buffers from id columns keeps working.
  """

  rows: jax.Array

  @property
  def shape(self):
    return self.rows.shape[:-1]


def gather_rows(tables: dict, batch, lookup_fn):
  """`batch` with every embedded `seq`/`cand` column replaced by its `Rows`.

  `lookup_fn(table_ve, [ids, ...]) -> [rows, ...]` serves all columns of
  one table in one call (e.g. `sharding.Placement.lookup`).
  """
  columns = collections.defaultdict(list)  # table -> [(part, feature)]
  for part in ("seq", "cand"):
    for feature in getattr(batch, part):
      if feature in FEATURE_TABLE:
        columns[FEATURE_TABLE[feature]].append((part, feature))
  new = {"seq": dict(batch.seq), "cand": dict(batch.cand)}
  for table, cols in sorted(columns.items()):
    rows = lookup_fn(tables[table], [getattr(batch, p)[f] for p, f in cols])
    for (part, feature), r in zip(cols, rows, strict=True):
      new[part][feature] = Rows(r)
  return dataclasses.replace(batch, **new)


class Embeddings(nnx.Module):
  def __init__(
    self, vocab_sizes: dict[str, int], emb_dim: int, *, rngs: nnx.Rngs
  ):
    if emb_dim % 32:
      raise ValueError(f"emb_dim={emb_dim} must be a multiple of 32 (O9)")
    self.tables = nnx.Dict(
      {
        name: param(rngs, (rows, emb_dim), ("table_rows", "table_dim"))
        for name, rows in sorted(table_sizes(vocab_sizes).items())
      }
    )

  def lookup(self, feature: str, ids):
    if isinstance(ids, Rows):  # looked up already (sharded, see above)
      return ids.rows
    return jnp.take(self.tables[FEATURE_TABLE[feature]][...], ids, axis=0)

  def concat(self, features: dict, names) -> jnp.ndarray:
    """`[rows, len(names) * emb_dim]`: the named columns side by side."""
    return jnp.concatenate([self.lookup(n, features[n]) for n in names], -1)
