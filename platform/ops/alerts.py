"""Prometheus alerting rules as code, each with a `promtool test rules` case that fires and one
that does not.

    write_alerts("cluster/prometheus")                  # k3-alerts.yaml + k3-alerts.test.yaml
    write_alerts("cluster/prometheus", AlertConfig(ttft_p99_s=1.0))
    check_rules("cluster/prometheus/k3-alerts.yaml")    # promtool check rules
    run_rule_tests("cluster/prometheus/k3-alerts.test.yaml")   # promtool test rules

The thresholds are `AlertConfig` fields (`k3 monitor dashboards --alerts-config FILE` reads them
from YAML). `k3 monitor up` loads the rules into Prometheus, which evaluates them (its /alerts
page and /api/v1/alerts); routing them to people needs an Alertmanager, which k3 does not run.
promtool ships in the same Debian package as Prometheus (`make prometheus`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from k3.model.directory import write_beside

from .prometheus import CACHED_BINARY, PrometheusError

RULES_FILE = "k3-alerts.yaml"
TESTS_FILE = "k3-alerts.test.yaml"
_DURATION = r"^[0-9]+[smh]$"
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def seconds(duration: str) -> int:
    """A duration of the `_DURATION` form in seconds."""
    return int(duration[:-1]) * _UNIT_S[duration[-1]]


class AlertConfig(BaseModel):
    """Thresholds of k3's alerts."""

    # nan or inf would be written into the rules as text promtool cannot parse
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    loss_window: str = Field("15m", pattern=_DURATION, description="Loss rising: the mean over this window is "
                                                                   "compared with the mean over the window before.")
    loss_rise: float = Field(1.05, gt=1.0, description="Loss rising: fires when the recent mean exceeds the earlier "
                                                       "mean times this.")
    throughput_drop: float = Field(0.5, gt=0.0, lt=1.0, description="Tokens/s dropping: fires when the last 5 "
                                                                    "minutes' mean falls below this share of the "
                                                                    "30 minutes before.")
    maxvio_bound: float = Field(1.0, gt=0.0, description="MaxVio high: the bound (1.0: a layer's busiest expert "
                                                         "takes twice its share of tokens).")
    maxvio_steps: int = Field(50, ge=1, description="MaxVio high: fires when a layer stayed above the bound for at "
                                                    "least this many optimizer steps...")
    maxvio_window: str = Field("30m", pattern=_DURATION, description="...taken within this window (it must be long "
                                                                     "enough to hold that many steps).")
    restart_window: str = Field("10m", pattern=_DURATION, description="Worker restart: how long the alert fires "
                                                                      "after the worker group restarted.")
    ttft_p99_s: float = Field(2.0, gt=0.0, description="Serving SLO: p99 time to first token, seconds.")
    http_5xx_ratio: float = Field(0.01, gt=0.0, lt=1.0, description="Serving SLO: share of HTTP requests answered "
                                                                    "5xx.")
    slo_for: str = Field("5m", pattern=_DURATION, description="How long a serving SLO must be missed before the "
                                                              "alert fires.")
    down_for: str = Field("1m", pattern=_DURATION, description="How long a replica is unhealthy or a node's "
                                                               "metrics are unreachable before the alert fires.")

    @field_validator("loss_window", "maxvio_window", "restart_window")
    @classmethod
    def _at_least_a_minute(cls, v: str) -> str:
        # Prometheus refuses a range or offset of 0; a window compares samples within it (two
        # windows' means, the step gauge's first and last) and the promtool cases sample once a minute
        if seconds(v) < 60:
            raise ValueError(f"must be at least 1m, got {v}")
        return v


@dataclass(frozen=True)
class Case:
    """A promtool unit test: input series ({selector: promtool's expanding notation}, one sample a
    minute), the time the alert is evaluated at, and the labels of each alert expected then
    (none: the alert must not fire)."""

    series: dict[str, str]
    at: str
    alerts: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str  # "critical" wakes someone; "warning" is looked at in working hours
    summary: str  # may name labels as {{ $labels.NAME }}
    fires: Case
    quiet: Case
    extra_cases: tuple[Case, ...] = field(default=())


def _geometric(start: float, per_window: float, window_min: int, minutes: int) -> str:
    """Explicit samples, one a minute for `minutes` + 1 minutes, multiplied by `per_window` every
    `window_min` minutes (the same factor each minute)."""
    step = per_window ** (1 / window_min)
    return " ".join(f"{start * step ** i:.9g}" for i in range(minutes + 1))


def training_alerts(c: AlertConfig) -> list[Alert]:
    loss, tps, mv, step = ("ray_k3_train_loss", "ray_k3_train_tokens_per_s", "ray_k3_train_maxvio",
                           "ray_k3_train_step")
    run = 'SessionName="s", WorkerId="w"'
    w = c.maxvio_window
    quiet_at = max(25, -(-seconds(c.restart_window) // 60) + 5)  # minutes
    rise_min = -(-seconds(c.loss_window) // 60)
    rise_at = 2 * rise_min + 10  # two windows of history, then the rule's 5m `for` and a margin
    return [
        Alert("K3TrainLossNotFinite", f"({loss} != {loss}) or (abs({loss}) == +Inf)", "0m", "critical",
              "training loss of {{ $labels.SessionName }} is NaN or infinite",
              fires=Case({f"{loss}{{{run}}}": "2.1 2.0 NaN"}, "2m", ({"SessionName": "s", "WorkerId": "w"},)),
              quiet=Case({f"{loss}{{{run}}}": "2.1 2.0 1.9"}, "2m")),
        Alert("K3TrainLossRising", f"avg_over_time({loss}[{c.loss_window}]) > {c.loss_rise:g} * "
                                   f"avg_over_time({loss}[{c.loss_window}] offset {c.loss_window})",
              "5m", "warning", "training loss of {{ $labels.SessionName }} is rising",
              # a loss growing (or shrinking) by the same factor every minute: any window's mean is
              # twice the rise (or under 1x) the window's before, whatever the window and the rise
              fires=Case({f"{loss}{{{run}}}": _geometric(2.0, 2 * c.loss_rise, rise_min, rise_at)}, f"{rise_at}m",
                         ({"SessionName": "s", "WorkerId": "w"},)),
              quiet=Case({f"{loss}{{{run}}}": _geometric(5.0, 0.5, rise_min, rise_at)}, f"{rise_at}m")),
        Alert("K3TrainThroughputDropped", f"avg_over_time({tps}[5m]) < {c.throughput_drop:g} * "
                                          f"avg_over_time({tps}[30m] offset 5m)",
              "5m", "warning", "tokens/s of {{ $labels.SessionName }} fell below "
                               f"{c.throughput_drop:.0%} of the half hour before",
              fires=Case({f"{tps}{{{run}}}": "1000x40 300x20"}, "55m", ({"SessionName": "s", "WorkerId": "w"},)),
              quiet=Case({f"{tps}{{{run}}}": "1000x40 700x20"}, "55m")),
        Alert("K3MaxVioHigh", f"min_over_time({mv}[{w}]) > {c.maxvio_bound:g} and on(SessionName) "
                              f"(max_over_time({step}[{w}]) - min_over_time({step}[{w}]) >= {c.maxvio_steps})",
              "0m", "warning", "MoE layer {{ $labels.layer }} of {{ $labels.SessionName }}: MaxVio above "
                               f"{c.maxvio_bound:g} for {c.maxvio_steps}+ steps",
              fires=Case({f'{mv}{{{run}, layer="3"}}': f"{c.maxvio_bound * 1.5:g}x40",
                          f"{step}{{{run}}}": f"0+{c.maxvio_steps}x40"}, "40m",
                         ({"SessionName": "s", "WorkerId": "w", "layer": "3"},)),
              # one dip below the bound a minute before the check: inside any window of 1m or more
              quiet=Case({f'{mv}{{{run}, layer="3"}}': f"{c.maxvio_bound * 1.5:g}x38 {c.maxvio_bound / 2:g} "
                                                       f"{c.maxvio_bound * 1.5:g}",
                          f"{step}{{{run}}}": f"0+{c.maxvio_steps}x40"}, "40m"),
              # above the bound the whole window, but too few steps in it (a stalled run)
              extra_cases=(Case({f'{mv}{{{run}, layer="3"}}': f"{c.maxvio_bound * 1.5:g}x40",
                                 f"{step}{{{run}}}": "100x40"}, "40m"),)),
        # each worker group start counts in a series of its own (a new WorkerId): a series that
        # exists now and did not `restart_window` ago is a restart within the window
        Alert("K3TrainWorkerRestarted", "ray_k3_train_restarts_total unless ray_k3_train_restarts_total offset "
                                        f"{c.restart_window}",
              "0m", "warning", "the worker group of {{ $labels.SessionName }} restarted from a checkpoint",
              # restarted at 14m: checked within the window after, and once the window has passed
              fires=Case({'ray_k3_train_restarts_total{SessionName="s", WorkerId="w2"}': "_x14 1x5"},
                         f"{14 + min(4, seconds(c.restart_window) // 120)}m",
                         ({"SessionName": "s", "WorkerId": "w2"},)),
              quiet=Case({'ray_k3_train_restarts_total{SessionName="s", WorkerId="w2"}': f"1x{quiet_at + 5}"},
                         f"{quiet_at}m")),
    ]


def serving_alerts(c: AlertConfig) -> list[Alert]:
    ttft = "ray_k3_serve_time_to_first_token_seconds_bucket"
    http = "ray_serve_num_http_requests_total"
    # two buckets around the SLO: every request in the upper one puts p99 above it
    lo, hi = f"{c.ttft_p99_s / 2:g}", f"{c.ttft_p99_s * 2:g}"

    # the rate's 5m window, then the SLO's `for`, then a margin; the series run past the check
    slo_at = 5 + -(-seconds(c.slo_for) // 60) + 5
    n = slo_at + 5
    down_at = 2 + -(-seconds(c.down_for) // 60) + 2  # unhealthy from the second minute

    def buckets(slow: bool) -> dict[str, str]:
        return {f'{ttft}{{model="k3", le="{lo}"}}': f"0x{n}" if slow else f"0+10x{n}",
                f'{ttft}{{model="k3", le="{hi}"}}': f"0+10x{n}", f'{ttft}{{model="k3", le="+Inf"}}': f"0+10x{n}"}

    ok, err = f'{http}{{application="k3", route="/", status_code="200"}}', \
        f'{http}{{application="k3", route="/", status_code="500"}}'
    return [
        Alert("K3ServeTTFTOverSLO", f"histogram_quantile(0.99, sum by (le, model) (rate({ttft}[5m]))) > "
                                    f"{c.ttft_p99_s:g}",
              c.slo_for, "critical", "p99 time to first token of {{ $labels.model }} is over "
                                     f"{c.ttft_p99_s:g} s",
              fires=Case(buckets(slow=True), f"{slo_at}m", ({"model": "k3"},)),
              quiet=Case(buckets(slow=False), f"{slo_at}m")),
        Alert("K3ServeHTTP5xxOverSLO", f'sum by (application) (rate({http}{{status_code=~"5.."}}[5m])) / '
                                       f'sum by (application) (rate({http}{{route!~"/-/.*"}}[5m])) > '
                                       f"{c.http_5xx_ratio:g}",
              c.slo_for, "critical", "{{ $labels.application }} answers over "
                                     f"{c.http_5xx_ratio:.0%} of requests with 5xx",
              fires=Case({ok: f"0+100x{n}", err: f"0+5x{n}"}, f"{slo_at}m", ({"application": "k3"},)),
              quiet=Case({ok: f"0+100x{n}", err: f"0x{n}"}, f"{slo_at}m")),
        Alert("K3ServeReplicaUnhealthy", "ray_serve_deployment_replica_healthy == 0", c.down_for, "critical",
              "replica {{ $labels.replica }} of {{ $labels.deployment }} fails its health check",
              fires=Case({'ray_serve_deployment_replica_healthy{deployment="PrefillServer", replica="r1"}':
                          f"1 1 0x{down_at}"}, f"{down_at}m", ({"deployment": "PrefillServer", "replica": "r1"},)),
              quiet=Case({'ray_serve_deployment_replica_healthy{deployment="PrefillServer", replica="r1"}':
                          f"1x{down_at + 2}"}, f"{down_at}m")),
    ]


def cluster_alerts(c: AlertConfig) -> list[Alert]:
    at = 2 + -(-seconds(c.down_for) // 60) + 1  # down from the second minute, the `for`, a margin
    return [
        # a listed node whose metrics stop answering, or one the autoscaler saw fail
        Alert("K3NodeDown", '(up{job="ray"} == 0) or (sum by (NodeType) (autoscaler_recently_failed_nodes) > 0)',
              c.down_for, "critical", "a Ray node is down ({{ $labels.instance }}{{ $labels.NodeType }})",
              fires=Case({'up{job="ray", instance="10.0.0.7:8080"}': f"1 1 0x{at}"}, f"{at}m",
                         ({"job": "ray", "instance": "10.0.0.7:8080"},)),
              quiet=Case({'up{job="ray", instance="10.0.0.7:8080"}': f"1x{at + 1}",
                          'autoscaler_recently_failed_nodes{NodeType="h100.8x"}': f"0x{at + 1}"}, f"{at}m"),
              extra_cases=(Case({'autoscaler_recently_failed_nodes{NodeType="h100.8x"}': f"0 1x{at}"}, f"{at}m",
                                ({"NodeType": "h100.8x"},)),)),
    ]


def alerts(config: AlertConfig | None = None) -> list[Alert]:
    c = config or AlertConfig()
    return [*training_alerts(c), *serving_alerts(c), *cluster_alerts(c)]


def _summary(a: Alert, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), a.summary)


def rules_file(items: list[Alert]) -> dict:
    """The rule file (Prometheus's rule-group format)."""
    return {"groups": [{"name": "k3", "rules": [
        {"alert": a.name, "expr": a.expr, "for": a.for_, "labels": {"severity": a.severity},
         "annotations": {"summary": a.summary}} for a in items]}]}


def tests_file(items: list[Alert], rules: str = RULES_FILE) -> dict:
    """promtool's unit-test file: every case of every alert, evaluated once a minute."""
    tests = []
    for a in items:
        for case in (a.fires, a.quiet, *a.extra_cases):
            exp = [{"exp_labels": {**labels, "severity": a.severity},
                    "exp_annotations": {"summary": _summary(a, labels)}} for labels in case.alerts]
            tests.append({"name": f"{a.name} {'fires' if case.alerts else 'stays quiet'}", "interval": "1m",
                          "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                          "alert_rule_test": [{"eval_time": case.at, "alertname": a.name, "exp_alerts": exp}]})
    return {"rule_files": [rules], "evaluation_interval": "1m", "tests": tests}


def write_alerts(out_dir: str | os.PathLike, config: AlertConfig | None = None) -> list[Path]:
    """Write the rules and their promtool tests under out_dir, swapped in together beside the
    folder's other files (k3.model.directory); returns both paths. Where promtool is found the
    new rules are checked and their tests run before the swap: PrometheusError, and out_dir as it
    was, when promtool refuses them."""
    items = alerts(config)
    files = {RULES_FILE: rules_file(items), TESTS_FILE: tests_file(items)}
    with write_beside(out_dir) as stage:
        for name, body in files.items():
            (stage / name).write_text(yaml.safe_dump(body, sort_keys=False, width=120))
        if find_promtool() is not None:
            try:
                check_rules(stage / RULES_FILE)
                run_rule_tests(stage / TESTS_FILE)
            except PrometheusError as e:
                raise PrometheusError(f"these thresholds give rules promtool refuses, {out_dir} left as it was: "
                                      f"{e}") from None
    return [Path(out_dir) / name for name in files]


def load_alert_config(path: str | os.PathLike) -> AlertConfig:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such alert config")
    try:
        return AlertConfig.model_validate(yaml.safe_load(p.read_text()) or {})
    except Exception as e:  # pydantic's ValidationError or a YAML error
        raise ValueError(f"{p}: {' '.join(str(e).split())}") from None


def find_promtool() -> Path | None:
    """promtool on PATH, else beside the Prometheus `make prometheus` unpacks into .cache/; None
    when neither is there."""
    found = shutil.which("promtool")
    if found:
        return Path(found)
    cached = CACHED_BINARY.with_name("promtool")
    return cached if cached.exists() else None


def promtool() -> Path:
    """find_promtool(), or PrometheusError saying how to get it."""
    found = find_promtool()
    if found is None:
        raise PrometheusError(f"no promtool: not on PATH and not at {CACHED_BINARY.with_name('promtool')} "
                              "(run `make prometheus`)")
    return found


def _promtool(*args: str) -> str:
    r = subprocess.run([str(promtool()), *args], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise PrometheusError(f"promtool {' '.join(args)} failed: {' '.join((r.stdout + r.stderr).split())}")
    return r.stdout


def check_rules(path: str | os.PathLike) -> str:
    """`promtool check rules PATH`; PrometheusError (one line) when it refuses the file."""
    return _promtool("check", "rules", str(path))


def run_rule_tests(path: str | os.PathLike) -> str:
    """`promtool test rules PATH` (every case of tests_file); PrometheusError when one fails."""
    return _promtool("test", "rules", str(path))
