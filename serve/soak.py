"""Soak test: many streaming clients for a while, zero errors expected, and the servers' resident
memory sampled once a second to show it stays flat after warm-up.

    summary = asyncio.run(run_soak(SoakConfig(base_url=url, clients=32, duration_s=60), sample_rss))

`sample_rss()` returns {process label: RSS bytes}; `jobs/serve_soak.py` finds the Serve replica
processes through Ray's state API and measures them and their engine processes
(`serve_process_rss`), a test passes the current process.

Memory is judged per process, each after its own warm-up: autoscaling that adds a replica adds
its memory to the total without any process growing, and a replica that goes away takes its
memory with it. The summary names the processes added and removed during the run.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from typing import Literal

import numpy as np
import psutil
from pydantic import BaseModel, ConfigDict, Field

from .bench import (ENGINE_CORE_MODULE, BenchConfig, auth_headers, endpoint_url, make_prompts, new_client,
                    request_body, served_model, stream_request, summarize)

RssSampler = Callable[[], dict[str, int]]


def serve_process_rss(replicas: Iterable[tuple[str, int]], stored: dict[int, int] | None = None) -> dict[str, int]:
    """{label: RSS bytes} of each replica process of `replicas` ((actor class, pid) pairs, on this
    machine) and of each one's engine process, where the engine and its cache live when it steps
    in a process of its own: "<class> <pid>" and "<class> <pid> engine <child pid>". A process
    that ended between the listing and the read (or that psutil may not read) is left out.

    `stored` {pid: bytes}: what a budgeted store in that process says it holds (the prefix pool's
    pages, which fill its byte budget by design); such a process is measured less those bytes,
    labelled "<class> <pid> less its store", so a leak shows and a filling store does not."""
    stored = stored or {}
    out = {}
    for cls, pid in replicas:
        try:
            proc = psutil.Process(pid)
            if pid in stored:
                out[f"{cls} {pid} less its store"] = proc.memory_info().rss - stored[pid]
            else:
                out[f"{cls} {pid}"] = proc.memory_info().rss
            for child in proc.children():
                try:
                    if ENGINE_CORE_MODULE in child.cmdline():
                        out[f"{cls} {pid} engine {child.pid}"] = child.memory_info().rss
                except psutil.Error:  # ended, or not ours to read
                    pass
        except psutil.Error:
            pass
    return out


class SoakConfig(BaseModel):
    """One soak run."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(description="The server, e.g. http://127.0.0.1:8000.")
    model: str | None = Field(None, description="Model name; default the first of GET /v1/models.")
    endpoint: Literal["completions", "chat"] = Field("chat", description="Which API to call.")
    api_key: str | None = Field(None, description="Sent as `Authorization: Bearer <key>`.")
    clients: int = Field(32, ge=1, description="Concurrent streaming clients, each sending requests back to back.")
    duration_s: float = Field(60.0, gt=0, description="How long clients start new requests.")
    input_len: int = Field(64, ge=1, description="Words per prompt.")
    output_len: int = Field(32, ge=1, description="max_tokens per request.")
    warmup_s: float = Field(10.0, ge=0, description="A process's RSS samples in its first warmup_s seconds (from the "
                                                    "run's start, or from when it appeared) are outside the verdict.")
    added_warmup_s: float = Field(60.0, ge=0, description="The warm-up of a process that appears during the run (a "
                                                         "replica autoscaling added, its engine process: the model "
                                                         "built and the decode graphs compiled first).")
    rss_interval_s: float = Field(1.0, gt=0, description="Seconds between RSS samples.")
    max_rss_growth: float = Field(0.05, ge=0, description="Flat: no process's RSS grows by more than this fraction "
                                                          "from the first to the last fifth of its samples after "
                                                          "its warm-up.")
    seed: int = Field(0, description="Seed of the prompts.")
    timeout_s: float = Field(120.0, gt=0, description="Per-request timeout.")


def rss_verdict(times_s: list[float], totals: list[int], warmup_s: float, max_growth: float) -> dict:
    """Whether one RSS curve is flat after warm-up: the mean of the last fifth of the samples against
    the first fifth (after warm-up), and the least-squares slope in MB/min."""
    after = [(t, r) for t, r in zip(times_s, totals) if t >= warmup_s]
    if len(after) < 5:
        return {"flat": None, "reason": f"{len(after)} samples after warm-up, need 5",
                "growth_fraction": None, "slope_mb_per_min": None}
    t = np.array([a[0] for a in after])
    r = np.array([a[1] for a in after], dtype=np.float64)
    k = max(1, len(after) // 5)
    growth = float(r[-k:].mean() / r[:k].mean() - 1.0)
    slope = float(np.polyfit(t, r, 1)[0]) * 60 / 2**20
    return {"flat": growth <= max_growth, "growth_fraction": round(growth, 4),
            "slope_mb_per_min": round(slope, 3), "max_growth": max_growth}


def process_verdicts(times_s: list[float], per_process: dict[str, list[int | None]], warmup_s: float,
                     max_growth: float, added_warmup_s: float | None = None) -> dict:
    """The memory verdict of a run: each process's curve judged on its own (rss_verdict, its warm-up
    counted from its first sample), and which processes came and went.

    Args:
        times_s: sample times.
        per_process: each process's RSS at every sample, None where it did not exist.
        added_warmup_s: the warm-up of a process absent from the first sample (an autoscaled
            replica builds its model and compiles its graphs first); default `warmup_s`.
    Returns {"flat": every judged process flat (None when none could be judged), "growing": the
    processes that grew, "processes": each one's verdict, "added" / "removed": processes absent
    from the first / last sample}."""
    if any(len(v) != len(times_s) for v in per_process.values()):
        raise ValueError(f"per_process: every curve needs one value per sample ({len(times_s)})")
    verdicts = {}
    for label, curve in per_process.items():
        seen = [(t, r) for t, r in zip(times_s, curve) if r is not None]
        if not seen:
            raise ValueError(f"per_process[{label!r}] has no sample")
        warm = warmup_s if curve[0] is not None or added_warmup_s is None else added_warmup_s
        verdicts[label] = rss_verdict([t for t, _ in seen], [r for _, r in seen], seen[0][0] + warm, max_growth)
    judged = [v["flat"] for v in verdicts.values() if v["flat"] is not None]
    return {"flat": all(judged) if judged else None,
            "growing": sorted(k for k, v in verdicts.items() if v["flat"] is False),
            "processes": verdicts,
            "added": sorted(k for k, v in per_process.items() if v[0] is None),
            "removed": sorted(k for k, v in per_process.items() if v[-1] is None)}


async def run_soak(cfg: SoakConfig, sample_rss: RssSampler | None = None) -> dict:
    """Run the soak; the summary has the request counts and latencies (bench's `summarize`), the
    errors, `zero_errors`, and with a sampler the RSS curve and its flatness verdict."""
    bench = BenchConfig(base_url=cfg.base_url, endpoint=cfg.endpoint, num_prompts=256, input_len=cfg.input_len,
                        output_len=cfg.output_len, seed=cfg.seed)
    prompts = make_prompts(bench)
    samples: list[tuple[float, dict[str, int]]] = []
    async with new_client(cfg.timeout_s) as client:
        model = cfg.model or await served_model(client, cfg.base_url.rstrip("/"), cfg.api_key)
        url = endpoint_url(cfg.base_url, cfg.endpoint)
        headers = auth_headers(cfg.api_key)
        start = time.perf_counter()
        end = start + cfg.duration_s
        done = asyncio.Event()

        async def client_loop(i: int) -> list:
            rng = random.Random(cfg.seed * 1000 + i)
            out = []
            while time.perf_counter() < end:
                out.append(await stream_request(client, url, request_body(bench, model, rng.choice(prompts)), headers))
            return out

        async def sampler() -> None:
            while True:
                # the sampler may block (an HTTP call to Ray's state API): keep it off the event loop
                sample = await asyncio.to_thread(sample_rss)
                samples.append((time.perf_counter() - start, sample))
                try:
                    await asyncio.wait_for(done.wait(), cfg.rss_interval_s)
                    return
                except asyncio.TimeoutError:
                    pass

        sampling = asyncio.create_task(sampler()) if sample_rss is not None else None
        per_client = await asyncio.gather(*(client_loop(i) for i in range(cfg.clients)))
        duration = time.perf_counter() - start
        done.set()
        if sampling is not None:
            await sampling
    results = [r for rs in per_client for r in rs]
    summary = summarize(results, duration)
    summary["zero_errors"] = summary["failed"] == 0
    summary["config"] = {**cfg.model_dump(exclude={"api_key"}), "model": model}
    if sample_rss is not None:
        times = [round(t, 2) for t, _ in samples]
        labels = sorted({k for _, s in samples for k in s})
        per_process = {k: [s.get(k) for _, s in samples] for k in labels}
        summary["rss"] = {
            "t_s": times,
            "total_mb": [round(sum(s.values()) / 2**20, 2) for _, s in samples],
            "per_process_mb": {k: [None if r is None else round(r / 2**20, 2) for r in v] for k, v in per_process.items()},
            **process_verdicts(times, per_process, cfg.warmup_s, cfg.max_rss_growth, cfg.added_warmup_s),
        }
    return summary
