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
