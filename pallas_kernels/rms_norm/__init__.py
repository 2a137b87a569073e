"""Fused RMSNorm with optional residual add (O11)."""

from pallas_kernels.rms_norm.op import rms_norm
from pallas_kernels.rms_norm.reference import rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference"]
