"""Hand-written tensor/sequence-parallel plans for the test models, applied with PyTorch's
own ``parallelize_module`` (veScale's dmodule plans arrive with a later issue).

Every op stays on DTensors (``use_local_output=False``), so tracing a step shows each op
DTensor must shard. Parameters the plan does not shard become Replicate DTensors, and the
root module gets :func:`~vescale.dtensor.implicit_replication.implicit_replication_scope`
for the plain tensors its forward creates. The vocabulary is sharded at both ends: the
embedding table by rows, the LM head's logits by columns (the loss then sees
``Shard(-1)`` logits, which :mod:`vescale.dtensor.ops.loss` never gathers). GPT-2's
``Conv1D`` stores weights as (in, out); its fused ``c_attn`` (q|k|v) and Mixtral's
``gate_up_proj`` (gate|up) are ``InterleavedShard``, so splitting them into parts is local.

Example::

    model = build_test_model("llama")
    mesh = init_device_mesh("cpu", (2,))
    apply_tensor_parallel(model, "llama", mesh, sequence_parallel=True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from vescale.dtensor.implicit_replication import ImplicitReplicationHandle, implicit_replication_scope
from vescale.dtensor.placements import InterleavedShard, distribute_tensor
from vescale.dtensor.testing.models.nanogpt import NanoGPT, NanoGPTConfig

__all__ = ["TEST_MODELS", "apply_tensor_parallel", "build_test_model", "model_loss", "tensor_parallel_plan"]

TEST_MODELS = ("llama", "mistral", "nanogpt", "mixtral", "gpt2")


def build_test_model(name: str, seed: int = 0) -> nn.Module:
    """One of :data:`TEST_MODELS` or a ``transformers`` model type, tiny, float32, from ``seed``.

    Example::

        model = build_test_model("nanogpt")
        assert model.lm_head.weight.shape == (64, 32)
    """
    if name == "nanogpt":
        torch.manual_seed(seed)
        return NanoGPT(NanoGPTConfig())
    from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model

    return build_tiny_hf_model(name, seed)


def model_loss(model: nn.Module, name: str, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own language-modelling loss for one batch.

    Example::

        loss = model_loss(model, "gpt2", input_ids, labels)
        loss.backward()
    """
    loss: torch.Tensor
    if name == "nanogpt":
        loss = model(input_ids, labels)[1]
    else:
        loss = model(input_ids=input_ids, labels=labels).loss
    return loss


def _decoder_plan(
    sequence_parallel: bool, embedding: str, column: list[str], row: list[str], norms: list[str]
) -> dict[str, ParallelStyle]:
    """Megatron's plan of a decoder: the token ``embedding`` vocabulary-parallel, the ``column``
    projections and ``lm_head`` column-parallel, the ``row`` projections row-parallel and, with
    sequence parallelism, the residual stream's ``norms`` sequence-parallel."""
    # With sequence parallelism activations between blocks are Shard(1) (sequence dim); the
    # projections gather them and scatter their outputs back.
    activation = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        embedding: VocabParallelEmbedding(activation),
        "lm_head": ColwiseParallel(input_layouts=activation, use_local_output=False),
    }
    for projection in column:
        plan[projection] = ColwiseParallel(input_layouts=activation, use_local_output=False)
    for projection in row:
        plan[projection] = RowwiseParallel(output_layouts=activation, use_local_output=False)
    if sequence_parallel:
        for norm in norms:
            plan[norm] = SequenceParallel(use_local_output=False)
    return plan


def _llama_family_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    column = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    return _decoder_plan(
        sequence_parallel,
        "model.embed_tokens",
        column=[f"model.layers.*.{projection}" for projection in column],
        row=["model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"],
        # Every norm on the residual stream (Gemma-2 has four per layer), not q_norm/k_norm.
        norms=["model.layers.*.*layernorm", "model.norm"],
    )


def _mixtral_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    activation = Shard(1) if sequence_parallel else Replicate()
    plan = {
        name: style for name, style in _llama_family_plan(sequence_parallel).items() if ".mlp." not in name
    }
    # Routing runs on every token, replicated; the experts' weights are sharded by feature, so
    # the block's output is a Partial sum that goes back to the residual stream's layout.
    plan["model.layers.*.mlp"] = PrepareModuleInputOutput(
        input_layouts=(activation,),
        desired_input_layouts=(Replicate(),),
        output_layouts=(Partial(),),
        desired_output_layouts=(activation,),
        use_local_input=False,
        use_local_output=False,
    )
    return plan


def _nanogpt_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    plan = _decoder_plan(
        sequence_parallel,
        "wte",
        column=["h.*.attn.q_proj", "h.*.attn.k_proj", "h.*.attn.v_proj", "h.*.mlp.c_fc"],
        row=["h.*.attn.c_proj", "h.*.mlp.c_proj"],
        norms=["h.*.ln_1", "h.*.ln_2", "ln_f"],
    )
    if sequence_parallel:
        # The position embedding is added to the sharded token embedding: shard it alike.
        plan["wpe"] = ParallelOutputAsShard(1)
    return plan


def _reduce_partial_gradient(grad: DTensor) -> DTensor:
    if any(placement.is_partial() for placement in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return grad


class VocabParallelEmbedding(RowwiseParallel):
    """``RowwiseParallel`` for an embedding, whose output gradient may arrive as Partial.

    With ``use_local_output=False`` downstream, the gradient of a Replicate embedding output
    can be Partial(sum); PyTorch's backward of the MaskPartial -> Replicate reduction cannot
    take Partial(sum) to MaskPartial, so the gradient is reduced to Replicate first.

    Example::

        parallelize_module(model, mesh, {"model.embed_tokens": VocabParallelEmbedding()})
    """

    def __init__(self, output_layout: Placement) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=output_layout, use_local_output=False)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        # torch leaves RowwiseParallel._prepare_output_fn unannotated.
        outputs = RowwiseParallel._prepare_output_fn(  # type: ignore[no-untyped-call]
            output_layouts, use_local_output, mod, outputs, device_mesh
        )
        if outputs.requires_grad:
            outputs.register_hook(_reduce_partial_gradient)
        return outputs


class ParallelOutputAsShard(ParallelStyle):
    """Keep the module's parameters replicated and return its output as ``Shard(dim)``.

    Example::

        parallelize_module(model, mesh, {"wpe": ParallelOutputAsShard(0)})
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_output(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> DTensor:
            # Replicated parameters already give a Replicate DTensor; a plain output is the same.
            if not isinstance(output, DTensor):
                output = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return output.redistribute(device_mesh, [Shard(self.dim)])

        module.register_forward_hook(shard_output)
        return module


def _gpt2_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    activation = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "transformer.wte": VocabParallelEmbedding(activation),
        "lm_head": ColwiseParallel(input_layouts=activation, use_local_output=False),
    }
    if sequence_parallel:
        for norm in ("transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"):
            plan[norm] = SequenceParallel(use_local_output=False)
        for block_input in ("transformer.h.*.attn", "transformer.h.*.mlp"):
            plan[block_input] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
    return plan


_PLANS: dict[str, Callable[[bool], dict[str, ParallelStyle]]] = {
    "llama": _llama_family_plan,
    "mistral": _llama_family_plan,
    "mixtral": _mixtral_plan,
    "nanogpt": _nanogpt_plan,
    "gpt2": _gpt2_plan,
}

# Parameters placed directly, for layers no ParallelStyle fits: Mixtral's 3-D expert weights
# (expert, out, in), whose gate_up_proj is gate|up, and GPT-2's Conv1D weights (in, out),
# whose c_attn is q|k|v: the fused ones are interleaved so that the split into parts is local.
_PARAMETER_PLACEMENTS: dict[str, dict[str, Placement | InterleavedShard]] = {
    "mixtral": {"mlp.experts.gate_up_proj": InterleavedShard(1, 2), "mlp.experts.down_proj": Shard(2)},
    "gpt2": {
        "attn.c_attn.weight": InterleavedShard(1, 3),
        "attn.c_attn.bias": InterleavedShard(0, 3),
        "mlp.c_fc.weight": Shard(1),
        "mlp.c_fc.bias": Shard(0),
        "attn.c_proj.weight": Shard(0),
        "mlp.c_proj.weight": Shard(0),
    },
    "llama": {},
    "mistral": {},
    "nanogpt": {},
}


def tensor_parallel_plan(name: str, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of test model ``name``.

    Example::

        plan = tensor_parallel_plan("llama", sequence_parallel=False)
        assert "model.layers.*.self_attn.q_proj" in plan
    """
    # Other transformers decoders name their layers as Llama does (model.layers.N.self_attn.q_proj).
    return _PLANS.get(name, _llama_family_plan)(sequence_parallel)


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make each group of once-tied FQNs one parameter again.

    PyTorch's ``parallelize_module`` distributes each module's parameters on its own, so GPT-2's
    ``lm_head`` (ColwiseParallel) and ``transformer.wte`` (vocabulary-parallel) come out as two
    parameters with equal shards; training them apart would not be the single-device model.
    """
    for group in groups:
        keep = model.get_parameter(group[0])
        for fqn in group[1:]:
            owner_fqn, _, name = fqn.rpartition(".")
            owner = model.get_submodule(owner_fqn)
            other = owner._parameters[name]
            if (
                isinstance(keep, DTensor)
                and isinstance(other, DTensor)
                and keep.placements != other.placements
            ):
                raise ValueError(f"tied {group[0]!r} and {fqn!r} got different placements from the plan")
            owner._parameters[name] = keep


def apply_tensor_parallel(
    model: nn.Module, name: str, mesh: DeviceMesh, sequence_parallel: bool = False
) -> ImplicitReplicationHandle:
    """Parallelize ``model`` in place on the 1-D ``mesh``; return its implicit-replication handle.

    Example::

        handle = apply_tensor_parallel(model, "mistral", mesh, sequence_parallel=True)
        loss = model_loss(model, "mistral", input_ids, labels)
    """
    tied: dict[int, list[str]] = {}
    for fqn, parameter in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(fqn)
    parallelize_module(model, mesh, tensor_parallel_plan(name, sequence_parallel))
    _retie(model, [fqns for fqns in tied.values() if len(fqns) > 1])
    placement_by_suffix = _PARAMETER_PLACEMENTS.get(name, {})
    for module_name, module in model.named_modules():
        for parameter_name, parameter in list(module.named_parameters(recurse=False)):
            if isinstance(parameter, DTensor):
                continue
            full_name = f"{module_name}.{parameter_name}"
            placement = next(
                (
                    placement
                    for suffix, placement in placement_by_suffix.items()
                    if full_name.endswith(suffix)
                ),
                Replicate(),
            )
            distributed = distribute_tensor(parameter.detach(), mesh, [placement])
            module.register_parameter(parameter_name, nn.Parameter(distributed, parameter.requires_grad))
    return implicit_replication_scope(model)
