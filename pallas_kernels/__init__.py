"""Pallas GPU kernels for recommendation shapes; public ops only.

Each op has a plain-`jnp` reference beside it (`*_reference`), which is also
the `implementation="xla"` path. This package knows nothing about models.

The packed layout the jagged ops take (sequences back to back, `offsets`)
and its padded view: `jagged_to_padded` / `jagged_from_padded` (aliases of
`pallas_kernels.jagged.to_padded` / `from_padded`), for code that hands a
batch to a padded op.

FP8 (G4): `fp8_quantize` / `fp8_dequantize` (aliases of
`pallas_kernels.fp8.quantize` / `dequantize`) make and undo an `Fp8Tensor`;
`fp8_dot_general` is `lax.dot_general` in FP8 with block scales;
`rms_norm(..., quantize=Fp8Output(...))` returns its output as an
`Fp8Tensor` for the next FP8 matmul.
"""

from pallas_kernels.block_attention import (
  block_attention,
  block_attention_reference,
  sliding_window_attention,
  sliding_window_reference,
)
from pallas_kernels.block_attention.reference import (
  rope_reference as rope_reference,
)
from pallas_kernels.fp8 import (
  Fp8Tensor,
  fp8_dot_general,
  fp8_dot_general_reference,
)
from pallas_kernels.fp8 import dequantize as fp8_dequantize
from pallas_kernels.fp8 import quantize as fp8_quantize
from pallas_kernels.gdpa import gdpa, gdpa_reference
from pallas_kernels.jagged import from_padded as jagged_from_padded
from pallas_kernels.jagged import to_padded as jagged_to_padded
from pallas_kernels.jagged_attention import (
  jagged_attention,
  jagged_attention_reference,
)
from pallas_kernels.rms_norm import Fp8Output, rms_norm, rms_norm_reference

__all__ = [
  "block_attention",
  "block_attention_reference",
  "gdpa",
  "gdpa_reference",
  "sliding_window_attention",
  "sliding_window_reference",
  "Fp8Output",
  "Fp8Tensor",
  "fp8_dequantize",
  "fp8_dot_general",
  "fp8_dot_general_reference",
  "fp8_quantize",
  "jagged_attention",
  "jagged_attention_reference",
  "jagged_from_padded",
  "jagged_to_padded",
  "rms_norm",
  "rms_norm_reference",
]
