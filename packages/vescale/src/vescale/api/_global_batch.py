"""The model ``vescale.parallelize`` returns: one call trains on the rank's share of the global batch.

``ParallelizedModel(**batch)`` returns the wrapped model's own output type whose ``loss`` is
the loss of the whole global batch on every rank, as one device would print it:

* each piece (this dp rank's slice, or one of its micro-batches) is weighted by its number of
  loss terms over the global number (:mod:`._token_weights`), so labels padded with ``-100``
  give the gradients of one device (the dp gradient average divides by ``dp`` again, which the
  weight undoes);
* with micro-batches, a training call runs forward and backward of each one (the dp gradient
  reduction paused until the last; the caller's ``torch.autocast`` cache of weight casts
  cleared after each) and the returned loss's ``backward()`` is a no-op; a call under
  ``torch.no_grad()`` runs their forwards; a call in eval mode with gradients is one forward
  of the rank's batch, whose backward is the caller's, as on one device;
* a pipeline (dpipe) runs its own micro-batches, each loss weighted as above
  (:meth:`~vescale.dpipe.PipelineModule.set_microbatch_loss_weights`).

Example::

    wrapped = ParallelizedModel(model, mesh, num_microbatches=2, pipelined=False, user_model=model)
    out = wrapped(input_ids=ids, labels=labels)
    out.loss.backward()         # no-op here: both micro-batches already ran backward
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from vescale.api._piece_random import PieceRandomness, warn_unreplayed_draws
from vescale.api._recompute import repeated_blocks
from vescale.api._token_weights import counts_tokens, loss_term_rule
from vescale.api.errors import UnsupportedPlanError
from vescale.dmodule.compiled_blocks import compile_blocks
from vescale.doptim import data_parallel_of
from vescale.doptim.mesh_groups import mesh_dims_group
from vescale.dpipe import loss_with_backward_done
from vescale.dpipe.pipeline_module import ModuleWrapper
from vescale.dtensor.batch_random import batch_rows, batch_with_doubled_rows
from vescale.dtensor.model_state import buffers_kept, generators_kept

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from vescale.dpipe.pipeline_module import PipelineModule

__all__ = ["ParallelizedModel"]

# torch.compiler.config.recompile_limit's default: compiled variants of one function before eager.
_RECOMPILES_PER_BLOCK = 8


def _split(batch: Mapping[str, Any], pieces: int) -> list[dict[str, Any]]:
    rows = next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    if rows is None or rows % pieces:
        raise UnsupportedPlanError(
            f"the batch has {rows} rows, which do not split into plan.num_microbatches={pieces} "
            "micro-batches; give each rank global_batch_size / dp rows (DistributedDataLoader does)"
        )
    size = rows // pieces
    return [
        {
            key: value[index * size : (index + 1) * size]
            if isinstance(value, torch.Tensor) and value.dim() > 0
            else value
            for key, value in batch.items()
        }
        for index in range(pieces)
    ]


def _concatenated(outputs: list[Any], loss: torch.Tensor) -> Any:
    """The last micro-batch's output object, its batch-shaped tensors concatenated, with ``loss``."""
    result = outputs[-1]
    if isinstance(result, torch.Tensor):
        return loss
    for key in list(result.keys()):
        values = [output[key] for output in outputs]
        if all(isinstance(value, torch.Tensor) and value.dim() > 0 for value in values):
            result[key] = torch.cat([value.detach() for value in values])
    return _with_loss(result, loss)


class ParallelizedModel(ModuleWrapper):
    """The user's parallelized model (:attr:`module`), called on one rank's share of the global batch.

    Attributes the wrapper lacks (``config``, ``generate``...) are the wrapped model's;
    ``state_dict`` keys are the wrapped model's own (no ``module.`` prefix).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        *,
        num_microbatches: int,
        pipelined: bool,
        user_model: nn.Module,
    ) -> None:
        super().__init__()
        self.module = module
        # What a call runs: the module, or its torch.compile'd form (kept out of the module tree so
        # that parameters and state_dict keys stay the module's).
        self.__dict__["_call_module"] = module
        # Set by turn_cache_off_in_training: training calls then pass use_cache=False.
        self._cache_off_in_training = False
        self.mesh = mesh
        self.num_microbatches = num_microbatches
        self.pipelined = pipelined
        # The user's own model names its loss function (a pipeline wrapper does not).
        self._count_terms = loss_term_rule(user_model)
        self._counts_tokens = counts_tokens(user_model)
        # The batch is split over dp, and over ep too under expert parallelism.
        dims = tuple(dim for dim in ("dp", "ep") if dim in (mesh.mesh_dim_names or ()))
        group, self._dp_size, dp_rank = mesh_dims_group(mesh, dims)
        self._dp_group = group if self._dp_size > 1 else None
        # Each piece of the global batch draws its rows of one device's random numbers (dropout).
        self._randomness = PieceRandomness(
            batch_rank=dp_rank, batch_ranks=self._dp_size, device_type=mesh.device_type
        )

    def compile_module(self, *, per_block: bool = False) -> None:
        """Run the wrapped module under ``torch.compile`` from the next call on.

        ``per_block``: compile the forward of each repeated block (each element of the outermost
        ``nn.ModuleList``s, as torchtitan does) instead of the whole module; the code between
        blocks (embedding, final norm, head, loss) and the blocks' own dmodule hooks stay eager.
        """
        # Compiled code generates its random numbers itself: a piece's dropout cannot be replayed.
        self._randomness.off_reason = "in a compiled module (compiled code draws its own random numbers)"
        if not per_block:
            self.__dict__["_call_module"] = torch.compile(self.module)
            return
        blocks = repeated_blocks(self.module)
        if not blocks:
            raise UnsupportedPlanError(
                f"compile=True with tensor parallelism compiles each repeated block (an element of an "
                f"nn.ModuleList), but {type(self.module).__name__} has no nn.ModuleList; use compile=False"
            )
        compile_blocks(self.module, [block for _, block in blocks])
        # The blocks share one code object and, with veScale's own hooks kept free of per-block
        # guards (vescale.dmodule.compiled_blocks), one compiled variant. A hook of the user's that
        # differs between blocks would make each block a variant of its own: give each block
        # torch's default budget of variants, or blocks past the 8th would silently run eagerly.
        budget = _RECOMPILES_PER_BLOCK * len(blocks)
        torch.compiler.config.recompile_limit = max(torch.compiler.config.recompile_limit, budget)
        torch.compiler.config.accumulated_recompile_limit = max(
            torch.compiler.config.accumulated_recompile_limit, budget
        )
        # A transformers KV cache keeps each block's keys and values: a compiled block then returns
        # them as extra DTensor outputs that need a gradient and never get one, and torch 2.13's AOT
        # autograd fails in backward ("Expected a DTensor tangent but got a plain Tensor",
        # pytorch/pytorch#172556). A training step never reads the cache.
        self.turn_cache_off_in_training()

    def turn_cache_off_in_training(self) -> None:
        """Pass ``use_cache=False`` to calls with gradients, when the module's forward takes it.

        For compiled blocks (see :meth:`compile_module`) and recomputed ones: a recomputation
        would append each block's keys and values to a ``transformers`` KV cache a second time,
        and selective recomputation then finds other ops than the forward ran.
        """
        accepted: Mapping[str, inspect.Parameter]
        try:
            accepted = inspect.signature(self.module.forward).parameters
        except (TypeError, ValueError):
            accepted = {}
        self._cache_off_in_training = "use_cache" in accepted

    def _run(self, batch: Mapping[str, Any]) -> Any:
        if self._cache_off_in_training and torch.is_grad_enabled() and "use_cache" not in batch:
            batch = {**batch, "use_cache": False}
        return self._call_module(**batch)

    def _resized_run(self, batch: Mapping[str, Any]) -> Callable[[], Any]:
        """A forward of ``batch`` with its rows doubled that leaves the module's buffers and the
        generators as they were: the second batch size from which a piece learns where random
        tensors hold its rows.
        It runs after the call's first forward, so a change a first forward makes to the model
        (BigBird's attention swap) is already made; the structure is left alone (FSDP2 registers
        its unsharded parameters on the modules, local execution its forwards)."""

        def run() -> None:
            with generators_kept(self.module), buffers_kept(self.module):
                self._run(batch_with_doubled_rows(batch)[1])

        return run

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        module = super().__getattr__("module")
        try:
            return getattr(module, name)
        except AttributeError:
            # A pipeline wraps the model, of which this rank holds only its stages.
            model = module.__dict__.get("_modules", {}).get("module")
            if not self.pipelined or model is None or not hasattr(model, name):
                raise
        value = getattr(model, name)
        if not callable(value):
            return value  # its config and other data are the whole model's
        # A method (generate) would run the whole model. An AttributeError still, so that
        # hasattr(model, name) answers False as before.
        raise AttributeError(
            f"{type(model).__name__}.{name} is not available on a pipelined model: each rank holds "
            f"only its pipeline stages of {type(model).__name__}, and {name} would run all of it. Use "
            "a plan without pipeline_parallel for it, or export the checkpoint (vescale checkpoint "
            "export-hf) and call it on from_pretrained's model"
        ) from None

    # torch types the ReduceOp members as ReduceOp.RedOpType.
    def _all_reduce(
        self, values: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        if self._dp_group is not None:
            dist.all_reduce(values, op=op, group=self._dp_group)
        return values

    def forward(self, *args: Any, **batch: Any) -> Any:
        if args:
            if len(args) != 1 or not isinstance(args[0], Mapping) or batch:
                raise TypeError(
                    "call the parallelized model as model(**batch) or model(batch) with a dict batch"
                )
            batch = dict(args[0])
        # In eval mode with gradients on, the call is the forward one device runs, its backward
        # left to the caller (who may train in eval mode, or never call it: a micro-batch's
        # backward run here would leave gradients one device does not have).
        whole = not self.training and torch.is_grad_enabled() and not self.pipelined
        pieces = 1 if whole else self.num_microbatches
        micro_batches = _split(batch, pieces) if pieces > 1 else [batch]
        counts = [self._count_terms(micro_batch) for micro_batch in micro_batches]
        if self.pipelined:
            return self._pipelined_forward(batch, counts)
        if len(micro_batches) == 1:
            return self._forward_one(batch, *counts[0])
        # Every micro-batch's backward needs the global term count: one all-reduce before the first.
        total_terms = self._global_term_count(counts)
        return self._forward_micro_batches(micro_batches, [count for count, _ in counts], total_terms)

    def _global_term_count(self, counts: list[tuple[int, bool]]) -> float:
        """The global batch's loss terms (one all-reduce over dp of this rank's pieces' ``counts``);
        refused where a piece's terms cannot be counted (:meth:`_check_weighable`)."""
        local = torch.tensor(
            [float(sum(count for count, _ in counts)), float(any(flag for _, flag in counts))]
        )
        total_terms, unweighted = self._all_reduce(local.to(torch.float64)).tolist()
        self._check_weighable(unweighted, pieces=len(counts))
        return float(total_terms)

    def _check_weighable(self, unweighted: float, *, pieces: int) -> None:
        """Refuse a loss whose terms vescale cannot count where the global batch has several pieces."""
        if unweighted and (self._dp_size > 1 or pieces > 1):
            raise UnsupportedPlanError(
                f"labels padded with -100, but {type(self.module).__name__}'s loss is not one whose terms "
                "vescale can count (transformers' ForCausalLMLoss, ForMaskedLMLoss, ForTokenClassification): "
                "the pieces of the global batch cannot be weighted, so gradients would differ from one "
                "device; use unpadded labels, or dp=1 and micro_batch_size = global_batch_size"
            )

    def _global_loss(self, weighted_local: torch.Tensor) -> torch.Tensor:
        """The sum over dp ranks of each rank's weighted loss (already divided by the global term count)."""
        value = _plain(weighted_local.detach()).to(torch.float64).reshape(1).clone()
        return self._all_reduce(value)[0].to(weighted_local.dtype)

    def _forward_one(self, batch: dict[str, Any], terms: int, unweighted: bool) -> Any:
        # The caller runs the backward: a recomputation by transformers' own gradient checkpointing
        # would draw outside the piece's replay, unlike its forward; there each rank draws as before.
        hf_recompute = torch.is_grad_enabled() and getattr(self.module, "is_gradient_checkpointing", False)
        call = self._randomness.call(
            training=self.training,
            rows_per_piece=batch_rows(batch),
            pieces=1,
            off_reason="under transformers' gradient checkpointing with one micro-batch per rank"
            if hf_recompute
            else None,
        )
        output = call.run_piece(0, lambda: self._run(batch), lambda _: None, self._resized_run(batch))
        loss = _loss_of(output)
        if loss is None:
            return output
        local = _plain(loss)
        # One all-reduce after the forward (none before it): the global term count, whether any
        # rank's loss is one vescale cannot weight, and the sum of each rank's loss times its term
        # count. Kept on the loss's device; the flag is read (a host sync) only where it can be set.
        counts = torch.tensor([float(terms), float(unweighted)], dtype=torch.float64, device=local.device)
        values = self._all_reduce(torch.cat([counts, local.detach().to(torch.float64).reshape(1) * terms]))
        if not self._counts_tokens and self._dp_size > 1:
            self._check_weighable(values[1].item(), pieces=1)
        weighted = (local * (terms / values[0])).to(local.dtype)  # one rounding, in float64 until then
        global_loss = (values[2] / values[0]).to(local.dtype)
        # The value is the global loss; the gradient is this rank's weighted share times dp (the
        # dp average divides by dp again), so backward() gives single-device gradients.
        scaled = weighted * self._dp_size
        return _with_loss(output, scaled + (global_loss - scaled).detach())

    def _forward_micro_batches(
        self, micro_batches: list[dict[str, Any]], counts: list[int], total: float
    ) -> Any:
        outputs: list[Any] = []
        weighted_sum: torch.Tensor | None = None
        training = torch.is_grad_enabled()
        call = self._randomness.call(
            training=self.training, rows_per_piece=batch_rows(micro_batches[0]), pieces=len(micro_batches)
        )
        for index, (micro_batch, terms) in enumerate(zip(micro_batches, counts, strict=True)):
            last = index == len(micro_batches) - 1
            losses: list[torch.Tensor] = []

            def backward(output: Any, terms: int = terms, losses: list[torch.Tensor] = losses) -> None:
                weighted = _required_loss(output) * (terms / total)
                losses.append(weighted.detach())
                if training:
                    # torch leaves Tensor.backward unannotated.
                    (weighted * self._dp_size).backward()  # type: ignore[no-untyped-call]
                    # Under the caller's torch.autocast, each micro-batch casts the weights afresh,
                    # as one device's forward does once: a cached cast of a weight ZeRO-3 gathered
                    # again would send the next micro-batch's gradient past FSDP2's reduction.
                    torch.clear_autocast_cache()

            with contextlib.nullcontext() if last or not training else _gradient_sync_paused(self.module):
                output = call.run_piece(
                    index, functools.partial(self._run, micro_batch), backward, self._resized_run(micro_batch)
                )
            outputs.append(output)
            weighted = losses[-1]
            weighted_sum = weighted if weighted_sum is None else weighted_sum + weighted
        if weighted_sum is None:  # the batch splitter gives at least one micro-batch
            raise UnsupportedPlanError(
                "the batch was cut into no micro-batches; give a batch of at least one sample"
            )
        global_loss = self._global_loss(weighted_sum)
        if training:
            anchor = torch.zeros((), requires_grad=True)
            global_loss = loss_with_backward_done(anchor, global_loss)
        return _concatenated(outputs, global_loss)

    def _pipelined_forward(self, batch: dict[str, Any], counts: list[tuple[int, bool]]) -> Any:
        # dpipe weights each micro-batch's loss by its share of the global batch's loss terms (times
        # dp, which the dp gradient average divides again): one all-reduce before the schedule.
        total_terms = self._global_term_count(counts)
        pipeline = cast("PipelineModule", self.module)
        # All labels -100: one device's mean over no terms is NaN, and so is every weight here.
        pipeline.set_microbatch_loss_weights(
            [count * self._dp_size / total_terms if total_terms else math.nan for count, _ in counts]
        )
        rows = batch_rows(batch)
        pipeline.set_global_batch(self._randomness.batch_rank * rows, rows * self._dp_size)
        # Each stage replays one device's draws on CPU (vescale.dpipe.random_carry), not compiled.
        pipeline.replays_random_numbers = (
            pipeline.replays_random_numbers and self._randomness.off_reason is None
        )
        states = torch.get_rng_state()
        output = self._run(batch)
        if not pipeline.replays_random_numbers and not torch.equal(states, torch.get_rng_state()):
            warn_unreplayed_draws(
                "under a pipeline (vescale.dpipe) "
                + (self._randomness.off_reason or "whose trace found no random op")
            )
        loss = _required_loss(output)
        return _with_loss(output, loss_with_backward_done(loss, self._global_loss(loss / self._dp_size)))


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` as the plain tensor one device would hold (differentiably, for a DTensor loss)."""
    if not isinstance(loss, DTensor):
        return loss
    replicate = [Replicate()] * loss.device_mesh.ndim
    return loss.redistribute(loss.device_mesh, replicate).to_local()


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    return getattr(output, "loss", None)


def _required_loss(output: Any) -> torch.Tensor:
    loss = _loss_of(output)
    if loss is None:
        raise UnsupportedPlanError(
            f"the model returned {type(output).__name__} without a loss, but micro-batching runs backward "
            "inside the call; pass labels in the batch (or return a scalar loss)"
        )
    return loss


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return loss
    output["loss"] = loss
    return output


@contextlib.contextmanager
def _gradient_sync_paused(module: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no dp reduction) for the backward passes run inside."""
    owner = data_parallel_of(module)
    if owner is None:
        yield
        return
    if hasattr(owner, "no_sync"):
        with owner.no_sync():
            yield
        return
    # ZeRO-3: FSDP2's own switch on the root module (fully_shard made its class an FSDPModule).
    root = cast("FSDPModule", module)
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
