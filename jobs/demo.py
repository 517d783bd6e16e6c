"""The demo, run by `make demo`: the main job end to end on this machine.

    python jobs/demo.py [--steps 200] [--keep-cluster]

Top to bottom: start a local Ray cluster on 127.0.0.1 (`ray start --head`, token auth on, as
Ray clusters are by default), prepare the bundled corpus (the Python standard library's source;
nothing is downloaded), submit the pretraining job with `ray job submit` (k3-tiny, 2 workers,
expert parallelism 2, Quantile Balancing through the coordinator actor), which prints its
summary and a sample from the final checkpoint; then serve that checkpoint on the same cluster,
disaggregated (1 prefill + 1 decode replica, the cache handed over through the object store),
ask it the job's own sample request (prompt, sampling settings and seed) through the completions
API and print the two texts side by side with whether they match (the served model is the
trained one), stream an answer to a chat request made with the official `openai` client, shut
Serve down, stop the cluster it started, and write the run's HTML report (`k3 report`), printing
its path.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from k3.platform.ops.local_ray import LocalRayHead
from k3.platform.ops.report import write_report

REPO = Path(__file__).resolve().parents[1]


SUMMARY = "summary.json"  # the job's summary in its run directory (--summary-json), with its sample


def side_by_side(left: str, right: str, titles: tuple[str, str], width: int = 44) -> str:
    """Two texts in two columns of `width` characters (long lines wrapped, tabs as 4 spaces)."""
    def rows(text: str) -> list[str]:
        out = []
        for line in text.expandtabs(4).split("\n"):
            out += [line[i:i + width] for i in range(0, max(len(line), 1), width)]
        return out

    a, b = rows(left), rows(right)
    a, b = a + [""] * (len(b) - len(a)), b + [""] * (len(a) - len(b))
    lines = [f"{titles[0]:<{width}} | {titles[1]}", f"{'-' * width}-+-{'-' * width}"]
    return "\n".join(lines + [f"{x:<{width}} | {y}" for x, y in zip(a, b)])


def replay_sample(client, model: str, run_dir: Path) -> None:
    """Ask the served model the job's own sample request; print both answers and whether they match."""
    path = run_dir / SUMMARY
    if not path.is_file():
        print(f"demo: no {path}: the job's sample cannot be replayed", flush=True)
        return
    sample = json.loads(path.read_text()).get("sample")
    if sample is None:
        print(f"demo: {path} has no sample (the job ran with --sample 0)", flush=True)
        return
    r = client.completions.create(model=model, prompt=sample["prompt"], max_tokens=sample["max_tokens"],
                                  temperature=sample["temperature"], top_p=sample["top_p"], seed=sample["seed"])
    served = r.choices[0].text
    same = served == sample["text"]
    print(f"demo: the job's sample request through the API (prompt {sample['prompt']!r}, temperature "
          f"{sample['temperature']}, top_p {sample['top_p']}, seed {sample['seed']}):", flush=True)
    print(side_by_side(sample["prompt"] + sample["text"], sample["prompt"] + served,
                       ("the job's sample (k3.model.generate)", "served (POST /v1/completions)")))
    print("demo: the same text: the served model is the trained one" if same else
          f"demo: the texts differ after {len(os.path.commonprefix([sample['text'], served]))} characters", flush=True)


def serve_demo(head: LocalRayHead, run_dir: Path) -> int:
    """5. Serve the trained checkpoint disaggregated, ask it the job's sample request, and stream one
    chat answer through `openai`."""
    from k3.platform.ops.local_ray import LOOPBACK_ENV

    # This driver joins the cluster as its workers do: loopback kept (Ray would swap 127.0.0.1 for
    # the outward address) and the cluster's auth token; set before Ray is imported.
    for key in (LOOPBACK_ENV, "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
        os.environ[key] = head.env[key]
    import openai
    import ray
    from ray import serve

    from k3.platform.train.export import export_model, latest_checkpoint
    from k3.platform.ops.local_ray import free_port
    from k3.serve.builder import build_pd_app

    model_dir = export_model(latest_checkpoint(run_dir), run_dir / "model")
    print(f"demo: exported {model_dir} (k3 model directory: config, weights, tokenizer, chat template)", flush=True)
    ray.init(address=head.gcs_address, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        small = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}}
        app = build_pd_app({"model_id": "k3-demo", "model": {"path": str(model_dir)}, "prefill": small,
                            "decode": small, "ingress": {"ray_actor_options": {"num_cpus": 0.1}}})
        serve.run(app, name="k3", route_prefix="/")
        print(f"demo: serving on http://127.0.0.1:{port}/v1 (PrefillServer + DecodeServer + Ingress)", flush=True)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        replay_sample(client, "k3-demo", run_dir)
        print("demo: chat> write a python function\ndemo: k3> ", end="", flush=True)
        stream = client.chat.completions.create(model="k3-demo", stream=True, max_tokens=60, temperature=0,
                                                messages=[{"role": "user", "content": "write a python function"}])
        for event in stream:
            for choice in event.choices:
                print(choice.delta.content or "", end="", flush=True)
        print("\ndemo: streamed through Ingress -> DecodeServer <- PrefillServer (object store handoff)", flush=True)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=200, help="training steps (about 1 s each on 2 cores)")
p.add_argument("--micro-batch", type=int, default=8, help="sequences per worker per step")
p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
p.add_argument("--data", default=str(REPO / "data" / "bundled"), help="prepared data directory")
p.add_argument("--runs", default=str(REPO / "runs"), help="checkpoint storage")
p.add_argument("--name", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}", help="run name")
p.add_argument("--no-serve", action="store_true", help="skip serving the trained checkpoint")
p.add_argument("--serve-only", action="store_true",
               help="skip data and training: serve the newest checkpoint of the run --name under --runs")
args = p.parse_args()
# the job runs in Ray's copy of the working dir: it gets absolute paths
args.data, args.runs = str(Path(args.data).resolve()), str(Path(args.runs).resolve())


# Ctrl-C and SIGTERM unwind through the `finally` below, so the cluster this script started stops.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

# 1. A private Ray cluster on loopback, every port chosen free, with its own auth token.
env = {"DS_ACCELERATOR": "cpu"}
head = LocalRayHead(num_cpus=2, env=env)
print(f"demo: starting Ray on {head.gcs_address} (dashboard {head.address}, log {head.log_path})", flush=True)
# 2. Data (a no-op when already prepared), while Ray starts.
prep = subprocess.Popen([sys.executable, str(REPO / "jobs" / "prepare_data.py"), "--out", args.data, "--quiet"],
                        env=head.env, stdout=subprocess.DEVNULL)
rc = 1
try:
    head.start()
    if prep.wait() != 0:
        sys.exit("demo: preparing the data failed")
    if args.serve_only:
        sys.exit(serve_demo(head, Path(args.runs) / args.name))
    # 3. The job, exactly as a user submits it.
    entry = ["python", "jobs/pretrain.py", "--data", args.data, "--preset", "k3-tiny", "--num-workers", "2",
             "--ep-size", "2", "--balance", "quantile_hist", "--steps", str(args.steps), "--micro-batch",
             str(args.micro_batch), "--lr", str(args.lr), "--log-every", "10", "--checkpoint-every", "50",
             "--storage-path", args.runs, "--name", args.name, "--sample", "120",
             "--summary-json", str(Path(args.runs) / args.name / SUMMARY)]
    print(f"demo: ray job submit --address {head.address} --working-dir {REPO} -- " + " ".join(entry), flush=True)
    rc = head.submit_job(entry, working_dir=REPO).returncode
    if rc == 0 and not args.no_serve:
        rc = serve_demo(head, Path(args.runs) / args.name)  # 4. serve what it trained
finally:
    # 5. Stop the cluster this script started (and only it).
    head.stop()
    print("demo: Ray stopped", flush=True)
# 6. The run's report: loss, tokens/s, MaxVio and router bias spread per layer (HTML + PNG).
if rc == 0:
    print(f"demo: run report {write_report(Path(args.runs) / args.name)}", flush=True)
sys.exit(rc)
