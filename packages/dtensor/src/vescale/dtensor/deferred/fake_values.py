"""Answer the values model code reads during a shapes-only forward, as a training batch would.

The planner's trace and profile and dpipe's split run a model's forward on tensors without
data (fake tensors of a deferred model, or meta tensors). They need the order in which modules
run and the shapes that flow, not values; but model code reads values as it goes
(``transformers``' packed-sequence check ``(position_ids[:, -1] == 0).all()``, XLM's
``lengths.max().item() <= slen``, a mixture-of-experts layer's ``nonzero`` over each expert's
tokens, X-MOD's boolean mask that selects each language's tokens, JetMoE's per-expert token
counts read with ``tolist()`` and fed to ``split``), which such tensors cannot answer. Under
:class:`FakeValuePolicy` an ``all()`` reads true and an ``any()`` false (no padding, no packing,
no overflow), any other scalar read is 0, and ``nonzero``, a boolean-mask index and
``masked_select`` find one hit, so every branch after them runs. Counts read this way are not
consistent with one another (an expert count of 0 each, where the counts must add up to the
tokens routed), so a ``split`` into sizes that do not fill the dimension, once a read has been
answered, splits it evenly instead: each of ``k`` experts gets ``1/k`` of the routed tokens. The
answers only steer the shapes-only pass: the model trains on real values, and a pipeline
stage that does not reach its boundary with them raises ``PipelineCutError``.

Example::

    with _compat.fake_tensor_mode(), FakeValuePolicy():
        trace = model(**fake_batch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from vescale.dtensor import _compat

if TYPE_CHECKING:
    from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
else:
    _DispatchModeBase = _compat.torch_dispatch_mode_class()

__all__ = ["FakeValuePolicy"]

_aten = torch.ops.aten
_ALL_OPS = (_aten.all.default, _aten.all.dim, _aten.all.dims)
_ANY_OPS = (_aten.any.default, _aten.any.dim, _aten.any.dims)
_SCALAR_READS = (_aten._local_scalar_dense.default, _aten.is_nonzero.default)
# Ops whose second argument is a list of indices, where a boolean mask means "the hits".
_MASK_INDEXED = (
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
)
_SHAPE_FROM_DATA = (_aten.nonzero.default, _aten.masked_select.default, *_MASK_INDEXED)
_SPLIT_BY_SIZES = (_aten.split_with_sizes.default, _aten.split_with_sizes_copy.default)


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _one_hit_indices(indices: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each boolean mask of ``k`` dims as ``k`` integer indices that select one element."""
    answered: list[torch.Tensor | None] = []
    for index in indices:
        if index is not None and _is_mask(index):
            answered += [torch.zeros(1, dtype=torch.long, device=index.device)] * index.ndim
        else:
            answered.append(index)
    return answered


def _even_sizes(length: int, parts: int) -> list[int]:
    """``parts`` sizes that add up to ``length``, the first ``length % parts`` one larger."""
    return [length // parts + (1 if part < length % parts else 0) for part in range(parts)]


def _split_sizes_misfit(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``split_with_sizes`` was given sizes that do not add up to its dimension."""
    if func not in _SPLIT_BY_SIZES or len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return False
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    sizes = list(args[1])
    return bool(sizes) and sum(sizes) != args[0].shape[dim]


def _without_data(args: tuple[Any, ...]) -> bool:
    """Whether an argument is a meta tensor (whose data-dependent ops raise plain errors)."""
    return any(isinstance(arg, torch.Tensor) and arg.is_meta for arg in args)


def _is_shapes_only(tensor: Any) -> bool:
    """A meta or fake tensor, or a DTensor whose local tensor is one (a tensor-parallel model's pass)."""
    if isinstance(tensor, DTensor):
        return _is_shapes_only(tensor._local_tensor)
    fake = _compat.fake_tensor_class()
    return isinstance(tensor, torch.Tensor) and (tensor.is_meta or isinstance(tensor, fake))


class FakeValuePolicy(_DispatchModeBase):
    """Data-dependent reads of fake or meta tensors answered as a training batch would (module docstring).

    Each op runs first as it is: a real tensor answers for itself, and a DTensor reaches its
    fake shards only here; only a tensor without data's refusal is answered.
    ``guessed_shapes`` counts the shapes chosen from data (the activations after them are a
    lower bound).

    Example::

        with FakeValuePolicy():
            bool((torch.zeros(2, 3, device="meta") == 0).all())   # True
    """

    def __init__(self) -> None:
        super().__init__()
        # id() of each all()/any() result -> its answer; the results are kept alive for the pass.
        self.known: dict[int, bool] = {}
        self._answered: list[torch.Tensor] = []
        self.guessed_shapes = 0
        self.answered_reads = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.answered_reads and _split_sizes_misfit(func, args, kwargs) and _is_shapes_only(args[0]):
            return self._split_evenly(func, args, kwargs)
        try:
            output = func(*args, **kwargs)
        except Exception as error:
            answerable = func in _SCALAR_READS or func in _SHAPE_FROM_DATA
            refused = isinstance(error, _compat.fake_tensor_data_dependent_errors()) or (
                isinstance(error, RuntimeError | NotImplementedError) and _without_data(args)
            )
            if not (answerable and refused):
                raise
            return self._answer(func, args, kwargs, error)
        if func in _ALL_OPS or func in _ANY_OPS:
            self.known[id(output)] = func in _ALL_OPS
            self._answered.append(output)
        return output

    def _answer(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception) -> Any:
        if func in _SCALAR_READS:
            self.answered_reads += 1
            value = self.known.get(id(args[0]), 0)
            return bool(value) if func is _aten.is_nonzero.default else value
        if func is _aten.nonzero.default:
            self.guessed_shapes += 1
            return torch.zeros((1, args[0].ndim), dtype=torch.long, device=args[0].device)
        if func is _aten.masked_select.default:
            self.guessed_shapes += 1
            return args[0].reshape(-1)[:1].clone()
        if len(args) > 1 and any(_is_mask(index) for index in args[1]):
            self.guessed_shapes += 1
            return func(args[0], _one_hit_indices(list(args[1])), *args[2:], **kwargs)
        raise error

    def _split_evenly(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The split of ``args[0]`` into as many even pieces as sizes were asked (module docstring)."""
        self.guessed_shapes += 1
        dim = args[2] if len(args) > 2 else kwargs.pop("dim", 0)
        sizes = _even_sizes(args[0].shape[dim], len(args[1]))
        return func(args[0], sizes, dim, **kwargs)
