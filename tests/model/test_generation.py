"""generate() and SamplingConfig: what they refuse, and tiny temperatures (greedy, as the engine)."""
from __future__ import annotations

import pytest
import torch

from k3.model import K3ForCausalLM, SamplingConfig, generate, get_preset
from k3.model.generation import GREEDY_BELOW


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(get_preset("k3-tiny")).eval()


PROMPTS = [[5, 17, 99], [3, 250]]


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")),  # NaN and inf reached multinomial: RuntimeError
    ("temperature", float("inf")),
    ("temperature", "1.0"),
    ("temperature", True),
    ("top_p", float("nan")),
    ("top_k", 2.5),  # TypeError from topk
    ("top_k", True),
    ("max_tokens", 2.5),  # TypeError from torch.zeros
    ("max_tokens", "2"),
    ("seed", "a"),  # RuntimeError from manual_seed
    ("seed", 1.5),
    ("seed", 2**64),
    ("stop_token_ids", 5),
    ("stop_token_ids", ["a"]),
])
def test_fields_of_the_wrong_type_or_range_name_the_field(model, field, value):
    sc = SamplingConfig(max_tokens=2, temperature=1.0)
    setattr(sc, field, value)
    with pytest.raises(ValueError, match=f"^{field} must be"):
        generate(model, PROMPTS, sc)


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, GREEDY_BELOW / 2])
def test_a_temperature_too_small_to_divide_by_is_greedy(model, temperature):
    # 1e-45 overflowed the logits to inf and multinomial raised on the NaN softmax
    got = generate(model, PROMPTS, SamplingConfig(max_tokens=3, temperature=temperature, seed=0))
    assert got == generate(model, PROMPTS, SamplingConfig(max_tokens=3))


@pytest.mark.parametrize("prompts", [
    torch.tensor([[1, 2]]),  # "Boolean value of Tensor with more than one value is ambiguous"
    [1, 2, 3],  # TypeError: no len()
    ["hello"],
    [[1.5, 2.0]],
    [[True, False]],
    [[[1, 2]]],
])
def test_prompts_that_are_not_lists_of_token_ids_are_refused(model, prompts):
    with pytest.raises(ValueError, match=r"^prompts"):
        generate(model, prompts, SamplingConfig(max_tokens=2))


def test_sampling_that_is_not_a_sampling_config_is_refused(model):
    with pytest.raises(ValueError, match="sampling must be a SamplingConfig, got dict"):
        generate(model, PROMPTS, {"max_tokens": 2})
