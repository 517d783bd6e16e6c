"""What k3's Grafana dashboards show: one `PanelSpec` per panel (title, unit, PromQL), per dashboard.

The queries name the metrics as Prometheus sees them: Ray prefixes every `ray.util.metrics` name
with `ray_` and appends `_total` to counters (`k3_serve_prompt_tokens` ->
`ray_k3_serve_prompt_tokens_total`); histograms come as `_bucket`/`_sum`/`_count`. Ray's own
series (`ray_node_*`, `ray_serve_*`, `autoscaler_*`) keep Ray's names.

Every panel returns data at any moment of a training run and of Serve traffic on the local
autoscaling cluster (tests/platform/test_autoscaling_monitoring.py samples them), except those
marked `needs="gpu"`, which read series only GPU nodes export. A counter of events that may not
have happened yet (restarts, retries, worker failures) is drawn as `... or 0 * <a series that
exists while the thing runs>`: zero while it runs without the event, nothing when it does not run.
"""
from __future__ import annotations

from dataclasses import dataclass

RATE = "$__rate_interval"  # Grafana's rate window: at least four scrape intervals


@dataclass(frozen=True)
class Query:
    """One PromQL target; a `unit` other than the panel's puts its series on a right-hand axis."""

    expr: str
    legend: str
    unit: str | None = None


@dataclass(frozen=True)
class PanelSpec:
    """One panel: a time series (or a heatmap with one row per series) of PromQL queries.
    `needs` names what the cluster must have for the panel to show data ("gpu"), if anything."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # or "heatmap"
    needs: str | None = None


def _quantiles(metric: str, by: str) -> tuple[Query, ...]:
    return tuple(Query(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[{RATE}])))",
                       f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.9, 0.99))


TRAINING_PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("Loss", "training loss of the last step, mean over workers (rank 0 reports)", "none",
              (Query("ray_k3_train_loss", "loss"),)),
    PanelSpec("Tokens per second", "tokens per second of the last step, all workers", "none",
              (Query("ray_k3_train_tokens_per_s", "tokens/s"),)),
    PanelSpec("Step", "the optimizer step just finished", "none", (Query("ray_k3_train_step", "step"),)),
    PanelSpec("Checkpoints", "steps since the last checkpoint (what a restart now would redo), and seconds to "
              "write the last checkpoint (right axis; none before the first)", "none",
              (Query("ray_k3_train_step - ray_k3_train_checkpoint_step", "steps since the last checkpoint"),
               Query("ray_k3_train_checkpoint_s", "seconds to write the last checkpoint", unit="s"))),
    PanelSpec("Learning rate", "learning rate of the last step", "none", (Query("ray_k3_train_lr", "lr"),)),
    PanelSpec("Gradient norm", "global gradient norm (dense and expert parameters) before clipping", "none",
              (Query("ray_k3_train_grad_norm", "grad norm"),)),
    PanelSpec("MaxVio per MoE layer", "max expert load / mean load - 1 of the last step, one row per MoE layer",
              "none", (Query("ray_k3_train_maxvio", "{{layer}}"),), kind="heatmap"),
    PanelSpec("MaxVio: mean and worst layer", "mean over MoE layers of the last step (rank 0), and the worst "
              "layer as the balance coordinator measured it from every worker's histograms", "none",
              (Query("ray_k3_train_maxvio_mean", "mean (rank 0)"),
               Query("max(ray_k3_train_qb_maxvio)", "worst layer (coordinator)"))),
    PanelSpec("Router bias spread", "max - min of the router bias per MoE layer: the model's after the last "
              "step (rank 0), and the one the Quantile Balancing coordinator solved", "none",
              (Query("ray_k3_train_bias_spread", "model L{{layer}}"),
               Query("ray_k3_train_qb_bias_spread", "coordinator L{{layer}}"))),
    PanelSpec("QB histogram bytes", "bytes of margin histograms the balance coordinator receives per second",
              "Bps", (Query(f"sum(rate(ray_k3_train_qb_hist_bytes_total[{RATE}]))", "received"),)),
    PanelSpec("Coordinator wait", "seconds the last step waited for the balance coordinator's bias (rank 0)",
              "s", (Query("ray_k3_train_coordinator_wait_s", "wait"),)),
    PanelSpec("Expert all-to-all time", "seconds of expert all-to-all in the last step (rank 0)", "s",
              (Query("ray_k3_train_all_to_all_s", "all-to-all"),)),
    PanelSpec("Compute time", "seconds of forward, backward and optimizer step in the last step (rank 0)", "s",
              (Query("ray_k3_train_compute_s", "compute"),)),
    PanelSpec("Worker restarts", "times the worker group started again from a checkpoint (a worker failed, or "
              "the run was resubmitted)", "none",
              (Query("sum by (SessionName) (ray_k3_train_restarts_total) or 0 * max by (SessionName) "
                     "(ray_k3_train_step)", "restarts"),)),
)

_hit = "sum by (source) (rate(ray_k3_serve_prefix_cache_hits_total[{r}])) / " \
       "sum by (source) (rate(ray_k3_serve_prefix_cache_queries_total[{r}]))"
_http = 'ray_serve_num_http_requests_total{{route!~"/-/.*"{sel}}}'  # /-/healthz and /-/routes are probes
SERVING_PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("HTTP requests by status code",
              "requests per second on Serve's HTTP port (its proxy, or HAProxy with direct ingress), by HTTP status",
              "reqps", (Query(f"sum by (status_code) (rate({_http.format(sel='')}[{RATE}]))", "{{status_code}}"),)),
    PanelSpec("HTTP error ratio", "share of requests answered 5xx (server) and 4xx (client); 0 while every "
              "request succeeds", "percentunit",
              tuple(Query(f"(sum(rate({_http.format(sel=f', status_code=~{c!r}')}[{RATE}])) or vector(0)) / "
                          f"sum(rate({_http.format(sel='')}[{RATE}]))", name)
                    for c, name in (("5..", "5xx"), ("4..", "4xx")))),
    PanelSpec("Time to first token", "TTFT percentiles", "s",
              _quantiles("ray_k3_serve_time_to_first_token_seconds", "model")),
    PanelSpec("Inter-token latency", "seconds between consecutive output tokens, percentiles", "s",
              _quantiles("ray_k3_serve_inter_token_latency_seconds", "model")),
    PanelSpec("End-to-end request latency", "request arrival to last token, percentiles", "s",
              _quantiles("ray_k3_serve_e2e_request_latency_seconds", "model")),
    PanelSpec("Throughput", "tokens per second", "none",
              (Query(f"sum by (model) (rate(ray_k3_serve_generation_tokens_total[{RATE}]))", "generated {{model}}"),
               Query(f"sum by (model) (rate(ray_k3_serve_prompt_tokens_total[{RATE}]))", "prompt {{model}}"))),
    PanelSpec("Finished requests", "requests finished per second, by finish reason", "reqps",
              (Query(f"sum by (finish_reason) (rate(ray_k3_serve_requests_finished_total[{RATE}]))",
                     "{{finish_reason}}"),)),
    PanelSpec("Running and waiting requests", "requests in the engines' running batches and waiting for admission",
              "none", (Query("sum by (model, role) (ray_k3_serve_num_requests_running)", "running {{role}}"),
                       Query("sum by (model, role) (ray_k3_serve_num_requests_waiting)", "waiting {{role}}"))),
    PanelSpec("Queue lengths", "requests queued in Serve's handles for a replica, and requests each deployment's "
              "replicas are working on", "none",
              (Query("sum by (deployment) (ray_serve_deployment_queued_queries)", "queued for {{deployment}}"),
               Query("sum by (deployment) (ray_serve_replica_processing_queries)", "in {{deployment}}"))),
    PanelSpec("Prefix-cache hit rate", "prompt tokens served from the prefix cache / looked up, by source "
              "(local: the replica's own cache; pool: the shared prefix pool)", "percentunit",
              (Query(_hit.format(r=RATE), "{{source}}"),)),
    PanelSpec("Cache usage", "share of the engine's MLA pages held by running requests", "percentunit",
              (Query("max by (model, role) (ray_k3_serve_cache_usage_ratio)", "{{role}}"),)),
    PanelSpec("Handoff size", "bytes of hybrid cache state handed from prefill to decode, percentiles", "bytes",
              _quantiles("ray_k3_serve_handoff_bytes", "model")),
    PanelSpec("Handoff latency", "seconds to export, move and import one request's cache state, percentiles", "s",
              _quantiles("ray_k3_serve_handoff_seconds", "model")),
    PanelSpec("Handoff retries", "prefill attempts tried again after one lost the cache state or its replica "
              "(a prefill node went away) or timed out, by error; 0 while handoffs succeed first time", "none",
              (Query(f"sum by (error) (increase(ray_k3_serve_handoff_retries_total[{RATE}])) or "
                     f"0 * sum(rate(ray_k3_serve_handoff_bytes_count[{RATE}]))", "{{error}}"),)),
    # Serve's controller sets this gauge from its control loop; a loop busy past two export intervals
    # (seen while a prefill node was removed on a loaded 2-core machine) blanked the panel at one
    # sampled moment. Each replica's last value within 30 s keeps it drawn; a replica gone for 30 s
    # drops out.
    PanelSpec("Replicas per deployment", "healthy replicas of each Serve deployment (Ray Serve's own metric; a "
              "replica gone drops out within 30 s)", "none",
              (Query("sum by (application, deployment) (last_over_time(ray_serve_deployment_replica_healthy[30s]))",
                     "{{application}}/{{deployment}}"),)),
)

CLUSTER_PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("Nodes", "nodes alive, pending (being launched) and recently failed, by node type (the autoscaler's "
              "view)", "none",
              (Query("sum by (NodeType) (autoscaler_active_nodes)", "alive {{NodeType}}"),
               Query("sum by (NodeType) (autoscaler_pending_nodes)", "pending {{NodeType}}"),
               Query("sum by (NodeType) (autoscaler_recently_failed_nodes) or "
                     "0 * sum by (NodeType) (autoscaler_active_nodes)", "failed {{NodeType}}"))),
    # Ray's node metrics miss an export now and then (seen on the autoscaling cluster: all three
    # panels blank at 2 of 9 sampled moments of a training run): each node's last value within a
    # minute keeps the panel drawn through one missed export; a node gone for a minute drops out.
    PanelSpec("CPU utilisation per node", "CPU busy, percent of the node's CPUs", "percent",
              (Query("avg by (instance) (last_over_time(ray_node_cpu_utilization[1m]))", "{{instance}}"),)),
    PanelSpec("Memory per node", "memory in use on each node", "bytes",
              (Query("sum by (instance) (last_over_time(ray_node_mem_used[1m]))", "{{instance}}"),)),
    PanelSpec("GPU utilisation per node", "GPU busy, percent, per GPU", "percent",
              (Query("avg by (instance, GpuIndex) (ray_node_gpus_utilization)", "{{instance}} GPU {{GpuIndex}}"),),
              needs="gpu"),
    PanelSpec("GPU memory per node", "GPU memory in use, per GPU", "bytes",
              (Query("sum by (instance, GpuIndex) (ray_node_gram_used) * 1024 * 1024",
                     "{{instance}} GPU {{GpuIndex}}"),), needs="gpu"),
    PanelSpec("Object store", "object store memory in use per node (where the hybrid cache handoff travels)",
              "bytes", (Query("sum by (instance) (ray_object_store_memory)", "{{instance}}"),)),
    PanelSpec("Worker failures", "worker processes that died unexpectedly, per node; 0 while none has",
              "none", (Query("sum by (instance) (last_over_time(ray_node_manager_unexpected_worker_failure_total[1m])) "
                             "or 0 * sum by (instance) (last_over_time(ray_node_cpu_count[1m]))", "{{instance}}"),)),
)
