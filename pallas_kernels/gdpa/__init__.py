"""GDPA: activation (GELU/SiLU) attention over jagged sequences (G2)."""

from pallas_kernels.gdpa.op import gdpa
from pallas_kernels.gdpa.reference import gdpa_reference

__all__ = ["gdpa", "gdpa_reference"]
