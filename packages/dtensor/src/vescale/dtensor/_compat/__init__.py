"""The private PyTorch APIs that ``vescale.dtensor`` relies on, confined to this package.

PyTorch offers no public way to drop every global module hook or to forget DTensor's
random-number tracker, both of which the test harness must do between tests. Each access
below names the private attribute it reads, and ``tests/test_dtensor_compat.py`` fails
loudly when a PyTorch release renames or removes one.

The package re-exports every name of its modules, one topic each:

* :mod:`.core`: the supported torch range (``MIN_TORCH``, ``TESTED_TORCH``), the one error
  type (``PrivateTorchAPIError``, ``unsupported_torch``) and the private-attribute readers.
* :mod:`.global_state`: global module hooks, a module's call hooks, DTensor's RNG tracker.
* :mod:`.dispatcher`: DTensor's op dispatcher and sharding propagator, implicit replication,
  the torch-function mode stack, end-of-backward callbacks.
* :mod:`.dispatch_modes`: the TorchDispatchMode base, collectives' namespaces and process
  groups, the running autograd node, fake tensors, op schemas and storage identities.
* :mod:`.placements`: ``_StridedShard``, ``Shard._to_new_shard_dim``, LocalTensorMode.
* :mod:`.patches`: the wrappers installed into DTensor's redistribution planner, strategy
  selection and propagation (installed in part when this package is imported).
* :mod:`.strategy_expansion`: strategies expanded over the mesh dims that can hold a choice.

Example::

    from vescale.dtensor import _compat
    _compat.clear_global_module_hooks()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vescale.dtensor._compat.core import (
    MIN_TORCH,
    TESTED_TORCH,
    PrivateTorchAPIError,
    torch_version,
    unsupported_torch,
)
from vescale.dtensor._compat.dispatch_modes import (
    C10D_COLLECTIVE_NAMESPACE,
    DTENSOR_OP_NAMESPACE,
    FUNCTIONAL_COLLECTIVE_NAMESPACE,
    current_autograd_node,
    custom_function_backward_class,
    disable_dispatch_modes,
    dispatch_mode_active,
    fake_tensor_class,
    fake_tensor_data_dependent_errors,
    fake_tensor_mode_class,
    op_schema,
    resolve_process_group,
    storage_key,
    torch_dispatch_mode_class,
)
from vescale.dtensor._compat.dispatcher import (
    STRATEGY_TYPE_NAMES,
    active_torch_function_modes,
    clear_dtensor_sharding_caches,
    dtensor_custom_op_handlers,
    dtensor_implicit_replication_enabled,
    dtensor_op_strategy,
    dtensor_random_ops,
    dtensor_scalar_shape_adjusters,
    dtensor_sharding_propagator,
    dtensor_strategy_registries,
    dtensor_strategy_type,
    pop_torch_function_mode,
    push_torch_function_mode,
    queue_autograd_engine_callback,
    set_dtensor_custom_op_handlers,
    set_dtensor_implicit_replication,
    set_dtensor_op_strategy,
)
from vescale.dtensor._compat.dispatcher import _op_dispatcher as _op_dispatcher  # for the tests
from vescale.dtensor._compat.global_state import (
    GLOBAL_CALL_HOOK_DICTS,
    GLOBAL_MODULE_HOOK_DICTS,
    MODULE_HOOK_DICTS,
    clear_global_module_hooks,
    dtensor_rng_tracker,
    global_call_hook_count,
    global_call_hooks,
    module_call_hook_count,
    module_call_hooks,
    reset_dtensor_rng_tracker,
    set_dtensor_rng_tracker,
)
from vescale.dtensor._compat.patches import (
    BATCH_MESH_DIMS,
    STRIDED_SHARD_UNDECODABLE_ERROR,
    install_batch_dims_strategy_guard,
    install_replicate_dims_guard,
    install_strided_shard_greedy_redistribution,
    register_dtensor_op_strategy_like,
)
from vescale.dtensor._compat.placements import (
    SHARD_TO_NEW_SHARD_DIM_PARAMETERS,
    local_tensor_mode_active,
    original_shard_to_new_shard_dim,
    set_shard_to_new_shard_dim,
    strided_shard_type,
)
from vescale.dtensor._compat.strategy_expansion import (
    batch_dims_expansion_disabled,
    install_batch_dims_expansion,
)

if TYPE_CHECKING:
    # For the type checker only (vescale's dispatch modes and placement code annotate with them).
    from vescale.dtensor._compat.dispatch_modes import TorchDispatchMode as TorchDispatchMode
    from vescale.dtensor._compat.placements import StridedShard as StridedShard

__all__ = [
    "BATCH_MESH_DIMS",
    "C10D_COLLECTIVE_NAMESPACE",
    "DTENSOR_OP_NAMESPACE",
    "FUNCTIONAL_COLLECTIVE_NAMESPACE",
    "GLOBAL_CALL_HOOK_DICTS",
    "GLOBAL_MODULE_HOOK_DICTS",
    "MIN_TORCH",
    "MODULE_HOOK_DICTS",
    "SHARD_TO_NEW_SHARD_DIM_PARAMETERS",
    "STRATEGY_TYPE_NAMES",
    "STRIDED_SHARD_UNDECODABLE_ERROR",
    "TESTED_TORCH",
    "PrivateTorchAPIError",
    "active_torch_function_modes",
    "batch_dims_expansion_disabled",
    "clear_dtensor_sharding_caches",
    "clear_global_module_hooks",
    "current_autograd_node",
    "custom_function_backward_class",
    "disable_dispatch_modes",
    "dispatch_mode_active",
    "dtensor_custom_op_handlers",
    "dtensor_implicit_replication_enabled",
    "dtensor_op_strategy",
    "dtensor_random_ops",
    "dtensor_rng_tracker",
    "dtensor_scalar_shape_adjusters",
    "dtensor_sharding_propagator",
    "dtensor_strategy_registries",
    "dtensor_strategy_type",
    "fake_tensor_class",
    "fake_tensor_data_dependent_errors",
    "fake_tensor_mode_class",
    "global_call_hook_count",
    "global_call_hooks",
    "install_batch_dims_expansion",
    "install_batch_dims_strategy_guard",
    "install_replicate_dims_guard",
    "install_strided_shard_greedy_redistribution",
    "local_tensor_mode_active",
    "module_call_hook_count",
    "module_call_hooks",
    "op_schema",
    "original_shard_to_new_shard_dim",
    "pop_torch_function_mode",
    "push_torch_function_mode",
    "queue_autograd_engine_callback",
    "register_dtensor_op_strategy_like",
    "reset_dtensor_rng_tracker",
    "resolve_process_group",
    "set_dtensor_custom_op_handlers",
    "set_dtensor_implicit_replication",
    "set_dtensor_op_strategy",
    "set_dtensor_rng_tracker",
    "set_shard_to_new_shard_dim",
    "storage_key",
    "strided_shard_type",
    "torch_dispatch_mode_class",
    "torch_version",
    "unsupported_torch",
]
