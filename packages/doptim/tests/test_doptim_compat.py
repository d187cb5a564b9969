"""Fails loudly when PyTorch renames or removes a private API that vescale.doptim relies on."""

from __future__ import annotations

import torch

from vescale.doptim import _compat
from vescale.dtensor import _compat as dtensor_compat


def test_installed_torch_is_within_the_supported_range():
    assert dtensor_compat.torch_version() >= _compat.MIN_TORCH, torch.__version__


def test_private_api_error_is_the_one_every_package_raises():
    # A caller that catches vescale.dtensor's error also catches the ones doptim raises.
    assert _compat.PrivateTorchAPIError is dtensor_compat.PrivateTorchAPIError
    error = dtensor_compat.unsupported_torch(
        "torch.autograd.Variable._execution_engine is missing", "vescale.doptim"
    )
    assert isinstance(error, _compat.PrivateTorchAPIError)
    assert "vescale.doptim was checked against torch" in str(error)
    assert "update vescale/doptim/_compat.py" in str(error)


def test_end_of_backward_callback_runs_once_after_the_last_gradient():
    events: list[str] = []
    weight = torch.ones(2, requires_grad=True)

    def on_gradient(_: torch.Tensor) -> None:
        events.append("grad")
        _compat.queue_end_of_backward_callback(lambda: events.append("end"))

    weight.register_post_accumulate_grad_hook(on_gradient)
    (weight * 3).sum().backward()
    assert events == ["grad", "end"]


def test_fsdp_post_backward_passes_a_missing_gradient_on_as_missing_in_vescale_units_only():
    # Installed twice: the second call keeps the first replacement.
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    ours, theirs = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    _compat.unmaterialized_fsdp_post_backward(ours)
    installed = _fsdp_param_group.RegisterPostBackwardFunction
    _compat.unmaterialized_fsdp_post_backward(ours)
    assert _fsdp_param_group.RegisterPostBackwardFunction is installed

    class _Group:
        def __init__(self, unit: torch.nn.Module) -> None:
            self.modules = (unit,)

        def post_backward(self) -> None:
            calls.append("post_backward")

    calls: list[str] = []
    for unit, unused_gradient in ((ours, None), (theirs, torch.zeros(2))):
        used, unused = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        used_out, _ = installed.apply(_Group(unit), used * 1, unused * 1)
        (used_out * 3).sum().backward()
        assert torch.equal(used.grad, torch.full((2,), 3.0))
        # veScale's unit: no gradient reached the unused input (not zeros). Another FSDP2 model in the
        # same process: torch's own behaviour, materialised zeros.
        if unused_gradient is None:
            assert unused.grad is None
        else:
            assert torch.equal(unused.grad, unused_gradient)
    assert calls == ["post_backward", "post_backward"]


def fsdp_hooks_under_a_scope_on_ranks() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vescale.dtensor.implicit_replication import _in_replication_mode, implicit_replication_scope

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    reference.load_state_dict(model.state_dict())
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    _compat.fsdp_forward_hooks_outside_implicit_replication(model)
    _compat.fsdp_forward_hooks_outside_implicit_replication(model)  # idempotent
    states = [unit._get_fsdp_state() for unit in (model[0], model)]
    replaced = [
        handle.hooks_dict_ref()[handle.id].vescale_outside_implicit_replication
        for state in states
        for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle)
    ]
    modes: list[bool] = []
    # A pre-hook registered before FSDP2's runs after it (FSDP2 prepends its own) and under the scope.
    model[0].register_forward_pre_hook(lambda *_: modes.append(_in_replication_mode()))
    handle = implicit_replication_scope(model)
    inputs = torch.ones(2, 4)
    model(inputs).sum().backward()
    handle.remove()
    reference(inputs).sum().backward()
    matches = torch.allclose(model[0].weight.grad.full_tensor(), reference[0].weight.grad)
    return {"replaced": replaced, "modes": modes, "matches": matches}


def test_fsdp_forward_hooks_run_outside_implicit_replication_and_the_model_inside():
    # The private FSDPState hook handles exist and are replaced (this fails loudly when torch renames
    # them); the unit's own forward still runs under the scope and the gradients are FSDP2's.
    from vescale.dtensor.testing import run_on_ranks

    for result in run_on_ranks(fsdp_hooks_under_a_scope_on_ranks, world_size=2, timeout_s=120):
        assert result["replaced"] == [True, True, True, True]
        assert result["modes"] == [True]
        assert result["matches"]


class _OldStylePostBackward(torch.autograd.Function):
    """torch 2.11's RegisterPostBackwardFunction: ``forward(ctx, param_group, *inputs)``, no setup_context."""

    @staticmethod
    def forward(ctx, param_group, *inputs):  # type: ignore[no-untyped-def]
        ctx.param_group = param_group
        return inputs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[no-untyped-def]
        ctx.param_group.post_backward()
        return (None, *grads)


def test_fsdp_post_backward_replacement_keeps_torch_2_11s_old_style_function(monkeypatch):
    # On torch 2.11 the replacement defined setup_context over an old-style forward(ctx, ...):
    # every ZeRO-3 forward failed with "setup_context is not implemented" (seen on the GPU
    # machines' torch 2.11.0+cu130, dp2 ZeRO-3 of a tiny Llama; ZeRO-1 unaffected).
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    monkeypatch.setattr(_fsdp_param_group, "RegisterPostBackwardFunction", _OldStylePostBackward)
    ours = torch.nn.Linear(2, 2)
    _compat.unmaterialized_fsdp_post_backward(ours)
    installed = _fsdp_param_group.RegisterPostBackwardFunction
    assert installed is not _OldStylePostBackward and issubclass(installed, _OldStylePostBackward)

    calls: list[str] = []

    class _Group:
        modules = (ours,)

        def post_backward(self) -> None:
            calls.append("post_backward")

    used, unused = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    used_out, _ = installed.apply(_Group(), used * 1, unused * 1)
    (used_out * 3).sum().backward()
    assert torch.equal(used.grad, torch.full((2,), 3.0))
    assert unused.grad is None and calls == ["post_backward"]
