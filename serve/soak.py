"""Soak test: many streaming clients for a while, zero errors expected, and the servers' resident
memory sampled once a second to show it stays flat after warm-up.

    summary = asyncio.run(run_soak(SoakConfig(base_url=url, clients=32, duration_s=60), sample_rss))

`sample_rss()` returns {process label: RSS bytes}; `jobs/serve_soak.py` finds the Serve replica
processes through Ray's state API, a test passes the current process.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .bench import (BenchConfig, auth_headers, endpoint_url, make_prompts, new_client, request_body, served_model,
                    stream_request, summarize)

RssSampler = Callable[[], dict[str, int]]


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
    warmup_s: float = Field(10.0, ge=0, description="RSS samples before this are warm-up, outside the verdict.")
    rss_interval_s: float = Field(1.0, gt=0, description="Seconds between RSS samples.")
    max_rss_growth: float = Field(0.05, ge=0, description="Flat: total RSS grows by at most this fraction "
                                                          "from the first to the last fifth after warm-up.")
    seed: int = Field(0, description="Seed of the prompts.")
    timeout_s: float = Field(120.0, gt=0, description="Per-request timeout.")


def rss_verdict(times_s: list[float], totals: list[int], warmup_s: float, max_growth: float) -> dict:
    """Whether the RSS curve is flat after warm-up: the mean of the last fifth of the samples against
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
        totals = [sum(s.values()) for _, s in samples]
        labels = sorted({k for _, s in samples for k in s})
        summary["rss"] = {
            "t_s": times,
            "total_mb": [round(x / 2**20, 2) for x in totals],
            "per_process_mb": {k: [round(s[k] / 2**20, 2) if k in s else None for _, s in samples] for k in labels},
            **rss_verdict(times, totals, cfg.warmup_s, cfg.max_rss_growth),
        }
    return summary
