"""Named device meshes over the current process group.

A veScale mesh names its dimensions after the parallelism that uses them, outermost
first in the canonical order ``pp``, ``dp``, ``ep``, ``tp`` (pipeline stages are farthest
apart, tensor-parallel peers closest), whatever order the caller gives them in. Size-1
dimensions are kept, so that every parameter can live on the full named mesh.

The same dimensions over the same process group give the same mesh object: a second model
parallelized in the process (or the same model built again to load a checkpoint into another
layout) shares its mesh with the first, and with every DTensor spec that DTensor's sharding
cache kept from the first (FSDP2 takes exactly one mesh object for all parameters).

Example::

    mesh = init_mesh(tp=2, dp=2)      # 4 processes: mesh.mesh_dim_names == ("dp", "tp")
    tp_group = mesh["tp"].get_group()
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vescale.dtensor.errors import MeshError
from vescale.dtensor.gloo_exit import wait_for_gloo_workers_at_exit

__all__ = ["MESH_DIM_ORDER", "device_type_for_backend", "init_mesh"]

MESH_DIM_ORDER = ("pp", "dp", "ep", "tp")


def device_type_for_backend(backend: str) -> str:
    """The device type a process-group backend communicates on: ``"gloo"`` -> ``"cpu"``.

    A multi-device backend string such as ``"cpu:gloo,cuda:nccl"`` gives the accelerator
    when one is available, else ``"cpu"``.

    Example::

        device_type_for_backend(dist.get_backend())   # "cuda" under NCCL
    """
    devices_by_backend: dict[str, list[str]] = {}
    for device, device_backend in dist.Backend.default_device_backend_map.items():
        devices_by_backend.setdefault(device_backend, []).append(device)
    if ":" in backend:
        devices = [pair.split(":")[0] for pair in backend.split(",")]
    else:
        devices = devices_by_backend.get(backend.lower(), [])
    if not devices:
        raise MeshError(
            f"cannot tell which device the process-group backend {backend!r} uses; "
            "pass it explicitly, e.g. init_mesh(dp=2, tp=2, device_type='cuda')"
        )
    # Only this machine's accelerator: torch maps gloo to "mps" as well as "cpu", and a mesh on
    # "mps" fails inside torch on a CUDA machine (torch.mps has no is_initialized).
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if current is not None and current.type in devices:
        return current.type
    return "cpu" if "cpu" in devices else devices[0]


def _call_text(dims: dict[str, int]) -> str:
    return "init_mesh(" + ", ".join(f"{name}={size}" for name, size in dims.items()) + ")"


def init_mesh(*, device_type: str | None = None, **dims: int) -> DeviceMesh:
    """Build a named mesh over the default process group, e.g. ``init_mesh(pp=1, dp=2, tp=2)``.

    Dimensions are ordered ``pp``, ``dp``, ``ep``, ``tp`` (outermost first); their sizes must
    multiply to the world size. The device type comes from the process group's backend
    unless ``device_type`` is given.

    Example::

        mesh = init_mesh(dp=2, tp=2)
        weight = distribute_tensor(torch.randn(8, 8), mesh, [Replicate(), Shard(0)])
    """
    call = _call_text(dims)
    if not dims:
        raise MeshError(f"init_mesh() needs at least one dimension, e.g. init_mesh(dp={_world_size_or(1)})")
    unknown = [name for name in dims if name not in MESH_DIM_ORDER]
    if unknown:
        raise MeshError(
            f"{call}: unknown mesh dimension {unknown[0]!r}; use the names {', '.join(MESH_DIM_ORDER)}"
        )
    bad_sizes = [name for name, size in dims.items() if isinstance(size, bool) or not isinstance(size, int)]
    bad_sizes += [name for name, size in dims.items() if name not in bad_sizes and size < 1]
    if bad_sizes:
        raise MeshError(f"{call}: the size of {bad_sizes[0]!r} must be a positive integer")
    if not dist.is_initialized():
        raise MeshError(
            f"{call}: torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "first, or start the program with torchrun"
        )
    names = tuple(name for name in MESH_DIM_ORDER if name in dims)
    shape = tuple(dims[name] for name in names)
    product = 1
    for size in shape:
        product *= size
    world_size = dist.get_world_size()
    if product != world_size:
        raise MeshError(
            f"{call}: the dimensions {', '.join(names)} multiply to {product}, but the world has "
            f"{world_size} processes; choose sizes whose product is {world_size}"
        )
    resolved_device = device_type or device_type_for_backend(dist.get_backend())
    world_group = dist.group.WORLD
    # A default group destroyed and made again is another object: its meshes are made anew, and
    # those of groups gone are dropped (the entries hold their group weakly).
    for stale in [key for key, (group, _) in _MESHES.items() if group() is not world_group]:
        del _MESHES[stale]
    key = (resolved_device, names, shape)
    if key in _MESHES:
        return _MESHES[key][1]
    mesh = init_device_mesh(resolved_device, shape, mesh_dim_names=names)
    _MESHES[key] = (weakref.ref(world_group), mesh)
    if resolved_device == "cpu":
        wait_for_gloo_workers_at_exit()
    return mesh


# (device type, dim names, sizes) -> (the default group it was made over, weakly; the mesh).
_MESHES: dict[tuple[str, tuple[str, ...], tuple[int, ...]], tuple[weakref.ref[Any], DeviceMesh]] = {}


def _world_size_or(default: int) -> int:
    return dist.get_world_size() if dist.is_initialized() else default
