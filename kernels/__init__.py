"""k3 kernels."""
from ._dispatch import eager

__all__ = ["eager"]
