"""Cluster YAMLs (Ray's own validation) and KubeRay manifests (field names from KubeRay's v1 types)."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from k3.platform.ops.cli import main
from k3.platform.ops.cluster import load_autoscaling_config, load_cloud_config
from k3.platform.ops.kuberay import load_manifest, load_serve_config, rayservice_manifest

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "cluster" / "local-autoscaling.yaml"
AWS = REPO / "cluster" / "aws-gpu.yaml"
KUBERAY = REPO / "cluster" / "kuberay"
SERVE_CONFIG = Path(__file__).resolve().parents[2] / "serve" / "config.yaml"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

# json field names of KubeRay's ray.io/v1 Go types (ray-operator/apis/ray/v1/{raycluster,rayjob,rayservice}_types.go
# at kuberay commits 3275ee09, f6ef3f7b, 834fe3a8). `required` are the fields without omitempty.
RAYCLUSTER_SPEC = {"suspend", "managedBy", "autoscalerOptions", "headServiceAnnotations", "enableInTreeAutoscaling",
                   "gcsFaultToleranceOptions", "headGroupSpec", "rayVersion", "workerGroupSpecs"}
HEAD_GROUP = {"template", "headService", "enableIngress", "rayStartParams", "serviceType"}
HEAD_GROUP_REQUIRED = {"template", "rayStartParams"}
WORKER_GROUP = {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds",
                "rayStartParams", "template", "scaleStrategy", "numOfHosts"}
WORKER_GROUP_REQUIRED = {"groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"}
AUTOSCALER_OPTIONS = {"resources", "image", "imagePullPolicy", "securityContext", "idleTimeoutSeconds",
                      "upscalingMode", "env", "envFrom", "volumeMounts"}
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
               "clusterSelector", "submitterConfig", "managedBy", "deletionPolicy", "entrypoint", "runtimeEnvYAML",
               "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus", "entrypointNumGpus",
               "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend"}
RAYSERVICE_SPEC = {"serveConfigV2", "rayClusterConfig", "serviceUnhealthySecondThreshold",
                   "deploymentUnhealthySecondThreshold", "serveService"}


def write_yaml(tmp_path: Path, cfg: dict, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def local_cfg() -> dict:
    return yaml.safe_load(LOCAL.read_text())


def check_cluster_spec(spec: dict, where: str) -> None:
    assert set(spec) <= RAYCLUSTER_SPEC, f"{where}: unknown RayClusterSpec fields {set(spec) - RAYCLUSTER_SPEC}"
    assert spec["enableInTreeAutoscaling"] is True and spec["rayVersion"] == _ray_version()
    assert set(spec["autoscalerOptions"]) <= AUTOSCALER_OPTIONS
    head = spec["headGroupSpec"]
    assert HEAD_GROUP_REQUIRED <= set(head) <= HEAD_GROUP, f"{where}: headGroupSpec fields {sorted(head)}"
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), "rayStartParams values are strings"
    assert spec["workerGroupSpecs"]
    for g in spec["workerGroupSpecs"]:
        assert WORKER_GROUP_REQUIRED <= set(g) <= WORKER_GROUP, f"{where}: workerGroupSpec fields {sorted(g)}"
        assert 0 == g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())
        (container,) = g["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    for c in [head["template"]["spec"]["containers"][0]] + [g["template"]["spec"]["containers"][0]
                                                           for g in spec["workerGroupSpecs"]]:
        assert c["image"].endswith(f":{VERSION}"), f"{where}: image {c['image']} is not k3 {VERSION}"


def _ray_version() -> str:
    import ray

    return ray.__version__


# -- local autoscaling YAML -----------------------------------------------------------------------
def test_local_autoscaling_yaml_is_complete_and_valid():
    cfg = load_autoscaling_config(LOCAL)
    assert cfg["provider"] == {**cfg["provider"], "type": "external", "module": "k3.platform.ops.fake_nodes.FakeNodes"}
    worker = cfg["available_node_types"]["cpu.worker"]
    assert worker["min_workers"] == 0 < worker["max_workers"] and cfg["idle_timeout_minutes"] > 0
    # every key the monitor reads without defaults is present (`ray start --autoscaling-config` fills none)
    for key in ("file_mounts", "cluster_synced_files", "worker_setup_commands", "worker_start_ray_commands",
                "head_node_type", "max_workers", "upscaling_speed", "auth"):
        assert key in cfg


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(head_node_type="gpu.head"), "head_node_type 'gpu.head' is not a node type"),
    (lambda c: c["available_node_types"]["cpu.worker"]["resources"].update(CPU=1.5),
     r"cpu.worker.resources.CPU must be a non-negative integer, got 1.5"),
    (lambda c: c["available_node_types"]["cpu.worker"]["resources"].update(CPU="2"),
     r"resources.CPU must be a non-negative integer, got '2'"),
    (lambda c: c["available_node_types"]["cpu.worker"].update(min_workers=5), "min_workers 5 > max_workers 3"),
    (lambda c: c["provider"].update(type="aws"), "provider must be Ray's fake multi-node provider"),
    (lambda c: c["provider"].update(module="my.Provider"), "module 'my.Provider'"),
    (lambda c: c.update(idle_timeout="1m"), "Additional properties are not allowed"),
    (lambda c: c.pop("cluster_synced_files"), "cluster_synced_files"),
    # wrongly typed YAML: one line naming the field, not an AttributeError or TypeError
    (lambda c: c.update(provider="fake"), "provider must be a mapping"),
    (lambda c: c["available_node_types"]["cpu.worker"].update(resources=[1, 2]),
     r"cpu.worker.resources must be a mapping, got \[1, 2\]"),
    (lambda c: c.update(head_node_type=["ray.head.default"]), r"head_node_type \['ray.head.default'\] is not a node"),
    (lambda c: c.update(upscaling_speed=float("nan")), "upscaling_speed must be a finite number >= 0, got nan"),
    (lambda c: c.update(upscaling_speed=float("inf")), "upscaling_speed must be a finite number >= 0, got inf"),
    (lambda c: c["available_node_types"]["ray.head.default"]["resources"].update(CPU=10**30),
     "ray.head.default.resources.CPU must be at most 922337203685477"),
])
def test_bad_local_yaml_is_one_clear_line(tmp_path, change, match):
    cfg = local_cfg()
    change(cfg)
    with pytest.raises(ValueError, match=match) as e:
        load_autoscaling_config(write_yaml(tmp_path, cfg))
    assert "\n" not in str(e.value)


def test_cluster_up_with_a_bad_yaml_starts_nothing(tmp_path, capsys):
    cfg = local_cfg()
    cfg["available_node_types"]["cpu.worker"]["resources"]["CPU"] = 0.5
    state = tmp_path / "state.json"
    rc = main(["cluster", "up", "--config", str(write_yaml(tmp_path, cfg)), "--state", str(state)])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "must be a non-negative integer, got 0.5" in err
    assert not state.exists() and not list(tmp_path.glob("head-*"))


# -- cloud GPU YAML ----------------------------------------------------------------------------------
def test_aws_gpu_yaml_passes_rays_validation():
    cfg = load_cloud_config(AWS)  # prepare_config, then validate_config against ray-schema.json
    types = cfg["available_node_types"]
    assert types[cfg["head_node_type"]]["resources"].get("GPU", 0) == 0
    gpu = {k: v for k, v in types.items() if v["resources"].get("GPU")}
    assert {v["node_config"]["InstanceType"] for v in gpu.values()} == {"p5.48xlarge", "p5e.48xlarge"}
    for t in gpu.values():
        assert t["resources"]["GPU"] == 8 and t["min_workers"] == 0
    setup = "\n".join(cfg["setup_commands"])
    assert f"== '{VERSION}'" in setup, "setup must pin k3 to the repository's version"
    assert f"=={_ray_version()}\"" in setup, "setup must install the Ray release the repository runs"


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(head_node_type="cpu-head"), "head_node_type 'cpu-head' is not a node type"),
    (lambda c: c["available_node_types"]["h100.8x"]["resources"].update(GPU=7.5), "h100.8x.resources.GPU"),
    (lambda c: c["available_node_types"]["h100.8x"].update(instance="p5"), "Additional properties"),
])
def test_bad_cloud_yaml_is_one_clear_line(tmp_path, change, match):
    cfg = yaml.safe_load(AWS.read_text())
    change(cfg)
    with pytest.raises(ValueError, match=match) as e:
        load_cloud_config(write_yaml(tmp_path, cfg))
    assert "\n" not in str(e.value)


# -- KubeRay ------------------------------------------------------------------------------------------
def test_raycluster_fields_are_kuberay_v1():
    doc = load_manifest(KUBERAY / "raycluster.yaml", "RayCluster")
    check_cluster_spec(doc["spec"], "raycluster.yaml")
    assert {g["groupName"] for g in doc["spec"]["workerGroupSpecs"]} == {"h100-8x", "h200-8x"}


def test_rayjob_runs_pretrain_on_the_same_cluster_spec():
    job = load_manifest(KUBERAY / "rayjob.yaml", "RayJob")
    spec = job["spec"]
    assert set(spec) <= RAYJOB_SPEC, f"unknown RayJob fields {set(spec) - RAYJOB_SPEC}"
    assert "rayClusterConfig" not in spec and "jobs/pretrain.py" in spec["entrypoint"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["runtimeEnvYAML"], str) and isinstance(yaml.safe_load(spec["runtimeEnvYAML"]), dict)
    check_cluster_spec(spec["rayClusterSpec"], "rayjob.yaml")
    assert spec["rayClusterSpec"] == load_manifest(KUBERAY / "raycluster.yaml", "RayCluster")["spec"]


def test_rayservice_serve_config_v2_builds_the_same_app(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    doc = rayservice_manifest(KUBERAY / "rayservice.yaml", SERVE_CONFIG, str(tmp_path))
    spec = doc["spec"]
    assert set(spec) <= RAYSERVICE_SPEC and "rayClusterSpec" not in spec
    check_cluster_spec(spec["rayClusterConfig"], "rayservice.yaml")
    assert isinstance(spec["serveConfigV2"], str)
    built = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    source = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_CONFIG.read_text()))
    assert [a.name for a in built.applications] == [a.name for a in source.applications]
    assert [a.import_path for a in built.applications] == ["k3.serve.builder:app_builder"]
    from k3.serve.builder import app_builder  # and the args build the application

    assert app_builder(built.applications[0].args) is not None


def test_rayservice_cli_prints_an_applicable_manifest(capsys):
    rc = main(["cluster", "rayservice", "--serve-config", str(SERVE_CONFIG), "--base", str(KUBERAY / "rayservice.yaml"),
               "--model-path", "/mnt/k3/models/k3-small"])
    out = capsys.readouterr().out
    assert rc == 0
    doc = yaml.safe_load(out)
    assert doc["kind"] == "RayService" and "serveConfigV2: |" in out
    args = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["model"] == {"path": "/mnt/k3/models/k3-small"}


def test_the_cli_s_default_files_are_k3_s_from_any_folder(tmp_path, monkeypatch, capsys):
    """`k3 cluster up` / `rayservice` without --config / --serve-config / --base read the files k3
    ships, not paths under the current directory (from jobs/ they were "no such Serve config")."""
    from k3.platform.ops import cluster

    monkeypatch.chdir(tmp_path)
    assert main(["cluster", "rayservice"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "RayService"
    assert yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]["model_id"] == "k3"
    seen = []

    def up(config, *args, **kwargs):  # records the path, starts nothing
        seen.append(Path(config))
        raise ValueError("not started by this test")

    monkeypatch.setattr(cluster, "up", up)
    assert main(["cluster", "up"]) != 0 and seen == [REPO / "cluster" / "local-autoscaling.yaml"]
    assert seen[0].is_file()
    # a path the user names is theirs: relative to the current directory
    capsys.readouterr()
    assert main(["cluster", "rayservice", "--serve-config", "serve/config.yaml"]) != 0
    assert "serve/config.yaml: no such Serve config" in capsys.readouterr().err
    # an installed wheel holds no cluster/ or serve/ configs: the default is read where the user is
    from k3.platform.ops import cli, prometheus

    monkeypatch.setattr(prometheus, "REPO", tmp_path / "site-packages" / "k3")
    assert cli._shipped(None, "serve/config.yaml") == Path("serve/config.yaml")
    assert cli._shipped("x.yaml", "serve/config.yaml") == Path("x.yaml")


def test_rayservice_with_haproxy_sets_the_flag_in_every_container(tmp_path, capsys):
    plain = rayservice_manifest(KUBERAY / "rayservice.yaml", SERVE_CONFIG, str(tmp_path))
    doc = rayservice_manifest(KUBERAY / "rayservice.yaml", SERVE_CONFIG, str(tmp_path), haproxy=True)
    cluster = doc["spec"]["rayClusterConfig"]
    check_cluster_spec(cluster, "rayservice.yaml")
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    before = [plain["spec"]["rayClusterConfig"]["headGroupSpec"]] + plain["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert len(pods) == len(before) >= 2  # the head and the GPU worker groups, none lost
    for got, was in zip(pods, before):
        containers, containers0 = got["template"]["spec"]["containers"], was["template"]["spec"]["containers"]
        assert len(containers) == len(containers0) >= 1
        for c, c0 in zip(containers, containers0):
            assert c["env"] == (c0.get("env") or []) + [{"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"}]
            assert {k: v for k, v in c.items() if k != "env"} == {k: v for k, v in c0.items() if k != "env"}
    assert doc["spec"]["serveConfigV2"] == plain["spec"]["serveConfigV2"]
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in yaml.safe_dump(plain)
    rc = main(["cluster", "rayservice", "--serve-config", str(SERVE_CONFIG), "--base", str(KUBERAY / "rayservice.yaml"),
               "--model-path", str(tmp_path), "--haproxy"])
    assert rc == 0 and yaml.safe_load(capsys.readouterr().out) == yaml.safe_load(yaml.safe_dump(doc))


@pytest.mark.parametrize("bad, match", [
    ({"applications": [{"name": "k3"}]}, "not a Serve config.*import_path"),
    ({"applications": [{"name": "k3", "import_path": "k3.serve.builder:app_builder",
                        "deployments": [{"name": "DecodeServer", "num_replicas": -3}]}]}, "not a Serve config"),
    ({"applications": "k3"}, "not a Serve config"),
])
def test_bad_serve_config_is_refused(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match) as e:
        load_serve_config(write_yaml(tmp_path, bad))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("entry, field", [
    ({"name": "DecodeServer", "num_replicas": 8}, "num_replicas"),
    ({"name": "PrefillServer", "ray_actor_options": {"num_gpus": 0}}, "ray_actor_options"),
    ({"name": "LLMServer", "autoscaling_config": {"max_replicas": 64}}, "autoscaling_config"),
])
def test_a_deployments_entry_sizing_an_engine_is_refused_for_the_rayservice(tmp_path, entry, field):
    cfg = yaml.safe_load(SERVE_CONFIG.read_text())
    cfg["applications"][0]["deployments"] = [{"name": "Ingress", "num_replicas": 2}, entry]
    with pytest.raises(ValueError, match=rf"applications\[0\]\.deployments\[1\] \({entry['name']}\) sets {field}") as e:
        rayservice_manifest(KUBERAY / "rayservice.yaml", write_yaml(tmp_path, cfg), str(tmp_path))
    assert "args." in str(e.value) and "\n" not in str(e.value)
    # an entry that leaves the sizing alone (the ingress's replicas, an engine's health checks) is kept
    cfg["applications"][0]["deployments"] = [{"name": "Ingress", "num_replicas": 2},
                                             {"name": "DecodeServer", "health_check_period_s": 5}]
    doc = rayservice_manifest(KUBERAY / "rayservice.yaml", write_yaml(tmp_path, cfg), str(tmp_path))
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    assert app["deployments"] == cfg["applications"][0]["deployments"]


def test_wrong_manifest_kind_is_refused():
    with pytest.raises(ValueError, match="expected apiVersion ray.io/v1 kind RayService"):
        load_manifest(KUBERAY / "rayjob.yaml", "RayService")
