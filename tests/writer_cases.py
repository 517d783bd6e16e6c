"""The model writers k3 has, each with a tiny model to write, shared by tests/model/test_model_writers.py
and the subprocess it kills midway (run with tests/ on the path, like this module's importers).

`write_case(writer, seed, path, scratch)` writes the tiny model of `seed` with `writer` to `path`;
`export_model` writes from a training checkpoint it first puts under `scratch`.
"""
from __future__ import annotations

from pathlib import Path

import torch

import k3.model
from k3.model import get_preset
from k3.model import training_checkpoint as ckpt
from k3.model.hf_k3 import save_k3
from k3.model.hf_kimi import save_kimi_linear
from k3.model.pretrained import save_model_dir
from k3.model.tokenizer import train_bpe

WRITERS = ("save_k3", "save_kimi_linear", "save_model_dir", "export_model")


def tiny_config(writer: str):
    cfg = get_preset("k3-tiny", num_layers=2, layer_types=["kda", "mla"], mlp_types=["dense", "moe"])
    if writer == "save_kimi_linear":  # Kimi Linear has no latent MoE, SiTU-GLU or AttnRes
        cfg = cfg.replace(moe_latent_size=None, activation="swiglu", attn_res_block_size=None, q_lora_rank=None,
                          mla_output_gate=False, kda_gate="unbounded", kda_output_gate="low_rank")
    return cfg


def training_checkpoint(model, path: Path) -> Path:
    """A k3 training checkpoint of `model` (one expert-parallel rank) with a tokenizer beside it."""
    d = path / "k3"
    d.mkdir(parents=True)
    ckpt.save_shared(model, d)
    ckpt.save_experts(model, d, 0, 1)
    train_bpe(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=300).save(str(d / "tokenizer.json"))
    return path


def write_model(writer: str, model, path: Path, **kw) -> None:
    """One of the three model writers (not export_model, which reads a training checkpoint)."""
    if writer == "save_k3":
        save_k3(model, path, max_shard_bytes=64 << 10, **kw)  # several shards: a kill can land between two
    elif writer == "save_kimi_linear":
        save_kimi_linear(model, path, **kw)
    else:
        save_model_dir(model, path, **kw)


def write_case(writer: str, seed: int, path: Path, scratch: Path, **kw) -> None:
    model = k3.model.build(tiny_config(writer), seed=seed).eval()
    if writer == "export_model":
        from k3.platform.train.export import export_model

        export_model(training_checkpoint(model, scratch / f"run-{seed}"), path, **kw)
    else:
        write_model(writer, model, path, **kw)


def model_state(path: Path) -> dict[str, torch.Tensor]:
    return k3.model.load(path, dtype=torch.float32).state_dict()
