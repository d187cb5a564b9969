"""One traced training step of a test model under tensor parallelism, and its single-process twin.

:func:`tensor_parallel_step` runs on every rank of a gloo group (through
:func:`vescale.dtensor.testing.run_on_ranks`): it builds the model from ``seed``, applies
:func:`~.tp_plans.apply_tensor_parallel` on the ``tp`` mesh dim, records the ops that reach
DTensor in the forward and in the backward separately, and returns the loss and every
parameter gradient as full tensors. With a ``dp`` dim too, each data-parallel rank takes its
slice of the batch and the gradients are averaged over ``dp``, as data parallelism would.
:func:`reference_step` is the same step in one process, the reference of every check.

Example::

    results = run_on_ranks(tensor_parallel_step, world_size=2, args=("llama",), kwargs={"tp": 2})
    reference = reference_step("llama")
    assert abs(results[0].loss - reference.loss) <= 1e-5 * abs(reference.loss)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale.dtensor.ops.coverage import OpCoverageRecorder, OpCoverageReport
from vescale.dtensor.testing.errors import DistributedTestError
from vescale.dtensor.testing.models.tiny_hf import tiny_batch
from vescale.dtensor.testing.models.tp_plans import apply_tensor_parallel, build_test_model, model_loss

__all__ = ["StepResult", "reference_step", "tensor_parallel_step"]

VOCAB_SIZE = 64


@dataclass
class StepResult:
    """The loss, the full gradient of every parameter by name, and (parallel runs) the ops seen."""

    loss: float
    gradients: dict[str, torch.Tensor]
    forward_ops: OpCoverageReport = field(default_factory=OpCoverageReport)
    backward_ops: OpCoverageReport = field(default_factory=OpCoverageReport)


def reference_step(name: str, seed: int = 0) -> StepResult:
    """Loss and gradients of one float32 step of test model ``name`` in this process.

    Example::

        reference = reference_step("gpt2")
        assert set(reference.gradients) == {n for n, _ in build_test_model("gpt2").named_parameters()}
    """
    model = build_test_model(name, seed)
    input_ids, labels = tiny_batch(VOCAB_SIZE)
    loss = model_loss(model, name, input_ids, labels)
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    gradients = {
        param_name: _grad(param_name, param).detach().clone()
        for param_name, param in model.named_parameters()
    }
    return StepResult(loss.item(), gradients)


def _grad(name: str, param: torch.Tensor) -> torch.Tensor:
    if param.grad is None:
        raise DistributedTestError(
            f"parameter {name!r} has no gradient after backward: the loss does not depend on it"
        )
    return param.grad


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tensor_parallel_step(
    name: str,
    tp: int,
    dp: int = 1,
    sequence_parallel: bool = False,
    seed: int = 0,
    replicate_uncovered: bool = False,
) -> StepResult:
    """Run on ``tp * dp`` ranks: one step of ``name`` under the test TP plan (see module docstring).

    ``replicate_uncovered`` computes ops without a strategy on gathered tensors so that a
    report lists them all (see :class:`OpCoverageRecorder`); tests leave it off.

    Example::

        result = run_on_ranks(tensor_parallel_step, 4, args=("mixtral", 2, 2))[0]
    """
    from vescale.dtensor.mesh import init_mesh

    mesh = init_mesh(dp=dp, tp=tp) if dp > 1 else init_mesh(tp=tp)
    tp_mesh = mesh["tp"]
    model = build_test_model(name, seed)
    input_ids, labels = tiny_batch(VOCAB_SIZE)
    if dp > 1:
        dp_rank = mesh.get_local_rank("dp")
        input_ids, labels = input_ids.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank]
    apply_tensor_parallel(model, name, tp_mesh, sequence_parallel=sequence_parallel)
    with OpCoverageRecorder(replicate_uncovered) as forward_recorder:
        loss = model_loss(model, name, input_ids, labels)
    with OpCoverageRecorder(replicate_uncovered) as backward_recorder:
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    loss_value = _full(loss).detach().clone()
    gradients = {}
    for param_name, param in model.named_parameters():
        gradient = _full(_grad(param_name, param)).detach().clone()
        if dp > 1:
            dist.all_reduce(gradient, group=mesh.get_group("dp"))
            gradient /= dp
        gradients[param_name] = gradient
    if dp > 1:
        dist.all_reduce(loss_value, group=mesh.get_group("dp"))
        loss_value /= dp
    return StepResult(loss_value.item(), gradients, forward_recorder.report(), backward_recorder.report())
