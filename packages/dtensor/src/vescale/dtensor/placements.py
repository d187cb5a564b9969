"""veScale's placements: ``InterleavedShard`` for fused weights, and the short string form of
every placement (``"R"``, ``"P"``, ``"S(0)"``, ``"IS(0,3)"``) that JSON sharding plans use.

A fused weight is ``interleaved_size`` equal parts along one dim (GPT-2's ``c_attn``:
q|k|v; Mixtral's ``experts.gate_up_proj``: gate|up). ``InterleavedShard(dim, k)`` gives
rank ``r`` its slice of every part: ``q_r|k_r|v_r``, each slice cut the way ``torch.chunk``
cuts the part over the mesh dim, so part sizes need not divide by the mesh size.

Design. DTensor accepts only PyTorch's own placement types (a Python ``Placement`` subclass
is rejected, a ``Shard`` subclass is silently stored as ``Shard``), so ``InterleavedShard``
is a plain frozen dataclass that converts to PyTorch's private ``_StridedShard(dim,
split_factor=k)``: on one mesh dim its layout (cut into ``k`` parts with ``torch.chunk``,
then ``torch.chunk`` each part over the mesh dim) is exactly this one, uneven sizes included,
and DTensor's redistribution, view and matmul rules already handle it. What PyTorch gets
wrong is patched here and in :mod:`vescale.dtensor._interleaved_ops`:

* ``distribute_tensor`` asserts on uneven sizes: for those this module broadcasts the full
  tensor and cuts the local shard out locally (one broadcast instead of one scatter);
* ``split``/``chunk`` into the parts all-gathered the tensor: they now cut the local shard
  and return ``Shard(dim)`` parts, and ``cat`` of such parts (the backward of ``split``)
  gives the interleaved tensor back, both without communication. These are sharding
  strategies (DTensor's cached fast path stays in use for every other split/cat), installed
  when the first ``InterleavedShard`` is turned into a DTensor placement.

A DTensor therefore shows ``_StridedShard`` in ``.placements``; :func:`to_vescale_placements`
(and :func:`placement_to_string`) read it back as ``InterleavedShard``.

Example::

    weight = distribute_tensor(c_attn_weight, mesh, [InterleavedShard(0, 3)])  # q_r|k_r|v_r
    q, k, v = weight.split(hidden_size, dim=0)  # each Shard(0), no communication
    placement_from_string("IS(0,3)") == InterleavedShard(0, 3)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from vescale.dtensor import _compat
from vescale.dtensor._interleaved_ops import register_interleaved_ops
from vescale.dtensor.errors import DTensorError

__all__ = [
    "AnyPlacement",
    "InterleavedShard",
    "PlacementError",
    "distribute_tensor",
    "from_local",
    "from_local_like",
    "placement_from_string",
    "placement_to_string",
    "redistribute",
    "to_torch_placements",
    "to_vescale_placements",
]


class PlacementError(DTensorError, ValueError):
    """A placement cannot be parsed, or cannot lay out a tensor of the given shape."""


@dataclass(frozen=True)
class InterleavedShard:
    """Shard each of ``interleaved_size`` equal parts of tensor dim ``dim`` over a mesh dim.

    Example::

        placement = InterleavedShard(dim=0, interleaved_size=3)  # q|k|v fused on dim 0
        placement.split_tensor(torch.arange(6), num_chunks=2)    # [tensor([0, 2, 4]), tensor([1, 3, 5])]
        str(placement)                                           # "IS(0,3)"
    """

    dim: int
    interleaved_size: int

    def __post_init__(self) -> None:
        for name in ("dim", "interleaved_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise PlacementError(f"InterleavedShard {name} must be an int, got {value!r}")
        if self.interleaved_size < 1:
            raise PlacementError(
                f"InterleavedShard(dim={self.dim}, interleaved_size={self.interleaved_size}): "
                "interleaved_size is the number of fused parts and must be at least 1 (e.g. 3 for q|k|v)"
            )

    def __str__(self) -> str:
        return f"IS({self.dim},{self.interleaved_size})"

    def to_torch(self) -> Placement:
        """The PyTorch placement a DTensor stores this one as (``Shard`` when there is one part)."""
        if self.interleaved_size == 1:
            return Shard(self.dim)
        # The part-wise split/cat strategies are installed once a model uses interleaved
        # sharding, so that without it a cat along a Shard dim gathers as in PyTorch.
        register_interleaved_ops()
        return _compat.strided_shard_type()(self.dim, split_factor=self.interleaved_size)

    def check_shape(self, shape: Sequence[int]) -> int:
        """Return the normalised tensor dim, or raise if ``shape`` cannot be interleaved-sharded."""
        if not -len(shape) <= self.dim < len(shape):
            raise PlacementError(
                f"{self!r} names tensor dim {self.dim}, but the tensor has shape {tuple(shape)} "
                f"({len(shape)} dims); use a dim in [{-len(shape)}, {len(shape) - 1}]"
            )
        dim = self.dim % len(shape)
        if shape[dim] % self.interleaved_size:
            raise PlacementError(
                f"{self!r} cannot shard tensor dim {dim} of size {shape[dim]} (shape {tuple(shape)}): "
                f"{shape[dim]} is not divisible by interleaved_size {self.interleaved_size}. Set "
                "interleaved_size to the number of equal fused parts along that dim (e.g. 3 for q|k|v), "
                f"or use Shard({dim}) for a tensor that is not fused."
            )
        return dim

    def split_tensor(self, tensor: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
        """The local shard of each of ``num_chunks`` ranks: every part cut like ``torch.chunk``."""
        dim = self.check_shape(tensor.shape)
        parts_by_rank = []
        for part in tensor.chunk(self.interleaved_size, dim):
            chunks = list(part.chunk(num_chunks, dim))
            # torch.chunk returns fewer chunks when they cannot all be non-empty; those ranks hold nothing.
            chunks += [part.narrow(dim, 0, 0)] * (num_chunks - len(chunks))
            parts_by_rank.append(chunks)
        local_shards = [
            torch.cat([chunks[index] for chunks in parts_by_rank], dim) for index in range(num_chunks)
        ]
        return local_shards


AnyPlacement = Placement | InterleavedShard | str

_SHORT_FORM = re.compile(r"^(?:(R)|P(?:\((\w+)\))?|S\((-?\d+)\)|IS\((-?\d+),(\d+)\))$")
_SHORT_FORMS_HELP = '"R", "P", "P(avg)", "S(<dim>)" or "IS(<dim>,<interleaved_size>)"'


def placement_to_string(placement: Placement | InterleavedShard) -> str:
    """The short form of a placement, as sharding plans store it in JSON.

    Example::

        placement_to_string(Shard(0))                  # "S(0)"
        placement_to_string(InterleavedShard(1, 2))    # "IS(1,2)"
    """
    strided_shard = _compat.strided_shard_type()
    if isinstance(placement, InterleavedShard):
        return str(placement)
    if isinstance(placement, strided_shard):
        return str(InterleavedShard(placement.dim, int(placement.split_factor)))
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if type(placement) is Partial:
        return "P" if placement.reduce_op == "sum" else f"P({placement.reduce_op})"
    raise PlacementError(
        f"placement {placement!r} has no short string form; plans can hold only {_SHORT_FORMS_HELP}"
    )


def placement_from_string(text: str) -> Placement | InterleavedShard:
    """Parse a placement's short form (whitespace is ignored).

    Example::

        placement_from_string("S(0)")     # Shard(dim=0)
        placement_from_string("IS(0, 3)") # InterleavedShard(dim=0, interleaved_size=3)
    """
    match = _SHORT_FORM.match(re.sub(r"\s+", "", text)) if isinstance(text, str) else None
    if match is None:
        raise PlacementError(f"cannot parse placement {text!r}; write one of {_SHORT_FORMS_HELP}")
    replicate, reduce_op, shard_dim, interleaved_dim, interleaved_size = match.groups()
    if replicate:
        return Replicate()
    if shard_dim is not None:
        return Shard(int(shard_dim))
    if interleaved_dim is not None:
        return InterleavedShard(int(interleaved_dim), int(interleaved_size))
    return Partial(reduce_op or "sum")


def to_torch_placements(placements: Sequence[AnyPlacement]) -> tuple[Placement, ...]:
    """PyTorch placements for DTensor: ``InterleavedShard`` and short strings converted.

    Example::

        to_torch_placements(["R", InterleavedShard(0, 3)])  # (Replicate(), _StridedShard(0, sf=3))
        dtensor.redistribute(mesh, to_torch_placements(["S(0)"]))
    """
    torch_placements = []
    for placement in placements:
        if isinstance(placement, str):
            placement = placement_from_string(placement)
        if isinstance(placement, InterleavedShard):
            placement = placement.to_torch()
        if not isinstance(placement, Placement):
            raise PlacementError(
                f"{placement!r} is not a placement; use a DTensor placement or InterleavedShard"
            )
        torch_placements.append(placement)
    return tuple(torch_placements)


def to_vescale_placements(
    placements: Sequence[Placement] | DTensor,
) -> tuple[Placement | InterleavedShard, ...]:
    """A DTensor's placements (or a sequence of them) with ``_StridedShard`` read as ``InterleavedShard``.

    Example::

        weight = distribute_tensor(fused, mesh, [Replicate(), InterleavedShard(0, 3)])
        to_vescale_placements(weight)   # (Replicate(), InterleavedShard(dim=0, interleaved_size=3))
    """
    if isinstance(placements, DTensor):
        placements = placements.placements
    strided_shard = _compat.strided_shard_type()
    return tuple(
        InterleavedShard(placement.dim, int(placement.split_factor))
        if isinstance(placement, strided_shard)
        else placement
        for placement in placements
    )


def _check_interleaved_shapes(shape: Sequence[int], placements: Sequence[AnyPlacement]) -> None:
    for placement in to_vescale_placements(to_torch_placements(placements)):
        if isinstance(placement, InterleavedShard):
            placement.check_shape(shape)


def _scatter_is_even(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> bool:
    # PyTorch's _StridedShard scatter asserts unless every rank's shard has the same size.
    strided_shard = _compat.strided_shard_type()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, strided_shard):
            dim = placement.dim % len(shape)
            sharding_same_dim = [
                p for p in placements if isinstance(p, Shard | strided_shard) and p.dim % len(shape) == dim
            ]
            if len(sharding_same_dim) > 1 or shape[dim] % (placement.split_factor * mesh.size(mesh_dim)):
                return False
    return True


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[AnyPlacement],
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``torch.distributed.tensor.distribute_tensor`` that also takes ``InterleavedShard`` and short strings.

    Example::

        mesh = init_mesh(dp=2, tp=2)
        c_attn = distribute_tensor(torch.randn(3 * 64, 64), mesh, ["R", "IS(0,3)"])
    """
    torch_placements = to_torch_placements(placements)
    _check_interleaved_shapes(tensor.shape, placements)
    if _scatter_is_even(tensor.shape, device_mesh, torch_placements):
        return torch_distribute_tensor(tensor, device_mesh, torch_placements, src_data_rank=src_data_rank)
    replicate_everywhere = [Replicate()] * device_mesh.ndim
    with torch.no_grad():
        replicated = torch_distribute_tensor(
            tensor.detach(), device_mesh, replicate_everywhere, src_data_rank=src_data_rank
        )
        sharded = replicated.redistribute(device_mesh, torch_placements)
    sharded.requires_grad_(tensor.requires_grad)
    return sharded


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[AnyPlacement],
    *,
    run_check: bool = False,
    shape: torch.Size | None = None,
    stride: tuple[int, ...] | None = None,
) -> DTensor:
    """``DTensor.from_local`` that also takes ``InterleavedShard`` and short strings.

    Pass ``shape`` (and ``stride``) when the parts do not divide evenly over the mesh.

    Example::

        local = torch.cat([q_local, k_local, v_local])
        qkv = from_local(local, mesh, [InterleavedShard(0, 3)], shape=(3 * hidden, hidden))
    """
    torch_placements = to_torch_placements(placements)
    if shape is not None:
        _check_interleaved_shapes(shape, placements)
    dtensor = DTensor.from_local(
        local_tensor, device_mesh, torch_placements, run_check=run_check, shape=shape, stride=stride
    )
    _check_interleaved_shapes(dtensor.shape, placements)
    return dtensor


def from_local_like(
    local_tensor: torch.Tensor, like: DTensor, *, stride: tuple[int, ...] | None = None
) -> DTensor:
    """This rank's ``local_tensor`` as a DTensor laid out like ``like``: its mesh, placements and
    global shape, and its global stride unless ``stride`` is given (e.g. the contiguous one).

    Example::

        grad = from_local_like(torch.zeros_like(weight.to_local()), weight)
        filled = from_local_like(local, tensor, stride=local.stride())
    """
    return DTensor.from_local(
        local_tensor,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride() if stride is None else stride,
    )


def redistribute(
    dtensor: DTensor,
    placements: Sequence[AnyPlacement],
    *,
    device_mesh: DeviceMesh | None = None,
    async_op: bool = False,
) -> DTensor:
    """``DTensor.redistribute`` that also takes ``InterleavedShard`` and short strings.

    Example::

        interleaved = redistribute(replicated_weight, [InterleavedShard(0, 3)])
        back = redistribute(interleaved, ["S(0)"])
    """
    torch_placements = to_torch_placements(placements)
    _check_interleaved_shapes(dtensor.shape, placements)
    return dtensor.redistribute(device_mesh or dtensor.device_mesh, torch_placements, async_op=async_op)
