"""``pipeline_parallelize``: wrap a model so that one call runs the whole pipeline schedule.

The user's loop stays ``out = model(**batch); out.loss.backward(); optimizer.step()``: the
call cuts the batch into micro-batches, runs the forward and backward passes of every
micro-batch on every stage, sums tied parameters' gradients across the stages that hold
them and returns the model's own output type. ``out.loss`` is the mean of the micro-batch
losses on every rank (or their weighted sum, :meth:`PipelineModule.set_microbatch_loss_weights`)
and its ``backward()`` does nothing (the schedule already ran it).
Under ``torch.no_grad()`` or ``model.eval()`` the call runs forward only. A ``transformers``
MoE model's load-balancing loss is that of all its layers, as without a pipeline: the
routers' statistics travel from stage to stage (:mod:`vescale.dmodule.experts.router_statistics`).

Example::

    model = pipeline_parallelize(model, init_mesh(pp=2), PipelinePlan(size=2, num_microbatches=4))
    out = model(input_ids=input_ids, labels=labels)
    out.loss.backward(); optimizer.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from vescale.dmodule.experts import carry_router_statistics
from vescale.doptim.clip import mark_pipeline_copy
from vescale.dpipe import _compat
from vescale.dpipe.activation_meter import ActivationMeter
from vescale.dpipe.errors import (
    MicrobatchError,
    PipelineArgumentError,
    PipelineCheckpointingError,
    PipelineError,
    PipelinePlanError,
)
from vescale.dpipe.finished_loss import loss_with_backward_done
from vescale.dpipe.gradients import (
    data_parallel_sync_deferred,
    finish_pipeline_gradients,
    tied_gradients_counted_once,
    tied_parameters,
)
from vescale.dpipe.plan import PipelinePlan
from vescale.dpipe.random_carry import GeneratorCarry, micro_batch_pieces
from vescale.dpipe.schedules import build_schedule, local_stage_indices
from vescale.dpipe.split import StageLayout, split_model
from vescale.dpipe.stage_inputs import StageInputs, find_stage_inputs
from vescale.dpipe.stage_module import PipelineStageModule, StageRouter
from vescale.dpipe.tracing import (
    ModelTrace,
    default_example_batch,
    no_cache_kwargs,
    trace_model,
    with_random_layout,
)

__all__ = ["ModuleWrapper", "PipelineModule", "pipeline_parallelize", "rebuilds_output"]

# The dtypes a loss may have; the broadcast of the loss carries the index of its own.
_LOSS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def rebuilds_output(output_type: type) -> bool:
    """Whether a pipeline can return a model's output of ``output_type``: one that takes ``loss`` and
    ``logits`` (a language model's ``CausalLMOutput``, a classifier's ``SequenceClassifierOutput``).

    Example::

        rebuilds_output(CausalLMOutputWithPast)          # True
        rebuilds_output(QuestionAnsweringModelOutput)    # False: start and end logits
    """
    try:
        output_type(loss=None, logits=None)  # what PipelineModule.forward builds, empty
    except TypeError:
        return False
    return True


def _check_output_type(model: nn.Module, output_type: type) -> None:
    """Refuse, on every rank before any stage runs, a model whose output the pipeline cannot rebuild.

    The pipeline returns the model's own output type holding the loss and the logits the last
    stage computed; a ``QuestionAnsweringModelOutput`` (start and end logits) or a plain tuple has
    no such fields, and failed on the last stage only, after the first ranks had started the schedule.
    """
    if not rebuilds_output(output_type):
        fields = list(getattr(output_type, "__dataclass_fields__", {})) or "none named"
        raise PipelinePlanError(
            f"{type(model).__name__} returns {output_type.__name__} (fields: {fields}), but a pipeline "
            "returns the model's loss and logits: it runs models whose output has `loss` and `logits` "
            "(language models, sequence and token classifiers); use a plan without pipeline_parallel"
        )


def _micro_batch_indices(batch_size: int, num_microbatches: int) -> torch.Tensor:
    """The schedule's ``target``: each row holds the index of the micro-batch it falls in, so that the
    loss function, which the schedule calls with a micro-batch's piece of it, knows which one it is."""
    rows = batch_size // num_microbatches
    return torch.arange(num_microbatches).repeat_interleave(rows).reshape(batch_size, 1)


class ModuleWrapper(nn.Module):
    """A module around :attr:`module` whose state dict is the wrapped module's own: the model's FQNs,
    without the wrapper's ``module.`` prefix, so that a checkpoint does not depend on the wrapping.

    Example::

        class Wrapped(ModuleWrapper):
            def __init__(self, module: nn.Module) -> None:
                super().__init__()
                self.module = module
    """

    module: nn.Module

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class PipelineModule(ModuleWrapper):
    """A model cut into pipeline stages; this rank holds :attr:`stage_indices` of them.

    Build it with :func:`pipeline_parallelize`. ``parameters()`` lists only this rank's;
    ``named_parameters()`` and ``state_dict()`` use the original model's FQNs (no ``module.``
    prefix), so they are independent of the pipeline size and split.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: PipelinePlan,
        layout: StageLayout,
        trace: ModelTrace,
        mesh: DeviceMesh | None,
        inputs: StageInputs | None = None,
        *,
        measure_activations: bool = False,
    ) -> None:
        super().__init__()
        self.module = model
        self.plan = plan
        self.layout = layout
        self.pp_group = mesh.get_group("pp") if mesh is not None else dist.group.WORLD
        self.pp_rank = dist.get_rank(self.pp_group)
        self.device = _current_device(mesh.device_type if mesh is not None else "cpu")
        self.stage_indices = local_stage_indices(plan, self.pp_rank)
        self._output_type = trace.output_type
        self._tied_parameters = tied_parameters(model, layout)
        for tied in self._tied_parameters:
            # Every stage that holds a tied parameter ends a step with the same summed gradient: the
            # global gradient norm counts it on the first of them only.
            if tied.stages.intersection(self.stage_indices) and min(tied.stages) not in self.stage_indices:
                mark_pipeline_copy(tied.parameter)
        # A tied parameter's name without a pipeline (its first name in the whole model), which a
        # stage that holds it only under another name (GPT-2's last stage: lm_head.weight) reports.
        first_names = {id(param): fqn for fqn, param in model.named_parameters()}
        self._tied_names = {
            id(tied.parameter): first_names[id(tied.parameter)] for tied in self._tied_parameters
        }
        router = StageRouter(model, layout, trace, self.stage_indices, self.device, inputs)
        model_kwargs = no_cache_kwargs(model)
        self._fixed_arguments = model_kwargs
        self.activation_meter = ActivationMeter(enabled=measure_activations)
        # The MoE load-balancing loss of transformers needs every layer's router statistics.
        router_statistics = carry_router_statistics(model)
        carries = (router_statistics,) if router_statistics is not None else ()
        # Each stage draws one device's random numbers (dropout) where its forward draws any (CPU).
        self._generator_carries = (
            {index: GeneratorCarry(router) for index in self.stage_indices}
            if trace.random_ops and self.device.type == "cpu"
            else {}
        )
        # Where its random tensors hold a micro-batch's rows (XLNet's sequence-first activations).
        self._random_layout = trace.random_layout
        self._stage_modules = [
            PipelineStageModule(
                model,
                router,
                index,
                model_kwargs,
                self.activation_meter,
                (*carries, self._generator_carries[index]) if self._generator_carries else carries,
            )
            for index in self.stage_indices
        ]
        self._schedules: dict[tuple[Any, ...], Any] = {}
        # Where this rank's batch lies in the global batch (set_global_batch): its own by default.
        self._global_batch: tuple[int, int] | None = None
        # The next call's micro-batch loss weights (set_microbatch_loss_weights), and the running
        # call's, which the schedule's loss function reads: 1 / m each where None.
        self._next_loss_weights: tuple[float, ...] | None = None
        self._loss_weights: tuple[float, ...] | None = None
        self.replays_random_numbers = bool(self._generator_carries)
        self._anchor = torch.zeros((), requires_grad=True)

    def forward(self, **batch: Any) -> Any:
        # The weights set for this call are for it alone, whether it runs or raises.
        self._loss_weights, self._next_loss_weights = self._next_loss_weights, None
        batch = self._without_fixed_arguments(batch)
        batch_size = _batch_size(batch)
        if batch_size % self.plan.microbatch_count:
            raise MicrobatchError(
                f"a batch of {batch_size} samples cannot be cut into {self.plan.microbatch_count} equal "
                f"micro-batches; use a batch size that is a multiple of num_microbatches="
                f"{self.plan.microbatch_count}"
            )
        training = self.training and torch.is_grad_enabled()
        has_labels = batch.get("labels") is not None
        schedules_before = len(self._schedules)
        schedule = self._schedule(batch, training, has_labels)
        replaying = self._begin_random_replay(
            batch_size, fresh_schedule=len(self._schedules) > schedules_before
        )
        losses: list[torch.Tensor] = []
        target = _micro_batch_indices(batch_size, self.plan.microbatch_count) if has_labels else None
        for module in self._stage_modules:
            module.logits.clear()
        run = schedule.step if training else schedule.eval
        if training and has_labels:
            tied_gradients_counted_once(self._tied_parameters, local_stages=self.stage_indices)
        self.activation_meter.reset_peak()
        try:
            with data_parallel_sync_deferred(self), _reentrant_checkpointing_named(self.module):
                run(**batch, target=target, losses=losses if has_labels else None, return_outputs=False)
        finally:
            self._loss_weights = None
            for carry in self._generator_carries.values():
                carry.end_step()
        if replaying:
            self._take_last_stages_generator_state()
        if training and has_labels:
            finish_pipeline_gradients(
                self.module.parameters(),
                self._tied_parameters,
                local_stages=self.stage_indices,
                pp_group=self.pp_group,
                device=self.device,
            )
        loss = self._broadcast_loss(losses) if has_labels else None
        if loss is not None and training:
            loss = loss_with_backward_done(self._anchor, loss)
        logits = None
        last_stage_module = self._stage_modules[-1]
        if last_stage_module.is_last:
            # A new schedule's first step also runs PyTorch's shape-inference forward: keep the last m.
            logits = torch.cat(last_stage_module.logits[-self.plan.microbatch_count :])
        return self._output_type(loss=loss, logits=logits)

    def set_global_batch(self, first_row: int, total_rows: int) -> None:
        """The next calls' batches are rows ``[first_row, first_row + rows)`` of a global batch of
        ``total_rows`` (a data-parallel rank's share): their random draws are those rows of one
        device's (:mod:`vescale.dpipe.random_carry`).

        Example::

            pipe.set_global_batch(first_row=4, total_rows=8)   # dp rank 1 of 2, 4 rows each
        """
        self._global_batch = (first_row, total_rows)

    def set_microbatch_loss_weights(self, weights: Sequence[float]) -> None:
        """The next call weights micro-batch ``i``'s loss by ``weights[i]`` instead of ``1 / m``.

        Its backward starts from the weighted loss and the call returns their weighted sum.
        A model's loss is a mean over its micro-batch's loss terms (tokens whose label is not
        ``-100``); where micro-batches hold unequal numbers of terms, the mean of their means
        is not one device's mean over the batch, but ``weights[i] = terms_i / terms`` gives it.
        The weights apply to the next call only.

        Example::

            pipe.set_microbatch_loss_weights([10 / 24, 14 / 24])   # terms of 2 micro-batches
            out = pipe(input_ids=ids, labels=labels)               # out.loss: the 24 terms' mean
        """
        weights = tuple(float(weight) for weight in weights)
        if len(weights) != self.plan.microbatch_count:
            raise MicrobatchError(
                f"{len(weights)} micro-batch loss weights were given for a pipeline of "
                f"num_microbatches={self.plan.microbatch_count}; give one weight per micro-batch"
            )
        # Only the last stage computes losses; the others' weights would never be read.
        last_stage_here = self.pp_rank == _stage_rank(self.plan, self.plan.num_stages - 1)
        self._next_loss_weights = weights if last_stage_here else None

    def _micro_batch_loss(
        self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor
    ) -> torch.Tensor:
        """A micro-batch's weighted loss, which its backward starts from (the schedule's loss function).

        The last stage returns (loss, logits): the model computed its own loss from the labels.
        Weighted here, each backward adds this call's share to the gradients and nothing divides
        them after the schedule: gradients a loop accumulated over earlier calls stay as they were.
        """
        if self._loss_weights is None:
            return output[0] / self.plan.microbatch_count
        return output[0] * self._loss_weights[int(target[0, 0])]

    def _begin_random_replay(self, batch_size: int, *, fresh_schedule: bool) -> bool:
        """Start each local stage's generator carry for this call; whether it replays."""
        if not (self.replays_random_numbers and self.training):
            return False
        first_row, total_rows = self._global_batch or (0, batch_size)
        pieces = [
            piece.with_layout(self._random_layout)
            for piece in micro_batch_pieces(first_row, batch_size, total_rows, self.plan.microbatch_count)
        ]
        step_state = torch.get_rng_state()
        for carry in self._generator_carries.values():
            carry.begin_step(pieces, step_state, skip_calls=1 if fresh_schedule else 0)
        return True

    def _take_last_stages_generator_state(self) -> None:
        """Every pp rank continues from where one device's forward ends: the last stage's end state."""
        last_stage = self.plan.num_stages - 1
        carry = self._generator_carries.get(last_stage)
        state = torch.get_rng_state()
        if carry is not None and carry.end_state is not None:
            state = carry.end_state.clone()
        dist.broadcast(state, group=self.pp_group, group_src=_stage_rank(self.plan, last_stage))
        torch.set_rng_state(state)

    def _without_fixed_arguments(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` less the arguments every stage passes the model itself (``use_cache=False``).

        A caller's equal value is dropped (``model(**batch, use_cache=False)``, as in a
        ``transformers`` training loop); another one is refused, named.
        """
        for name, fixed in self._fixed_arguments.items():
            if name in batch and batch[name] is not None and batch[name] != fixed:
                raise PipelineArgumentError(
                    f"{name}={batch[name]!r} was passed, but every pipeline stage runs "
                    f"{type(self.module).__name__} with {name}={fixed!r} (a stage returns no KV cache); "
                    f"pass {name}={fixed!r} or leave it out"
                )
        return {name: value for name, value in batch.items() if name not in self._fixed_arguments}

    # The model's own FQNs, without this wrapper's ``module.`` prefix: a checkpoint, an optimizer
    # keyed by FQN and data parallelism then see the names the model has without a pipeline, so
    # they do not depend on the pipeline size or split. Other stages' parameters are ``None``
    # on this rank and so absent.
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for fqn, parameter in self.module.named_parameters(prefix, recurse, remove_duplicate):
            tied_name = self._tied_names.get(id(parameter))
            if tied_name is not None:
                fqn = f"{prefix}.{tied_name}" if prefix else tied_name
            yield fqn, parameter

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def _schedule(self, batch: Mapping[str, Any], training: bool, has_labels: bool) -> Any:
        # PyTorch stages fix their activation shapes on first use: one schedule per input shape.
        key = (
            training,
            has_labels,
            tuple((name, tuple(getattr(value, "shape", ()))) for name, value in batch.items()),
        )
        if key not in self._schedules:
            stage_class = _compat.pipeline_stage_class()
            stages = [
                stage_class(
                    module, module.stage_index, self.plan.num_stages, self.device, group=self.pp_group
                )
                for module in self._stage_modules
            ]
            loss_fn = self._micro_batch_loss if has_labels else None
            self._schedules[key] = build_schedule(self.plan, stages, loss_fn)
        return self._schedules[key]

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean micro-batch loss (the sum of their weighted losses) on every pp rank,
        in the dtype it has there.

        Only the last stage knows the loss's dtype (a float64 or bf16 model's loss is one), so
        the loss travels as float64, which holds every floating dtype's value exactly, beside
        its dtype's index in :data:`_LOSS_DTYPES`: one broadcast of two numbers.
        """
        last_stage_rank = _stage_rank(self.plan, self.plan.num_stages - 1)
        message = torch.zeros(2, dtype=torch.float64, device=self.device)
        if losses:
            loss = torch.stack([micro_loss.detach() for micro_loss in losses]).sum()
            if loss.dtype not in _LOSS_DTYPES:
                raise PipelineError(
                    f"the model's loss has dtype {loss.dtype}; a pipeline broadcasts losses of "
                    f"{', '.join(map(str, _LOSS_DTYPES))}: return a floating-point loss"
                )
            message[0] = loss.to(torch.float64)
            message[1] = _LOSS_DTYPES.index(loss.dtype)
        dist.broadcast(message, group=self.pp_group, group_src=last_stage_rank)
        if losses:
            return loss
        return message[0].to(_LOSS_DTYPES[int(message[1])])

    @property
    def measure_activations(self) -> bool:
        """Whether calls count the activations each stage saves for backward (off by default: it
        runs a Python hook on every saved tensor). :meth:`activation_bytes` and
        :meth:`peak_activation_bytes` report the last call that counted.

        Example::

            model.measure_activations = True
            model(**batch)
            print(model.peak_activation_bytes())
        """
        return self.activation_meter.enabled

    @measure_activations.setter
    def measure_activations(self, enabled: bool) -> None:
        self.activation_meter.enabled = enabled

    def _measured_meter(self) -> ActivationMeter:
        if not self.activation_meter.measured:
            raise PipelineError(
                "no call of this pipeline measured its activations; set model.measure_activations = True "
                "(or pipeline_parallelize(..., measure_activations=True)) before the calls to measure"
            )
        return self.activation_meter

    def activation_bytes(self) -> dict[int, int]:
        """Bytes each local stage saved for backward in its last measured micro-batch forward
        (see :attr:`measure_activations`).

        Example::

            model.measure_activations = True
            out = model(**batch)
            print(model.activation_bytes())   # {stage_index: bytes}
        """
        self._measured_meter()
        return {module.stage_index: module.saved_activation_bytes for module in self._stage_modules}

    def peak_activation_bytes(self) -> int:
        """The most bytes this rank's stages held saved for backward at once during the last call.

        This is the schedule's in-flight activation memory: GPipe holds every micro-batch's
        activations before the first backward, 1F1B at most ``size - pp_rank`` micro-batches'.

        Example::

            model.measure_activations = True
            out = model(**batch)
            print(model.peak_activation_bytes() / model.activation_bytes()[model.stage_indices[0]])
        """
        return self._measured_meter().peak_bytes


# The message of torch.utils.checkpoint's refusal when a reentrant checkpoint meets a backward
# given ``inputs``, as PyTorch's stage backward passes them.
_REENTRANT_REFUSAL = "use_reentrant=True"


@contextlib.contextmanager
def _reentrant_checkpointing_named(model: nn.Module) -> Iterator[None]:
    """Turn torch's refusal of reentrant activation checkpointing in a stage's backward into an
    error that names the cause in the model and the two ways out."""
    try:
        yield
    except RuntimeError as error:
        if _REENTRANT_REFUSAL not in str(error):
            raise
        raise PipelineCheckpointingError(
            f"{type(model).__name__} runs reentrant activation checkpointing "
            "(torch.utils.checkpoint(..., use_reentrant=True); in transformers, "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True})), "
            "which a pipeline stage's backward cannot run: PyTorch's schedules differentiate each "
            "stage with respect to its inputs. Use use_reentrant=False (transformers' default), or "
            "leave recomputation to the plan (the activation_checkpointing constraint)"
        ) from error


def _stage_rank(plan: PipelinePlan, stage_index: int) -> int:
    return next(rank for rank in range(plan.size) if stage_index in local_stage_indices(plan, rank))


def _current_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _batch_size(batch: Mapping[str, Any]) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise MicrobatchError(
        f"the batch {sorted(batch)} has no tensor with a batch dimension to cut into micro-batches"
    )


def pipeline_parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    plan: PipelinePlan,
    example_batch: Mapping[str, Any] | None = None,
    *,
    measure_activations: bool = False,
) -> PipelineModule:
    """Cut ``model`` into the stages of ``plan`` and keep this rank's; the model class is untouched.

    ``mesh`` needs a ``pp`` dimension of size ``plan.size`` (``None``: the whole world is the
    pipeline). ``example_batch`` (default: 16 zero token ids) drives the one fake-tensor pass
    that finds the module order and FLOPs. ``measure_activations``: count the activations each
    stage saves for backward (see :attr:`PipelineModule.measure_activations`).

    Example::

        pipe = pipeline_parallelize(model, init_mesh(pp=2), PipelinePlan(size=2, num_microbatches=2))
        loss = pipe(input_ids=input_ids, labels=labels).loss
    """
    pp_mesh_dim = _pp_mesh_dim(mesh) if mesh is not None else None
    pp_size = mesh.size(pp_mesh_dim) if mesh is not None and pp_mesh_dim is not None else None
    if mesh is not None and pp_size is None:
        raise PipelinePlanError(
            f"the mesh {mesh.mesh_dim_names} has no 'pp' dimension; build it with init_mesh(pp=...)"
        )
    world = pp_size if mesh is not None else dist.get_world_size()
    if world != plan.size:
        raise PipelinePlanError(f"PipelinePlan.size is {plan.size} but the pp dimension has {world} ranks")
    batch = example_batch if example_batch is not None else default_example_batch(model)
    trace = with_random_layout(model, batch, trace_model(model, batch))
    _check_output_type(model, trace.output_type)
    layout = split_model(model, plan, trace)
    # What a later stage needs from an earlier one besides the hidden state (a position bias, the
    # per-layer inputs computed before the blocks) travels with it; this follows the data to find it.
    inputs = find_stage_inputs(model, layout, batch)
    return PipelineModule(model, plan, layout, trace, mesh, inputs, measure_activations=measure_activations)


def _pp_mesh_dim(mesh: DeviceMesh) -> int | None:
    names = mesh.mesh_dim_names
    return names.index("pp") if names is not None and "pp" in names else None
