"""The two Serve applications the app tests share (disaggregated and aggregated, one Serve
instance, the `apps` fixture in tests/serve/conftest.py) and helpers to call them."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

POISON = 4095  # a token id the test models below treat as fatal
CONFIG_YAML = Path(__file__).resolve().parents[1] / "serve" / "config.yaml"

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


def config_yaml_apps(path: Path = CONFIG_YAML, num_cpus: float = 0.05) -> list[tuple[str, str, object, dict]]:
    """The applications `serve run <path>` deploys, built the way Serve's controller builds them
    (the YAML validated as a ServeDeploySchema, each import_path called with its args by Serve's own
    builder call): [(name, route_prefix, bound app, args)].

    The one thing changed is what the 2-CPU test cluster cannot give: every replica's CPU share
    becomes num_cpus. Host and port are the test session's Serve (loopback, a free port) instead of
    the file's http_options. An engine that leaves `compile_decode` to its default gets True, what
    the default is on a user's CPU machine (this session's K3_COMPILE_DECODE=0 would turn it off).
    Per-deployment overrides or a runtime_env in the file would be applied by `serve run` and are
    not here: they are refused rather than silently dropped."""
    import yaml
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    spec = ServeDeploySchema.model_validate(yaml.safe_load(Path(path).read_text()))
    out = []
    for a in spec.applications:
        if a.deployments or a.runtime_env:
            raise ValueError(f"{path}: application {a.name!r} has `deployments` or `runtime_env`, which "
                             "config_yaml_apps does not apply: extend it before relying on them")
        args = dict(a.args)
        engine = dict(args.get("engine") or {})
        if engine.get("compile_decode") is None:
            engine["compile_decode"] = True
        args["engine"] = engine
        for name in ("prefill", "decode", "llm", "ingress"):
            dep = dict(args.get(name) or {})
            dep["ray_actor_options"] = {**dep.get("ray_actor_options", {}), "num_cpus": num_cpus}
            args[name] = dep
        out.append((a.name, a.route_prefix, call_user_app_builder_with_args_if_necessary(import_attr(a.import_path),
                                                                                          args), args))
    return out


def client(base):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def rand(n, seed):
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Poisoned(nn.Module):
    """The tiny model, but a forward whose input holds POISON raises (mode "raise"), or every
    logits row sampled for a sequence that has consumed POISON is NaN (mode "nan")."""

    def __init__(self, model, mode):
        super().__init__()
        self.inner, self.cfg, self.mode = model, model.cfg, mode
        self.poisoned_slots: set[int] = set()

    def forward(self, input_ids, cache=None, logits_at=None, **kw):
        if self.mode == "raise" and bool((input_ids == POISON).any()):
            raise RuntimeError("kernel failure on poisoned input")
        out = self.inner(input_ids, cache=cache, logits_at=logits_at, **kw)
        if self.mode == "nan":
            cu, slots, ctx = cache.cu_seqlens.tolist(), cache.kda_slots.tolist(), cache.context_lens.tolist()
            for i, slot in enumerate(slots):
                if ctx[i] == 0:  # a new sequence in this slot
                    self.poisoned_slots.discard(slot)
                if bool((input_ids[0, cu[i]:cu[i + 1]] == POISON).any()):
                    self.poisoned_slots.add(slot)
            for j, r in enumerate(logits_at.tolist()):
                i = next(i for i in range(len(cu) - 1) if cu[i] <= r < cu[i + 1])
                if slots[i] in self.poisoned_slots:
                    out.logits[j] = float("nan")
        return out


def tiny_lm():
    """k3-tiny as tests/serve/conftest.py's `tiny_model` builds it."""
    from k3.model import K3ForCausalLM, get_preset

    torch.manual_seed(0)
    m = K3ForCausalLM(get_preset("k3-tiny")).eval()
    with torch.no_grad():
        m.model.attn_res.queries.normal_(0, 0.05)
    return m


def tiny_engine(poison: str | None = None, **engine):
    """An engine over `tiny_lm` (wrapped in `Poisoned(mode=poison)` when given), eager steps: a
    factory a `ProcessEngine`'s child can unpickle (this module is on the tests' path)."""
    from k3.serve.engine import EngineConfig, LLMEngine

    torch.set_num_threads(1)
    m = tiny_lm()
    return LLMEngine(m if poison is None else Poisoned(m, poison), EngineConfig(**{"compile_decode": False, **engine}))
