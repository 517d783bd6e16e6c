"""LocalRayHead: its set-up without starting Ray, and a start that loses a port (the ordinary
start is proven by the job-submit test); stopping process groups; finding a fake node's processes."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from helpers import wait_until

from k3.platform.ops.local_ray import DRAIN_ENV, LocalRayHead

REPO = Path(__file__).resolve().parents[2]


def test_every_port_is_chosen_and_distinct(tmp_path):
    head = LocalRayHead(num_cpus=1, workdir=tmp_path)
    ports = list(head.ports.values())
    assert len(set(ports)) == len(ports) == 11  # nine `ray start` flags, two metrics servers
    assert head.env["RAY_AUTH_MODE"] == "token" and head.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert "RAY_ADDRESS" not in head.env and head.env[DRAIN_ENV] == "0"
    assert head.address.startswith("http://127.0.0.1:") and head.gcs_address.startswith("127.0.0.1:")
    head.stop()  # never started: a no-op


JSON_STDOUT = """
import json, sys
from ray._private.worker import print_to_stdstream
from k3.platform.ops.local_ray import json_stdout

result = json_stdout()
print("a progress line")
print_to_stdstream({"lines": ["Task ServeController.listen_for_change failed."], "pid": "raylet", "is_err": False},
                   ignore_prefix=False)
print(json.dumps({"ok": 1}), file=result)
"""


def test_a_bench_s_stdout_holds_only_its_json():
    # Ray's driver prints the raylet's errors to sys.stdout (is_err False) whatever log_to_driver says
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", JSON_STDOUT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"ok": 1}
    assert "a progress line" in p.stderr and "listen_for_change failed" in p.stderr


def test_bad_cpu_count_is_refused(tmp_path):
    with pytest.raises(ValueError, match="num_cpus"):
        LocalRayHead(num_cpus=0, workdir=tmp_path)


def test_autoscaling_head_points_the_provider_at_its_own_gcs(tmp_path):
    import yaml

    head = LocalRayHead(autoscaling_config=REPO / "cluster" / "local-autoscaling.yaml", workdir=tmp_path,
                        autoscaler_update_s=1)
    assert head.num_cpus == 1  # the YAML's head node type, not the default
    assert head.env["RAY_FAKE_CLUSTER"] == "1" and head.env["AUTOSCALER_UPDATE_INTERVAL_S"] == "1"
    args = head.autoscaling_args()
    (path,) = [a.split("=", 1)[1] for a in args if a.startswith("--autoscaling-config=")]
    written = yaml.safe_load(open(path))
    assert written["provider"]["gcs_address"] == head.gcs_address  # not the provider's default 6379
    # a second process reaches (and would stop) the same head from its recorded state
    again = LocalRayHead.from_state({**head.state(), "pid": None})
    assert again.gcs_address == head.gcs_address and again.session_dir == head.session_dir
    assert not again.alive()


DETACHED_ACTOR = """
import sys
import ray
ray.init(address=sys.argv[1])
@ray.remote(num_cpus=0)
class Held:
    def ping(self):
        return "up"
print(ray.get(Held.options(name="held", lifetime="detached").remote().ping.remote()))
"""


@pytest.mark.ray  # starts a Ray head
def test_a_taken_port_is_retried_and_a_head_holding_detached_actors_stops_without_draining(tmp_path):
    """A port free when it was picked can be taken by another process before Ray binds it (seen
    on a busy machine: the raylet could not start its server and `ray start` timed out).

    Ray 2.60's `ray start` drains its node on SIGTERM until it is idle or 30 s pass; Serve's
    controller and replicas are detached actors, so a head with a Serve app never went idle and
    every `k3 cluster down` waited out the 30 s (34 s in the autoscaling scenario)."""
    import socket
    import subprocess
    import sys

    head = LocalRayHead(num_cpus=1, workdir=tmp_path)
    taken = head.ports["node-manager-port"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        with head:
            assert head.alive() and head.ports["node-manager-port"] != taken
            assert head.ray("job", "list", "--address", head.address).returncode == 0
            run = subprocess.run([sys.executable, "-c", DETACHED_ACTOR, head.gcs_address], env=head.env,
                                 capture_output=True, text=True, timeout=120)
            assert run.stdout.strip().endswith("up"), run.stderr[-2000:]
    assert not head.alive()
    assert not head.temp_dir.exists()  # Ray's session (~40 MB a head) goes with it; its log stays
    log = head.log_path.read_text()
    assert "Draining for up to" not in log, log[-2000:]
    # a caller that wants the drain keeps it
    assert LocalRayHead(num_cpus=1, workdir=tmp_path / "b", env={DRAIN_ENV: "5"}).env[DRAIN_ENV] == "5"


@pytest.mark.parametrize("attempts", [0, -1, 1.5, True])
def test_bad_attempt_count_is_refused_before_anything_starts(tmp_path, attempts):
    head = LocalRayHead(num_cpus=1, workdir=tmp_path)
    with pytest.raises(ValueError, match="attempts"):
        head.start(attempts=attempts)
    assert head.pid is None and not head.alive()


def test_a_group_whose_leader_exited_is_not_alive_though_nobody_waited_for_it():
    # A head or Prometheus handle rebuilt from a state file has no Popen: the exited leader, a
    # zombie child of this process, used to keep its group "alive" until a stop's grace ran out.
    import subprocess
    import time

    from k3.platform.ops.process_group import group_alive

    leader = subprocess.Popen(["sleep", "0.2"], start_new_session=True)
    pid = leader.pid
    leader.returncode = 0  # forget it, as a handle rebuilt from a state file has no Popen to poll
    deadline = time.time() + 10
    while group_alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not group_alive(pid), "an exited, unreaped leader still reads as a live group"
    live = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert group_alive(live.pid) and group_alive(live.pid, live)
    finally:
        live.kill()
        live.wait()
    assert not group_alive(live.pid, live) and not group_alive(None)


def test_stop_group_ends_the_whole_group_and_kills_what_ignores_sigterm(tmp_path):
    import subprocess
    import time

    from k3.platform.ops.process_group import group_alive, stop_group

    # a leader that ignores SIGTERM, with a child in its group: both go, by SIGKILL after the grace
    ready = tmp_path / "ready"
    proc = subprocess.Popen(["bash", "-c", f"trap '' TERM; touch {ready}; sleep 60 & wait"], start_new_session=True)
    wait_until(ready.exists, 60, "the leader's SIGTERM trap")
    t = time.time()
    stop_group(proc.pid, proc, grace_s=1.0)
    assert not group_alive(proc.pid, proc) and time.time() - t < 8
    stop_group(proc.pid, proc)  # stopping what is gone is a no-op
    # a leader that goes on SIGTERM, leaving a member that ignores it (a fake node's raylet waiting
    # on its gone head): the member gets the short second grace, not what is left of the first
    ready.unlink()
    proc = subprocess.Popen(["bash", "-c", f"(trap '' TERM; touch {ready}; sleep 60) & sleep 60"],
                            start_new_session=True)
    wait_until(ready.exists, 60, "the member's SIGTERM trap")
    t = time.time()
    stop_group(proc.pid, proc, grace_s=60.0, rest_grace_s=1.0)
    assert not group_alive(proc.pid, proc) and time.time() - t < 8, time.time() - t


def test_stop_group_signals_the_leader_before_the_rest_of_its_group(tmp_path):
    """The leader (a `ray start --block` head stops its own processes in order) gets SIGTERM first;
    what it leaves running (an autoscaler's fake nodes) gets the group's SIGTERM after it has gone."""
    import subprocess
    import sys
    import time

    from k3.platform.ops.process_group import group_alive, stop_group

    log, ready = tmp_path / "log", tmp_path / "ready"
    member = ("import signal, sys, time\n"
              "def term(*_):\n"
              f"    open({str(log)!r}, 'a').write(sys.argv[1] + ' %.6f\\n' % time.time()); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, term)\n"
              f"open({str(ready)!r}, 'a').write(sys.argv[1] + '\\n')\n"
              "time.sleep(60)\n")
    script = tmp_path / "member.py"
    script.write_text(member)
    # the leader starts a member it never stops, then waits; on SIGTERM it writes and exits
    leader = (f"import subprocess, sys; subprocess.Popen([sys.executable, {str(script)!r}, 'left']); "
              f"sys.argv = ['x', 'leader']; exec(open({str(script)!r}).read())")
    proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    # both have installed their handlers (each says so after it has)
    wait_until(lambda: ready.exists() and sorted(ready.read_text().split()) == ["leader", "left"], 60,
               "both members' SIGTERM handlers")
    stop_group(proc.pid, proc, grace_s=20.0)
    assert not group_alive(proc.pid, proc)
    got = dict(line.split() for line in log.read_text().splitlines())
    assert set(got) == {"leader", "left"}, got  # both stopped by SIGTERM, not killed
    assert float(got["leader"]) < float(got["left"])


def test_a_fake_node_s_processes_include_workers_that_lead_their_own_group():
    """The autoscaling scenario removes a fake worker node by its processes: the raylet-like one
    carries the node's id and is in the head's group; its worker leads a group of its own (as Ray's
    workers do) and must be found as its child. Another node's process is left out."""
    import importlib.util
    import os
    import signal
    import subprocess
    import sys
    import time

    spec = importlib.util.spec_from_file_location("scenario_tools", Path(__file__).with_name("scenario_tools.py"))
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    node_processes = tools.node_processes

    tree = ("import os, subprocess, sys, time\n"
            "w = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)'])\n"
            "print(w.pid, flush=True); time.sleep(60)\n")
    lead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    node = other = worker = None
    try:
        env = {**os.environ, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": "n1"}
        # the node's "raylet" joins the leader's group, as a fake node's processes join the head's
        node = subprocess.Popen([sys.executable, "-c", tree], env=env, stdout=subprocess.PIPE, text=True,
                                process_group=lead.pid)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**os.environ, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": "n2"},
                                 process_group=lead.pid)
        worker = int(node.stdout.readline())
        deadline = time.time() + 10
        while os.getpgid(worker) != worker and time.time() < deadline:
            time.sleep(0.05)
        assert os.getpgid(worker) == worker != lead.pid
        assert node_processes(lead.pid, "n1", "head") == sorted([node.pid, worker])
        with pytest.raises(ValueError, match="is the head"):
            node_processes(lead.pid, "n1", "n1")
    finally:
        for p in (node, other, lead):
            if p is not None:
                p.kill()
                p.wait()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


PROBE_JOB = """
import os

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

before = os.stat(".").st_ino
ray.init()


@ray.remote(num_cpus=1)
def where():
    return ray.get_runtime_context().get_node_id(), os.getcwd(), os.path.isfile("probe.py")


pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")  # the head has 1 CPU: a node joins
ray.get(pg.ready(), timeout=240)
out = ray.get([where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
               .remote() for i in range(2)], timeout=240)
print("RESULT", repr((out, os.getcwd(), os.stat(".").st_ino == before)))
"""


@pytest.mark.ray  # an autoscaling head and one fake worker node
def test_a_fake_node_joining_a_job_leaves_the_drivers_working_dir_in_place(tmp_path):
    # A node's runtime-env agent unpacks the job's working_dir after removing what is at its path;
    # fake nodes share the head's session directory, so a joining node deleted the folder the
    # job's driver ran in (os.getcwd() then raised FileNotFoundError).
    job = tmp_path / "job"
    job.mkdir()
    (job / "probe.py").write_text(PROBE_JOB)
    with LocalRayHead(autoscaling_config=REPO / "cluster" / "local-autoscaling.yaml", workdir=tmp_path / "head",
                      autoscaler_update_s=1) as head:
        proc = head.submit_job(["python", "probe.py"], working_dir=job, echo=False)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-3000:]
    tasks, driver_cwd, same_folder = eval(line[len("RESULT "):])
    assert len({node for node, _, _ in tasks}) == 2  # one task on the head, one on the new node
    assert all(found for _, _, found in tasks)  # each ran in an unpacked copy of the job
    assert len({cwd for _, cwd, _ in tasks}) == 2  # the new node's copy is its own
    assert same_folder, f"the driver's folder {driver_cwd} was replaced while the job ran"
