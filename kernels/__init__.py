"""k3 kernels."""
