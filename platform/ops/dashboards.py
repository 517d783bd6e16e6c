"""Grafana dashboards as code: k3's training, serving and cluster dashboards, Ray's own
dashboards beside them, their provisioning files, and the push to a Grafana server.

    write_dashboards("cluster/grafana")               # k3-*.json, ray/*.json, provisioning/
    push_dashboards("http://grafana:3000", token)     # POST /api/dashboards/db through grafana-client

Each k3 panel is a `PanelSpec` (k3.platform.ops.panels) turned into Grafana's JSON by the official
`grafana-foundation-sdk` builders. Ray's dashboards (default, Serve, Serve deployment, Train,
Data) are the ones a Ray head generates into `<session dir>/metrics/grafana/dashboards/`, made
here by Ray's own generator (so they match the pinned Ray, offline), with Ray's uids: the Ray
dashboard's Metrics tab embeds their panels by uid from the Grafana at RAY_GRAFANA_HOST.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from k3.model.directory import write_beside

from .panels import CLUSTER_PANELS, SERVING_PANELS, TRAINING_PANELS, PanelSpec

DATASOURCE_VAR = "datasource"
FOLDER_UID = "k3"
RAY_FOLDER_UID = "ray"
# file name -> generator in ray.dashboard.modules.metrics.grafana_dashboard_factory (the names the
# head writes them under)
RAY_DASHBOARDS = {"default_grafana_dashboard.json": "generate_default_grafana_dashboard",
                  "serve_grafana_dashboard.json": "generate_serve_grafana_dashboard",
                  "serve_deployment_grafana_dashboard.json": "generate_serve_deployment_grafana_dashboard",
                  "train_grafana_dashboard.json": "generate_train_grafana_dashboard",
                  "data_grafana_dashboard.json": "generate_data_grafana_dashboard"}


def _panel(spec: PanelSpec, ds):
    from grafana_foundation_sdk.builders import heatmap, prometheus, timeseries
    from grafana_foundation_sdk.models.common import HeatmapCellLayout
    from grafana_foundation_sdk.models.dashboard import DynamicConfigValue
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
        ref = chr(ord("A") + i)
        p = p.with_target(prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(ref).datasource(ds))
        if q.unit is not None:
            p = p.override_by_query(ref, [DynamicConfigValue(id_val="unit", value=q.unit),
                                          DynamicConfigValue(id_val="custom.axisPlacement", value="right")])
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


def cluster_dashboard() -> dict:
    return build_dashboard("k3 cluster", "k3-cluster", CLUSTER_PANELS, ["k3", "cluster"])


def k3_dashboards() -> list[dict]:
    return [training_dashboard(), serving_dashboard(), cluster_dashboard()]


def ray_dashboards() -> dict[str, dict]:
    """Ray's own dashboards by file name, from the installed Ray's generator (its RAY_GRAFANA_*
    environment overrides of uids and filters apply, as they do on a head)."""
    from ray.dashboard.modules.metrics import grafana_dashboard_factory as factory

    return {name: json.loads(getattr(factory, gen)()[0]) for name, gen in RAY_DASHBOARDS.items()}


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel of a dashboard's JSON."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def provisioning_files(dashboards_path: str) -> dict[str, dict]:
    """Grafana provisioning: a Prometheus datasource named as Ray's dashboards expect it (URL from
    $PROMETHEUS_URL, which Grafana expands when it reads the file) and one file provider per
    folder: k3's dashboards in <dashboards_path>/k3, Ray's in <dashboards_path>/ray."""
    return {
        "provisioning/datasources/k3-prometheus.yaml": {
            "apiVersion": 1,
            "datasources": [{"name": "Prometheus", "type": "prometheus", "uid": "k3-prometheus", "access": "proxy",
                             "url": "$PROMETHEUS_URL", "isDefault": True}]},
        "provisioning/dashboards/k3.yaml": {
            "apiVersion": 1,
            "providers": [{"name": name, "folder": title, "folderUid": uid, "type": "file", "allowUiUpdates": False,
                           "options": {"path": f"{dashboards_path}/{uid}"}}
                          for name, title, uid in (("k3", "k3", FOLDER_UID), ("ray", "Ray", RAY_FOLDER_UID))]},
    }


def write_dashboards(out_dir: str | os.PathLike, dashboards_path: str = "/etc/grafana/dashboards") -> list[Path]:
    """Write k3's dashboards (out_dir/k3-*.json), Ray's (out_dir/ray/*.json) and the provisioning
    files under out_dir; returns the paths. The new files are written beside out_dir and swapped in
    together (k3.model.directory), keeping the folder's other files: a writer killed midway leaves
    the previous version."""
    out = Path(out_dir)
    files = {f"{d['uid']}.json": json.dumps(d, indent=2, sort_keys=True) + "\n" for d in k3_dashboards()}
    files |= {f"ray/{name}": json.dumps(d, indent=2, sort_keys=True) + "\n" for name, d in ray_dashboards().items()}
    files |= {rel: yaml.safe_dump(body, sort_keys=False) for rel, body in provisioning_files(dashboards_path).items()}
    with write_beside(out) as stage:
        for rel, text in files.items():
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            (stage / rel).write_text(text)
    return [out / rel for rel in files]


def check_grafana_url(url: str | None) -> str:
    """url when it is one Grafana's client can reach (http or https), else ValueError naming the flag."""
    if not url:
        raise ValueError("no Grafana URL: pass --grafana-url or set GRAFANA_URL")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--grafana-url must start with http:// or https://, got {url!r}")
    return url


class GrafanaPushError(RuntimeError):
    """The push to Grafana failed (the message is one line)."""


def push_dashboards(url: str, token: str | None, folders: dict[tuple[str, str], list[dict]] | None = None,
                    timeout_s: float = 10.0) -> list[dict]:
    """For each (folder uid, title) -> dashboards (default: k3's in "k3", Ray's in "Ray"): create
    the folder if missing, then POST each dashboard to /api/dashboards/db with `folderUid` and
    `overwrite: true`, through grafana-client; returns Grafana's replies."""
    import requests
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

    check_grafana_url(url)
    if not token:
        raise ValueError("no Grafana token: set GRAFANA_TOKEN to a service-account token with dashboard write access")
    if folders is None:
        folders = {(FOLDER_UID, "k3"): k3_dashboards(), (RAY_FOLDER_UID, "Ray"): list(ray_dashboards().values())}
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    replies = []
    try:
        for (folder_uid, folder_title), dashboards in folders.items():
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
