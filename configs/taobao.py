"""Taobao UserBehavior logs (`user,item,category,behavior,timestamp`).

  python -m gemjax.train --config taobao --set data.path=UserBehavior.csv
  python -m gemjax.train --config taobao --set data.path=... \\
      --set train.steps=50                                   # run small

Behaviours become actions (pv: click, fav and cart: cart, buy: order), so
every viewed item is a positive for CTR and a bought one for conversion;
the negatives are items the user never touched, sampled by popularity (the
log has no impressions). Same temporal protocol, model and baselines as
`movielens`; the buffers are sized from the log (capacities 0). Tables
hash raw ids: the start-up summary reports the collision rate, and a rate
over 1% says which table size to set.
"""

import dataclasses
import pathlib

from gemjax import config as config_lib


def get_config():
  # By path, as the CLI loads every config: this folder is not a package
  # the library imports.
  cfg = config_lib.load(pathlib.Path(__file__).with_name("movielens.py"))
  return dataclasses.replace(
    cfg,
    data=dataclasses.replace(
      cfg.data,
      source="taobao",
      path="data/UserBehavior.csv",
      num_items=1 << 20,
      num_categories=1 << 14,
      neg_per_request=4,
      max_cands=14,
      token_capacity=0,
      cand_capacity=0,
    ),
  )
