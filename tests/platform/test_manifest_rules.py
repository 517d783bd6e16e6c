"""Manifests that would come up: each one rendered as a user gets it and held to the rules of
where it runs (KubeRay's Service and probes, the cluster's GPU groups, the image, AWS's AMI and
EFA). Offline: Ray's own schema and KubeRay's field names; nothing here runs on Kubernetes or AWS."""
from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from k3.platform.ops.aws import DLAMI, EFA_CARDS, render_aws
from k3.platform.ops.cluster import load_cloud_config
from k3.platform.ops.kuberay import SERVE_PORT, engine_deployments, gpu_groups, load_manifest, rayservice_manifest

REPO = Path(__file__).resolve().parents[2]
KUBERAY = REPO / "cluster" / "kuberay"
SERVE_CONFIG = REPO / "serve" / "config.yaml"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
SUBNET, SG = "subnet-0123456789abcdef0", "sg-0123456789abcdef0"


def write_yaml(tmp_path: Path, doc: dict, name: str = "m.yaml") -> Path:
    (tmp_path / name).write_text(yaml.safe_dump(doc))
    return tmp_path / name


def cluster_spec(doc: dict) -> dict:
    return doc["spec"].get("rayClusterConfig") or doc["spec"].get("rayClusterSpec") or doc["spec"]


def check_image(doc: dict, path: Path) -> None:
    """Every pod runs k3:<version>, which cluster/kuberay/Dockerfile builds on Ray's GPU image of
    the cluster's rayVersion; the manifest's header says where the image comes from."""
    spec = cluster_spec(doc)
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    assert {c["image"] for p in pods for c in p["template"]["spec"]["containers"]} == {f"k3:{VERSION}"}
    docker = (KUBERAY / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{spec['rayVersion']}-py311-gpu" in docker
    assert 'pip install --no-cache-dir -e "/home/ray/k3[ray,monitor]"' in docker and "/home/ray/k3" in docker
    assert "cluster/kuberay/Dockerfile" in path.read_text().split("apiVersion:")[0]


def check_serve_rules(doc: dict) -> None:
    """serveConfigV2 reachable by KubeRay and sized for the cluster's GPU groups."""
    v2 = yaml.safe_load(doc["spec"]["serveConfigV2"])
    assert v2["proxy_location"] == "EveryNode", "KubeRay probes localhost:8000/-/healthz on every worker pod"
    assert v2["http_options"]["host"] == "0.0.0.0" and v2["http_options"]["port"] == SERVE_PORT
    groups = [g for g in gpu_groups(cluster_spec(doc)) if g["gpus"]]
    assert groups, "no GPU worker group"
    per_gpu_cpus = min(g["cpus"] // g["gpus"] for g in groups)
    (app,) = [a for a in v2["applications"] if a["import_path"] == "k3.serve.builder:app_builder"]
    args = app["args"]
    assert "path" in args["model"] and "preset" not in args["model"], "random preset weights on GPUs"
    replicas = 0
    for name in engine_deployments(args["disaggregated"]):
        opts = args[name]["ray_actor_options"]
        assert opts["num_gpus"] == 1 and 1 <= opts["num_cpus"] <= per_gpu_cpus, (name, opts)
        auto = args[name].get("autoscaling_config")
        replicas += auto["max_replicas"] if auto else args[name].get("num_replicas", 1)
    assert replicas <= sum(g["gpus"] * g["max_pods"] for g in groups)
    assert args["ingress"]["ray_actor_options"].get("num_gpus", 0) == 0


def test_rendered_rayservice_would_come_up(tmp_path):
    path = KUBERAY / "rayservice.yaml"
    doc = rayservice_manifest(path, SERVE_CONFIG, "/mnt/k3/models/k3-small")
    check_serve_rules(doc)
    check_image(doc, path)


@pytest.mark.parametrize("name, kind", [("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob")])
def test_raycluster_and_rayjob_would_come_up(name, kind):
    doc = load_manifest(KUBERAY / name, kind)
    check_image(doc, KUBERAY / name)
    spec = cluster_spec(doc)
    gpus = sum(g["gpus"] * g["max_pods"] for g in gpu_groups(spec))
    for g in spec["workerGroupSpecs"]:
        mounts = {m["mountPath"] for m in g["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert "/dev/shm" in mounts, "NCCL and the object store want a large /dev/shm"
    if kind == "RayJob":
        workers = int(re.search(r"--num-workers (\d+)", doc["spec"]["entrypoint"]).group(1))
        assert "--use-gpu" in doc["spec"]["entrypoint"] and workers <= gpus


@pytest.mark.parametrize("change, match", [
    (lambda c: [g["template"]["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu")
                for g in c["spec"]["rayClusterConfig"]["workerGroupSpecs"]], "no GPU worker group"),
    (lambda c: c["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas=0), "hold 0 GPUs"),
])
def test_a_rayservice_that_cannot_fit_is_refused(tmp_path, change, match):
    doc = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    change(doc)
    with pytest.raises(ValueError, match=match):
        rayservice_manifest(write_yaml(tmp_path, doc), SERVE_CONFIG, "/mnt/k3/models/k3")


def worker(doc: dict) -> dict:
    """The GPU worker group of a RayService base."""
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def worker_limits(doc: dict, **limits) -> None:
    for where in ("limits", "requests"):
        worker(doc)["template"]["spec"]["containers"][0]["resources"][where].update(limits)


def serve_args(tmp_path: Path, **changes) -> Path:
    """serve/config.yaml with the k3 app's args changed."""
    cfg = yaml.safe_load(SERVE_CONFIG.read_text())
    cfg["applications"][0]["args"].update(changes)
    return write_yaml(tmp_path, cfg, "serve.yaml")


def k3_args(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]


@pytest.mark.parametrize("change, match", [
    (lambda d: worker_limits(d, cpu="4"), "worker group h100-8x: 4 CPUs for 8 GPUs.*at least 16 CPUs"),
    (lambda d: worker_limits(d, cpu="500m"), "worker group h100-8x: 1 CPUs for 8 GPUs"),
    (lambda d: worker_limits(d, cpu="4 cores"), "workerGroupSpecs h100-8x: limits.cpu: '4 cores' is not a CPU"),
    (lambda d: worker_limits(d, **{"nvidia.com/gpu": "eight"}), "h100-8x: limits.nvidia.com/gpu: 'eight' is not a whole"),
])
def test_a_worker_group_the_engines_cannot_run_on_is_refused_by_name(tmp_path, change, match):
    doc = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    change(doc)
    with pytest.raises(ValueError, match=match) as e:
        rayservice_manifest(write_yaml(tmp_path, doc), SERVE_CONFIG, "/mnt/k3/models/k3-small")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, cpus", [
    (lambda d: worker_limits(d, cpu="40000m"), 4),  # Kubernetes millicores: 40 CPUs, 5 a GPU
    (lambda d: worker_limits(d, cpu=24), 2),
    (lambda d: worker_limits(d, cpu="36.5"), 3),  # KubeRay starts Ray with 37
    (lambda d: worker(d)["rayStartParams"].update({"num-cpus": "16"}), 1),  # rayStartParams win
    (lambda d: worker(d).pop("maxReplicas"), 21),  # KubeRay's default: unbounded
])
def test_kubernetes_quantities_and_defaults_size_the_engines(tmp_path, change, cpus):
    doc = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    change(doc)
    out = rayservice_manifest(write_yaml(tmp_path, doc), SERVE_CONFIG, "/mnt/k3/models/k3-small")
    check_serve_rules(out)
    for name in ("prefill", "decode"):
        assert k3_args(out)[name]["ray_actor_options"] == {"num_cpus": cpus, "num_gpus": 1}


@pytest.mark.parametrize("changes, match", [
    ({"engine": {"max_num_seqs": -5}, "bogus": 1},
     r"serve.yaml: applications\[0\]\.args: not a k3 LLMServingConfig: engine.max_num_seqs: .*greater than or "
     r"equal to 1; bogus: Extra inputs"),
    ({"decode": {"num_replicas": "auto"}}, r"applications\[0\]\.args: .*decode.num_replicas: Input should be a "
                                           r"valid integer"),
    ({"prefill": {"autoscaling_config": {"max_replicas": "many"}}},
     r"applications\[0\]\.args.prefill.autoscaling_config: max_replicas: Input should be a valid integer"),
])
def test_app_args_are_checked_as_the_builder_reads_them(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match) as e:
        rayservice_manifest(KUBERAY / "rayservice.yaml", serve_args(tmp_path, **changes), "/mnt/k3/models/k3-small")
    assert "\n" not in str(e.value)


def test_bad_app_args_are_one_cli_error_line(tmp_path, capsys):
    from k3.platform.ops.cli import main

    serve = serve_args(tmp_path, engine={"max_num_seqs": -5})
    assert main(["cluster", "rayservice", "--serve-config", str(serve), "--base", str(KUBERAY / "rayservice.yaml")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"k3: error: {serve}: applications[0].args") and err.count("\n") == 1
    assert "engine.max_num_seqs" in err


def test_the_engines_are_sized_as_the_builder_reads_disaggregated(tmp_path):
    doc = rayservice_manifest(KUBERAY / "rayservice.yaml", serve_args(tmp_path, disaggregated="false"),
                              "/mnt/k3/models/k3-small")
    check_serve_rules(doc)
    args = k3_args(doc)
    assert args["disaggregated"] is False and args["llm"]["ray_actor_options"]["num_gpus"] == 1
    assert all("num_gpus" not in args[n]["ray_actor_options"] for n in ("prefill", "decode"))


def test_serve_config_v2_says_the_model_and_cache_are_as_given():
    v2 = rayservice_manifest(KUBERAY / "rayservice.yaml", SERVE_CONFIG, "/mnt/k3/models/k3-small")["spec"]["serveConfigV2"]
    head = v2.splitlines()[0]
    assert head.startswith("# k3: ") and "whole model (/mnt/k3/models/k3-small) on its one GPU" in head
    assert f"cache_memory_bytes {256 * 2**20} from {SERVE_CONFIG}" in head


@pytest.mark.parametrize("model_path", ["", "models/k3"])
def test_rayservice_model_path_must_be_absolute(model_path):
    with pytest.raises(ValueError, match="--model-path must be an absolute path"):
        rayservice_manifest(KUBERAY / "rayservice.yaml", SERVE_CONFIG, model_path)


def test_the_laptop_serve_config_would_not_come_up_as_it_is():
    """The rules catch what serve/config.yaml says for a laptop (the old serveConfigV2 copied it)."""
    raw = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    raw["spec"]["serveConfigV2"] = SERVE_CONFIG.read_text()
    with pytest.raises(AssertionError, match="KubeRay probes"):
        check_serve_rules(raw)


# -- AWS ---------------------------------------------------------------------------------------------
def rays_default_amis() -> set[str]:
    """The AMIs Ray fills in for a node type without ImageId (its module imports boto3, which is
    not installed here: read from its source)."""
    import ray

    source = (Path(ray.__file__).parent / "autoscaler" / "_private" / "aws" / "config.py").read_text()
    table = source[source.index("DEFAULT_AMI = {"):]
    return set(re.findall(r'"(ami-[0-9a-f]+)"', table[:table.index("}")]))


def check_aws_rules(cfg: dict, rendered: bool) -> None:
    eol = rays_default_amis()
    assert len(eol) > 10  # the table was found
    for name, t in cfg["available_node_types"].items():
        nc = t["node_config"]
        assert nc.get("ImageId") and nc["ImageId"] not in eol, f"{name}: Ray's end-of-life AMI"
        cards = EFA_CARDS.get(nc["InstanceType"])
        if not rendered or cards is None:
            continue
        nics = nc["NetworkInterfaces"]
        assert sorted(n["NetworkCardIndex"] for n in nics) == list(range(cards)) == list(range(32))
        assert all(n["InterfaceType"] == "efa" and n["SubnetId"] == SUBNET and n["Groups"] == [SG] for n in nics)
        assert [n["DeviceIndex"] for n in nics if n["NetworkCardIndex"] == 0] == [0]
        assert nc["Placement"]["GroupName"] and "SubnetIds" not in nc  # Ray takes subnets from the interfaces
    setup = "\n".join(cfg["setup_commands"])
    assert "python3.11 -m venv ~/k3-venv" in setup and "source ~/k3-venv/bin/activate" in setup
    # each node's Ray from its venv (an exported variable may lead the line)
    assert all(re.sub(r"^(export [A-Z_]+=\S*; )*", "", c).startswith("~/k3-venv/bin/ray ")
               for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"])


def test_aws_yaml_and_its_rendering_would_come_up():
    check_aws_rules(load_cloud_config(REPO / "cluster" / "aws-gpu.yaml"), rendered=False)
    cfg = render_aws(REPO / "cluster" / "aws-gpu.yaml", "us-west-2", SUBNET, SG)
    check_aws_rules(cfg, rendered=True)
    assert cfg["provider"]["region"] == "us-west-2" and "availability_zone" not in cfg["provider"]
    assert {t["node_config"]["ImageId"] for t in cfg["available_node_types"].values()} == {DLAMI}
    pinned = render_aws(REPO / "cluster" / "aws-gpu.yaml", "us-west-2", SUBNET, SG, ami="ami-0123456789abcdef0")
    assert {t["node_config"]["ImageId"] for t in pinned["available_node_types"].values()} == {"ami-0123456789abcdef0"}


def test_aws_with_haproxy_starts_every_nodes_ray_with_direct_ingress(tmp_path):
    plain = render_aws(REPO / "cluster" / "aws-gpu.yaml", "us-west-2", SUBNET, SG)
    cfg = render_aws(REPO / "cluster" / "aws-gpu.yaml", "us-west-2", SUBNET, SG, haproxy=True)
    check_aws_rules(cfg, rendered=True)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        prefix = "export RAY_SERVE_ENABLE_HA_PROXY=1; "
        assert [c.removeprefix(prefix) for c in cfg[key]] == plain[key]
        assert [c.startswith(prefix) for c in cfg[key]] == ["ray start" in c for c in cfg[key]]
        for c in cfg[key]:  # what each node's shell runs: the variable set for the command after it
            if c.startswith(prefix):
                line = c.replace("~/k3-venv/bin/ray", "printenv RAY_SERVE_ENABLE_HA_PROXY; : ray", 1)
                assert subprocess.run(["bash", "-c", line], capture_output=True, text=True).stdout == "1\n", line
    assert {k: v for k, v in cfg.items() if not k.endswith("start_ray_commands")} == \
        {k: v for k, v in plain.items() if not k.endswith("start_ray_commands")}
    base = yaml.safe_load((REPO / "cluster" / "aws-gpu.yaml").read_text())
    base["worker_start_ray_commands"] = ["echo no ray here"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(ValueError, match="worker_start_ray_commands has no `ray start` command"):
        render_aws(tmp_path / "c.yaml", "us-west-2", SUBNET, SG, haproxy=True)


@pytest.mark.parametrize("kw, match", [
    ({"subnet": "subnet-xyz"}, "--subnet 'subnet-xyz' is not an AWS subnet"),
    ({"security_group": None}, "--security-group None"),
    ({"region": "Ohio"}, "--region 'Ohio'"),
    ({"ami": "ubuntu-22.04"}, "--ami 'ubuntu-22.04'"),
    ({"placement_group": ""}, "--placement-group ''"),
    # `re.match` with `$` let a final newline through: `region: |` in the rendered YAML
    ({"region": "us-east-2\n"}, "--region 'us-east-2\\n'"),
    ({"subnet": SUBNET + "\n"}, "--subnet"),
    ({"placement_group": "k3-p5\n"}, "--placement-group 'k3-p5\\n'"),
])
def test_bad_aws_parameters_are_one_clear_line(kw, match):
    args = {"region": "us-east-2", "subnet": SUBNET, "security_group": SG, **kw}
    with pytest.raises(ValueError, match=re.escape(match)) as e:
        render_aws(REPO / "cluster" / "aws-gpu.yaml", **args)
    assert "\n" not in str(e.value)
