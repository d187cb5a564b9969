"""Grouped matrix multiplication (``torch._grouped_mm``, the MoE expert matmul) on any dtype.

PyTorch has a sharding strategy for ``aten._grouped_mm``, but DTensor computes the output's
shape with the op's meta function, which implements the CUDA kernel's checks and rejects
every dtype but bfloat16; the CPU kernel takes float32 too, so a float32 Mixtral (whose
experts ``transformers`` runs through ``grouped_mm`` by default) fails under DTensor. This
handler decides the placements itself from the operands' dim roles and calls the local
kernel, with no meta function involved:

* a dim of one operand that the output keeps (tokens, output features) may be sharded,
  alone, and the output is sharded the same way there (``Shard`` or interleaved);
* the contracted dim sharded alike in both operands gives a ``Partial`` sum;
* a batch dim present in both operands and the output (3-D x 3-D) sharded in both;
* the dim that ``offs`` cuts into groups, and the expert dim, must stay whole.

Anything else is first redistributed to Replicate (the activation, then the weight). The
CPU kernel wants every non-unit stride a multiple of 16 bytes; a shard of an aligned tensor
may not be (12 columns over 2 ranks: 6 floats), so such a local operand is copied into a
padded buffer first.

Example::

    import vescale.dtensor.ops  # registers the handler
    out = torch._grouped_mm(tokens_replicated, experts_shard2, offs=offsets)  # out: Shard(1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from vescale.dtensor import _compat
from vescale.dtensor._op_handlers import dispatch_previous, register_op_handlers
from vescale.dtensor.grouped_mm_shapes import empty_grouped_mm_output, holds_no_data

__all__ = ["GROUPED_MM_LAYOUTS", "grouped_mm_handler"]

aten = torch.ops.aten


@dataclass(frozen=True)
class _Layout:
    """Dim labels of (mat_a, mat_b, output); ``grouped`` is the label ``offs`` cuts."""

    mat_a: str
    mat_b: str
    output: str
    grouped: str


# By (mat_a.ndim, mat_b.ndim), as in torch's grouped_mm strategy: s = the grouped token dim,
# k = contracted, e = expert (group), m/n = free dims.
GROUPED_MM_LAYOUTS: dict[tuple[int, int], _Layout] = {
    (2, 3): _Layout("sk", "ekn", "sn", "s"),
    (2, 2): _Layout("ks", "sn", "ekn", "s"),
    (3, 2): _Layout("emk", "kn", "mn", "n"),
    (3, 3): _Layout("emk", "ekn", "emn", ""),
}


def _sharded_label(placement: Placement, labels: str) -> tuple[str, int] | None:
    """(label, split factor) of a Shard/interleaved placement, else None."""
    strided_shard = _compat.strided_shard_type()
    if isinstance(placement, strided_shard):
        return labels[placement.dim % len(labels)], int(placement.split_factor)
    if isinstance(placement, Shard):
        return labels[placement.dim % len(labels)], 1
    return None


def _shard_on(dim: int, split_factor: int) -> Placement:
    if split_factor == 1:
        return Shard(dim)
    return _compat.strided_shard_type()(dim, split_factor=split_factor)


def _is_sum(placement: Placement) -> bool:
    return isinstance(placement, Partial) and placement.reduce_op == "sum"


def _output_placement(layout: _Layout, placement_a: Placement, placement_b: Placement) -> Placement | None:
    """The output's placement on one mesh dim, or None when the pair cannot be computed locally."""
    a_is_replicate, b_is_replicate = placement_a.is_replicate(), placement_b.is_replicate()
    if a_is_replicate and b_is_replicate:
        return Replicate()
    if (_is_sum(placement_a) and b_is_replicate) or (a_is_replicate and _is_sum(placement_b)):
        return Partial()
    sharded_a = _sharded_label(placement_a, layout.mat_a)
    sharded_b = _sharded_label(placement_b, layout.mat_b)
    for sharded, other_is_replicate, other_labels in (
        (sharded_a, b_is_replicate, layout.mat_b),
        (sharded_b, a_is_replicate, layout.mat_a),
    ):
        if sharded is None or not other_is_replicate:
            continue
        label, split_factor = sharded
        if label in layout.output and label != layout.grouped and label not in other_labels:
            return _shard_on(layout.output.index(label), split_factor)
    if sharded_a is not None and sharded_a == sharded_b:
        label, split_factor = sharded_a
        if label == layout.grouped:
            return None
        if label not in layout.output:
            return Partial()
        return _shard_on(layout.output.index(label), split_factor)
    return None


def _plan(layout: _Layout, mat_a: DTensor, mat_b: DTensor) -> tuple[list[Any], list[Any], list[Any]]:
    """Placements to move (mat_a, mat_b) to, and the output's, mesh dim by mesh dim."""
    plan_a, plan_b, plan_out = [], [], []
    for placement_a, placement_b in zip(mat_a.placements, mat_b.placements, strict=True):
        output = _output_placement(layout, placement_a, placement_b)
        if output is None:
            placement_a = Replicate()
            output = _output_placement(layout, placement_a, placement_b)
        if output is None:
            placement_b = Replicate()
            output = Replicate()
        plan_a.append(placement_a)
        plan_b.append(placement_b)
        plan_out.append(output)
    return plan_a, plan_b, plan_out


def _global_output_shape(layout: _Layout, mat_a: DTensor, mat_b: DTensor, groups: int) -> list[int]:
    sizes = dict(zip(layout.mat_a, mat_a.shape, strict=True))
    sizes.update(zip(layout.mat_b, mat_b.shape, strict=True))
    sizes.setdefault("e", groups)
    return [sizes[label] for label in layout.output]


def _to_replicated_local(tensor: Any) -> Any:
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        return tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    return tensor


def _is_aligned(local: torch.Tensor) -> bool:
    alignment = max(16 // local.element_size(), 1)
    if local.stride(-1) == 1:
        unit_dim = local.ndim - 1
    elif local.stride(-2) == 1:
        unit_dim = local.ndim - 2
    else:
        return False
    return all(stride % alignment == 0 for dim, stride in enumerate(local.stride()) if dim != unit_dim)


def _aligned(local: torch.Tensor) -> torch.Tensor:
    """``local`` itself, or a copy whose rows start on 16-byte boundaries (the kernel's demand)."""
    if _is_aligned(local):
        return local
    alignment = max(16 // local.element_size(), 1)
    columns = local.size(-1)
    padded = local.new_zeros(*local.shape[:-1], -(-columns // alignment) * alignment)
    padded[..., :columns].copy_(local)
    return padded[..., :columns]


def _placed(tensor: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``tensor`` on ``placements``; itself where it already is (the expert weights, as a rule).

    A no-op ``redistribute`` is still an autograd Function returning its input's local tensor,
    which autograd then detaches in place: in a shapes-only pass (dpipe's split of a
    tensor-parallel GPT-OSS or Aria) that local tensor is a real parameter and the fake mode
    refuses the in-place ``detach_``.
    """
    if tuple(tensor.placements) == tuple(placements):
        return tensor
    return tensor.redistribute(tensor.device_mesh, placements)


def grouped_mm_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """DTensor handler of ``aten._grouped_mm.default`` (see the module docstring).

    Example::

        register_op_handlers({torch.ops.aten._grouped_mm.default: grouped_mm_handler})
        out = torch._grouped_mm(tokens, experts, offs=offsets)
    """
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args, strict=False)) | kwargs
    mat_a, mat_b = bound["mat_a"], bound["mat_b"]
    offs, out_dtype = bound.get("offs"), bound.get("out_dtype")
    layout = GROUPED_MM_LAYOUTS.get((mat_a.ndim, mat_b.ndim))
    supported = (
        layout is not None
        and bound.get("bias") is None
        and isinstance(mat_a, DTensor)
        and isinstance(mat_b, DTensor)
        and mat_a.device_mesh == mat_b.device_mesh
        and mat_a.device_mesh.get_coordinate() is not None
        and (offs is None) == (layout.grouped == "")
    )
    if not supported or layout is None:  # supported implies a layout; the check narrows its type
        return dispatch_previous(op_call, args, kwargs)
    mesh = mat_a.device_mesh
    plan_a, plan_b, plan_out = _plan(layout, mat_a, mat_b)
    local_a = _aligned(_placed(mat_a, plan_a).to_local())
    local_b = _aligned(_placed(mat_b, plan_b).to_local())
    local_offs = _to_replicated_local(offs)
    if holds_no_data(local_a) or holds_no_data(local_b):
        # A structure analysis (fake or meta tensors): the meta function would reject float32.
        local_out = empty_grouped_mm_output(local_a, local_b, out_dtype)
    else:
        local_out = op_call(local_a, local_b, local_offs, None, out_dtype)
    groups = 0 if offs is None else offs.shape[0]
    shape = _global_output_shape(layout, mat_a, mat_b, groups)
    stride = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        stride[dim] = stride[dim + 1] * max(shape[dim + 1], 1)
    return DTensor.from_local(
        local_out, mesh, plan_out, run_check=False, shape=torch.Size(shape), stride=tuple(stride)
    )


register_op_handlers({aten._grouped_mm.default: grouped_mm_handler})
