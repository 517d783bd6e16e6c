"""Grafana dashboards as code: the training and serving dashboards, their provisioning files,
and the push to a Grafana server.

    write_dashboards("cluster/grafana")               # k3-training.json, k3-serving.json, provisioning/
    push_dashboards("http://grafana:3000", token)     # POST /api/dashboards/db through grafana-client

Each panel is a `PanelSpec` (title, unit, PromQL queries) turned into Grafana's JSON by the
official `grafana-foundation-sdk` builders. The queries name the metrics as Prometheus sees them:
Ray prefixes every `ray.util.metrics` name with `ray_` and appends `_total` to counters
(`k3_serve_prompt_tokens` -> `ray_k3_serve_prompt_tokens_total`); histograms come as
`_bucket`/`_sum`/`_count`. Every panel's queries are checked against a real Prometheus scraping a
real cluster (tests/platform/test_autoscaling_monitoring.py): a panel that can never return data
is a defect, so panels whose metric does not exist yet are listed in `PENDING_PANELS` instead.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from k3.model.directory import write_beside

DATASOURCE_VAR = "datasource"
RATE = "$__rate_interval"  # Grafana's rate window: at least four scrape intervals
FOLDER_UID = "k3"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    """One panel: a time series (or a heatmap with one row per series) of PromQL queries."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # or "heatmap"


def _quantiles(metric: str, by: str) -> tuple[Query, ...]:
    return tuple(Query(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[{RATE}])))",
                       f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.9, 0.99))


TRAINING_PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("Loss", "training loss, mean over workers (rank 0 reports)", "none",
              (Query("ray_k3_train_loss", "loss"),)),
    PanelSpec("Tokens per second", "tokens per second over all workers since the last report", "none",
              (Query("ray_k3_train_tokens_per_s", "tokens/s"),)),
    PanelSpec("Learning rate", "learning rate of the last step", "none", (Query("ray_k3_train_lr", "lr"),)),
    PanelSpec("Gradient norm", "global gradient norm (dense and expert parameters) before clipping", "none",
              (Query("ray_k3_train_grad_norm", "grad norm"),)),
    PanelSpec("MaxVio per MoE layer", "max expert load / mean load - 1 of the last step, one row per MoE layer",
              "none", (Query("ray_k3_train_maxvio", "{{layer}}"),), kind="heatmap"),
    PanelSpec("Quantile Balancing bias spread", "max - min of the router bias the coordinator solved, per MoE layer",
              "none", (Query("ray_k3_train_qb_bias_spread", "layer {{layer}}"),)),
    PanelSpec("QB histogram bytes", "bytes of margin histograms the balance coordinator receives per second",
              "Bps", (Query(f"sum(rate(ray_k3_train_qb_hist_bytes_total[{RATE}]))", "received"),)),
    PanelSpec("Coordinator wait", "seconds rank 0 waited for the balance coordinator's bias since the last report",
              "s", (Query("ray_k3_train_coordinator_wait_s", "wait"),)),
    PanelSpec("Expert all-to-all time", "seconds of expert all-to-all in the last step (rank 0)", "s",
              (Query("ray_k3_train_all_to_all_s", "all-to-all"),)),
    PanelSpec("Compute time", "seconds of forward, backward and optimizer step since the last report (rank 0)",
              "s", (Query("ray_k3_train_compute_s", "compute"),)),
    PanelSpec("Checkpoint time", "seconds to write the last checkpoint (rank 0)", "s",
              (Query("ray_k3_train_checkpoint_s", "checkpoint"),)),
)

_hit = "sum by (source) (rate(ray_k3_serve_prefix_cache_hits_total[{r}])) / " \
       "sum by (source) (rate(ray_k3_serve_prefix_cache_queries_total[{r}]))"
SERVING_PANELS: tuple[PanelSpec, ...] = (
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
    PanelSpec("Running and waiting requests", "requests in the running batch and waiting for admission", "none",
              (Query("sum by (model, role) (ray_k3_serve_num_requests_running)", "running {{role}}"),
               Query("sum by (model, role) (ray_k3_serve_num_requests_waiting)", "waiting {{role}}"))),
    PanelSpec("Prefix-cache hit rate", "prompt tokens served from the prefix cache / looked up, by source "
              "(local: the replica's own cache; pool: the shared prefix pool)", "percentunit",
              (Query(_hit.format(r=RATE), "{{source}}"),)),
    PanelSpec("Cache usage", "share of the engine's MLA pages held by running requests", "percentunit",
              (Query("max by (model, role) (ray_k3_serve_cache_usage_ratio)", "{{role}}"),)),
    PanelSpec("Handoff size", "bytes of hybrid cache state handed from prefill to decode, percentiles", "bytes",
              _quantiles("ray_k3_serve_handoff_bytes", "model")),
    PanelSpec("Handoff latency", "seconds to export, move and import one request's cache state, percentiles", "s",
              _quantiles("ray_k3_serve_handoff_seconds", "model")),
    PanelSpec("Handoff retries", "prefill attempts tried again per second after one lost the state or timed out, "
              "by error", "ops",
              (Query(f"sum by (error) (rate(ray_k3_serve_handoff_retries_total[{RATE}]))", "{{error}}"),)),
    PanelSpec("Replicas per deployment", "healthy replicas of each Serve deployment (Ray Serve's own metric)",
              "none", (Query("sum by (application, deployment) (ray_serve_deployment_replica_healthy)",
                             "{{application}}/{{deployment}}"),)),
)

# Panels the issue asks for whose metric no code exports yet; added when it does.
PENDING_PANELS = {
    "Worker restarts": "needs a worker-restart counter from the trainer (none is exported on this branch); "
                       "Ray Train's own metrics do not count restarts",
}


def _panel(spec: PanelSpec, ds):
    from grafana_foundation_sdk.builders import heatmap, prometheus, timeseries
    from grafana_foundation_sdk.models.common import HeatmapCellLayout
    from grafana_foundation_sdk.models.heatmap import HeatmapColorMode

    if spec.kind == "heatmap":
        # one row per series (layer), values as they are: no bucketing by Grafana
        p = (heatmap.Panel().calculate(False).rows_frame(heatmap.RowsHeatmapOptions().layout(HeatmapCellLayout.AUTO))
             .color(heatmap.HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges").steps(64))
             .show_legend().show_tooltip())
    elif spec.kind == "timeseries":
        p = timeseries.Panel().line_width(1)
    else:
        raise ValueError(f"panel {spec.title!r}: kind must be 'timeseries' or 'heatmap', got {spec.kind!r}")
    p = p.title(spec.title).description(spec.description).unit(spec.unit).datasource(ds).height(8).span(12)
    for i, q in enumerate(spec.queries):
        target = prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i)).datasource(ds)
        p = p.with_target(target)
    return p


def build_dashboard(title: str, uid: str, panels: tuple[PanelSpec, ...], tags: list[str]) -> dict:
    """A dashboard's JSON model (the `dashboard` object of Grafana's API), from the SDK builders."""
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")
    b = (db.Dashboard(title).uid(uid).tags(tags).refresh("10s").time("now-1h", "now").timezone("browser")
         .with_variable(db.DatasourceVariable(DATASOURCE_VAR).label("Prometheus").type("prometheus")))
    for spec in panels:
        b = b.with_panel(_panel(spec, ds))
    return json.loads(json.dumps(b.build(), cls=JSONEncoder))


def training_dashboard() -> dict:
    return build_dashboard("k3 training", "k3-training", TRAINING_PANELS, ["k3", "training"])


def serving_dashboard() -> dict:
    return build_dashboard("k3 serving", "k3-serving", SERVING_PANELS, ["k3", "serving"])


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel of a dashboard's JSON."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def provisioning_files(dashboards_path: str) -> dict[str, dict]:
    """Grafana provisioning: a Prometheus datasource (URL from $PROMETHEUS_URL, which Grafana
    expands when it reads the file) and a file provider for the dashboards folder."""
    return {
        "provisioning/datasources/k3-prometheus.yaml": {
            "apiVersion": 1,
            "datasources": [{"name": "Prometheus", "type": "prometheus", "uid": "k3-prometheus", "access": "proxy",
                             "url": "$PROMETHEUS_URL", "isDefault": True}]},
        "provisioning/dashboards/k3.yaml": {
            "apiVersion": 1,
            "providers": [{"name": "k3", "folder": "k3", "folderUid": FOLDER_UID, "type": "file",
                           "allowUiUpdates": False, "options": {"path": dashboards_path}}]},
    }


def write_dashboards(out_dir: str | os.PathLike, dashboards_path: str = "/etc/grafana/dashboards/k3") -> list[Path]:
    """Write both dashboards' JSON and the provisioning files under out_dir; returns the paths. The
    new files are written beside out_dir and swapped in together (k3.model.directory),
    keeping the folder's other files: a writer killed midway leaves the previous version."""
    out = Path(out_dir)
    files = {f"{d['uid']}.json": json.dumps(d, indent=2, sort_keys=True) + "\n"
             for d in (training_dashboard(), serving_dashboard())}
    files |= {rel: yaml.safe_dump(body, sort_keys=False) for rel, body in provisioning_files(dashboards_path).items()}
    with write_beside(out) as stage:
        for rel, text in files.items():
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            (stage / rel).write_text(text)
    return [out / rel for rel in files]


class GrafanaPushError(RuntimeError):
    """The push to Grafana failed (the message is one line)."""


def push_dashboards(url: str, token: str | None, folder_uid: str = FOLDER_UID, folder_title: str = "k3",
                    dashboards: list[dict] | None = None, timeout_s: float = 10.0) -> list[dict]:
    """Create the folder if missing, then POST each dashboard to /api/dashboards/db with
    `folderUid` and `overwrite: true`, through grafana-client; returns Grafana's replies."""
    import requests
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

    if not url:
        raise ValueError("no Grafana URL: pass --grafana-url or set GRAFANA_URL")
    if not token:
        raise ValueError("no Grafana token: set GRAFANA_TOKEN to a service-account token with dashboard write access")
    dashboards = dashboards if dashboards is not None else [training_dashboard(), serving_dashboard()]
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    replies = []
    try:
        try:
            api.folder.get_folder(folder_uid)
        except GrafanaClientError as e:
            if e.status_code != 404:
                raise
            api.folder.create_folder(folder_title, uid=folder_uid)
        for d in dashboards:
            body = {"dashboard": {**d, "id": None}, "folderUid": folder_uid, "overwrite": True,
                    "message": "k3 dashboards as code"}
            replies.append(api.dashboard.update_dashboard(body))
    except GrafanaUnauthorizedError:
        raise GrafanaPushError(f"Grafana at {url} refused the token (HTTP 401): check GRAFANA_TOKEN") from None
    except GrafanaException as e:
        raise GrafanaPushError(f"Grafana at {url} answered HTTP {e.status_code}: {' '.join(str(e.message).split())}") \
            from None
    except requests.exceptions.RequestException as e:
        raise GrafanaPushError(f"Grafana at {url} is unreachable: {type(e).__name__}") from None
    return replies
