"""How one rank computes its shard of a random op so that it equals the single-device values.

Every rank holds the generator state the single process would hold (same seed, same ops
so far). Two ways then give rank ``r`` exactly its slice of the single-device result and
leave its generator where the single process's would be:

* **full**: run the op on a tensor of the global shape and strides, then cut the local
  shard out (the way ``DTensor`` cuts it). Exact for every placement and device, since every
  rank replays the single process; it costs a global-size op (and an all-gather of the
  input for ops that read input values, such as dropout).
* **slice** (CPU only): the CPU generator is an mt19937 word stream without offsets. When
  the local shard is one contiguous run ``[start, end)`` of the global elements and the op
  draws a fixed ``w`` words per element in element order (blocks of ``b`` elements), the
  rank discards ``w*start`` words, runs the op on its shard, and discards the
  ``w*(global - end)`` words after it. Discarding draws int32 words, cheaper than the op.

Whether an op, dtype and argument set draws words that way is not assumed but *measured*
once per process on a probe (:func:`slice_model`): word counts, slices of a probe against
the full probe, and end states must all match exactly, or the op keeps the full strategy.
This covers builds whose kernels draw differently (e.g. MKL's Bernoulli on Intel CPUs).

Example::

    call = RandomCall(torch.ops.aten.uniform_.default, "fill", (0.0, 1.0), {}, None)
    full = lambda: torch.empty(8, 4)
    (local,) = draw_local(call, mesh, [Shard(0)], (8, 4), (4, 1), full, torch.empty(4, 4))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from vescale.dtensor import _compat
from vescale.dtensor._batch_piece import BatchPiece, current_piece
from vescale.dtensor.errors import DTensorError

__all__ = ["RandomCall", "RandomOpError", "cut_local_shard", "draw_local", "local_box", "slice_model"]

# Discarded words are drawn into int32 buffers of at most this many elements (4 MiB).
_DISCARD_CHUNK = 1 << 20
# Block sizes tried by the calibration: 1 (per-element ops) and CPU normal_'s 16-element blocks.
_BLOCK_SIZES = (1, 16)
_WORDS_PER_ELEMENT = (1, 2, 3, 4)
# Measured slice models by call key: a fact of the torch build, the same for the whole process.
_slice_models: dict[tuple[Any, ...], tuple[int, int] | None] = {}


class RandomOpError(DTensorError, NotImplementedError):
    """A random op on a DTensor cannot be made to give the single-device values for this layout."""


@dataclass(frozen=True)
class RandomCall:
    """One random op call with its tensor argument left out.

    ``kind`` says what the tensor argument is: ``"fill"`` (overwritten in place),
    ``"like"`` (only its shape, dtype and strides matter), ``"map"`` (its values are read,
    e.g. dropout's input) or ``"factory"`` (only its shape: ``op(shape, ...)``).
    """

    op: Any
    kind: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    generator: torch.Generator | None

    def run(self, tensor: torch.Tensor, generator: torch.Generator | None) -> Any:
        kwargs = dict(self.kwargs)
        if generator is not None or getattr(self.op, "_overloadname", "") == "generator":
            kwargs["generator"] = generator  # aten.randn.generator takes it, None included
        if self.kind == "factory":
            return self.op(list(tensor.shape), *self.args, **kwargs)
        return self.op(tensor, *self.args, **kwargs)

    def calibration_key(self, dtype: torch.dtype) -> tuple[Any, ...]:
        return (self.op, self.kind, dtype, repr(self.args), repr(sorted(self.kwargs.items())))


def _chunk_span(offset: int, length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of chunk ``index`` of ``torch.chunk`` over ``[offset, offset+length)``."""
    chunk_size = math.ceil(length / num_chunks) if length else 0
    start = min(index * chunk_size, length)
    return offset + start, max(0, min(chunk_size, length - start))


def local_box(
    mesh: DeviceMesh, placements: Sequence[Placement], global_shape: Sequence[int]
) -> list[tuple[int, int]] | None:
    """Per tensor dim ``(offset, length)`` of this rank's shard, or None if it is not one box."""
    box = [(0, size) for size in global_shape]
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard:
            if coordinate is None:  # only a rank of the mesh holds a shard
                raise RandomOpError(
                    f"a random op on a DTensor of mesh {mesh} ran on a rank outside that mesh; "
                    "run it on the mesh's ranks only"
                )
            dim = placement.dim % len(global_shape)
            box[dim] = _chunk_span(*box[dim], mesh.size(mesh_dim), coordinate[mesh_dim])
        elif not isinstance(placement, (Replicate, Partial)):
            return None
    return box


def _contiguous_run(box: list[tuple[int, int]], global_shape: Sequence[int]) -> tuple[int, int] | None:
    """``(start, end)`` in row-major element order when ``box`` is one contiguous run, else None."""
    numel = math.prod(length for _, length in box)
    if numel == 0:
        return 0, 0
    cut_dims = [dim for dim, (_, length) in enumerate(box) if length != global_shape[dim]]
    # Dims after the last cut dim are whole; the run is contiguous iff every dim before it has extent 1.
    if cut_dims and any(box[dim][1] != 1 for dim in range(cut_dims[-1])):
        return None
    start, stride = 0, 1
    for dim in reversed(range(len(box))):
        start += box[dim][0] * stride
        stride *= global_shape[dim]
    return start, start + numel


def _discard_words(count: int, generator: torch.Generator | None) -> None:
    """Advance the CPU generator by ``count`` 32-bit words (int32 ``random_`` draws one each)."""
    if count <= 0:
        return
    buffer = torch.empty(min(count, _DISCARD_CHUNK), dtype=torch.int32)
    while count > 0:
        step = min(count, _DISCARD_CHUNK)
        buffer[:step].random_(generator=generator)
        count -= step


def _outputs(result: Any) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _probe(dtype: torch.dtype, numel: int, kind: str) -> torch.Tensor:
    if kind == "map":  # values in [0, 1]: valid dropout inputs and Bernoulli probabilities
        return torch.linspace(0.0, 1.0, numel, dtype=torch.float64).to(dtype)
    return torch.zeros(numel, dtype=dtype)


def _draw_consumes(call: RandomCall, dtype: torch.dtype, numel: int, words: int) -> bool:
    torch.manual_seed(1)
    call.run(_probe(dtype, numel, call.kind), None)
    after_op = torch.get_rng_state()
    torch.manual_seed(1)
    _discard_words(words, None)
    return torch.equal(after_op, torch.get_rng_state())


def _slice_is_exact(
    call: RandomCall, dtype: torch.dtype, numel: int, words: int, start: int, end: int
) -> bool:
    torch.manual_seed(2)
    probe = _probe(dtype, numel, call.kind)
    full_outputs = _outputs(call.run(probe.clone(), None))
    full_state = torch.get_rng_state()
    torch.manual_seed(2)
    _discard_words(words * start, None)
    slice_outputs = _outputs(call.run(probe[start:end].clone(), None))
    _discard_words(words * (numel - end), None)
    return torch.equal(full_state, torch.get_rng_state()) and all(
        torch.equal(full.view(-1)[start:end], part.view(-1))
        for full, part in zip(full_outputs, slice_outputs, strict=True)
    )


def _measure_slice_model(call: RandomCall, dtype: torch.dtype) -> tuple[int, int] | None:
    saved_state = torch.get_rng_state()
    try:
        for block in _BLOCK_SIZES:
            numel = 7 * block if block > 1 else 37
            words = next(
                (w for w in _WORDS_PER_ELEMENT if _draw_consumes(call, dtype, numel, w * numel)), None
            )
            if words is None:
                continue
            spans = [
                (0, numel),
                (0, 2 * block),
                (2 * block, 5 * block),
                (5 * block, numel),
                (3 * block, 3 * block),
            ]
            if block == 1:
                spans += [(5, 20), (1, 2)]
            if all(_slice_is_exact(call, dtype, numel, words, start, end) for start, end in spans):
                return words, block
        return None
    finally:
        torch.set_rng_state(saved_state)


def slice_model(call: RandomCall, dtype: torch.dtype) -> tuple[int, int] | None:
    """``(words per element, block size)`` under which ``call`` can be sliced on CPU, or None.

    Example::

        slice_model(RandomCall(aten.bernoulli_.float, "fill", (0.5,), {}, None), torch.float32)  # (2, 1)
    """
    key = call.calibration_key(dtype)
    if key not in _slice_models:
        # The probe runs on real tensors even when the first such op comes in a fake pass
        # (dpipe's split of a tensor-parallel model): a fake mode would refuse its
        # torch.equal, and its draws would not move the generator it measures.
        with _compat.disable_dispatch_modes():
            _slice_models[key] = _measure_slice_model(call, dtype)
    return _slice_models[key]


def cut_local_shard(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's shard of ``full`` under ``placements`` (Partial read as Replicate), no communication.

    Example::

        local = cut_local_shard(torch.arange(8), mesh, [Shard(0)])   # rank 1 of 2: tensor([4, 5, 6, 7])
    """
    layout = [Replicate() if isinstance(p, Partial) else p for p in placements]
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, layout).to_local()


def _slice_run(
    call: RandomCall,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    global_shape: Sequence[int],
    global_stride: Sequence[int],
    local_template: torch.Tensor,
) -> tuple[tuple[int, int], int] | None:
    """``((start, end), words per element)`` when the slice strategy is exact here, else None."""
    if not _sliceable_layout(global_shape, global_stride, local_template):
        return None
    box = local_box(mesh, placements, global_shape)
    return None if box is None else _slice_run_of_box(call, box, global_shape, local_template)


def _sliceable_layout(
    global_shape: Sequence[int], global_stride: Sequence[int], local_template: torch.Tensor
) -> bool:
    return (
        local_template.device.type == "cpu"
        and local_template.is_contiguous()
        and tuple(global_stride) == _contiguous_stride(global_shape)
    )


def _slice_run_of_box(
    call: RandomCall, box: list[tuple[int, int]], global_shape: Sequence[int], local_template: torch.Tensor
) -> tuple[tuple[int, int], int] | None:
    run = _contiguous_run(box, global_shape)
    if run is None:
        return None
    model = slice_model(call, local_template.dtype)
    if model is None:
        return None
    words, block = model
    numel = math.prod(global_shape)
    if any(value % block for value in (numel, *run)) or 0 < run[1] - run[0] < block:
        return None
    return run, words


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def draw_local(
    call: RandomCall,
    mesh: DeviceMesh | None,
    placements: Sequence[Placement],
    global_shape: Sequence[int],
    global_stride: Sequence[int],
    global_template: Callable[[], torch.Tensor],
    local_template: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The outputs of ``call`` on this rank's shard, equal to that shard of the single-device outputs.

    ``global_template()`` builds the global tensor argument (only the full strategy calls
    it); ``local_template`` is the local one (filled in place by ``"fill"`` calls). Inside a
    piece of the global batch (:mod:`vescale.dtensor.batch_random`), a tensor holding the piece's
    rows (in its leading dim, or where the piece's layout says) is drawn as those rows of the
    whole batch's tensor; ``mesh`` None is a plain tensor there (its own global tensor).

    Example::

        full = lambda: torch.empty(8, 4)
        (local,) = draw_local(call, mesh, [Shard(0)], (8, 4), (4, 1), full, torch.empty(4, 4))
    """
    piece = current_piece()
    located = piece.locate(global_shape) if piece is not None else None
    if piece is not None and located is not None and not piece.whole:
        return _draw_in_piece(
            call,
            piece,
            located,
            mesh,
            placements,
            global_shape,
            global_stride,
            global_template,
            local_template,
        )
    if mesh is None:
        raise RandomOpError(f"{call.op} on a plain tensor was sent to the sharded draw outside a batch piece")
    slice_run = _slice_run(call, mesh, placements, global_shape, global_stride, local_template)
    if slice_run is not None:
        (start, end), words = slice_run
        return _draw_run(call, local_template, start, end, words, math.prod(global_shape))
    full_outputs = _outputs(call.run(global_template(), call.generator))
    local_outputs = tuple(cut_local_shard(full, mesh, placements) for full in full_outputs)
    if call.kind == "fill":
        local_template.copy_(local_outputs[0])
        return (local_template,)
    return local_outputs


def _draw_run(
    call: RandomCall, local_template: torch.Tensor, start: int, end: int, words: int, numel: int
) -> tuple[torch.Tensor, ...]:
    """Discard the words of the elements before ``start``, draw ``[start, end)``, discard the rest."""
    _discard_words(words * start, call.generator)
    outputs = _outputs(call.run(local_template, call.generator))
    _discard_words(words * (numel - end), call.generator)
    return outputs


def _empty_in_layout(
    shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dims lie in memory in the order ``stride`` gives them."""
    order = sorted(range(len(shape)), key=lambda dim: -stride[dim])
    outer_first = torch.empty([shape[dim] for dim in order], dtype=dtype, device=device)
    return outer_first.permute([order.index(dim) for dim in range(len(shape))])


def _draw_in_piece(
    call: RandomCall,
    piece: BatchPiece,
    located: tuple[int, int],
    mesh: DeviceMesh | None,
    placements: Sequence[Placement],
    piece_shape: Sequence[int],
    piece_stride: Sequence[int],
    piece_template: Callable[[], torch.Tensor],
    local_template: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """``draw_local`` for a tensor of ``piece_shape`` whose dim ``dim`` holds ``factor`` tensor rows
    per sample of ``piece`` (``located``): one device's tensor has ``total * factor`` there, the
    piece's from ``start * factor``."""
    dim, factor = located
    first, last = piece.start * factor, (piece.start + piece.rows) * factor
    whole_shape = list(piece_shape)
    whole_shape[dim] = piece.total * factor
    if _sliceable_layout(piece_shape, piece_stride, local_template):
        box = (
            [(0, size) for size in piece_shape] if mesh is None else local_box(mesh, placements, piece_shape)
        )
        if box is not None:
            whole_box = list(box)
            whole_box[dim] = (box[dim][0] + first, box[dim][1])
            slice_run = _slice_run_of_box(call, whole_box, whole_shape, local_template)
            if slice_run is not None:
                (start, end), words = slice_run
                return _draw_run(call, local_template, start, end, words, math.prod(whole_shape))
    whole = _empty_in_layout(whole_shape, piece_stride, local_template.dtype, local_template.device)
    if call.kind == "map":  # the op reads its input elementwise: the other rows' values do not matter
        whole.zero_()
        whole.narrow(dim, first, last - first).copy_(piece_template())
    whole_outputs = _outputs(call.run(whole, call.generator))
    outputs = [output.narrow(dim, first, last - first) for output in whole_outputs]
    if mesh is not None:
        outputs = [cut_local_shard(output, mesh, placements) for output in outputs]
    if call.kind == "fill":
        local_template.copy_(outputs[0])
        return (local_template,)
    return tuple(output.clone() for output in outputs)  # not views keeping the whole batch's tensor
