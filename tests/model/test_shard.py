"""SequenceShard (model/shard.py): where a piece lies, which keys its queries see, the conv rows
it takes from the previous piece, the loss's targets and count; a one-piece shard runs the model
exactly as the packed stream does; bad shards and bad inputs. (Pieces on several processes:
tests/platform/test_context_parallel.py.)"""
from __future__ import annotations

import pytest
import torch

import k3.model
from k3.model import get_preset
from k3.model.model import next_token_targets
from k3.model.shard import SequenceShard

DOCS = [0, 5, 9, 20, 30]  # over a stream of 30 tokens
BOUNDS = (0, 10, 20, 30)


def _stacked(copies: int):
    """A stand-in for a group's all-gather on one process: every piece sends the same x."""
    return lambda x: torch.stack([x] * copies)


def _shard(rank: int, docs=DOCS, bounds=BOUNDS) -> SequenceShard:
    return SequenceShard(rank, bounds, torch.tensor(docs), _stacked(len(bounds) - 1))


@pytest.mark.parametrize("rank, local_cu, continues, spans", [
    (0, [0, 5, 9, 10], False, [(0, 5, 0, 5), (5, 9, 5, 9), (9, 10, 9, 10)]),
    (1, [0, 10], True, [(0, 10, 9, 20)]),
    (2, [0, 10], False, [(0, 10, 20, 30)]),
])
def test_where_a_piece_lies(rank, local_cu, continues, spans):
    s = _shard(rank)
    assert s.local_cu_seqlens().tolist() == local_cu
    assert s.continues == continues
    assert s.attention_spans() == spans


def test_targets_of_the_pieces_are_the_streams_and_share_its_count():
    labels = torch.arange(30)[None]
    full, count = next_token_targets(labels, torch.tensor(DOCS))
    parts = [_shard(r).next_token_targets(labels) for r in range(3)]
    assert torch.equal(torch.cat([t for t, _ in parts], dim=1), full)
    assert all(c == int(count) for _, c in parts)


def test_previous_rows_stop_at_the_document_start():
    x = torch.arange(1.0, 11.0)[:, None]  # the piece's own rows; every piece "sends" the same
    # piece 1 continues the document that began at 9: of the 3 rows before it only row 9 is its own
    rows = _shard(1).previous_rows(x, 3)
    assert rows[:, 0].tolist() == [0.0, 0.0, 10.0]
    assert _shard(2).previous_rows(x, 3).abs().sum() == 0  # begins a document
    assert _shard(0).previous_rows(x, 3).abs().sum() == 0  # begins the stream


def test_gather_stream_drops_the_padding_of_shorter_pieces():
    s = SequenceShard(0, (0, 2, 5), None, lambda x: torch.stack([x, x + 10]))
    out = s.gather_stream(torch.tensor([[1.0], [2.0]]))
    assert out[:, 0].tolist() == [1.0, 2.0, 11.0, 12.0, 10.0]  # piece 1's rows: its 3 (here x + 10, padded)


@pytest.mark.parametrize("ckpt", [False, True])
def test_a_one_piece_shard_runs_as_the_packed_stream(ckpt):
    torch.manual_seed(0)
    cfg = get_preset("k3-tiny", num_layers=4, layer_types=["kda", "kda", "kda", "mla"],
                     mlp_types=["dense", "moe", "moe", "moe"])
    model = k3.model.build(cfg, seed=1).train()
    model.model.activation_checkpointing = ckpt
    ids = torch.randint(0, cfg.vocab_size, (1, 300))
    docs = torch.tensor([0, 100, 101, 300])
    ref = model(ids, cu_seqlens=docs, labels=ids)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    out = model(ids, labels=ids, shard=SequenceShard(0, (0, 300), docs, _stacked(1)))
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    assert torch.allclose(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out.loss, ref.loss, rtol=1e-6)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0, bounds=(0, 5, 5), cu=None), "bounds must rise strictly"),
    (dict(rank=2, bounds=(0, 5, 10), cu=None), "rank 2 is not in"),
    (dict(rank=0, bounds=(0, 5, 10), cu=[0, 4, 9]), "cu_seqlens must rise from 0 to the stream's 10"),
])
def test_bad_shards(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cu = None if kwargs["cu"] is None else torch.tensor(kwargs["cu"])
        SequenceShard(kwargs["rank"], kwargs["bounds"], cu, _stacked(2))


@pytest.mark.parametrize("rank, bounds, cu, match", [
    # a float offset was truncated: documents [0, 4.7) and [4.7, 10) ran as [0, 4) and [4, 10)
    (0, (0, 5, 10), torch.tensor([0.0, 4.7, 10.0]), r"cu_seqlens must be a 1-D integer tensor .*torch.float32"),
    (0, (0, 5, 10), torch.tensor([], dtype=torch.long), r"cu_seqlens must be a 1-D integer tensor .*shape \(0,\)"),
    (0, (0, 5, 10), torch.tensor([[0, 10]]), r"cu_seqlens must be a 1-D integer tensor .*shape \(1, 2\)"),
    (0, (0, 5, 10), torch.tensor([True, True]), r"cu_seqlens must be a 1-D integer tensor .*torch.bool"),
    (0, (0, 5, 10), [0, 10], r"cu_seqlens must be a 1-D integer tensor .*got list"),
    (0, (0, 5.5, 10), None, r"bounds must be a tuple of ints, got \(0, 5.5, 10\)"),
    (0, (0, True, 10), None, r"bounds must be a tuple of ints"),
    (0.0, (0, 5, 10), None, r"rank must be an int, got 0.0"),
])
def test_shard_offsets_are_integers(rank, bounds, cu, match):
    with pytest.raises(ValueError, match=match):
        SequenceShard(rank, bounds, cu, _stacked(2))


def test_bad_inputs_with_a_shard():
    model = k3.model.build(get_preset("k3-tiny", num_layers=1, layer_types=["kda"], mlp_types=["dense"]), seed=0)
    ids = torch.randint(0, 100, (1, 30))
    with pytest.raises(ValueError, match=r"whole stream \[1, 30\]"):
        model(ids[:, :10], shard=_shard(0))
    with pytest.raises(ValueError, match="no cu_seqlens"):
        model(ids, cu_seqlens=torch.tensor(DOCS), shard=_shard(0))
    with pytest.raises(ValueError, match="reach past the previous piece"):
        model(ids[:, :6], shard=SequenceShard(1, (0, 2, 6), None, _stacked(2)))


def test_a_shard_is_held_to_the_positions_by_its_longest_document():
    """The stream of 30 tokens runs on a model of 11 positions (its documents are at most 11 long);
    a document of 12 tokens is refused, naming the shard."""
    cfg = get_preset("k3-tiny", num_layers=1, layer_types=["kda"], mlp_types=["dense"], max_position_embeddings=11)
    model = k3.model.build(cfg, seed=0)
    ids = torch.randint(0, 100, (1, 30))
    assert _shard(0).longest_document == 11
    with torch.no_grad():
        assert model(ids, shard=_shard(0)).logits.shape[:2] == (1, 10)
        with pytest.raises(ValueError, match="the shard's stream holds a document of 12 tokens > "
                                             "max_position_embeddings 11"):
            model(ids, shard=_shard(0, docs=[0, 5, 17, 20, 30]))
