"""Block-local attention with fused RoPE, and the sliding-window baseline
(G3)."""

from pallas_kernels.block_attention.op import (
  block_attention,
  sliding_window_attention,
)
from pallas_kernels.block_attention.reference import (
  block_attention_reference,
  sliding_window_reference,
)

__all__ = [
  "block_attention",
  "block_attention_reference",
  "sliding_window_attention",
  "sliding_window_reference",
]
