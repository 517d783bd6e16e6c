"""Training metrics through ray.util.metrics (Prometheus sees them as ray_k3_train_*)."""
from __future__ import annotations


class TrainMetrics:
    """Gauges for the rank-0 worker: loss, tokens/s, lr, grad norm, MaxVio and bias spread per
    MoE layer (tag `layer`), checkpoint seconds, time split (compute, all-to-all, coordinator)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from ray.util.metrics import Gauge

        names = {
            "loss": "training loss (mean over workers)", "tokens_per_s": "tokens per second, all workers",
            "lr": "learning rate", "grad_norm": "global gradient norm", "maxvio_mean": "mean MaxVio over MoE layers",
            "checkpoint_s": "seconds to write the last checkpoint", "compute_s": "compute seconds since last report",
            "all_to_all_s": "expert all-to-all seconds in the last step",
            "coordinator_wait_s": "seconds waiting for the balance coordinator since last report",
            "step": "optimizer step",
        }
        self.g = {k: Gauge(f"k3_train_{k}", v) for k, v in names.items()}
        self.layer_g = {"maxvio": Gauge("k3_train_maxvio", "max expert load / mean load - 1", ("layer",)),
                        "bias_spread": Gauge("k3_train_bias_spread", "max - min router bias", ("layer",))}

    def update(self, values: dict) -> None:
        if not self.enabled:
            return
        for k, v in values.items():
            if k in self.g and isinstance(v, (int, float)):
                self.g[k].set(float(v))
            elif k in self.layer_g and isinstance(v, list):
                for i, x in enumerate(v):
                    self.layer_g[k].set(float(x), tags={"layer": str(i)})
