"""dtype and device conversions of a deferred module (``model.to(torch.bfloat16)``, ``.double()``).

Reference: the same model built eagerly with the same seed and converted the same way. Compared:
every parameter's and buffer's dtype and value, bitwise, after materialisation; ties; the
generator. Before this, every conversion of a deferred module raised "Couldn't swap
Embedding.weight" (torch swaps a fake parameter for its converted copy, and cannot).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from vescale.dtensor.deferred import (
    DeferredInitError,
    deferred_init,
    is_deferred,
    materialize_module,
    materialize_tensor,
)
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config

SEED = 1234
CONVERSIONS = {
    "to(bfloat16)": lambda module: module.to(torch.bfloat16),
    "double()": lambda module: module.double(),
    "half()": lambda module: module.half(),
    "to(cpu, float64)": lambda module: module.to("cpu", torch.float64),
    "float()": lambda module: module.float(),
}


def build(name: str) -> nn.Module:
    """A tiny model with its architecture's defaults (GPT-2 ties its head; Llama here tied too)."""
    config = tiny_hf_config(name.removesuffix("_tied"))
    if name.endswith("_tied"):
        config.tie_word_embeddings = True
    return transformers.AutoModelForCausalLM.from_config(config)


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by FQN (the rotary ``inv_freq`` buffer included)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def eager(name: str, conversion) -> nn.Module:
    torch.manual_seed(SEED)
    model = build(name)
    conversion(model)
    return model


def assert_bitwise(model: nn.Module, reference: nn.Module) -> None:
    values, expected = tensors(model), tensors(reference)
    assert sorted(values) == sorted(expected)
    wrong = [
        fqn
        for fqn, value in values.items()
        if value.dtype != expected[fqn].dtype or not torch.equal(value, expected[fqn])
    ]
    assert wrong == []


@pytest.mark.parametrize("name", ["llama_tied", "gpt2"])
@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_a_converted_deferred_model_materialises_bitwise_as_the_eager_model_converted_alike(name, conversion):
    reference = eager(name, CONVERSIONS[conversion])
    state_after_eager = torch.get_rng_state()

    torch.manual_seed(SEED)
    model = deferred_init(build, name)
    assert CONVERSIONS[conversion](model) is model
    assert torch.equal(torch.get_rng_state(), state_after_eager), "a conversion must not draw"
    deferred = tensors(model)
    assert all(is_deferred(tensor) for tensor in deferred.values())
    expected = tensors(reference)
    assert {fqn: t.dtype for fqn, t in deferred.items()} == {fqn: t.dtype for fqn, t in expected.items()}

    materialize_module(model)
    assert_bitwise(model, reference)
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_converting_one_submodule_converts_its_tied_parameter_everywhere_as_eager_does():
    # Eager .to converts a parameter in place, so the embedding it is tied to changes too.
    reference = eager("llama_tied", lambda model: model.lm_head.double())
    assert reference.get_input_embeddings().weight.dtype == torch.float64

    torch.manual_seed(SEED)
    model = deferred_init(build, "llama_tied")
    model.lm_head.double()
    assert model.get_input_embeddings().weight.dtype == torch.float64
    assert model.model.norm.weight.dtype == torch.float32
    materialize_module(model)
    assert_bitwise(model, reference)


def test_a_partly_materialised_module_converts_both_kinds_of_tensor():
    torch.manual_seed(SEED)
    reference = nn.Linear(4, 3).double()
    torch.manual_seed(SEED)
    model = deferred_init(nn.Linear, 4, 3)
    model.weight = nn.Parameter(materialize_tensor(model.weight, fqn="weight"))
    assert model.double() is model
    assert not is_deferred(model.weight) and is_deferred(model.bias)
    assert [name for name, _ in model.named_parameters()] == ["weight", "bias"]
    materialize_module(model)
    assert_bitwise(model, reference)


def test_after_materialisation_conversions_are_torchs_own_again():
    torch.manual_seed(SEED)
    model = deferred_init(build, "gpt2")
    materialize_module(model)
    assert all("_apply" not in module.__dict__ for module in model.modules())
    weight = model.lm_head.weight
    model.double()
    assert weight.dtype == torch.float64 and model.lm_head.weight is weight  # converted in place


def test_a_conversion_that_is_not_a_dtype_or_device_change_names_the_tensor_and_the_fix():
    torch.manual_seed(SEED)
    model = deferred_init(build, "gpt2")
    with pytest.raises(
        DeferredInitError,
        match=r"transformer\.wte\.weight \(shape \(64, 32\)\) is deferred.*dtype and device conversions only",
    ):
        model._apply(lambda tensor: tensor.flatten())
