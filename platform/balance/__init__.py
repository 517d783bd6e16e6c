"""k3.platform.balance: expert balancing for the MoE router.

    config.py      BalanceConfig (the `--balance` knobs) and the method names
    routing.py     top-k with a selection bias, QB margins, loads, MaxVio; the baselines' updates
    quantile.py    Quantile Balancing's solves (exact, histogram) and the per-layer histogram step
    methods.py     one balancer class per method: a bias per MoE layer and its update, in one process
    strategies.py  how a training job runs a method (on each worker, or through the coordinator)
    coordinator.py the BalanceCoordinator actor: sums the workers' histograms and solves

The names below are the single-process API; the training job's pieces are imported from their
modules (strategies and coordinator need Ray).
"""
from .config import METHODS, BalanceConfig
from .methods import Balancer, make_balancer
from .quantile import (HistLayerState, adaptive_gain, exact_bias, exact_thresholds, fine_window, format_trace,
                       hist_step, histogram_bias, histogram_thresholds, solve_batch, window_for)
from .routing import (centred, check_top_k, check_layers, expert_loads, loss_free_update, max_violation, quantile_target,
                      route, switch_aux_loss, token_margins)

__all__ = [
    "METHODS", "BalanceConfig", "Balancer", "make_balancer", "HistLayerState", "adaptive_gain", "centred", "check_top_k",
    "check_layers", "exact_bias", "exact_thresholds", "expert_loads", "fine_window", "format_trace", "hist_step",
    "histogram_bias", "histogram_thresholds", "loss_free_update", "max_violation", "quantile_target", "route",
    "solve_batch", "switch_aux_loss", "token_margins", "window_for",
]
