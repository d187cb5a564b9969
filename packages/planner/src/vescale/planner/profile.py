"""One forward of a model on meta tensors: what it holds for backward, by module and repeated block.

Every parameter, buffer and input is replaced by a meta tensor (shapes only: nothing is
allocated, a 70B-parameter model profiles in seconds). ``torch.autograd.graph.saved_tensors_hooks``
sees every tensor autograd saves for backward; forward hooks say which module was running and
which repeated block (the longest ``ModuleList`` of same-class modules) it belongs to. Saved
tensors are counted once per storage, parameters and views of them not at all, and the forward's
outputs (alive until backward) are counted too. Meta tensors always take SDPA's math path, so
attention is counted as the fused kernels of real devices save it. Mixture-of-experts layers
(``transformers``' grouped-matmul experts) are profiled with their routed token shapes.

For ``activation_checkpointing="selective"`` the profile also records, as ``selective_kept``,
the outputs of the ops that selective checkpointing keeps (:mod:`vescale.planner.selective`:
matmuls and attention kernels, once per storage), whether autograd saves them or not.

Example::

    profile = profile_model(model, sequence_length=2048, micro_batch_size=1)
    print(profile.num_blocks, sum(record.nbytes for record in profile.saved))
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vescale.dmodule.example_labels import example_labels
from vescale.dmodule.experts import find_moe_blocks
from vescale.dpipe.pipeline_module import rebuilds_output
from vescale.dtensor.deferred.fake_values import FakeValuePolicy
from vescale.dtensor.grouped_mm_shapes import GroupedMatmulShapes
from vescale.planner.errors import PlanError
from vescale.planner.op_costs import OpCost, OpCostRecorder, attention_cost
from vescale.planner.selective import KEPT_COMPUTE_OPS

__all__ = ["ModelProfile", "find_repeated_blocks", "profile_model"]

_LOGGER = logging.getLogger("vescale.planner")


@dataclass(frozen=True)
class _ParameterRecord:
    fqn: str
    numel: int
    block: int | None
    side: str  # "first" (before the blocks, the first stage) or "last" (after them)


@dataclass(frozen=True)
class _SavedRecord:
    module_fqn: str
    nbytes: int
    is_float: bool
    block: int | None
    side: str


@dataclass(frozen=True)
class ModelProfile:
    """What one meta forward of one sample of ``sequence_length`` tokens showed (see module docstring)."""

    sequence_length: int
    micro_batch_size: int
    num_blocks: int
    parameters: tuple[_ParameterRecord, ...]
    saved: tuple[_SavedRecord, ...]
    block_input_bytes: int
    module_parameters: dict[str, tuple[str, ...]]
    selective_kept: tuple[_SavedRecord, ...] = ()
    op_costs: tuple[OpCost, ...] = ()
    # The largest top-k of the model's MoE routers (0 without MoE blocks): under expert parallelism
    # each token's hidden state is sent to that many experts and comes back from them.
    expert_top_k: int = 0
    # The FQN of the block list (``model.layers``): pipeline split points name its members.
    blocks_fqn: str = ""
    # The class of the model's output, and whether a pipeline can return it (it takes a loss and
    # logits: not a question-answering head's start and end logits, nor a bare tensor).
    output_type_name: str = ""
    pipelinable_output: bool = True

    @property
    def pipeline_stage_limit(self) -> int:
        """The most pipeline stages a plan may cut the model into: one per block, or one when a
        pipeline cannot return its output."""
        return self.num_blocks if self.pipelinable_output else 1


def find_repeated_blocks(model: nn.Module, ran: Collection[str] | None = None) -> tuple[str, list[nn.Module]]:
    """The FQN and members of the longest ``ModuleList`` of same-class modules (the layers).

    Given the FQNs of the modules that ``ran`` in a forward, only lists whose every member ran
    count: a multimodal model's vision or audio encoder does not run on a text batch.

    Example::

        prefix, blocks = find_repeated_blocks(llama)   # "model.layers", 32 decoder layers
    """
    best: tuple[str, list[nn.Module]] = ("", [])
    for fqn, module in _block_lists(model):
        members = list(module)
        prefix = f"{fqn}." if fqn else ""
        if ran is not None and any(f"{prefix}{index}" not in ran for index in range(len(members))):
            continue
        if len(members) > max(1, len(best[1])):
            best = (fqn, members)
    return best


def _block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The ``ModuleList``s of two or more modules of one class."""
    return [
        (fqn, module)
        for fqn, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1
    ]


def _modules_that_run(
    model: nn.Module, meta: dict[str, torch.Tensor], args: Any, kwargs: Any
) -> set[str] | None:
    """The FQNs of the modules one meta forward calls (``None`` if it cannot run)."""
    ran: set[str] = set()

    def called(fqn: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        return lambda module, inputs: ran.add(fqn)

    handles = [module.register_forward_pre_hook(called(fqn)) for fqn, module in model.named_modules()]
    try:
        with torch.no_grad(), GroupedMatmulShapes(), FakeValuePolicy():
            functional_call(model, meta, args, kwargs)
    except (RuntimeError, NotImplementedError, ValueError):
        return None
    finally:
        for handle in handles:
            handle.remove()
    return ran


def _example_inputs(
    model: nn.Module, batch: int, sequence_length: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    input_ids = torch.zeros(batch, sequence_length, dtype=torch.long, device="meta")
    names = list(inspect.signature(model.forward).parameters)
    if "input_ids" in names:
        labels = {"labels": example_labels(model, input_ids)} if "labels" in names else {}
        return (), {"input_ids": input_ids, **labels}
    return (input_ids,), {}


class _FusedAttentionSaves(TorchFunctionMode):
    """Count what a fused attention kernel saves (q, k, v, its output and the per-row log-sum-exp).

    Meta tensors always take SDPA's math path, which saves the sequence x sequence scores; CPU
    and CUDA runs take a fused kernel (flash / memory-efficient) that saves far less. The
    output is given the fused kernels' (batch, sequence, heads, dim) layout, so that the
    reshape feeding the output projection is a view, as it is on a real device.
    """

    def __init__(
        self,
        save: Callable[[torch.Tensor], None],
        record_extra: Callable[[int], None],
        keep: Callable[[torch.Tensor], None],
        cost: Callable[..., None] = lambda *args: None,
    ) -> None:
        super().__init__()
        self.save, self.record_extra, self.keep, self.inside = save, record_extra, keep, False
        self.cost = cost

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.inside:
            return func(*args, **kwargs)
        self.inside = True
        try:
            output = func(*args, **kwargs)
        finally:
            self.inside = False
        if output.dim() == 4:
            output = output.transpose(1, 2).contiguous().transpose(1, 2)
        inputs = [*args[:3], *(kwargs[name] for name in ("query", "key", "value") if name in kwargs)]
        causal = bool(kwargs.get("is_causal")) or kwargs.get("attn_mask") is not None or len(args) > 3
        flops, dims = attention_cost(inputs[0], inputs[1], causal)
        traffic = sum(t.numel() * t.element_size() for t in [*inputs, output])
        self.cost("attention", flops, dims, float(traffic), 0.0)
        for tensor in [*inputs, output]:
            self.save(tensor)
        batch_heads_rows = output.numel() // output.shape[-1]
        self.record_extra(batch_heads_rows * 4)  # the fp32 log-sum-exp of each query row
        self.keep(output)  # the kernel's output and log-sum-exp are kept by selective checkpointing
        return output


class _KeptOutputs(TorchDispatchMode):
    """Pass the outputs of the ops selective checkpointing keeps to ``keep`` (not inside attention,
    whose math path on meta stands for one fused kernel: :class:`_FusedAttentionSaves` keeps it)."""

    def __init__(self, keep: Callable[[torch.Tensor], None], attention: _FusedAttentionSaves) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.keep, self.attention = keep, attention

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        output = func(*args, **(kwargs or {}))
        if func in KEPT_COMPUTE_OPS and not self.attention.inside:
            for tensor in _tensors_in(output):
                self.keep(tensor)
        return output


def _tensors_in(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, list | tuple):
        return [tensor for item in outputs for tensor in _tensors_in(item)]
    return []


def profile_model(model: nn.Module, sequence_length: int, micro_batch_size: int = 1) -> ModelProfile:
    """Profile one micro-batch of ``sequence_length`` tokens through ``model`` on meta tensors.

    Raises ``PlanError`` when the forward cannot run on meta tensors (data-dependent code, such
    as mixture-of-experts routing that counts tokens per expert).

    Example::

        profile = profile_model(model, sequence_length=2048)
        estimate = estimate_from_profile(profile, ParallelChoices(tensor_parallel_size=8))
    """
    meta = {
        name: torch.empty_like(tensor, device="meta").requires_grad_(tensor.requires_grad)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }
    args, kwargs = _example_inputs(model, micro_batch_size, sequence_length)
    # Several candidate block lists (a multimodal model): the one that runs on a text batch.
    ran = _modules_that_run(model, meta, args, kwargs) if len(_block_lists(model)) > 1 else None
    blocks_fqn, blocks = find_repeated_blocks(model, ran)
    block_of = {f"{blocks_fqn}.{index}": index for index in range(len(blocks))}
    parameter_storages = {id(meta[name].untyped_storage()) for name, _ in model.named_parameters()}
    stack: list[str] = []
    seen_block = [False, False]  # a block has started; a block has finished
    block_inputs: list[int] = []
    saved: dict[int, tuple[Any, _SavedRecord]] = {}
    kept: dict[int, tuple[Any, _SavedRecord]] = {}
    costs: list[OpCost] = []

    def block_index(fqn: str) -> int | None:
        head = ".".join(fqn.split(".")[: len(blocks_fqn.split(".")) + 1]) if blocks_fqn else ""
        return block_of.get(head)

    def record(key: Any, nbytes: int, is_float: bool, into: dict[int, tuple[Any, _SavedRecord]]) -> None:
        module_fqn = stack[-1] if stack else ""
        block = block_index(module_fqn)
        side = "last" if block is None and seen_block[1] else "first"
        # The key is kept referenced so that its id is not reused by a later tensor.
        into[id(key)] = (key, _SavedRecord(module_fqn, nbytes, is_float, block, side))

    def save(tensor: torch.Tensor, into: dict[int, tuple[Any, _SavedRecord]] = saved) -> None:
        storage = tensor.untyped_storage()
        if id(storage) not in parameter_storages and id(storage) not in into:
            record(storage, storage.nbytes(), tensor.is_floating_point(), into)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not attention.inside:
            save(tensor)
        return tensor

    def keep(tensor: torch.Tensor) -> None:
        save(tensor, into=kept)

    def keep_log_sum_exp(nbytes: int) -> None:
        key = object()  # saved for backward, and kept by selective checkpointing
        for into in (saved, kept):
            record(key, nbytes, True, into)

    def cost(kind: str, flops: float, dims: tuple[Any, ...], traffic: float, output_bytes: float) -> None:
        module_fqn = stack[-1] if stack else ""
        block = block_index(module_fqn)
        side = "last" if block is None and seen_block[1] else "first"
        costs.append(OpCost(kind, module_fqn, block, side, flops, dims, traffic, output_bytes))

    attention = _FusedAttentionSaves(save, keep_log_sum_exp, keep, cost)
    recorder = OpCostRecorder(cost, lambda: attention.inside)

    def enter(fqn: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            stack.append(fqn)
            if fqn in block_of:
                seen_block[0] = True
                first = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
                block_inputs.append(0 if first is None else first.untyped_storage().nbytes())

        return hook

    def leave(fqn: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            stack.pop()
            seen_block[1] = seen_block[1] or fqn in block_of

        return hook

    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(fqn), with_kwargs=True))
        handles.append(module.register_forward_hook(leave(fqn), with_kwargs=True, always_call=True))
    try:
        saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        values = FakeValuePolicy()
        with saving, attention, GroupedMatmulShapes(), values, _KeptOutputs(keep, attention), recorder:
            outputs = functional_call(model, meta, args, kwargs)
        if values.guessed_shapes:
            _LOGGER.warning(
                "%s's forward chose %d tensor shape(s) from data (nonzero/where, e.g. eager mixture-of-"
                "experts loops, or a split by counted tokens); on meta tensors each found one element (a "
                "lower bound of the activations after it) or split evenly (an estimate)",
                type(model).__name__,
                values.guessed_shapes,
            )
        # The outputs (logits next to the loss) stay alive until backward, saved or not.
        for tensor in _tensors_in(outputs):
            save(tensor)
    except (RuntimeError, NotImplementedError, ValueError) as error:
        # ValueError: a model's own check of its input (Reformer: the length its position embeddings need).
        raise PlanError(
            f"{type(model).__name__}'s forward cannot run on meta tensors of {sequence_length} tokens, so "
            f"its memory cannot be estimated: {str(error).splitlines()[0]}"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    first_block_param = next(
        (i for i, (n, _) in enumerate(model.named_parameters()) if block_index(n) is not None), 0
    )
    parameters = tuple(
        _ParameterRecord(name, p.numel(), block_index(name), "first" if i < first_block_param else "last")
        for i, (name, p) in enumerate(model.named_parameters())
    )
    owned = {
        fqn: tuple(f"{fqn}.{name}" if fqn else name for name, _ in module.named_parameters(recurse=False))
        for fqn, module in model.named_modules()
    }
    return ModelProfile(
        sequence_length=sequence_length,
        micro_batch_size=micro_batch_size,
        num_blocks=len(blocks),
        parameters=parameters,
        saved=tuple(record for _, record in saved.values()),
        block_input_bytes=max(block_inputs, default=0),
        module_parameters={fqn: names for fqn, names in owned.items() if names},
        selective_kept=tuple(record for _, record in kept.values()),
        op_costs=tuple(costs),
        expert_top_k=max((block.top_k or 1 for block in find_moe_blocks(model)), default=0),
        blocks_fqn=blocks_fqn,
        output_type_name=type(outputs).__name__,
        pipelinable_output=rebuilds_output(type(outputs)),
    )
