"""Fails loudly when PyTorch renames or removes a private API that vescale.dtensor relies on."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed.tensor._random as dtensor_random
import torch.nn.modules.module as module_module

from vescale.dtensor import _compat


def test_installed_torch_is_within_the_supported_range():
    assert _compat.torch_version() >= _compat.MIN_TORCH, torch.__version__


def test_global_module_hook_dicts_exist_as_ordered_dicts():
    for attribute in _compat.GLOBAL_MODULE_HOOK_DICTS:
        assert isinstance(getattr(module_module, attribute, None), OrderedDict), attribute


def test_clear_global_module_hooks_removes_hooks_registered_through_the_public_api():
    calls: list[str] = []
    forward = module_module.register_module_forward_hook(lambda *_: calls.append("forward"))
    pre = module_module.register_module_forward_pre_hook(lambda *_: calls.append("pre"))
    try:
        _compat.clear_global_module_hooks()
        torch.nn.Linear(2, 2)(torch.ones(2))
        assert calls == []
    finally:
        forward.remove()
        pre.remove()


def test_dtensor_rng_tracker_attribute_exists_and_resets():
    assert hasattr(dtensor_random, "_rng_tracker")
    saved = dtensor_random._rng_tracker
    dtensor_random._rng_tracker = object()
    try:
        _compat.reset_dtensor_rng_tracker()
        assert dtensor_random._rng_tracker is None
    finally:
        dtensor_random._rng_tracker = saved


def test_dtensor_op_dispatcher_extension_points_exist_with_their_types():
    assert isinstance(_compat.dtensor_custom_op_handlers(), dict)
    assert torch.ops.aten.argmax.default in _compat.dtensor_custom_op_handlers()
    assert isinstance(_compat.dtensor_random_ops(), set)
    assert torch.ops.aten.native_dropout.default in _compat.dtensor_random_ops()
    propagator = _compat.dtensor_sharding_propagator()
    assert torch.ops.aten.mm.default in propagator.op_strategy_funcs


def test_communication_accounting_accessors_exist():
    assert issubclass(_compat.torch_dispatch_mode_class(), object)
    assert _compat.current_autograd_node() is None  # outside backward
    for namespace in (
        _compat.FUNCTIONAL_COLLECTIVE_NAMESPACE,
        _compat.C10D_COLLECTIVE_NAMESPACE,
        _compat.DTENSOR_OP_NAMESPACE,
    ):
        assert hasattr(torch.ops, namespace), namespace
    assert hasattr(torch.ops._dtensor, "shard_dim_alltoall")
    assert callable(getattr(torch.distributed.distributed_c10d, "_resolve_process_group", None))


def test_shard_to_new_shard_dim_has_the_signature_redistribute_replaces():
    import vescale.dtensor.shard_alltoall  # noqa: F401  (installs the replacement)

    original = _compat.original_shard_to_new_shard_dim()
    code = original.__code__
    assert code.co_varnames[: code.co_argcount] == _compat.SHARD_TO_NEW_SHARD_DIM_PARAMETERS
    assert original.__module__ == "torch.distributed.tensor.placement_types"
    assert _compat.local_tensor_mode_active() is False


# --- deferred initialisation --------------------------------------------------------------


def test_deferred_init_private_apis_exist_and_behave():
    fake_mode = _compat.fake_tensor_mode_class()(allow_non_fake_inputs=True)
    with fake_mode:
        fake = torch.empty(3, 4)
        view = fake[1]
        assert isinstance(fake, _compat.fake_tensor_class())
        assert not fake.is_meta and fake.untyped_storage().device.type == "meta"
        with _compat.disable_dispatch_modes():
            assert not isinstance(torch.empty(1), _compat.fake_tensor_class())
        assert _compat.storage_key(view) == _compat.storage_key(fake)
        assert _compat.storage_key(torch.empty(1)) != _compat.storage_key(fake)
        for error in _compat.fake_tensor_data_dependent_errors():
            assert issubclass(error, Exception)
    written = [
        argument.name
        for argument in _compat.op_schema(torch.ops.aten.normal_.default).arguments
        if argument.alias_info is not None and argument.alias_info.is_write
    ]
    assert written == ["self"]


def test_dtensor_op_strategy_can_be_read_and_replaced():
    view = torch.ops.aten.view.default
    registered = _compat.dtensor_op_strategy(view)
    assert callable(registered)
    assert _compat.dtensor_sharding_propagator().op_strategy_funcs[view] is registered

    def replacement(op_schema):
        return registered(op_schema)

    try:
        _compat.set_dtensor_op_strategy(view, replacement)
        assert _compat.dtensor_op_strategy(view) is replacement
    finally:
        _compat.set_dtensor_op_strategy(view, registered)


# --- DTensor's op dispatcher: its handler table, scalar-shape adjusters and caches ---------


def handler_table_subclass_is_read_by_dispatch_on_ranks() -> list[str]:
    """DTensor's C++ dispatch finds a handler in a dict subclass put in place of its table."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    original = _compat.dtensor_custom_op_handlers()
    calls: list[str] = []

    class Table(dict):
        pass

    def neg_handler(op_call, args, kwargs):
        calls.append(str(op_call))
        return args[0]

    table = Table(original)
    table[torch.ops.aten.neg.default] = neg_handler
    try:
        _compat.set_dtensor_custom_op_handlers(table)
        assert _compat.dtensor_custom_op_handlers() is table
        assert torch.neg(x) is x
    finally:
        _compat.set_dtensor_custom_op_handlers(original)
    return calls


def test_dtensor_handler_table_can_be_replaced_by_a_dict_subclass():
    # Imported here: this file's section above is shared and only appended to.
    import pytest

    from vescale.dtensor.testing import run_on_ranks

    assert run_on_ranks(handler_table_subclass_is_read_by_dispatch_on_ranks, 1) == [["aten.neg.default"]]
    with pytest.raises(_compat.PrivateTorchAPIError, match="must be a dict"):
        _compat.set_dtensor_custom_op_handlers([])


def test_dtensor_scalar_shape_adjusters_and_sharding_caches_exist():
    adjusters = _compat.dtensor_scalar_shape_adjusters()
    assert isinstance(adjusters, dict)
    if _compat.torch_version() >= (2, 13):
        assert torch.ops.aten.native_group_norm.default in adjusters  # PyTorch's own use of the table
    else:
        # torch 2.11 has no such table: _compat adds it, and applies it, to the propagator.
        propagate = _compat.dtensor_sharding_propagator().propagate_op_sharding_non_cached
        assert propagate.__name__ == "propagate_with_adjusters"
    propagate = _compat.dtensor_sharding_propagator().propagate_op_sharding
    _compat.clear_dtensor_sharding_caches()
    assert propagate.cache_info().currsize == 0


def test_dtensor_strategy_types_exist():
    for name in _compat.STRATEGY_TYPE_NAMES:
        assert isinstance(_compat.dtensor_strategy_type(name), type), name
    op_spec = _compat.dtensor_strategy_type("op_spec")(None, None, [[0.0]])
    assert _compat.dtensor_strategy_type("op_strategy")([op_spec]).strategies == [op_spec]


# --- torch 2.11: what _compat adds where torch 2.11's DTensor lacks it ---------------------


def test_strided_shard_redistribution_falls_back_to_greedy_on_torch_2_11_only():
    import importlib
    import inspect

    redistribute_module = importlib.import_module("torch.distributed.tensor._redistribute")
    _compat.install_strided_shard_greedy_redistribution()
    plan = redistribute_module._gen_transform_infos_non_cached
    if _compat.torch_version() >= (2, 13):
        assert not getattr(plan, "vescale_greedy_fallback", False)
        return
    assert plan.vescale_greedy_fallback
    assert redistribute_module._gen_transform_infos.__wrapped__  # the cached planner calls it by name
    spec_source = inspect.getsource(importlib.import_module("torch.distributed.tensor._dtensor_spec"))
    assert _compat.STRIDED_SHARD_UNDECODABLE_ERROR in spec_source


def test_moves_torch_2_11_cannot_make_in_one_step_go_through_replicate():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from vescale.dtensor._placement_moves import through_replicate

    transform_info = importlib_attribute("torch.distributed.tensor._redistribute", "_TransformInfo")
    strided = _compat.strided_shard_type()(0, split_factor=3)
    steps = [
        transform_info(mesh_dim=0, src_dst_placements=(strided, Shard(0)), logical_shape=[6, 2]),
        transform_info(mesh_dim=1, src_dst_placements=(Partial(), strided), logical_shape=[6, 2]),
        transform_info(mesh_dim=0, src_dst_placements=(Replicate(), strided), logical_shape=[6, 2]),
        transform_info(mesh_dim=0, src_dst_placements=(Shard(1), Shard(0)), logical_shape=[6, 2]),
    ]
    planned = through_replicate(steps, _compat.strided_shard_type())
    moves = [(step.mesh_dim, *step.src_dst_placements) for step in planned]
    assert moves == [
        (0, strided, Replicate()),
        (0, Replicate(), Shard(0)),
        (1, Partial(), Replicate()),
        (1, Replicate(), strided),
        (0, Replicate(), strided),
        (0, Shard(1), Shard(0)),
    ]


def importlib_attribute(module_name: str, attribute: str):
    import importlib

    return getattr(importlib.import_module(module_name), attribute)


def test_dispatcher_runs_rewritten_ops_and_detach_has_a_strategy_on_every_torch():
    import vescale.dtensor.ops  # noqa: F401  (registers the strategies torch 2.11 lacks)

    local_results = _compat._op_dispatcher()._dispatch_get_local_results_slow_path
    assert getattr(local_results, "vescale_runs_rewritten_ops", False) == (_compat.torch_version() < (2, 13))
    strategies = _compat.dtensor_strategy_registries()["op_strategy_funcs"]
    assert torch.ops.aten.detach_.default in strategies
    _compat.register_dtensor_op_strategy_like(torch.ops.aten.detach_.default, torch.ops.aten.detach.default)
    assert strategies[torch.ops.aten.detach_.default] is strategies[torch.ops.aten.detach.default]


def test_active_torch_function_modes_lists_the_modes_entered_on_this_thread():
    from torch.overrides import TorchFunctionMode

    class Marker(TorchFunctionMode):
        pass

    assert not any(isinstance(mode, Marker) for mode in _compat.active_torch_function_modes())
    with Marker() as marker:
        assert _compat.active_torch_function_modes()[-1] is marker
    assert marker not in _compat.active_torch_function_modes()


def test_custom_function_backward_node_class_runs_the_backward_through_apply():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x * 2

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return grad * 2

    node_class = _compat.custom_function_backward_class()
    node = Double.apply(torch.ones(2, requires_grad=True)).grad_fn
    assert isinstance(node, node_class) and callable(node_class.__dict__["apply"])
    assert node._forward_cls is Double
    assert torch.equal(node_class.__dict__["apply"](node, torch.ones(2)), torch.full((2,), 2.0))


def test_torch_function_mode_pop_and_push_round_trip():
    class Marker(torch.overrides.TorchFunctionMode):
        pass

    with Marker() as marker:
        assert _compat.active_torch_function_modes()[-1] is marker
        popped = _compat.pop_torch_function_mode()
        assert popped is marker
        assert marker not in _compat.active_torch_function_modes()
        _compat.push_torch_function_mode(popped)
        assert _compat.active_torch_function_modes()[-1] is marker
    assert marker not in _compat.active_torch_function_modes()


def test_dispatch_mode_activity_is_visible():
    assert not _compat.dispatch_mode_active()
    with _compat.torch_dispatch_mode_class()():
        assert _compat.dispatch_mode_active()
    assert not _compat.dispatch_mode_active()


def test_module_call_hooks_lists_module_and_global_hooks():
    module = torch.nn.Linear(2, 2)

    def forward_hook(*_: object) -> None:
        return None

    def global_hook(*_: object) -> None:
        return None

    handle = module.register_forward_hook(forward_hook)
    global_handle = module_module.register_module_forward_pre_hook(global_hook)
    try:
        assert {forward_hook, global_hook} <= set(_compat.module_call_hooks(module))
    finally:
        handle.remove()
        global_handle.remove()
    assert forward_hook not in _compat.module_call_hooks(module)
