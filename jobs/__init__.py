"""k3 jobs."""
