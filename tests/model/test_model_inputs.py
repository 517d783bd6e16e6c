"""K3ForCausalLM.forward's optional arguments: each wrong one gets a ValueError that names it
(they raised IndexError, AttributeError or a torch RuntimeError, or returned a NaN loss)."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_close

from k3.model import K3ForCausalLM, get_preset

V = 4096  # k3-tiny's vocab


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(get_preset("k3-tiny")).eval()


def ids(B=2, T=6, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def embeds(model, x):
    with torch.no_grad():
        return model.model.embed_tokens(x)


def test_int32_labels_give_the_int64_loss(model):
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x, labels=x.int()).loss, model(x, labels=x).loss)


@pytest.mark.parametrize("labels", [
    lambda x: torch.full_like(x, -100),  # every label ignored
    lambda x: x[:, :1],  # one token per row: nothing to predict
])
def test_labels_with_no_target_are_refused_not_a_nan_loss(model, labels):
    x = ids()
    lab = labels(x)
    with torch.no_grad(), pytest.raises(ValueError, match="labels give no targets"):
        model(x[:, :lab.shape[1]], labels=lab)


def test_packed_sequences_of_one_token_give_no_targets(model):
    x = ids(1, 3)
    with torch.no_grad(), pytest.raises(ValueError, match="labels give no targets"):
        model(x, cu_seqlens=torch.tensor([0, 1, 2, 3]), labels=x)


@pytest.mark.parametrize("labels,match", [
    (lambda x: x.float(), "labels must be an int32 or int64 tensor.*torch.float32"),
    (lambda x: x.to(torch.int16), "labels must be an int32 or int64 tensor.*torch.int16"),
    (lambda x: x.tolist(), "labels must be an int32 or int64 tensor.*list"),
    (lambda x: x + V, r"labels out of range \[0, 4096\)"),
    (lambda x: -x - 2, r"labels out of range \[0, 4096\)"),
])
def test_bad_labels_name_the_argument(model, labels, match):
    x = ids()
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        model(x, labels=labels(x))


def test_a_label_out_of_range_where_it_is_never_a_target_changes_nothing(model):
    # position 0's label is no one's target (position t predicts labels[t + 1])
    x = ids()
    lab = x.clone()
    lab[:, 0] = -7
    with torch.no_grad():
        assert torch.equal(model(x, labels=lab).loss, model(x, labels=x).loss)


@pytest.mark.parametrize("logits_at,match", [
    (torch.tensor([12]), r"logits_at out of range \[0, 12\)"),
    (torch.tensor([-1]), r"logits_at out of range \[0, 12\)"),
    (torch.tensor([1.0]), "logits_at must be a 1-D int32 or int64 tensor.*torch.float32"),
    (torch.tensor([True, False]), "logits_at must be a 1-D int32 or int64 tensor.*torch.bool"),
    ([1, 2], "logits_at must be a 1-D int32 or int64 tensor.*list"),
    (3, "logits_at must be a 1-D int32 or int64 tensor.*int"),
    (torch.tensor([[1, 2]]), r"logits_at must be a 1-D int32 or int64 tensor.*\(1, 2\)"),
])
def test_bad_logits_at_names_the_argument(model, logits_at, match):
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        model(ids(), logits_at=logits_at)


@pytest.mark.parametrize("at", [torch.tensor([5, 11]), torch.tensor([0, 11], dtype=torch.int32)])
def test_logits_at_in_range_picks_those_rows(model, at):
    x = ids()
    with torch.no_grad():
        full = model(x).logits.reshape(-1, V)
        assert_close("logits", model(x, logits_at=at).logits, full[at.long()], 1e-6)  # the head on fewer rows
        assert model(x, logits_at=torch.zeros(0, dtype=torch.long)).logits.shape == (0, V)  # training's: none


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_inputs_embeds_in_another_dtype_than_the_model_are_refused(model, dtype):
    x = ids()
    with torch.no_grad(), pytest.raises(ValueError, match=f"inputs_embeds must be in the model's dtype torch.float32, "
                                                          f"got {dtype}"):
        model(x, inputs_embeds=embeds(model, x).to(dtype))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_in_inputs_embeds_is_named_not_blamed_on_the_kda_gate(model, bad):
    x = ids()
    e = embeds(model, x).clone()
    e[1, 3, 5] = bad
    with torch.no_grad(), pytest.raises(ValueError, match="inputs_embeds holds NaN or inf"):
        model(x, inputs_embeds=e)


@pytest.mark.parametrize("cu,match", [
    ([0, 6, 12], "cu_seqlens must be a 1-D int32 or int64 tensor.*list"),
    (torch.tensor([0.0, 6.0, 12.0]), "cu_seqlens must be a 1-D int32 or int64 tensor.*torch.float32"),
    (torch.tensor([[0, 6, 12]]), "cu_seqlens must be a 1-D int32 or int64 tensor"),
    (torch.tensor([0, 8, 6, 12]), "cu_seqlens must rise from 0 to 12"),
])
def test_bad_cu_seqlens_name_the_argument(model, cu, match):
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        model(ids().reshape(1, -1), cu_seqlens=cu)


def test_a_packed_stream_is_held_to_the_positions_by_its_longest_document():
    """A sequence holds positions, a stream of them does not: a packed stream of three 4-token
    documents runs on a model of 8 positions (its whole 12 tokens were refused), its output the
    documents' own; a document of 9 tokens is refused, naming it. A row of [B, T] is one sequence."""
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("k3-tiny", num_layers=2, layer_types=["kda", "mla"], mlp_types=["dense", "moe"],
                                     max_position_embeddings=8)).eval()
    x = ids(3, 4)
    with torch.no_grad():
        packed = model(x.reshape(1, -1), cu_seqlens=torch.tensor([0, 4, 8, 12]), labels=x.reshape(1, -1))
        rows = model(x, labels=x)
        assert_close("packed vs rows", packed.logits.reshape(3, 4, -1), rows.logits, 1e-5)
        with pytest.raises(ValueError, match="cu_seqlens holds a document of 9 tokens > max_position_embeddings 8"):
            model(x.reshape(1, -1), cu_seqlens=torch.tensor([0, 9, 12]))
        with pytest.raises(ValueError, match="input_ids has 9 tokens > max_position_embeddings 8"):
            model(ids(1, 9))
