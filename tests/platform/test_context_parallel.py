"""Context parallelism on 4 gloo processes, with expert parallelism (EP = 2) at the same time:
an 8K-token stream of packed documents (crossing piece bounds, one starting exactly on a bound,
one two tokens before a bound so the conv window reaches back into it) run with C = 2 (two
data-parallel groups, two streams) and C = 4 (activation checkpointing on) gives the logits,
the loss and the gradient of every parameter that one process gives on the whole streams; and
through the Trainer (DeepSpeed, 2 processes), a checkpoint saved with C = 2 continues with C = 1
exactly as it does with C = 2."""
from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import k3.model
from k3.model import get_preset
from k3.platform.ops.local_ray import free_port

pytestmark = pytest.mark.distributed  # gloo worker processes (make test-fast leaves them out)

T = 8192
WORLD, EP = 4, 2
DOCS = [0, 1000, 2046, 3000, 6144, 6145, T]  # with C = 4 the bounds are 2048, 4096, 6144
TOL = 1e-5
# A KDA layer's A_log gradient: one number a head, each a sum over every token and channel with
# much cancellation, summed in another order under context parallelism: 1.9-2.5e-5 apart on an
# Intel Xeon host (MKL's avx512 kernels), under 1e-5 on the AMD EPYC one; every other gradient
# stays under TOL on both.
A_LOG_TOL = 5e-5


def _cfg():
    # 3 KDA layers + 1 MLA, a dense layer then MoE, two AttnRes blocks: every kind of layer
    return get_preset("k3-tiny", num_layers=4, layer_types=["kda", "kda", "kda", "mla"],
                      mlp_types=["dense", "moe", "moe", "moe"], vocab_size=1024)


# Routing held fixed: every router's weight zero (every score exactly 0.5 on every rank) and a
# distinct bias choosing experts 2, 5 (EP rank 0) and 9, 14 (EP rank 1) for every token. With
# random routers an expert choice can flip where two scores tie to round-off (the fold sums in
# another order: one token of 49K routings did at 8K tokens), which makes gradients incomparable,
# not wrong; the tokens still cross ranks through the all-to-all.
CHOSEN = [2, 5, 9, 14]


def _fixed_routing(model) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:
                layer.mlp.gate.weight.zero_()
                layer.mlp.gate.bias.copy_(torch.linspace(0, -0.1, 16))
                layer.mlp.gate.bias[CHOSEN] = 1.0 + torch.arange(4.0) / 8


def _streams():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 1024, (2, T), generator=g)
    doc_start = torch.zeros(2, T, dtype=torch.long)
    doc_start[:, DOCS[:-1]] = 1
    return tokens, doc_start


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from k3.platform.train.context_parallel import ContextParallel, cp_groups
    from k3.platform.train.expert_parallel import apply_expert_parallel, ep_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))  # a desync fails, never hangs
    tokens, doc_start = _streams()
    result = {}
    for C in (2, 4):
        model = k3.model.build(_cfg(), rank % EP, EP, seed=5).train()
        _fixed_routing(model)
        model.model.activation_checkpointing = C == 4
        ep = apply_expert_parallel(model, *ep_groups(rank, WORLD, EP), world=WORLD)
        cp = ContextParallel(cp_groups(rank, WORLD, C), C, rank % C)
        s = rank // C  # the stream of this rank's data-parallel group
        stream, shard = cp.shard(tokens[s:s + 1], doc_start[s:s + 1])
        o = model(stream, labels=stream, shard=shard, collect_router=True)
        o.loss.backward()
        experts = {id(p) for p in ep.params}
        grads = {}
        for name, p in model.named_parameters():  # the gradient of the sum of the streams' losses
            grad = p.grad.clone()
            dist.all_reduce(grad, group=ep.edp_group if id(p) in experts else None)
            grads[name] = grad
        loss = o.loss.detach().clone()
        dist.all_reduce(loss)  # the group's shares of a stream's mean add up to it
        result[C] = {"logits": o.logits.detach(), "start": shard.start, "stream": s, "loss": float(loss) / (WORLD // C),
                     "grads": grads,
                     "first": {n: ep.owner(p).first for n, p in model.named_parameters() if id(p) in experts},
                     "expert_ids": [r.expert_ids for r in o.router]}
    dist.destroy_process_group()
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    """One process, whole streams, every expert: per stream the logits, loss, router choices,
    and the gradients of stream 0's loss and of the two streams' losses summed."""
    torch.set_num_threads(1)
    tokens, doc_start = _streams()
    model = k3.model.build(_cfg(), seed=5).train()
    _fixed_routing(model)
    cu = torch.tensor(DOCS)
    ref = {"logits": [], "loss": [], "expert_ids": []}
    for s in range(2):
        o = model(tokens[s:s + 1], cu_seqlens=cu, labels=tokens[s:s + 1], collect_router=True)
        o.loss.backward()
        ref["logits"].append(o.logits.detach()[0])
        ref["loss"].append(float(o.loss.detach()))
        ref["expert_ids"].append([r.expert_ids for r in o.router])
        if s == 0:
            ref["grads_0"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref["grads_01"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("C", [2, 4])
def test_logits_and_loss_equal_one_process(runs, reference, C):
    for r in range(WORLD):
        got = runs[r][C]
        n = got["logits"].shape[1]
        # the same experts chosen for every token (a flip at round-off would make the gradients
        # incomparable, not wrong)
        for layer, (a, b) in enumerate(zip(got["expert_ids"], reference["expert_ids"][got["stream"]])):
            differ = (a.sort(-1).values != b[got["start"]:got["start"] + n].sort(-1).values).any(-1)
            assert not differ.any(), f"rank {r}: MoE layer {layer} routes {int(differ.sum())} tokens differently"
        want = reference["logits"][got["stream"]][got["start"]:got["start"] + n]
        assert _rel(got["logits"][0], want) <= TOL, f"rank {r}: logits differ by {_rel(got['logits'][0], want):.2e}"
        ref_loss = reference["loss"][0] if C == 4 else sum(reference["loss"]) / 2
        assert abs(got["loss"] - ref_loss) <= TOL * ref_loss, f"rank {r}: loss {got['loss']} vs {ref_loss}"


@pytest.mark.parametrize("C", [2, 4])
def test_every_gradient_equals_one_process(runs, reference, C):
    want = reference["grads_0"] if C == 4 else reference["grads_01"]
    for r in range(WORLD):
        got = runs[r][C]
        for name, grad in got["grads"].items():
            ref = want[name]
            if name in got["first"]:  # this rank's rows of the experts
                ref = ref[got["first"][name]:got["first"][name] + grad.shape[0]]
            assert grad.abs().sum() > 0, f"{name}: no gradient"
            tol = A_LOG_TOL if name.endswith(".A_log") else TOL
            assert _rel(grad, ref) <= tol, f"rank {r}, C={C}: {name} differs by {_rel(grad, ref):.2e}"


# -- the Trainer: a checkpoint saved with C = 2 continues identically with C = 1 -------------------
ROW = 257  # one sequence of 256 predictions, documents crossing the middle (where C = 2 cuts it)


def _train_cfg(C: int):
    from k3.platform.train.config import TrainConfig

    return TrainConfig(num_workers=2, ep_size=2, context_parallel=C, micro_batch=1, steps=4, lr=1e-3, warmup_steps=0,
                       balance={"method": "loss_free"}, seed=3,
                       model_overrides=dict(num_layers=4, layer_types=["kda", "kda", "kda", "mla"],
                                            mlp_types=["dense", "moe", "moe", "moe"]))


def _raw(step: int) -> dict[str, torch.Tensor]:
    """The step's batch; every rank gets the same one (C = 2: the ranks split it; C = 1: the two
    data-parallel ranks train the same row, so their mean is that row's gradient)."""
    g = torch.Generator().manual_seed(100 + step)
    doc_start = torch.zeros(1, ROW, dtype=torch.long)
    doc_start[0, [90, 127, 200]] = 1
    return {"tokens": torch.randint(0, 4096, (1, ROW), generator=g), "doc_start": doc_start}


def _train_worker(rank: int, port: int, out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    from k3.platform.train.trainer import Trainer

    deepspeed.init_distributed(dist_backend="gloo")
    root, steps = Path(out), {}
    t = Trainer(_train_cfg(2), rank, 2).build()
    t.start()
    for step in (0, 1):
        steps[("C2", step)] = t.train_step(t.make_batch(_raw(step)), step)
        t.save(root / f"c2-step{step + 1}", {"step": step + 1, "history": []})
    t = Trainer(_train_cfg(1), rank, 2).build()
    t.start()
    steps[("C1", 0)] = t.train_step(t.make_batch(_raw(0)), 0)
    t = Trainer(_train_cfg(1), rank, 2).build()
    t.load(root / "c2-step1")
    t.start()
    steps[("C1 from C2", 1)] = t.train_step(t.make_batch(_raw(1)), 1)
    t.save(root / "c1-from-c2-step2", {"step": 2, "history": []})
    torch.save({k: (r.loss, r.grad_norm, r.tokens) for k, r in steps.items()}, root / f"steps{rank}.pt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp-trainer")
    mp.spawn(_train_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return out


def test_a_c2_checkpoint_continues_identically_with_c1(trained):
    steps = torch.load(trained / "steps0.pt")
    for (a, b) in [(("C2", 0), ("C1", 0)), (("C2", 1), ("C1 from C2", 1))]:
        (la, na, ta), (lb, nb, tb) = steps[a], steps[b]
        assert abs(la - lb) <= TOL * lb and abs(na - nb) <= TOL * nb, f"{a} vs {b}: loss {la} / {lb}, norm {na} / {nb}"
    assert steps[("C2", 0)][2] == ROW and steps[("C1", 0)][2] == 2 * ROW  # one row, or two data-parallel ones
    a = dict(k3.model.load(trained / "c2-step2").named_parameters())
    b = dict(k3.model.load(trained / "c1-from-c2-step2").named_parameters())
    with torch.no_grad():
        va, vb = torch.cat([a[n].reshape(-1) for n in a]), torch.cat([b[n].reshape(-1) for n in a])
    assert _rel(vb, va) <= TOL, f"parameters after the continued step differ by {_rel(vb, va):.2e}"
    moved = dict(k3.model.load(trained / "c2-step1").named_parameters())
    assert all(not torch.equal(moved[n], a[n]) for n in a if "experts" in n or "lm_head" in n)
