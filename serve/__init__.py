"""k3 serve."""
