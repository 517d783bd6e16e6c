"""Alerting rules as code: the committed files are what the code writes, promtool accepts the rules,
and every alert has a promtool unit test that fires and one that stays quiet, all passing."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from helpers import run_killed_midway, tree_bytes

import k3.platform.ops.alerts as alerts_mod
from k3.platform.ops.alerts import (
    RULES_FILE, TESTS_FILE, AlertConfig, alerts, check_rules, load_alert_config, run_rule_tests, write_alerts)
from k3.platform.ops.prometheus import PrometheusError

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "cluster" / "prometheus"
ASKED_FOR = {"K3TrainLossNotFinite", "K3TrainLossRising", "K3TrainThroughputDropped", "K3MaxVioHigh",
             "K3TrainWorkerRestarted", "K3ServeTTFTOverSLO", "K3ServeHTTP5xxOverSLO", "K3ServeReplicaUnhealthy",
             "K3NodeDown"}


def test_committed_rules_and_tests_are_what_the_code_writes(tmp_path):
    for p in write_alerts(tmp_path):
        assert (COMMITTED / p.name).read_text() == p.read_text(), f"{p.name} is stale: run `k3 monitor dashboards`"


def test_rules_killed_midway_leave_the_previous_version_whole(tmp_path):
    out = tmp_path / "prometheus"
    write_alerts(out)
    (out / RULES_FILE).write_text("groups: []\n")  # an older version, and a file of the user's own
    (out / "mine.yaml").write_text("mine\n")
    before = tree_bytes(out)
    run_killed_midway(f"from k3.platform.ops.alerts import write_alerts\nwrite_alerts({str(out)!r})",
                      "pathlib:Path.write_text", after=1)
    assert tree_bytes(out) == before, "the killed writer changed the previous rules"
    written = write_alerts(out)
    assert [p.name for p in written] == [RULES_FILE, TESTS_FILE] and (out / "mine.yaml").read_text() == "mine\n"
    assert (out / RULES_FILE).read_text() == (COMMITTED / RULES_FILE).read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prometheus"], "a killed writer's leftovers stayed"


def test_promtool_accepts_the_rules_and_every_case_passes():
    assert "SUCCESS: 9 rules found" in check_rules(COMMITTED / RULES_FILE)
    assert "SUCCESS" in run_rule_tests(COMMITTED / TESTS_FILE)


def test_every_alert_has_a_case_that_fires_and_one_that_does_not():
    names = {a.name for a in alerts()}
    assert names == ASKED_FOR
    tests = yaml.safe_load((COMMITTED / TESTS_FILE).read_text())["tests"]
    for name in names:
        mine = [t["alert_rule_test"][0] for t in tests if t["alert_rule_test"][0]["alertname"] == name]
        assert any(t["exp_alerts"] for t in mine) and any(not t["exp_alerts"] for t in mine), name


@pytest.mark.parametrize("change", [
    ("K3ServeTTFTOverSLO", "> 2", "> 20"),  # a threshold no case reaches: the firing case fails
    ("K3TrainWorkerRestarted", "offset 10m", "offset 1m"),
    ("K3ServeHTTP5xxOverSLO", "> 0.01", "> 0.1"),
    ("K3MaxVioHigh", ">= 50", ">= 0"),  # the stalled-run case (no steps) then fires
])
def test_a_wrong_rule_fails_its_promtool_case(tmp_path, change):
    name, old, new = change
    write_alerts(tmp_path)
    rules = yaml.safe_load((tmp_path / RULES_FILE).read_text())
    (rule,) = [r for r in rules["groups"][0]["rules"] if r["alert"] == name]
    assert old in rule["expr"]
    rule["expr"] = rule["expr"].replace(old, new)
    (tmp_path / RULES_FILE).write_text(yaml.safe_dump(rules))
    with pytest.raises(PrometheusError, match=f"promtool test rules \\S+ failed.*{name} (fires|stays quiet)"):
        run_rule_tests(tmp_path / TESTS_FILE)


def test_thresholds_come_from_the_config(tmp_path):
    (tmp_path / "a.yaml").write_text("ttft_p99_s: 0.5\nmaxvio_steps: 10\n")
    write_alerts(tmp_path, load_alert_config(tmp_path / "a.yaml"))
    exprs = {r["alert"]: r["expr"] for r in yaml.safe_load((tmp_path / RULES_FILE).read_text())["groups"][0]["rules"]}
    assert exprs["K3ServeTTFTOverSLO"].endswith("> 0.5") and ">= 10)" in exprs["K3MaxVioHigh"]
    assert "SUCCESS" in run_rule_tests(tmp_path / TESTS_FILE)  # the cases follow the thresholds


@pytest.mark.parametrize("body, match", [
    ("ttft_p99_s: -1\n", "ttft_p99_s"),
    ("loss_window: 15 minutes\n", "loss_window"),
    ("throughput_drop: 1.5\n", "throughput_drop"),
    ("unknown: 1\n", "unknown"),
    ("loss_window: 0m\n", "loss_window.*at least 1m"),  # promtool: "duration must be greater than 0"
    ("maxvio_window: 30s\n", "maxvio_window.*at least 1m"),
    ("restart_window: 0s\n", "restart_window.*at least 1m"),
    ("maxvio_bound: .inf\n", "maxvio_bound"),  # written as `infx40`, which promtool cannot parse
    ("ttft_p99_s: .nan\n", "ttft_p99_s"),
])
def test_bad_alert_config_is_one_clear_line(tmp_path, body, match):
    (tmp_path / "a.yaml").write_text(body)
    with pytest.raises(ValueError, match=match) as e:
        load_alert_config(tmp_path / "a.yaml")
    assert "\n" not in str(e.value)


def test_promtool_refusing_a_rules_file_is_one_clear_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("groups:\n- name: k3\n  rules:\n  - alert: X\n    expr: rate(\n")
    with pytest.raises(PrometheusError, match=r"promtool check rules \S+bad.yaml failed") as e:
        check_rules(tmp_path / "bad.yaml")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("body", [
    "loss_rise: 2.0\n",  # the firing case rose 5% a quarter hour whatever the threshold
    "loss_rise: 1000\nloss_window: 2h\n",
    "slo_for: 1h\ndown_for: 30m\n",  # the cases were checked 15 and 4-5 minutes in
    "maxvio_steps: 100000\nmaxvio_window: 1m\n",  # the quiet case's dip was outside windows under 20m
    "restart_window: 1h\n",  # the quiet case ended before the window had passed
    "restart_window: 1m\n",
])
def test_the_cases_follow_the_windows(tmp_path, body):
    (tmp_path / "a.yaml").write_text(body)
    write_alerts(tmp_path, load_alert_config(tmp_path / "a.yaml"))
    assert "SUCCESS" in run_rule_tests(tmp_path / TESTS_FILE)


def test_rules_promtool_refuses_leave_the_previous_ones(tmp_path, monkeypatch):
    out = tmp_path / "prometheus"
    write_alerts(out)
    before = tree_bytes(out)
    wrong = [dataclasses.replace(a, expr=a.expr.replace("> 2", "> 20")) for a in alerts_mod.serving_alerts(AlertConfig())]
    monkeypatch.setattr(alerts_mod, "serving_alerts", lambda c: wrong)  # a threshold no firing case reaches
    with pytest.raises(PrometheusError, match=f"{out} left as it was: promtool test rules .*K3ServeTTFTOverSLO") as e:
        write_alerts(out, AlertConfig())
    assert "\n" not in str(e.value)
    assert tree_bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["prometheus"]
