"""Shard(i) -> Shard(j) through one all-to-all on CPU meshes (gloo), as on NCCL.

Stock DTensor on a CPU mesh turns ``Shard(i) -> Shard(j)`` into an all-gather of the whole
tensor followed by a local chunk: each rank receives (n-1)/n of the *global* tensor where
an all-to-all receives (n-1)/n of its *local* shard, n times less. gloo implements
``all_to_all_single`` with uneven splits, so this module sends every rank exactly its
``torch.chunk`` piece: no padding, uneven sizes (and ranks holding nothing) included.

:func:`install_shard_alltoall` replaces ``Shard._to_new_shard_dim``, the one step DTensor's
redistribution calls for this transition, both in ``.redistribute()`` and in the
redistributions that sharding propagation inserts before an op. Backward of a
redistribution is the reverse redistribution, so gradients go through the reverse
all-to-all. Non-CPU meshes keep PyTorch's own path. It is installed when this module is
imported; installing again changes nothing.

Example::

    import vescale.dtensor.shard_alltoall  # installs the all-to-all path
    x = distribute_tensor(torch.randn(6, 10), mesh, [Shard(0)])
    y = x.redistribute(mesh, [Shard(1)])   # one all_to_all, no all_gather
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from vescale.dtensor import _compat

__all__ = ["chunk_sizes", "install_shard_alltoall", "shard_dim_alltoall"]


def chunk_sizes(size: int, num_chunks: int) -> list[int]:
    """The sizes ``torch.chunk`` cuts ``size`` into, padded with zeros to ``num_chunks`` entries.

    Example::

        chunk_sizes(5, 4)   # [2, 2, 1, 0]
        chunk_sizes(3, 4)   # [1, 1, 1, 0]
    """
    chunk = -(-size // num_chunks)
    return [max(0, min(chunk, size - index * chunk)) for index in range(num_chunks)]


def shard_dim_alltoall(
    local_tensor: torch.Tensor,
    mesh: DeviceMesh,
    mesh_dim: int,
    logical_shape: Sequence[int],
    old_dim: int,
    new_dim: int,
) -> torch.Tensor:
    """This rank's ``Shard(new_dim)`` piece of a tensor now sharded ``Shard(old_dim)`` on ``mesh_dim``.

    ``logical_shape`` is the shape being sharded over ``mesh_dim`` (the global shape, less
    what other mesh dims already cut). Every rank cuts its shard along ``new_dim`` like
    ``torch.chunk`` and sends piece k to rank k; the pieces received are concatenated
    along ``old_dim`` in rank order.

    Example::

        local = shard_dim_alltoall(x.to_local(), mesh, 0, x.shape, old_dim=0, new_dim=1)
        torch.equal(local, x.full_tensor().chunk(mesh.size(), 1)[mesh.get_local_rank()])
    """
    num_ranks = mesh.size(mesh_dim)
    my_rank = mesh.get_local_rank(mesh_dim)
    old_sizes = chunk_sizes(logical_shape[old_dim], num_ranks)
    new_sizes = chunk_sizes(logical_shape[new_dim], num_ranks)

    # torch leaves Tensor.split unannotated.
    pieces_to_send = local_tensor.split(new_sizes, dim=new_dim)  # type: ignore[no-untyped-call]
    send_buffer = torch.cat([piece.reshape(-1) for piece in pieces_to_send])
    # What rank k sends me: its old_dim shard, cut to my new_dim piece.
    received_shapes = []
    for source in range(num_ranks):
        shape = list(local_tensor.shape)
        shape[old_dim], shape[new_dim] = old_sizes[source], new_sizes[my_rank]
        received_shapes.append(shape)
    receive_splits = [int(torch.Size(shape).numel()) for shape in received_shapes]
    receive_buffer = send_buffer.new_empty(sum(receive_splits))
    dist.all_to_all_single(
        receive_buffer,
        send_buffer,
        output_split_sizes=receive_splits,
        input_split_sizes=[piece.numel() for piece in pieces_to_send],
        group=mesh.get_group(mesh_dim),
    )
    received = [
        piece.view(shape)
        for piece, shape in zip(
            receive_buffer.split(receive_splits),  # type: ignore[no-untyped-call]  # as above
            received_shapes,
            strict=True,
        )
    ]
    return torch.cat(received, dim=old_dim)


def _to_new_shard_dim_alltoall(
    self: Shard,
    local_tensor: torch.Tensor,
    mesh: DeviceMesh,
    mesh_dim: int,
    current_logical_shape: Sequence[int],
    new_shard_dim: int,
) -> torch.Tensor:
    """``Shard._to_new_shard_dim`` with the all-to-all on CPU meshes; PyTorch's own elsewhere."""
    if mesh.device_type != "cpu" or _compat.local_tensor_mode_active():
        original: torch.Tensor = _compat.original_shard_to_new_shard_dim()(
            self, local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim
        )
        return original
    if mesh.get_coordinate() is None:
        return local_tensor  # not a member of this mesh: it holds an empty tensor, as in PyTorch
    ndim = len(current_logical_shape)
    return shard_dim_alltoall(
        local_tensor, mesh, mesh_dim, current_logical_shape, self.dim % ndim, new_shard_dim % ndim
    )


def install_shard_alltoall() -> None:
    """Make DTensor's ``Shard(i) -> Shard(j)`` use one all-to-all on CPU meshes (idempotent).

    Example::

        install_shard_alltoall()
        install_shard_alltoall()   # no effect the second time
        y = x.redistribute(mesh, [Shard(1)])
    """
    _compat.set_shard_to_new_shard_dim(_to_new_shard_dim_alltoall)


install_shard_alltoall()
