"""FP8 with power-of-two block scales: quantize and dot_general (G4)."""

from pallas_kernels.fp8.format import FORMATS, Fp8Tensor
from pallas_kernels.fp8.op import (
  dequantize,
  fp8_dot_general,
  fp8_dot_general_reference,
  quantize,
)
from pallas_kernels.fp8.reference import (
  dequantize_reference,
  quantize_reference,
  scaled_matmul_reference,
)

__all__ = [
  "FORMATS",
  "Fp8Tensor",
  "dequantize",
  "dequantize_reference",
  "fp8_dot_general",
  "fp8_dot_general_reference",
  "quantize",
  "quantize_reference",
  "scaled_matmul_reference",
]
