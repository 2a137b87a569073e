"""Event logs to jagged batches."""

from gemjax.data.jagged import JaggedBatch, from_padded, to_padded

__all__ = ["JaggedBatch", "from_padded", "to_padded"]
