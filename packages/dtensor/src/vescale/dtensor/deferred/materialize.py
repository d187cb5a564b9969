"""Materialise deferred parameters and buffers: each rank allocates only its own shards.

Every rank replays, one tensor at a time, the ops that build that tensor (the same ops
eager construction ran, random draws from their recorded generator states), cuts its local
shard out without communication, and frees the full tensor before the next one. So the
values are bitwise those of eager single-device construction, and the peak beyond the
shards is one full tensor (plus the few small ones it is computed from).

Example::

    mesh = init_device_mesh("cpu", (4,))
    materialize_module(model, {"lm_head.weight": (mesh, [Shard(0)])})  # others: plain tensors
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial

from vescale.dtensor.deferred.construct import module_tensors
from vescale.dtensor.deferred.conversion import drop_deferred_conversions
from vescale.dtensor.deferred.errors import DeferredInitError, DeferredPlacementError, NotDeferredError
from vescale.dtensor.deferred.record import deferred_handle, is_deferred
from vescale.dtensor.deferred.replay import release_freed_memory, replay_tensor
from vescale.dtensor.placements import (
    AnyPlacement,
    InterleavedShard,
    PlacementError,
    distribute_tensor,
    from_local_like,
    to_torch_placements,
    to_vescale_placements,
)

__all__ = ["PlacementSpec", "check_unchanged_since_construction", "materialize_module", "materialize_tensor"]

# Where a tensor goes: a mesh and one placement per mesh dim, or None for a plain local tensor.
PlacementSpec = tuple[DeviceMesh, Sequence[AnyPlacement]] | None


def _check_placements(fqn: str, shape: tuple[int, ...], mesh: DeviceMesh, placements: Sequence[Any]) -> None:
    where = f"{fqn} (shape {shape}, mesh {tuple(mesh.shape)})"
    if len(placements) != mesh.ndim:
        raise DeferredPlacementError(
            f"{where}: {len(placements)} placements for a {mesh.ndim}-dim mesh; give one per mesh dim"
        )
    try:
        vescale_placements = to_vescale_placements(to_torch_placements(placements))
    except PlacementError as error:
        raise DeferredPlacementError(f"{where}: {error}") from error
    for placement in vescale_placements:
        if isinstance(placement, Partial):
            raise DeferredPlacementError(
                f"{where}: {placement} cannot be materialised (a partial sum has no initial value); "
                "use Replicate() and redistribute later"
            )
        dim = getattr(placement, "dim", None)
        if dim is not None and not -len(shape) <= dim < len(shape):
            raise DeferredPlacementError(
                f"{where}: {placement} names tensor dim {dim}, but the tensor has {len(shape)} dims; "
                f"use a dim in [{-len(shape)}, {len(shape) - 1}]"
            )
        if isinstance(placement, InterleavedShard):
            try:
                placement.check_shape(shape)
            except PlacementError as error:
                raise DeferredPlacementError(f"{where}: {error}") from error


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def check_unchanged_since_construction(tensor: torch.Tensor, fqn: str) -> None:
    """Raise :class:`DeferredInitError` where the deferred parameter ``tensor`` was changed after
    ``deferred_init`` returned: in place (an ``nn.init`` call or a ``copy_``), or replaced through
    ``.data`` by a tensor of another shape or dtype (``resize_token_embeddings`` does this). The
    record holds only the constructor's ops, so materialising would silently drop the change.
    Buffers are not checked: a forward updates some in place (BatchNorm's statistics, in the
    planner's trace), and their constructed values are the ones to materialise.

    Example::

        check_unchanged_since_construction(model.lm_head.weight, "lm_head.weight")
    """
    handle = deferred_handle(tensor, fqn)
    if not isinstance(tensor, nn.Parameter):
        return
    recorded = (handle.ref.size, handle.dtype or handle.ref.dtype)
    now = (tuple(tensor.shape), tensor.dtype)
    if now != recorded:
        change = (
            f"replaced through .data (as resize_token_embeddings does) by a {now[1]} tensor of "
            f"shape {now[0]}, where it was built as {recorded[1]}"
        )
    elif tensor._version != handle.version:
        change = "changed in place (an nn.init call, a fill_ or copy_ on it, load_state_dict)"
    else:
        return
    raise DeferredInitError(
        f"{fqn} (shape {recorded[0]}) was {change} after deferred_init returned, which a deferred "
        "parameter cannot record: the change would be lost. Make it part of construction, "
        "deferred_init(lambda: initialise(Model(config))), or change the parameter after "
        "vescale.parallelize (or materialize_module); load pretrained weights after "
        "vescale.parallelize with vescale.dcheckpoint.load_hf(model, directory)"
    )


def materialize_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[AnyPlacement] | None = None,
    *,
    fqn: str = "tensor",
) -> torch.Tensor:
    """The real value of a deferred tensor: a plain tensor, or this rank's shard as a DTensor.

    Example::

        weight = materialize_tensor(model.lm_head.weight, mesh, [Shard(0)], fqn="lm_head.weight")
        bias = materialize_tensor(model.lm_head.bias)   # a plain CPU tensor
    """
    handle = deferred_handle(tensor, fqn)
    check_unchanged_since_construction(tensor, fqn)
    mesh_placements: Sequence[AnyPlacement] = placements or ()
    if device_mesh is not None:
        # Checked before the replay, so a bad plan fails before any work.
        _check_placements(fqn, handle.ref.size, device_mesh, mesh_placements)
    full = replay_tensor(handle.record, handle.ref, handle.position)
    if handle.dtype is not None and full.dtype != handle.dtype:
        full = full.to(handle.dtype)  # the module was converted after construction
    if device_mesh is None:
        if handle.device is not None and full.device != handle.device:
            full = full.to(handle.device)
        return full if _owns_its_storage(full) else full.clone()
    sharded = distribute_tensor(full, device_mesh, mesh_placements, src_data_rank=None)
    local = sharded.to_local()
    # A shard that views the full tensor would keep all of it alive.
    local = local if _owns_its_storage(local) else local.clone()
    if device_mesh.device_type != "cpu":
        local = local.to(device_mesh.device_type)
    return from_local_like(local, sharded)


def _placement_spec(
    placements_for: Mapping[str, PlacementSpec] | Callable[[str], PlacementSpec] | None, fqn: str
) -> PlacementSpec:
    if placements_for is None:
        return None
    if callable(placements_for):
        return placements_for(fqn)
    return placements_for.get(fqn)


def materialize_module(
    module: nn.Module,
    placements_for: Mapping[str, PlacementSpec] | Callable[[str], PlacementSpec] | None = None,
) -> nn.Module:
    """Materialise every deferred parameter, buffer and tensor attribute of ``module`` in place.

    ``placements_for`` maps an FQN (``"model.layers.0.mlp.up_proj.weight"``) to
    ``(device_mesh, placements)`` for a DTensor holding this rank's shard, or to ``None``
    (the default for FQNs it lacks) for a plain full tensor. Tied tensors stay tied and
    must get the same placements under every FQN.

    Example::

        model = deferred_init(LlamaForCausalLM, config)
        materialize_module(model, lambda fqn: (mesh, [Shard(0)]) if fqn.endswith("proj.weight") else None)
    """
    by_tensor: dict[int, list[tuple[str, nn.Module, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for fqn, owner, attribute, tensor in module_tensors(module):
        if is_deferred(tensor):
            # Every tensor is checked before any is materialised: an error leaves the module as it was.
            check_unchanged_since_construction(tensor, fqn)
            by_tensor.setdefault(id(tensor), []).append((fqn, owner, attribute))
            tensors[id(tensor)] = tensor
    if not tensors:
        raise NotDeferredError(
            f"{type(module).__name__} has no deferred parameter or buffer; build it with "
            f"vescale.dmodule.deferred_init({type(module).__name__}, ...) before materialising"
        )
    for key, owners in by_tensor.items():
        specs = [(fqn, _placement_spec(placements_for, fqn)) for fqn, _, _ in owners]
        fqn, spec = specs[0]
        for tied_fqn, tied_spec in specs[1:]:
            if tied_spec != spec:
                raise DeferredPlacementError(
                    f"{tied_fqn} is tied to {fqn} but gets placements {tied_spec} instead of {spec}; "
                    "give tied tensors the same placements"
                )
        deferred = tensors.pop(key)
        real = materialize_tensor(deferred, *(spec or (None, None)), fqn=fqn)
        if isinstance(deferred, nn.Parameter):
            real = nn.Parameter(real, requires_grad=deferred.requires_grad)
        for _, owner, attribute in owners:
            if attribute in owner._parameters:
                # A registered parameter was an nn.Parameter when deferred, so ``real`` is one too.
                owner._parameters[attribute] = cast(nn.Parameter, real)
            elif attribute in owner._buffers:
                owner._buffers[attribute] = real
            else:
                setattr(owner, attribute, real)
        del deferred, real
        release_freed_memory()
    drop_deferred_conversions(module)
    return module
