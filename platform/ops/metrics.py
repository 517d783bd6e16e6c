"""k3's metrics through ray.util.metrics (Prometheus sees them as ray_k3_train_* and ray_k3_serve_*).

Ray keeps a gauge only while it is set again: a value not re-set within two metrics export
intervals (Ray 2.60's OpenTelemetry recorder, `metrics_report_interval_ms`, 10 s by default) is
dropped, and a panel reading it goes blank. TrainMetrics therefore sets every gauge each step
and re-sets the last values from a small thread between steps (a step or a checkpoint can take
longer than the interval), twice per interval, so a re-set held back by up to an interval (a
thread starved on a loaded machine) still lands before the gauge expires; the values go when the
worker does, as they should.
"""
from __future__ import annotations

import threading
import time

# name: description. Every gauge the training rank 0 sets; Prometheus sees `ray_k3_train_<name>`.
TRAIN_GAUGES = {
    "step": "optimizer step just finished",
    "loss": "training loss of the last step (mean over workers)",
    "tokens_per_s": "tokens per second of the last step, all workers",
    "lr": "learning rate of the last step",
    "grad_norm": "global gradient norm of the last step, before clipping",
    "maxvio_mean": "mean MaxVio over MoE layers, last step",
    "compute_s": "seconds of forward, backward and optimizer step in the last step",
    "all_to_all_s": "seconds of expert all-to-all in the last step",
    "coordinator_wait_s": "seconds the last step waited for the balance coordinator's bias",
    "checkpoint_s": "seconds to write the last checkpoint",
    "checkpoint_step": "step of the last checkpoint (0: none yet)",
}
TRAIN_LAYER_GAUGES = {"maxvio": "max expert load / mean load - 1 of the last step, per MoE layer",
                      "bias_spread": "max - min router bias after the last step, per MoE layer"}


class TrainMetrics:
    """The training gauges of one worker (only rank 0 sets them: `enabled`), each step's values
    kept alive between steps; and `restarts`, counted when a worker group starts from a
    checkpoint (a worker failure, or a resubmitted run).

    Args:
        enabled: whether this worker exports (rank 0); a disabled TrainMetrics does nothing.
        refresh_s: seconds between re-sets of the last values (default: half Ray's export interval).
    """

    def __init__(self, enabled: bool = True, refresh_s: float | None = None) -> None:
        if refresh_s is not None and refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.enabled = enabled
        self.last: dict[tuple[str, str | None], float] = {}  # (name, layer) -> value
        self._lock = threading.Lock()
        if not enabled:
            return
        import ray
        from ray.util.metrics import Counter, Gauge

        self.g = {k: Gauge(f"k3_train_{k}", v) for k, v in TRAIN_GAUGES.items()}
        self.g.update({k: Gauge(f"k3_train_{k}", v, ("layer",)) for k, v in TRAIN_LAYER_GAUGES.items()})
        self.restarts = Counter("k3_train_restarts", "worker-group starts from a checkpoint (a worker failure, "
                                                     "or a resubmitted run)")
        # half Ray's export interval (at least 0.5 s): a re-set lands in every expiry window (two
        # intervals) even when one is late by a whole interval
        self.refresh_s = refresh_s or max(ray._config.metrics_report_interval_ms(), 1000) / 2000
        threading.Thread(target=self._keep, name="k3-train-metrics", daemon=True).start()

    def update(self, values: dict) -> None:
        """Set the gauges named in `values` (numbers; lists per MoE layer); other keys are ignored."""
        if not self.enabled:
            return
        with self._lock:
            for k, v in values.items():
                if k in TRAIN_GAUGES and isinstance(v, (int, float)):
                    self.last[(k, None)] = float(v)
                elif k in TRAIN_LAYER_GAUGES and isinstance(v, list):
                    self.last.update({(k, str(i)): float(x) for i, x in enumerate(v)})
            self._set_all()

    def count_restart(self) -> None:
        if self.enabled:
            self.restarts.inc(1.0)

    def _set_all(self) -> None:
        for (k, layer), v in self.last.items():
            self.g[k].set(v, tags=None if layer is None else {"layer": layer})

    def _keep(self) -> None:
        while True:  # a daemon thread: it ends with the worker, and Ray then drops the gauges
            time.sleep(self.refresh_s)
            with self._lock:
                self._set_all()


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
