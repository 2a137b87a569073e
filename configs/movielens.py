"""MovieLens-100K (RecBole's copy) under the temporal protocol.

  make data && make train CONFIG=movielens
  python -m gemjax.train --config movielens --set train.steps=50  # run small

Ratings become actions (5: order, 4: cart, 3: click, 1-2: impression), so
CTR is "rated 3 or more" and conversion "rated 5", over each request's
rated items and two items the user never rated (sampled by popularity).
Requests before the time that leaves the last 10% of ratings train; the
same users' later requests evaluate. The baselines (item popularity,
logistic regression on item, category and history aggregates) are scored
on the same held-out candidates and printed beside the model.

Its results against the baselines, and the runs behind its settings:
docs/real_data.md.
"""

from gemjax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
    model=ModelConfig(
      d_model=64,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      emb_dim=32,
      head_hidden=(128, 64),
      cross_layers=2,
      # Learned queries that pool the whole history into the user vector
      # (G2): the user's rating habit, which the candidates' cross
      # attention alone did not carry as well as the baselines' aggregates.
      pooled_queries=4,
    ),
    data=DataConfig(
      source="recbole",
      path="data/ml-100k/ml-100k.inter",
      protocol="temporal",
      num_items=65_536,
      num_categories=65_536,
      num_users=1 << 20,
      max_seq_len=256,
      max_cands=12,
      neg_per_request=2,
      requests_per_shard=32,
      token_capacity=0,  # derived from the log
      cand_capacity=0,
    ),
    train=TrainConfig(
      steps=1300,
      checkpoint_every=650,
      log_every=25,
      # Items move from their initial rows only at a high row-wise Adagrad
      # rate on a log this small (docs/real_data.md).
      embedding_learning_rate=0.1,
    ),
  )
