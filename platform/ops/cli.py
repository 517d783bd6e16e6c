"""The `k3` command line.

    k3 params --preset k3 [--json]      total and active parameter counts (meta device, no memory)
    k3 params --preset k3 --release-layout   also count the K3 release's tensor layout
    k3 presets                          list the presets
    k3 config --preset k3-tiny          print a preset's config as JSON
    k3 cluster up|status|down           the local autoscaling Ray cluster (cluster/local-autoscaling.yaml)
    k3 cluster env                      its addresses as shell exports: eval "$(k3 cluster env)"
    k3 cluster rayservice               the KubeRay RayService with serveConfigV2 from serve/config.yaml
    k3 cluster aws --subnet --security-group   cluster/aws-gpu.yaml with EFA and a placement group
    k3 monitor up|down                  Prometheus scraping it (+ the dashboards pushed when GRAFANA_URL is set)
    k3 monitor dashboards [--out DIR]   write the Grafana dashboards and provisioning files (this checkout's
                                        cluster/grafana) and the alerting rules (cluster/prometheus)
    k3 monitor push                     push the dashboards to GRAFANA_URL with GRAFANA_TOKEN
    k3 report RUN_DIR                   an HTML page with PNG plots of a pretraining run
    k3 plan --preset k3 --context 1048576 --gpus 64 --gpu h200 [--json]
                                        training and serving capacity on a cluster (platform/ops/plan/)

Operational commands print one line `k3: error: ...` and exit 1 on bad input or an unreachable
service, leaving nothing they started running. Only the commands that need torch, Ray or the
monitoring packages import them, so help and argument errors answer at once.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from k3.model.config import PRESETS, get_preset


def _human(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3f}{unit}"
    return str(n)


def cmd_params(args: argparse.Namespace) -> int:
    from k3.model.params import count_parameters, count_release_parameters, count_vision_parameters

    cfg = get_preset(args.preset)
    c = count_parameters(cfg)
    v = count_vision_parameters(cfg)
    r = count_release_parameters(cfg) if args.release_layout else None
    if args.json:
        extra = ({} if v is None else {"vision": v.as_dict()}) | ({} if r is None else {"release_layout": r.as_dict()})
        print(json.dumps({"preset": args.preset, **c.as_dict(), **extra}, indent=2))
        return 0
    print(f"preset          {args.preset}")
    print(f"total           {c.total:>20,}  ({_human(c.total)})")
    print(f"active/token    {c.active:>20,}  ({_human(c.active)})")
    print(f"  embedding     {c.embedding:>20,}  (input embedding, not counted as active)")
    print(f"  routed experts{c.routed_experts:>20,}  ({cfg.num_experts_per_token} of {cfg.num_experts} active per MoE layer)")
    print(f"  attention     {c.attention:>20,}")
    if v is not None:
        print(f"vision tower    {v.tower:>20,}  ({_human(v.tower)}, MoonViT-V2)")
        print(f"mm projector    {v.projector:>20,}  ({_human(v.projector)}, PatchMergerV2)")
    print(f"note: {c.note}" + ("; the totals above are the language model, vision is listed apart" if v else ""))
    if r is not None:
        print(f"release layout  {r.total:>20,}  ({_human(r.total)}; language model, MXFP4 experts counted unpacked)")
        print(f"  difference    {r.total - r.k3_total:>20,}  = AttnRes norm weights {r.attn_res_norms:,} (k3 folds "
              f"each into its pseudo-query) + A_log padding {r.a_log_padding:,} + router correction bias "
              f"{r.router_bias:,} (a buffer in k3)")
        print(f"  MXFP4 scales  {r.mxfp4_scales:>20,}  (one E8M0 byte per 32 expert weights, not counted)")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    for name in PRESETS:
        cfg = get_preset(name)
        print(f"{name:22s} layers={cfg.num_layers:3d} hidden={cfg.hidden_size:5d} experts={cfg.num_experts:4d} "
              f"experts_per_token={cfg.num_experts_per_token:2d} mla_layers={cfg.layer_types.count('mla')}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    print(get_preset(args.preset).to_json())
    return 0


# where `k3 monitor dashboards` writes, under this checkout whatever the current directory
GRAFANA_OUT = Path("cluster") / "grafana"
ALERTS_OUT = Path("cluster") / "prometheus"


def _shipped(given: str | None, default: str) -> Path:
    """A file the user named (relative to the current directory, as any path on a command line), or
    the checkout's `default` from any folder of it. An installed wheel holds no cluster/ or serve/
    configs: there `default` is read from the current directory, as before, and a missing one is
    refused naming its path."""
    from k3.platform.ops.prometheus import REPO

    if given:
        return Path(given)
    return REPO / default if (REPO / default).is_file() else Path(default)


def cmd_cluster(args: argparse.Namespace) -> int:
    from k3.platform.ops import cluster

    if args.action == "rayservice":
        from k3.platform.ops.kuberay import dump_manifest, rayservice_manifest

        print(dump_manifest(rayservice_manifest(_shipped(args.base, "cluster/kuberay/rayservice.yaml"),
                                                _shipped(args.serve_config, "serve/config.yaml"),
                                                args.model_path, haproxy=args.haproxy)), end="")
    elif args.action == "aws":
        from k3.platform.ops.aws import render_aws
        from k3.platform.ops.kuberay import dump_manifest

        print(dump_manifest(render_aws(_shipped(args.base, "cluster/aws-gpu.yaml"), args.region, args.subnet,
                                       args.security_group, args.placement_group, args.ami,
                                       haproxy=args.haproxy)), end="")
    elif args.action == "up":
        from k3.platform.ops.local_ray import direct_ingress_env

        st = cluster.up(_shipped(args.config, "cluster/local-autoscaling.yaml"), args.state,
                        grafana_url=os.environ.get("GRAFANA_URL") or None,
                        env=direct_ingress_env() if args.haproxy else None)
        print(f"k3 cluster up: head pid {st['pid']}, GCS {st['gcs_address']}, dashboard {st['address']}\n"
              f"  session dir {st['session_dir']}\n"
              f"  Prometheus port {st['prometheus_port']} reserved: `k3 monitor up` starts it there\n"
              f"  submit jobs with: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={st['token_path']} "
              f"ray job submit --address {st['address']} ...")
        if args.haproxy:
            print("  Serve's HTTP port is HAProxy's: each request goes to an ingress replica's own server")
    elif args.action == "env":
        print(cluster.shell_env(args.state), end="")
    elif args.action == "status":
        print(cluster.status(args.state), end="")
    else:
        print(f"k3 cluster down: {cluster.down(args.state, force=args.force)}")
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from k3.platform.ops.dashboards import push_dashboards, write_dashboards

    if args.action == "dashboards":
        from k3.platform.ops.alerts import load_alert_config, write_alerts
        from k3.platform.ops.prometheus import REPO

        alert_config = load_alert_config(args.alerts_config) if args.alerts_config else None
        for p in write_dashboards(args.out or REPO / GRAFANA_OUT):
            print(p)
        for p in write_alerts(args.alerts_out or REPO / ALERTS_OUT, alert_config):
            print(p)
    elif args.action == "push":
        for r in push_dashboards(args.grafana_url, os.environ.get("GRAFANA_TOKEN")):
            print(f"pushed {r.get('uid')}: {r.get('url')}")
    elif args.action == "down":
        _monitor_down(args.state, args.force)
    else:
        _monitor_up(args)
    return 0


def _monitor_state(path: str | None):
    from k3.platform.ops.state import StateFile, default_monitor_state

    return StateFile(default_monitor_state() if path is None else path, "k3 monitor", "k3 monitor down")


def _monitor_down(state: str | None, force: bool) -> None:
    from k3.platform.ops.prometheus import Prometheus

    print(f"k3 monitor down: {_monitor_state(state).stop(Prometheus.from_state, force)}")


def _scrape_target(args: argparse.Namespace) -> tuple[str, int | None]:
    """(session dir, port): --session-dir and --port, or the recorded cluster's session and the
    port `k3 cluster up` reserved for Prometheus (the Ray dashboard was started pointing there)."""
    if args.session_dir is not None:
        return args.session_dir, args.port
    from k3.platform.ops.cluster import running_head, state_file

    head = running_head(args.cluster_state)
    reserved = state_file(args.cluster_state).read().get("prometheus_port")
    return str(head.session_dir), args.port or reserved


def _monitor_up(args: argparse.Namespace) -> None:
    from k3.platform.ops.alerts import check_rules, find_promtool
    from k3.platform.ops.dashboards import check_grafana_url, push_dashboards
    from k3.platform.ops.prometheus import Prometheus

    state = _monitor_state(args.state)
    old = state.load(Prometheus.from_state)
    if old is not None and old.alive():
        raise ValueError(f"Prometheus already runs (pid {old.pid}, see {state.path}): `k3 monitor down` first")
    state.prepare()  # before Prometheus starts: it must not run unrecorded
    if args.grafana_url and not os.environ.get("GRAFANA_TOKEN"):
        raise ValueError("GRAFANA_URL is set but GRAFANA_TOKEN is not: the dashboards cannot be pushed")
    if args.grafana_url:
        check_grafana_url(args.grafana_url)  # before Prometheus starts
    session, port = _scrape_target(args)
    from k3.platform.ops.prometheus import REPO

    shipped = REPO / "cluster" / "prometheus" / "k3-alerts.yaml"
    rules = Path(args.rules) if args.rules else (shipped if shipped.is_file() else None)
    prom = Prometheus(session, state.path.parent / "prometheus", scrape_interval_s=args.scrape_interval, port=port,
                      rules_file=rules)
    if prom.rules_file is not None and find_promtool() is not None:
        check_rules(prom.rules_file)  # Prometheus itself says only "error loading config"
    prom.start()
    try:
        if args.grafana_url:
            for r in push_dashboards(args.grafana_url, os.environ.get("GRAFANA_TOKEN")):
                print(f"pushed {r.get('uid')}: {r.get('url')}")
        state.write(prom.state())
    except BaseException:
        prom.stop()  # nothing half-started stays running
        raise
    print(f"k3 monitor up: Prometheus {prom.url} (pid {prom.pid}) scraping {session}, "
          f"alerting rules {prom.rules_file or 'none'}")
    if args.session_dir is not None:
        print(f"  for the Ray dashboard's metrics, start that cluster's head with RAY_PROMETHEUS_HOST={prom.url}")


def cmd_report(args: argparse.Namespace) -> int:
    from k3.platform.ops.report import write_report

    print(write_report(args.run_dir, args.out, args.log))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from k3.platform.ops.plan.hardware import get_gpu

    get_gpu(args.gpu)  # an unknown GPU is refused before torch loads
    from k3.platform.ops.plan.planner import make_plan
    from k3.platform.ops.plan.render import as_json, render

    plan = make_plan(get_preset(args.preset), args.preset, args.context, args.gpus, args.gpu,
                     micro_batch=args.micro_batch, zero_stage=args.zero, checkpointing=not args.no_checkpointing,
                     utilisation=args.utilisation, expert_format=args.expert_format, dp=args.dp, cp=args.cp,
                     ep=args.ep)
    print(json.dumps(as_json(plan), indent=2) if args.json else render(plan))
    return 0


def _add_plan(sub) -> None:
    sp = sub.add_parser("plan", help="training and serving capacity of a preset on a GPU cluster")
    sp.add_argument("--preset", required=True, choices=sorted(PRESETS), help="preset name")
    sp.add_argument("--context", type=int, required=True, help="tokens per sequence")
    sp.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster (at most 1,048,576)")
    sp.add_argument("--gpu", required=True, help="GPU type: a100, h100 or h200")
    sp.add_argument("--micro-batch", type=int, default=1, help="training: sequences per data-parallel rank")
    sp.add_argument("--zero", type=int, choices=[1, 2], help="training: ZeRO stage (default: the better of 1 and 2)")
    sp.add_argument("--no-checkpointing", action="store_true", help="training: without activation checkpointing")
    sp.add_argument("--dp", type=int, help="training: pin the data-parallel size")
    sp.add_argument("--cp", type=int, help="training: pin the context-parallel size")
    sp.add_argument("--ep", type=int, help="training: pin the expert-parallel size")
    sp.add_argument("--utilisation", type=float, default=0.4,
                    help="share of the bf16 peak the FLOPs run at (0.01 to 1)")
    sp.add_argument("--expert-format", default="mxfp4", choices=["mxfp4", "bf16"],
                    help="serving: routed expert weights as released (MXFP4) or bf16")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.set_defaults(func=cmd_plan)


def _state_help(what: str, name: str) -> str:
    """--state's help: where `k3 cluster` and `k3 monitor` keep their state by default
    (k3.platform.ops.state), the same from any folder of a checkout."""
    return (f"where {what} is recorded (default: {name} under $K3_STATE_DIR if set, else under .cache of the "
            f"k3 checkout holding the current directory, else under ~/.cache/k3)")


def _add_cluster(sub) -> None:
    sp = sub.add_parser("cluster", help="the local autoscaling Ray cluster")
    sp.add_argument("action", choices=["up", "env", "status", "down", "rayservice", "aws"])
    sp.add_argument("--config", help="up: the fake multi-node cluster YAML (default: k3's "
                                     "cluster/local-autoscaling.yaml, from any folder)")
    sp.add_argument("--serve-config", help="rayservice: the Serve config (default: k3's serve/config.yaml)")
    sp.add_argument("--model-path", default="/mnt/k3/models/k3-small",
                    help="rayservice: the model directory inside the pods (on the shared volume); each engine "
                         "replica holds the whole model on one GPU (no tensor or expert parallelism), so it must "
                         "fit one: k3-small does, the full K3 does not. The engine's cache is the Serve config's "
                         "engine.cache_memory_bytes (256 MiB in serve/config.yaml): raise it there for a GPU")
    sp.add_argument("--base", help="rayservice: the RayService base (cluster/kuberay/rayservice.yaml); "
                                   "aws: the cluster YAML (cluster/aws-gpu.yaml)")
    sp.add_argument("--region", default="us-east-2", help="aws: the AWS region")
    sp.add_argument("--subnet", help="aws: the subnet for every node (in the zone of your p5 capacity)")
    sp.add_argument("--security-group", help="aws: a security group letting all traffic from itself in and out")
    sp.add_argument("--placement-group", default="k3-p5", help="aws: an existing cluster placement group")
    sp.add_argument("--ami", help="aws: pin this AMI (default: the current DLAMI, resolved when a node launches)")
    sp.add_argument("--state", help=_state_help("the running cluster", "k3-cluster/state.json"))
    sp.add_argument("--force", action="store_true", help="down: also remove a state file that cannot be read")
    sp.add_argument("--haproxy", action="store_true",
                    help="up, rayservice, aws: Ray Serve's direct ingress with HAProxy on Serve's HTTP port in "
                         "place of its Python proxy, each request forwarded to an ingress replica's own HTTP "
                         "server (rayservice / aws: its variable on every pod / node)")
    sp.set_defaults(func=cmd_cluster)


def _scrape_interval(text: str) -> float:
    from k3.platform.ops.prometheus import duration

    try:
        seconds = float(text)
        duration(seconds)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return seconds


def _add_monitor(sub) -> None:
    sp = sub.add_parser("monitor", help="Prometheus and the Grafana dashboards")
    sp.add_argument("action", choices=["up", "down", "dashboards", "push"])
    sp.add_argument("--cluster-state", help="the cluster to scrape (written by `k3 cluster up`; default: its default)")
    sp.add_argument("--session-dir", help="scrape this Ray session directory instead")
    sp.add_argument("--scrape-interval", type=_scrape_interval, default=5.0,
                    help="seconds between scrapes, 0.001 to 86400 (Prometheus keeps milliseconds)")
    sp.add_argument("--port", type=int, help="up: Prometheus's port (default: the one `k3 cluster up` reserved, "
                                            "or a free one with --session-dir)")
    sp.add_argument("--state", help=_state_help("the running Prometheus", "k3-monitor/state.json"))
    sp.add_argument("--force", action="store_true", help="down: also remove a state file that cannot be read")
    sp.add_argument("--grafana-url", default=os.environ.get("GRAFANA_URL"), help="Grafana to push to ($GRAFANA_URL)")
    sp.add_argument("--out", help=f"dashboards: output directory (default: this checkout's {GRAFANA_OUT})")
    sp.add_argument("--alerts-out", help="dashboards: where the alerting rules and their promtool tests go "
                                         f"(default: this checkout's {ALERTS_OUT})")
    sp.add_argument("--alerts-config", help="dashboards: YAML of alert thresholds (k3.platform.ops.alerts.AlertConfig)")
    sp.add_argument("--rules", help="up: alerting rules for Prometheus to evaluate (default: this checkout's "
                                    "cluster/prometheus/k3-alerts.yaml when there is one)")
    sp.set_defaults(func=cmd_monitor)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="k3: train and serve Kimi K3-architecture models on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("params", help="total and active parameter counts of a preset")
    sp.add_argument("--preset", required=True, choices=sorted(PRESETS), help="preset name")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.add_argument("--release-layout", action="store_true",
                    help="also count the release checkpoint's tensors (config.json names, MXFP4 experts)")
    sp.set_defaults(func=cmd_params)
    sp = sub.add_parser("presets", help="list presets")
    sp.set_defaults(func=cmd_presets)
    sp = sub.add_parser("config", help="print a preset's config as JSON")
    sp.add_argument("--preset", required=True, choices=sorted(PRESETS))
    sp.set_defaults(func=cmd_config)

    _add_cluster(sub)
    _add_monitor(sub)

    sp = sub.add_parser("report", help="HTML page with PNG plots of a pretraining run")
    sp.add_argument("run_dir", help="the run's directory (storage path / run name)")
    sp.add_argument("--out", help="output directory (default RUN_DIR/report)")
    sp.add_argument("--log", help="the job's log, whose tail the page shows (default RUN_DIR/job.log if present)")
    sp.set_defaults(func=cmd_report)
    _add_plan(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("cluster", "monitor", "report", "plan"):
        from k3.platform.ops.dashboards import GrafanaPushError
        from k3.platform.ops.prometheus import PrometheusError

        try:
            return args.func(args)
        except (ValueError, PrometheusError, GrafanaPushError, TimeoutError, RuntimeError) as e:
            print(f"k3: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 1
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
