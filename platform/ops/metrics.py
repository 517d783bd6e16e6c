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


# Buckets in seconds and bytes, in the manner of vLLM's (latencies from 1 ms to 80 s).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
E2E_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]
BYTES_BUCKETS = [float(4 ** i * 1024) for i in range(12)]  # 1 KiB .. 4 GiB

# name: (kind, description, tag keys, buckets). Every serving metric k3 exports, in one table, so the
# Serve deployments, the dashboards and the docs agree on one set of names. Prometheus sees each as
# `ray_<name>` (histograms with _bucket/_sum/_count).
SERVE_METRICS: dict[str, tuple] = {  # (kind, description, tag keys[, histogram buckets])
    "k3_serve_time_to_first_token_seconds": ("histogram", "seconds from request arrival to its first token",
                                             ("model", "role"), TTFT_BUCKETS),
    "k3_serve_inter_token_latency_seconds": ("histogram", "seconds between consecutive output tokens of a request",
                                             ("model", "role"), ITL_BUCKETS),
    "k3_serve_e2e_request_latency_seconds": ("histogram", "seconds from request arrival to its last token",
                                             ("model", "role"), E2E_BUCKETS),
    "k3_serve_prompt_tokens": ("counter", "prompt tokens processed", ("model", "role")),
    "k3_serve_generation_tokens": ("counter", "tokens generated", ("model", "role")),
    "k3_serve_requests_finished": ("counter", "requests finished, by finish reason (stop, length, abort, error)",
                                   ("model", "role", "finish_reason")),
    "k3_serve_num_requests_running": ("gauge", "requests in the engine's running batch", ("model", "role")),
    "k3_serve_num_requests_waiting": ("gauge", "requests waiting for admission", ("model", "role")),
    "k3_serve_prefix_cache_queries": ("counter", "prompt tokens looked up in the prefix cache",
                                      ("model", "role", "source")),
    "k3_serve_prefix_cache_hits": ("counter", "prompt tokens served from the prefix cache",
                                   ("model", "role", "source")),
    "k3_serve_cache_usage_ratio": ("gauge", "share of the engine's MLA pages held by running requests",
                                   ("model", "role")),
    "k3_serve_handoff_bytes": ("histogram", "bytes of hybrid cache state handed from prefill to decode",
                               ("model",), BYTES_BUCKETS),
    "k3_serve_handoff_seconds": ("histogram", "seconds to export, move and import one request's cache state",
                                 ("model",), TTFT_BUCKETS),
    "k3_serve_handoff_retries": ("counter", "prefill attempts of a handoff that failed and were tried again, by error",
                                 ("model", "error")),
}


class ServeMetrics:
    """The SERVE_METRICS of one replica (tags `model` and `role` fixed), through ray.util.metrics.
    Outside a Ray worker (unit tests, the bare engine) nothing is recorded."""

    def __init__(self, model: str, role: str) -> None:
        self.base = {"model": model, "role": role}
        self.m: dict = {}
        try:
            import ray
            from ray.util.metrics import Counter, Gauge, Histogram
        except ImportError:
            return
        if not ray.is_initialized():
            return
        for name, (kind, desc, keys, *buckets) in SERVE_METRICS.items():
            if kind == "histogram":
                self.m[name] = Histogram(name, desc, boundaries=buckets[0], tag_keys=keys)
            elif kind == "counter":
                self.m[name] = Counter(name, desc, tag_keys=keys)
            else:
                self.m[name] = Gauge(name, desc, tag_keys=keys)

    def _tags(self, name: str, extra: dict) -> dict:
        keys = SERVE_METRICS[name][2]
        return {k: v for k, v in {**self.base, **extra}.items() if k in keys}

    def observe(self, name: str, value: float, **tags) -> None:
        if name in self.m:
            self.m[name].observe(float(value), tags=self._tags(name, tags))

    def inc(self, name: str, value: float = 1.0, **tags) -> None:
        if name in self.m and value > 0:
            self.m[name].inc(float(value), tags=self._tags(name, tags))

    def set(self, name: str, value: float, **tags) -> None:
        if name in self.m:
            self.m[name].set(float(value), tags=self._tags(name, tags))
