"""Process groups over several mesh dims at once: data parallel over dp x ep.

Under expert parallelism the batch is split over dp x ep, and every non-expert gradient is
averaged over all of those ranks; a ``DeviceMesh`` has a process group per dim only. The
group over several dims is made once per mesh and dims with ``torch.distributed.new_group``
(every rank creates every group of the mesh, in the same order, as ``new_group`` requires)
and kept for the life of that mesh object in that process group world: ``DeviceMesh`` compares
by value, so an equal mesh of a later world (after ``destroy_process_group`` and a new
``init_process_group``) must not find the destroyed world's groups, and whether an equal older
mesh is still alive (a reference cycle awaiting the collector) may differ between ranks, which
must never decide whether a rank calls the collective ``new_group``.

Example::

    group, size, rank = mesh_dims_group(init_mesh(dp=2, ep=2), ("dp", "ep"))   # 4 ranks
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vescale.doptim.errors import DataParallelMeshError

__all__ = ["mesh_dim_names", "mesh_dims_group"]

# id(mesh) -> (the default process group the groups were made in, groups by dims); an entry
# leaves with its mesh.
_GROUPS: dict[int, tuple[Any, dict[tuple[str, ...], Any]]] = {}


def mesh_dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's dim names; data parallelism finds its dims by name, so a mesh needs them.

    Example::

        mesh_dim_names(init_mesh(dp=2, tp=2))   # ("dp", "tp")
    """
    if mesh.mesh_dim_names is None:
        raise DataParallelMeshError(
            f"the mesh {mesh} has no dim names; build it with init_mesh(dp=..., ...) so that data "
            "parallelism can find its dims"
        )
    return mesh.mesh_dim_names


def _flattened_rank(mesh: DeviceMesh, dims: Sequence[str]) -> int:
    rank = 0
    for dim in dims:
        rank = rank * mesh.size(mesh_dim_names(mesh).index(dim)) + mesh.get_local_rank(dim)
    return rank


def _groups_of(mesh: DeviceMesh) -> dict[tuple[str, ...], Any]:
    world = dist.group.WORLD
    entry = _GROUPS.get(id(mesh))
    if entry is None:
        weakref.finalize(mesh, _GROUPS.pop, id(mesh), None)
    elif entry[0] is world:
        return entry[1]
    groups: dict[tuple[str, ...], Any] = {}
    _GROUPS[id(mesh)] = (world, groups)
    return groups


def mesh_dims_group(mesh: DeviceMesh, dims: Sequence[str]) -> tuple[Any, int, int]:
    """``(process group, size, this rank's index in it)`` over the mesh dims ``dims`` (outer first).

    One dim is the mesh's own group; none is a group of one (``None`` group, size 1, rank 0).

    Example::

        group, size, rank = mesh_dims_group(mesh, ("dp", "ep"))
    """
    dims = tuple(dims)
    names = tuple(mesh.mesh_dim_names or ())
    if not dims:
        return None, 1, 0
    if len(dims) == 1:
        index = names.index(dims[0])
        return mesh.get_group(dims[0]), mesh.size(index), mesh.get_local_rank(dims[0])
    size = 1
    for dim in dims:
        size *= mesh.size(names.index(dim))
    cache = _groups_of(mesh)
    if dims not in cache:
        indices = [names.index(dim) for dim in dims]
        others = [index for index in range(mesh.ndim) if index not in indices]
        ranks = mesh.mesh.permute(*others, *indices).reshape(-1, size)
        mine = None
        # Every rank creates every group, in the same order (new_group is collective).
        for row in ranks.tolist():
            group = dist.new_group(row)
            if dist.get_rank() in row:
                mine = group
        cache[dims] = mine
    return cache[dims], size, _flattened_rank(mesh, dims)
