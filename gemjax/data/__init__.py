"""Event logs to jagged batches (O1-O4, O12, G10).

config.DataConfig          what the data is and how batches are shaped
loader.Loader              training iterator (resumable, sharded, prefetched)
loader.eval_batches        the fixed held-out set
synthetic                  generated traffic + hidden label model (ceiling)
events                     event-log schema and readers of real formats
build                      request building: anti-leakage, dedup, quota
features                   log-bucketed context features
bbs                        batch planning (BBS) and packing
"""

from gemjax.data.config import DataConfig
from gemjax.data.jagged import JaggedBatch, from_padded, to_padded
from gemjax.data.loader import Loader, eval_batches

__all__ = [
  "DataConfig",
  "JaggedBatch",
  "Loader",
  "eval_batches",
  "from_padded",
  "to_padded",
]
