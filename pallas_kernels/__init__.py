"""Pallas GPU kernels for recommendation shapes; public ops only.

Each op has a plain-`jnp` reference beside it (`*_reference`), which is also
the `implementation="xla"` path. This package knows nothing about models.
"""

from pallas_kernels.jagged_attention import (
  jagged_attention,
  jagged_attention_reference,
)
from pallas_kernels.rms_norm import rms_norm, rms_norm_reference

__all__ = [
  "jagged_attention",
  "jagged_attention_reference",
  "rms_norm",
  "rms_norm_reference",
]
