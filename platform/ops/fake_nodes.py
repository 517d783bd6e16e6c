"""The local autoscaling cluster's node provider: Ray's fake multi-node provider, whose worker
nodes run no log monitor of their own and unpack runtime environments into folders of their own.

cluster/local-autoscaling.yaml names it (`provider: {type: external, module:
k3.platform.ops.fake_nodes.FakeNodes}`); the autoscaler imports it in the head's monitor process.

Why: every fake node is another raylet on this machine sharing the head's session directory,
and a node's log monitor forwards every worker log file it finds in that directory's logs/ to
the drivers, from the start of each file. With one log monitor per node, a driver printed every
worker's line once per node (and a node that joined replayed the logs so far). The head's log
monitor alone already sees every worker's file, so the others are not started.

The same sharing hit runtime environments: a node's runtime-env agent unpacks a job's
working_dir into <session>/runtime_resources/working_dir_files/<package>, and it unpacks with
`overwrite=True`: it removes that folder first. On one shared session directory a worker node
joining a job (the second training worker's node) deleted the folder the job's driver and the
head's workers were running in, and re-created it beside them: their current directory was gone
(`os.getcwd()` raised FileNotFoundError; importing torch._dynamo, which reads it, failed in the
README's training job). Each fake node now keeps its runtime environments in a folder named for
it (`runtime_env_dir_name`), as a real node keeps them on its own disk.
"""
from __future__ import annotations

import itertools
import os
import threading

import ray._private.parameter as parameter
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

_PATCH = threading.Lock()  # the autoscaler may launch nodes from several threads
_NODES = itertools.count(1)


def runtime_env_dir_name(n: int) -> str:
    """The folder under the session directory where fake node n (of this monitor) keeps its
    runtime environments; the head keeps Ray's default, `runtime_resources`."""
    return f"runtime_resources_fake_node_{os.getpid()}_{n}"


class FakeNodes(FakeMultiNodeProvider):
    """FakeMultiNodeProvider whose nodes start without a log monitor, each with its own
    runtime-environment folder."""

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        # The parent builds the node's RayParams inline; the only way to set its fields is to
        # hand it a RayParams with other defaults (no log monitor, a runtime-env folder of the
        # node's own), for this call.
        with _PATCH:
            real = parameter.RayParams

            class FakeNodeParams(real):
                def __init__(self, *args, **kwargs):  # once per node the call starts
                    own = {"include_log_monitor": False, "runtime_env_dir_name": runtime_env_dir_name(next(_NODES))}
                    super().__init__(*args, **{**own, **kwargs})

            parameter.RayParams = FakeNodeParams
            try:
                super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
            finally:
                parameter.RayParams = real
