"""The AWS GPU cluster for `ray up`: cluster/aws-gpu.yaml with what only its user can know filled in.

    k3 cluster aws --region us-east-2 --subnet subnet-0abc --security-group sg-0abc > my-cluster.yaml
    ray up my-cluster.yaml

The base file runs as it is (a current GPU AMI, Python 3.11, this checkout); the rendered one
adds what expert all-to-all across p5 / p5e nodes needs: 32 EFA interfaces per node (one per
network card, in the subnet and the security group given: EFA wants a group that lets all traffic
from itself in and out) and a cluster placement group (`aws ec2 create-placement-group
--group-name k3-p5 --strategy cluster` first) so the nodes sit on one network spine.

The AMI: by default EC2 resolves AWS's public Systems Manager parameter for the Deep Learning
Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04: NVIDIA driver, CUDA, EFA and the NCCL OFI plugin)
when a node launches, in whatever region it is; `--ami ami-...` pins one (look it up with
`aws ssm get-parameter --region R --name <DLAMI_PARAMETER> --query Parameter.Value`). Without an
ImageId Ray fills in an end-of-life Deep Learning AMI (Ubuntu 18.04) on which neither Python
3.11 nor this Ray installs.
"""
from __future__ import annotations

import copy
import os
import re

from .local_ray import HAPROXY_FLAG

DLAMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
DLAMI = f"resolve:ssm:{DLAMI_PARAMETER}"
# network cards per instance type: one EFA interface on each
EFA_CARDS = {"p5.48xlarge": 32, "p5e.48xlarge": 32, "p5en.48xlarge": 16}
_ID = {"region": r"^[a-z]{2}(-gov)?-[a-z]+-\d$", "subnet": r"^subnet-[0-9a-f]{8,17}$",
       "security_group": r"^sg-[0-9a-f]{8,17}$", "ami": r"^ami-[0-9a-f]{8,17}$",
       "placement_group": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$"}


def _check(name: str, value: str | None) -> None:
    if not isinstance(value, str) or not re.fullmatch(_ID[name], value):  # match with $ lets a final \n through
        raise ValueError(f"--{name.replace('_', '-')} {value!r} is not an AWS {name.replace('_', ' ')} "
                         f"(expected {_ID[name]})")


def efa_interfaces(cards: int, subnet: str, security_group: str) -> list[dict]:
    """One EFA interface per network card; the first is the instance's primary interface."""
    return [{"NetworkCardIndex": i, "DeviceIndex": 0 if i == 0 else 1, "InterfaceType": "efa", "SubnetId": subnet,
             "Groups": [security_group], "DeleteOnTermination": True} for i in range(cards)]


def render_aws(base: str | os.PathLike, region: str, subnet: str, security_group: str,
               placement_group: str = "k3-p5", ami: str | None = None, haproxy: bool = False) -> dict:
    """cluster/aws-gpu.yaml for one region, subnet and security group, checked the way `ray up`
    checks it (k3.platform.ops.cluster.check_cloud_config). `haproxy`: every node's `ray start`
    with Serve's direct ingress with HAProxy (one Ray per node: Ray's HAProxy ports stay)."""
    from .cluster import check_cloud_config, read_yaml

    for name, value in (("region", region), ("subnet", subnet), ("security_group", security_group),
                        ("placement_group", placement_group)):
        _check(name, value)
    if ami is not None:
        _check("ami", ami)
    cfg = copy.deepcopy(read_yaml(base))
    # the subnet decides the zone (put it where the p5 capacity reservation is)
    cfg["provider"] = {k: v for k, v in cfg["provider"].items() if k != "availability_zone"} | {"region": region}
    for name, node_type in cfg["available_node_types"].items():
        nc = node_type["node_config"]
        nc["ImageId"] = ami or DLAMI
        cards = EFA_CARDS.get(nc["InstanceType"])
        if cards is None:
            nc.update(SubnetIds=[subnet], SecurityGroupIds=[security_group])
            continue
        nc["NetworkInterfaces"] = efa_interfaces(cards, subnet, security_group)
        nc["Placement"] = {"GroupName": placement_group}
    if haproxy:
        for key in ("head_start_ray_commands", "worker_start_ray_commands"):
            commands = cfg.get(key) or []
            if not any("ray start" in c for c in commands):
                raise ValueError(f"{base}: {key} has no `ray start` command to run with {HAPROXY_FLAG}=1")
            # exported for the whole line: every command of it (`ray stop; ray start ...` too)
            cfg[key] = [f"export {HAPROXY_FLAG}=1; {c}" if "ray start" in c else c for c in commands]
    check_cloud_config(cfg, f"cluster/aws-gpu.yaml for {region}")
    return cfg
