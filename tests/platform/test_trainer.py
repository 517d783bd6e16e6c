"""The Trainer without Ray: two processes (gloo) train the same batches with ep_size 1 and 2.

Checks the one global gradient clip (experts folded into DeepSpeed's norm), that the reported
norm is the norm over every parameter computed by hand on one process, that a checkpoint saved
with ep_size 2 continues identically with ep_size 1, why the experts are not handed to
DeepSpeed as expert-parallel parameters by attribute, and that Muon steps eagerly on a CPU."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from k3.platform.ops.local_ray import free_port
from k3.platform.train.config import TrainConfig
import k3.model

pytestmark = pytest.mark.distributed  # gloo worker processes (make test-fast leaves them out)

CLIP = 0.05  # far below the first step's gradient norm, so the clip is active


def _cfg(ep_size: int) -> TrainConfig:
    return TrainConfig(num_workers=2, ep_size=ep_size, micro_batch=2, steps=4, lr=1e-3, warmup_steps=0,
                       grad_clip=CLIP, balance={"method": "none"}, seed=3)


def _batch(rank: int, step: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"tokens": torch.randint(0, vocab, (2, 33), generator=g)}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    from k3.platform.train.ds_adapter import ds_config
    from k3.platform.train.trainer import Trainer

    deepspeed.init_distributed(dist_backend="gloo")
    root = Path(out)
    vocab = _cfg(1).model_cfg().vocab_size
    norms = {}
    for ep in (1, 2):
        t = Trainer(_cfg(ep), rank, 2).build()
        t.start()
        r = t.train_step(t.make_batch(_batch(rank, 0, vocab)), 0)
        norms[ep] = r.grad_norm
        t.save(root / f"ep{ep}-step1", {"step": 1, "history": []})
        if ep == 2:  # one more step with ep_size 2: the continuation to match
            t.train_step(t.make_batch(_batch(rank, 1, vocab)), 1)
            t.save(root / "ep2-step2", {"step": 2, "history": []})
    # the ep_size 2 checkpoint, continued with ep_size 1
    t = Trainer(_cfg(1), rank, 2).build()
    t.load(root / "ep2-step1")
    t.start()
    t.train_step(t.make_batch(_batch(rank, 1, vocab)), 1)
    t.save(root / "ep1-from-ep2-step2", {"step": 2, "history": []})

    # Why the experts stay outside DeepSpeed: marked as DeepSpeed expert parameters by attribute
    # (allreduce=False, group_name, DeepSpeed's expert groups created), they are still treated as
    # replicated parameters, because DeepSpeed enables its expert-parallel handling only for
    # modules of its own MoE classes: after one ZeRO step both ranks hold the same "experts".
    from deepspeed.utils import groups

    import torch.distributed as dist

    from k3.platform.train.expert_parallel import apply_expert_parallel, ep_groups

    groups._create_expert_and_data_parallel(2)
    cfg = _cfg(2)
    model = k3.model.build(cfg.model_cfg(), rank % 2, 2, seed=cfg.seed)
    ep = apply_expert_parallel(model, *ep_groups(rank, 2, 2), world=2)
    for p in ep.params:
        p.allreduce, p.group_name = False, "ep_size_2"
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=ds_config(cfg))
    tok = _batch(rank, 0, vocab)["tokens"]
    engine.backward(engine(tok, labels=tok).loss)
    engine.step()
    w = ep.params[0].detach().contiguous()
    both = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(both, w)

    # Muon on a CPU: DeepSpeed's torch.compile of its update is passed by (k3.platform.train.ds_adapter),
    # and the step still moves every matrix Muon owns
    from torch._dynamo.utils import counters

    muon = Trainer(_cfg(2).model_copy(update={"optimizer": "muon", "lr": 0.02}), rank, 2).build()
    mats = {n: p.detach().clone() for n, p in muon.model.named_parameters() if getattr(p, "use_muon", False)}
    graphs = counters["stats"]["unique_graphs"]
    muon.start()
    muon.train_step(muon.make_batch(_batch(rank, 0, vocab)), 0)
    moved = [not torch.equal(p, mats[n]) for n, p in muon.model.named_parameters() if n in mats]
    torch.save({"norms": norms, "ds_has_moe": engine.has_moe_layers, "experts_same_on_both_ranks":
                torch.equal(both[0], both[1]), "muon_graphs": counters["stats"]["unique_graphs"] - graphs,
                "muon_matrices": len(moved), "muon_moved": sum(moved)}, root / f"rank{rank}.pt")
    # an orderly end: a process that exits with the gloo group's threads still running can abort in
    # their destructors ("terminate called without an active exception", SIGABRT), failing the spawn
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    port = free_port()
    mp.spawn(_worker, args=(port, str(out)), nprocs=2, join=True)
    return out


def _params(path: Path) -> dict[str, torch.Tensor]:
    return dict(k3.model.load(path).named_parameters())


def _rel(a: dict, b: dict) -> tuple[float, float, str]:
    """(|a - b| / |a| over all parameters as one vector, the worst single tensor's, its name).

    Per tensor, Adam's first step divides gradients by their own magnitude, so elements whose
    gradient is near eps turn float summation-order noise into ~1e-4 of a zero-initialised
    tensor (attn_res.queries); the whole-model measure is the one the bound is on."""
    with torch.no_grad():
        per = {n: float((a[n] - b[n]).norm() / a[n].norm().clamp_min(1e-30)) for n in a}
        va = torch.cat([a[n].reshape(-1) for n in a])
        vb = torch.cat([b[n].reshape(-1) for n in a])
        worst = max(per, key=per.get)
        return float((va - vb).norm() / va.norm()), per[worst], worst


def test_global_clip_same_step_with_ep_size_1_and_2(runs):
    r0 = torch.load(runs / "rank0.pt")
    n1, n2 = r0["norms"][1], r0["norms"][2]
    assert n1 > 10 * CLIP, f"the clip is not active: grad_norm {n1}"
    assert abs(n1 - n2) <= 1e-5 * n1, f"grad_norm ep1 {n1} vs ep2 {n2}"
    rel, worst, name = _rel(_params(runs / "ep1-step1"), _params(runs / "ep2-step1"))
    assert rel <= 1e-5 and worst <= 1e-3, f"parameters after one clipped step differ by {rel:.2e} relative " \
        f"(worst tensor {name}: {worst:.2e})"
    # the step did move every parameter group, experts included
    init = dict(k3.model.build(_cfg(1).model_cfg(), seed=3).named_parameters())
    after = _params(runs / "ep1-step1")
    assert all(not torch.equal(init[n], after[n]) for n in after if ".experts." in n or "lm_head" in n)


def test_reported_norm_is_the_norm_over_every_parameter(runs):
    cfg = _cfg(1)
    model = k3.model.build(cfg.model_cfg(), seed=cfg.seed)
    vocab = cfg.model_cfg().vocab_size
    losses = [model(b["tokens"], labels=b["tokens"]).loss for b in (_batch(0, 0, vocab), _batch(1, 0, vocab))]
    (sum(losses) / 2).backward()  # the data-parallel mean over the two workers
    hand = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    for ep, reported in torch.load(runs / "rank0.pt")["norms"].items():
        assert abs(reported - float(hand)) <= 1e-5 * float(hand), f"ep_size {ep}: reported {reported}, by hand {hand}"


def test_ep2_checkpoint_continues_identically_with_ep1(runs):
    rel, worst, name = _rel(_params(runs / "ep2-step2"), _params(runs / "ep1-from-ep2-step2"))
    assert rel <= 1e-5 and worst <= 1e-3, f"ep1 continuation of an ep2 checkpoint differs by {rel:.2e} " \
        f"relative (worst tensor {name}: {worst:.2e})"


def test_deepspeed_ignores_expert_attributes_on_non_deepspeed_modules(runs):
    r1 = torch.load(runs / "rank1.pt")
    assert r1["ds_has_moe"] is False
    assert r1["experts_same_on_both_ranks"], "DeepSpeed kept the ranks' different experts apart"


def test_muon_on_a_cpu_steps_eagerly(runs):
    for rank in (0, 1):
        r = torch.load(runs / f"rank{rank}.pt")
        assert r["muon_graphs"] == 0, f"rank {rank}: Muon's step compiled {r['muon_graphs']} graphs on a CPU"
        assert r["muon_matrices"] > 10 and r["muon_moved"] == r["muon_matrices"], r
