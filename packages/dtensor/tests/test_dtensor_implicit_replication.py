"""Plain tensors made inside a scoped module's forward act as Replicate; outside, mixing raises.

Outputs are compared bitwise with the same module run on plain tensors in one process: a
Replicate operand leaves every element's arithmetic unchanged, and the sharded input only
splits the rows. The weight's gradient sums over the rows, per rank and then across ranks,
a different order of float32 additions: within 1e-6 relative.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from vescale.dtensor.implicit_replication import (
    ImplicitReplicationError,
    _in_replication_mode,
    implicit_replication_scope,
)
from vescale.dtensor.testing import run_on_ranks

MIXED_ERROR = "mixed torch.Tensor and DTensor"


class PlainTensorsInForward(nn.Module):
    """A forward that creates what real models create: a position table from a factory call,
    a causal mask, position ids and a buffer, each meeting the (sharded) input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4), persistent=False)
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 16).view(4, 4))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        seq_len = hidden.shape[1]
        position_ids = torch.arange(seq_len)
        rotary = torch.cos(position_ids[:, None] * torch.ones(4))
        mask = torch.ones(seq_len, seq_len).tril()
        mixed = (hidden * rotary + self.scale) @ self.weight
        return mask @ mixed


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = PlainTensorsInForward()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Plain tensors after the inner module returned: still inside the outer scope.
        return self.inner(hidden) + torch.ones(hidden.shape[-1])


class Failing(nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("forward failed")


def _input() -> torch.Tensor:
    return torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4) / 10


def _mixing_raises(dtensor: DTensor) -> bool:
    try:
        dtensor * torch.ones(dtensor.shape)
    except RuntimeError as error:
        return MIXED_ERROR in str(error)
    return False


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def scoped_forward_on_ranks():
    mesh = _mesh()
    module = PlainTensorsInForward()
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Replicate()]))
    hidden = distribute_tensor(_input(), mesh, [Shard(0)])
    raised_before = _mixing_raises(hidden)
    handle = implicit_replication_scope(module)
    out = module(hidden)
    out.sum().backward()
    raised_after = _mixing_raises(hidden)
    handle.remove()
    removed_raises = False
    try:
        module(hidden)
    except RuntimeError as error:
        removed_raises = MIXED_ERROR in str(error)
    return {
        "placements": out.placements,
        "out": out.full_tensor(),
        "weight_grad": module.weight.grad.full_tensor(),
        "raised_before": raised_before,
        "raised_after": raised_after,
        "removed_raises": removed_raises,
    }


def test_plain_tensors_in_scoped_forward_are_replicate_and_only_there():
    reference = PlainTensorsInForward()
    expected = reference(_input())
    expected.sum().backward()
    result = run_on_ranks(scoped_forward_on_ranks, 2)[0]
    assert result["placements"] == (Shard(0),)
    assert torch.equal(result["out"], expected.detach())
    grad_error = (result["weight_grad"] - reference.weight.grad).abs().max()
    assert grad_error <= 1e-6 * reference.weight.grad.abs().max()
    assert result["raised_before"] and result["raised_after"], "mixing outside the scope must raise"
    assert result["removed_raises"], "after handle.remove() the forward must raise again"


def nested_and_failing_scopes_on_ranks():
    mesh = _mesh()
    outer = Outer()
    hidden = distribute_tensor(_input(), mesh, [Shard(0)])
    outer_handle = implicit_replication_scope(outer)
    inner_handle = implicit_replication_scope(outer.inner)
    out = outer(hidden)
    after_nested = _mixing_raises(hidden)
    failing = Failing()
    implicit_replication_scope(failing)
    with pytest.raises(ValueError, match="forward failed"):
        failing(hidden)
    after_exception = _mixing_raises(hidden)
    outer_handle.remove()
    inner_handle.remove()
    return out.full_tensor(), after_nested, after_exception


def test_scopes_nest_and_are_restored_after_an_exception():
    expected = Outer()(_input()).detach()
    out, after_nested, after_exception = run_on_ranks(nested_and_failing_scopes_on_ranks, 2)[0]
    assert torch.equal(out, expected)
    assert after_nested, "the outer scope must end with the outer forward"
    assert after_exception, "a forward that raised must still close its scope"


def test_scope_of_a_non_module_is_a_typed_error_naming_the_fix():
    with pytest.raises(ImplicitReplicationError, match=r"expects an nn\.Module, got function"):
        implicit_replication_scope(lambda hidden: hidden)


class SortByKey(torch.autograd.Function):
    """Reformer's pattern: the forward gathers by indices it keeps on ``ctx`` as a plain tensor,
    and the backward gathers the gradient back with them, outside every module's forward."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.order = order
        return torch.gather(values, 1, order.argsort(dim=1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return torch.gather(grad, 1, ctx.order), None


class SortedProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 16).view(4, 4))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        projected = hidden @ self.weight
        order = torch.arange(projected.shape[1]).flip(0).expand(projected.shape[0], -1).contiguous()
        return SortByKey.apply(projected, order.unsqueeze(-1).expand(*projected.shape).contiguous())


def custom_function_backward_on_ranks():
    mesh = _mesh()
    module = SortedProjection()
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Replicate()]))
    handle = implicit_replication_scope(module)
    hidden = distribute_tensor(_input(), mesh, [Replicate()])
    out = module(hidden)
    (out * out).sum().backward()
    handle.remove()
    return {"out": out.full_tensor(), "weight_grad": module.weight.grad.full_tensor()}


def test_a_custom_function_backward_in_scope_sees_plain_tensors_as_replicate():
    # Without it: "aten.gather.default got mixed torch.Tensor and DTensor" in the backward.
    reference = SortedProjection()
    expected = reference(_input())
    (expected * expected).sum().backward()
    result = run_on_ranks(custom_function_backward_on_ranks, 2)[0]
    assert torch.equal(result["out"], expected.detach())
    grad_error = (result["weight_grad"] - reference.weight.grad).abs().max()
    assert grad_error <= 1e-6 * reference.weight.grad.abs().max()


class TorchStyleDouble(torch.autograd.Function):
    """Stands for a Function of torch's own (its backward defined in a ``torch.`` module); records
    whether its backward ran under the implicit-replication mode."""

    modes: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx, values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return values * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        TorchStyleDouble.modes.append(_in_replication_mode())
        return grad * 2


TorchStyleDouble.__module__ = "torch.distributed.stand_in"


class KeepsTorchBackward(TorchStyleDouble):
    """A subclass that changes only its context set-up, as doptim's FSDP2 post-backward does."""


class OwnBackward(TorchStyleDouble):
    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        TorchStyleDouble.modes.append(_in_replication_mode())
        return grad * 2


class DoublesTwice(nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return OwnBackward.apply(KeepsTorchBackward.apply(hidden))


def backward_modes_on_ranks() -> list[bool]:
    mesh = _mesh()
    module = DoublesTwice()
    handle = implicit_replication_scope(module)
    hidden = distribute_tensor(_input(), mesh, [Shard(0)]).requires_grad_()
    TorchStyleDouble.modes.clear()
    module(hidden).sum().backward()
    handle.remove()
    return list(TorchStyleDouble.modes)


def test_a_subclass_keeping_a_torch_functions_backward_runs_it_outside_the_mode():
    # FSDP2's post-backward under the mode sent every tensor call of its gradient reduction through
    # veScale's Python dispatch (~450 calls a step in the e2e bench). The model's own backward
    # (OwnBackward, first in backward order) still runs under it.
    assert run_on_ranks(backward_modes_on_ranks, 2)[0] == [True, False]


class OuterOfRefusing(nn.Module):
    """``inner`` refuses its first call in a pre-hook registered before its scope's; the outer
    forward catches that and goes on mixing plain tensors with DTensors."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Outer()
        self.refused = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        try:
            self.inner(hidden)
        except KeyError:
            self.refused += 1
        return self.inner(hidden) * torch.ones(hidden.shape[-1])


def refused_pre_hook_on_ranks():
    mesh = _mesh()
    module = OuterOfRefusing()
    calls = []

    def refuse_once(hooked: nn.Module, args: tuple) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("refused")

    module.inner.register_forward_pre_hook(refuse_once)  # before the scope's own hooks
    handle = implicit_replication_scope(module)
    hidden = distribute_tensor(_input(), mesh, [Shard(0)])
    out = module(hidden)
    after = _mixing_raises(hidden)
    handle.remove()
    return out.full_tensor(), module.refused, after


def test_a_pre_hook_that_raises_before_the_scope_leaves_the_enclosing_scope_on():
    # torch calls the inner module's always-called exit hook although its enter hook never ran;
    # the scope must not close the outer forward's (which then mixed tensors and failed).
    expected = Outer()(_input()).detach()
    out, refused, after = run_on_ranks(refused_pre_hook_on_ranks, 2)[0]
    assert refused == 1
    assert torch.equal(out, expected)
    assert after, "the scope ends with the outer forward"


def suspended_scope_on_ranks():
    from vescale.dtensor.implicit_replication import ReplicatePlainTensorsMode, suspended_implicit_replication

    mesh = _mesh()
    outer = Outer()
    handle = implicit_replication_scope(outer)
    seen = {}

    def inner_forward(module: nn.Module, args: tuple) -> None:
        from vescale.dtensor import _compat

        modes = _compat.active_torch_function_modes()
        seen["mode_in_inner"] = any(isinstance(mode, ReplicatePlainTensorsMode) for mode in modes)

    outer.inner.register_forward_pre_hook(inner_forward)
    hidden = distribute_tensor(_input(), mesh, [Shard(0)])
    with suspended_implicit_replication():
        local = outer(hidden.to_local())  # plain tensors only: the inner scope stays off
    seen["mixing_after"] = _mixing_raises(hidden)
    handle.remove()
    return local, seen


def test_suspended_scope_keeps_submodule_forwards_local():
    for rank, (local, seen) in enumerate(run_on_ranks(suspended_scope_on_ranks, 2)):
        # Each rank's shard of the batch, computed as plain tensors.
        assert torch.equal(local, Outer()(_input()[rank : rank + 1]).detach())
        assert seen == {"mode_in_inner": False, "mixing_after": True}
