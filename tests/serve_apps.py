"""The two Serve applications the app tests share (disaggregated and aggregated, one Serve
instance, the `apps` fixture in tests/serve/conftest.py) and helpers to call them."""
from __future__ import annotations

import torch

KEY = "sk-test-k3"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=512, page_size=8, snapshot_interval=2,
              cache_memory_bytes=32 * 2**20)


def app_config(tok_path, disaggregated):
    small = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
    # the key reaches the ingress replica as users pass secrets to Serve: its runtime_env
    ingress = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1,
                                                        "runtime_env": {"env_vars": {"K3_TEST_API_KEY": KEY}}}}
    # decode autoscales from 1 replica: a burst of requests beyond 2 in flight adds one
    decode = {"ray_actor_options": {"num_cpus": 0.1}, "max_ongoing_requests": 8, "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
        "downscale_delay_s": 4, "look_back_period_s": 1}}
    return {"model_id": "k3-tiny", "model": {"preset": "k3-tiny", "seed": 0, "tokenizer_path": tok_path},
            "engine": ENGINE, "disaggregated": disaggregated, "prefill": small, "decode": decode, "llm": small,
            "ingress": ingress, "api_key_env": "K3_TEST_API_KEY"}


def client(base):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def rand(n, seed):
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
