"""Quantile Balancing inside the training step, at a learning rate where the router moves more
per step than its tokens differ. Three runs on the same batches:

- margins of the training forward (the first behaviour): the deep layers head for collapse onto k
  experts (MaxVio above 2; total collapse is E/k - 1 = 3);
- margins of a forward under the weights the step just produced, one solve of every layer (the
  second): no collapse, but worse balanced than the default: a deep layer's bias is solved while
  the layers below it still route with last step's biases (at this learning rate that matters; at
  2-4x the demo's the second alternation is what counts, docs/benchmarks.md). How much worse
  depends on the host's float rounding: every layer from the second on above 1.3 on the AMD EPYC
  host this was written on, worst layers 0.83 against the default's 0.54 on an Intel Xeon one;
- the default: the same forward solved layer by layer, two alternations of the solve each: each
  MoE layer is solved as that forward reaches it (its scores re-routed with the solve and solved
  again) and routes with its new bias before the next is reached, so every layer is solved for
  the inputs it will see, and every layer stays under 1.0."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from k3.platform.ops.local_ray import free_port

pytestmark = pytest.mark.distributed  # gloo worker processes (make test-fast leaves them out)

STEPS, MICRO_BATCH, SEQ, LR = 20, 8, 64, 4e-2
BOUND = 1.0  # per-layer MaxVio, mean over the last third of the run (collapse is 3.0)
RUNS = {"training_forward": {"margins_after_step": False, "layerwise": False},
        "after_step_one_solve": {"margins_after_step": True, "layerwise": False, "solve_rounds": 1},
        "after_step_layerwise": {}}  # BalanceConfig's defaults


def _tokens(step: int, vocab: int) -> dict[str, torch.Tensor]:
    # Zipf-like ids, so a few tokens dominate as in text; the same batches for both runs
    g = torch.Generator().manual_seed(step)
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float)
    return {"tokens": torch.multinomial(p, MICRO_BATCH * (SEQ + 1), replacement=True, generator=g)
            .reshape(MICRO_BATCH, SEQ + 1)}


def _worker(index: int, ports: list[int], out: str) -> None:
    """One run per process (three processes on the machine's two cores), each a world of one."""
    name, balance = list(RUNS.items())[index]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[index]), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    from k3.platform.train.config import TrainConfig
    from k3.platform.train.trainer import Trainer

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = TrainConfig(num_workers=1, ep_size=1, micro_batch=MICRO_BATCH, steps=STEPS, lr=LR, warmup_steps=2,
                      seed=0, balance={"method": "quantile", **balance})
    t = Trainer(cfg, 0, 1).build()
    t.start()
    vocab = cfg.model_cfg().vocab_size
    maxvio = torch.tensor([t.train_step(t.make_batch(_tokens(s, vocab)), s).maxvio for s in range(STEPS)])
    torch.save(maxvio, f"{out}.{name}")


@pytest.fixture(scope="module")
def maxvio(tmp_path_factory):
    out = tmp_path_factory.mktemp("qb") / "maxvio.pt"
    ports: list[int] = []
    while len(ports) < len(RUNS):  # distinct: each run's rendezvous is its own
        ports += [port] if (port := free_port()) not in ports else []
    mp.spawn(_worker, args=(ports, str(out)), nprocs=len(RUNS), join=True)
    return {name: torch.load(f"{out}.{name}") for name in RUNS}


@pytest.mark.parametrize("run", list(RUNS))
def test_qb_keeps_every_layer_balanced_at_high_lr(maxvio, run):
    tail = maxvio[run][-STEPS // 3:].mean(0)  # [layers]
    if run == "after_step_layerwise":
        assert tail.max() <= BOUND, f"a layer left the bound {BOUND}: per-layer MaxVio {tail.tolist()}"
    elif run == "after_step_one_solve":  # every layer from one forward, kept as an option: less balanced
        best = maxvio["after_step_layerwise"][-STEPS // 3:].mean(0)
        assert tail.max() > best.max(), f"expected one solve per step to balance worse than the default's " \
                                        f"layer-by-layer solve: worst layer {tail.max():.3f} against {best.max():.3f}"
    else:  # the first behaviour, kept as an option: this is the collapse after-step margins remove
        assert tail.max() >= 2.0, f"expected the training forward's margins to let a layer near collapse: {tail.tolist()}"
