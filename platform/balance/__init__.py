"""k3.platform.balance.quantile: Expert balancing: Quantile Balancing's math, one strategy per method, the coordinator."""
