"""The Trainer on a multimodal preset without Ray: two processes (gloo, ep_size 2) take one
image/video step and one text step. The reported gradient norm of the media step equals the
norm computed by hand on one process from the same examples, both ranks hold the same tower
afterwards (it is DeepSpeed's, averaged like any replicated parameter), the text step reaches
every tower parameter (zero-weighted), the routers balancing solves from see the media rows,
and the checkpoint loads as K3ForConditionalGeneration."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from k3.platform.ops.local_ray import free_port

from k3.model import K3ForConditionalGeneration
from k3.platform.train.data import prepare
from k3.platform.train.config import TrainConfig
from k3.platform.train.vision_data import write_vision_set
import k3.model

pytestmark = pytest.mark.distributed  # gloo worker processes (make test-fast leaves them out)



def _cfg(data: str) -> TrainConfig:
    return TrainConfig(preset="k3-tiny-vl", data=data, num_workers=2, ep_size=2, micro_batch=2, steps=2, lr=1e-3,
                       warmup_steps=0, balance={"method": "none"}, seed=5, media_micro_batch=3, text_every=2)


def _worker(rank: int, port: int, data: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    from k3.platform.train.trainer import Trainer

    deepspeed.init_distributed(dist_backend="gloo")
    t = Trainer(_cfg(data), rank, 2).build()
    t.start()
    sched = t.media_schedule()
    assert not sched.is_text_step(0) and sched.is_text_step(1)
    media_batch = t.make_batch({"examples": sched.examples(0)})
    media = t.train_step(media_batch, 0)
    with torch.no_grad():  # the margins QB solves from see the media rows, as the training forward does
        full = t.forward(media_batch).router
    after = t.router_pass(media_batch)()
    routers_match = all(torch.allclose(a.margins, b.margins, atol=1e-5) for a, b in zip(after, full))
    g = torch.Generator().manual_seed(rank)
    text_batch = t.make_batch({"tokens": torch.randint(7, 300, (2, 33), generator=g)})
    t.forward(text_batch).loss.backward()  # gradients of a text batch
    reached = all(p.grad is not None for n, p in t.model.named_parameters() if n.startswith("vision_tower."))
    t.ds.zero_grad()
    t.train_step(text_batch, 1)
    w = t.model.vision_tower.encoder.blocks[0].wqkv.weight.detach().contiguous()
    both = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(both, w)
    t.save(Path(out) / "ckpt", {"step": 2, "history": []})
    torch.save({"media_norm": media.grad_norm, "media_loss": media.loss, "tower_same": torch.equal(*both),
                "text_reaches_tower": reached, "routers_match": routers_match}, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_vl")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    data = root / "data"
    prepare(str(corpus), data, vocab_size=300, seq_len=32, progress=False)
    write_vision_set(data, heldout=4, max_digits=16, photos=False)
    port = free_port()
    mp.spawn(_worker, args=(port, str(data), str(root)), nprocs=2, join=True)
    return root, str(data)


def test_media_step_norm_equals_the_hand_computed_norm(run):
    root, data = run
    cfg = _cfg(data)
    model = k3.model.build(cfg.model_cfg(), seed=cfg.seed).train()
    from k3.platform.train.trainer import Trainer

    losses = []
    for rank in range(2):
        t = Trainer(cfg, rank, 2)
        b = t.make_batch({"examples": t.media_schedule().examples(0)})
        losses.append(model(b["input_ids"], b["pixel_values"], b["grid_thws"], labels=b["labels"]).loss)
    (sum(losses) / 2).backward()  # the data-parallel mean over the two workers
    hand = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)))
    r0 = torch.load(root / "rank0.pt")
    assert abs(r0["media_norm"] - hand) <= 1e-4 * hand, (r0["media_norm"], hand)
    assert abs(r0["media_loss"] - float(sum(losses) / 2)) <= 1e-4


def test_tower_replicated_text_step_reaches_it_and_checkpoint_loads(run):
    root, _ = run
    for rank in range(2):
        r = torch.load(root / f"rank{rank}.pt")
        assert r["tower_same"] and r["text_reaches_tower"] and r["routers_match"]
    model = k3.model.load(root / "ckpt")
    assert isinstance(model, K3ForConditionalGeneration)
    init = k3.model.build(_cfg(run[1]).model_cfg(), seed=5)
    assert not torch.equal(model.vision_tower.patch_embed.proj.weight, init.vision_tower.patch_embed.proj.weight)


def test_config_checks_the_media_set(run):
    _, data = run
    assert _cfg(data).check()["vocab_size"] <= 300
    with pytest.raises(ValueError, match="examples per step"):
        _cfg(data).model_copy(update={"media_micro_batch": 1000}).check()
