"""Jagged (unpadded) attention over packed sequences (G1, O7, O10)."""

from pallas_kernels.jagged_attention.op import jagged_attention
from pallas_kernels.jagged_attention.reference import (
  jagged_attention_reference,
)

__all__ = ["jagged_attention", "jagged_attention_reference"]
