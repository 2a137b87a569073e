"""Fused RMSNorm with optional residual add (O11) and FP8 output (G4)."""

from pallas_kernels.rms_norm.op import rms_norm
from pallas_kernels.rms_norm.reference import Fp8Output, rms_norm_reference

__all__ = ["Fp8Output", "rms_norm", "rms_norm_reference"]
