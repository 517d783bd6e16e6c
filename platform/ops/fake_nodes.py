"""The local autoscaling cluster's node provider: Ray's fake multi-node provider, whose worker
nodes run no log monitor of their own.

cluster/local-autoscaling.yaml names it (`provider: {type: external, module:
k3.platform.ops.fake_nodes.FakeNodes}`); the autoscaler imports it in the head's monitor process.

Why: every fake node is another raylet on this machine sharing the head's session directory,
and a node's log monitor forwards every worker log file it finds in that directory's logs/ to
the drivers, from the start of each file. With one log monitor per node, a driver printed every
worker's line once per node (and a node that joined replayed the logs so far). The head's log
monitor alone already sees every worker's file, so the others are not started.
"""
from __future__ import annotations

import threading

import ray._private.parameter as parameter
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

_PATCH = threading.Lock()  # the autoscaler may launch nodes from several threads


class FakeNodes(FakeMultiNodeProvider):
    """FakeMultiNodeProvider whose nodes start without a log monitor."""

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        # The parent builds the node's RayParams inline; the only way to set one field of it is
        # to hand it a RayParams that defaults include_log_monitor to False, for this call.
        with _PATCH:
            real = parameter.RayParams

            class NoLogMonitor(real):
                def __init__(self, *args, **kwargs):
                    super().__init__(*args, **{"include_log_monitor": False, **kwargs})

            parameter.RayParams = NoLogMonitor
            try:
                super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
            finally:
                parameter.RayParams = real
