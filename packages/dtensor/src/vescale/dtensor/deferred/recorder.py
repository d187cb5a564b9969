"""The dispatch mode that records a deferred construction.

It sits above a ``FakeTensorMode``, so it sees every aten op the constructor runs, with
fake arguments, before they are faked: ``nn`` default inits, ``transformers``'
``_init_weights`` (whichever Python function it calls, it ends in aten ops), buffers built
from ``arange``/``pow``, ``tie_weights``. For each op it stores a :class:`RecordedOp`.

Random numbers. The CPU generator is an mt19937 stream with no offsets: a draw's numbers
depend on every draw before it. Before each random op the recorder saves the generator's
state into the record, then advances the real generator exactly as eager construction
would, by running the same op for real on a scratch tensor of the same size and strides
(its other tensor inputs replayed with their real values). So after ``deferred_init``
returns the global generator is where ``Model(cfg)`` would have left it, later draws by the
user are unchanged, and materialisation replays each draw from its saved state without
touching the global generator. Scratch tensors live for one op: at most one full
parameter is allocated at a time.

Values. Code that reads values during construction (``mask.any()`` in ``trunc_normal_``'s
rejection loop, ``.item()``) gets the real answer: the tensor is replayed from the record
up to that point. An op whose output shape depends on values is run for real the same way
and its result enters the record as a constant.

Example::

    record = InitRecord()
    fake_mode = _compat.fake_tensor_mode_class()(allow_non_fake_inputs=True)
    with fake_mode, InitRecorder(record, fake_mode) as recorder:
        model = Model(cfg)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from vescale.dtensor import _compat
from vescale.dtensor.deferred.errors import DeferredInitError
from vescale.dtensor.deferred.record import InitRecord, RecordedOp, TensorRef
from vescale.dtensor.deferred.replay import release_freed_memory, replay_tensor

__all__ = ["InitRecorder"]

_aten = torch.ops.aten
# In-place ops whose result does not depend on the values they overwrite.
_OVERWRITING_OPS = frozenset(
    {
        _aten.normal_,
        _aten.uniform_,
        _aten.random_,
        _aten.exponential_,
        _aten.cauchy_,
        _aten.log_normal_,
        _aten.geometric_,
        _aten.bernoulli_,
        _aten.fill_,
        _aten.zero_,
        _aten.copy_,
    }
)


def _constant(value: torch.Tensor) -> torch.Tensor:
    """The op of a record entry whose result was computed for real during recording."""
    return value


def _written_values(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    if op is _constant:
        return []
    written = []
    for index, argument in enumerate(_compat.op_schema(op).arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(args[index] if index < len(args) else kwargs.get(argument.name))
    return tree_flatten(written)[0]


if TYPE_CHECKING:
    from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
else:
    _DispatchModeBase = _compat.torch_dispatch_mode_class()


class InitRecorder(_DispatchModeBase):
    """Records every op run under it (with fake tensors) into ``record``; see the module docstring."""

    def __init__(self, record: InitRecord, fake_mode: Any) -> None:
        super().__init__()
        self.record = record
        self._fake_mode = fake_mode
        self._fake_tensor = _compat.fake_tensor_class()
        self._storage_ids: dict[int, int] = {}
        # Storage keys are addresses: holding every storage stops a freed one's key being reused.
        self._storages_alive: list[torch.UntypedStorage] = []

    def storage_id(self, tensor: torch.Tensor) -> int:
        """The record's id of a fake tensor's storage (one made during this construction)."""
        storage_id = self._storage_ids.get(_compat.storage_key(tensor))
        if storage_id is None:
            raise DeferredInitError(
                f"a fake tensor of shape {tuple(tensor.shape)} was not created during this deferred "
                "construction; build every tensor the module holds inside the deferred_init call"
            )
        return storage_id

    def ref(self, tensor: torch.Tensor) -> TensorRef:
        return TensorRef.of(tensor, self.storage_id(tensor))

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        is_random = torch.Tag.nondeterministic_seeded in func.tags
        generator_state = self._generator_state(func, kwargs) if is_random else None
        try:
            outputs = func(*args, **kwargs)
        except _compat.fake_tensor_data_dependent_errors():
            return self._run_for_real(func, args, kwargs)
        if is_random:
            self._advance_generator(func, args, kwargs)
        # Constants are cloned as real tensors, not faked by the mode below.
        with _compat.disable_dispatch_modes():
            self._append(func, args, kwargs, outputs, generator_state)
        return outputs

    def _generator_state(self, func: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        generator = kwargs.get("generator") or torch.default_generator
        if generator.device.type != "cpu":
            raise DeferredInitError(
                f"{func} draws from a {generator.device.type} generator; deferred_init replays CPU "
                "draws only: construct the module on CPU (the default device)"
            )
        return generator.get_state()

    def _real_value(self, value: Any) -> Any:
        if isinstance(value, self._fake_tensor):
            return replay_tensor(self.record, self.ref(value), len(self.record.ops))
        return value

    def _advance_generator(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        written_ids = {id(value) for value in _written_values(func, args, kwargs)}

        def scratch_or_real(value: Any) -> Any:
            if isinstance(value, self._fake_tensor) and id(value) in written_ids:
                return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
            return self._real_value(value)

        with _compat.disable_dispatch_modes(), torch.no_grad():
            func(*tree_map(scratch_or_real, args), **tree_map(scratch_or_real, kwargs))
        release_freed_memory()

    def _run_for_real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _written_values(func, args, kwargs):
            raise DeferredInitError(
                f"{func} writes a tensor in place with a result that depends on tensor values; "
                "deferred_init cannot record it: construct this module eagerly"
            )
        with _compat.disable_dispatch_modes(), torch.no_grad():
            outputs = func(*tree_map(self._real_value, args), **tree_map(self._real_value, kwargs))
        if not isinstance(outputs, torch.Tensor):
            return outputs
        fake_output = self._fake_mode.from_tensor(outputs)
        with _compat.disable_dispatch_modes():
            self._append(_constant, (outputs,), {}, fake_output, None)
        return fake_output

    def _append(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any, generator_state: Any
    ) -> None:
        created = []
        for index, output in enumerate(tree_flatten(outputs)[0]):
            if isinstance(output, self._fake_tensor):
                key = _compat.storage_key(output)
                if key not in self._storage_ids:
                    storage_id = len(self._storage_ids)
                    self._storage_ids[key] = storage_id
                    self._storages_alive.append(output.untyped_storage())
                    self.record.storage_nbytes[storage_id] = output.untyped_storage().nbytes()
                    created.append((index, storage_id))
        written_refs = [self.ref(value) for value in _written_values(func, args, kwargs)]
        if not created and not written_refs:
            return
        recorded_args, recorded_kwargs = tree_map(self._recorded_value, (args, kwargs))
        argument_refs = [
            value
            for value in tree_flatten((recorded_args, recorded_kwargs))[0]
            if isinstance(value, TensorRef)
        ]
        written = {ref.storage_id for ref in written_refs}
        overwritten = set()
        if getattr(func, "overloadpacket", None) in _OVERWRITING_OPS:
            read_elsewhere = {ref.storage_id for ref in argument_refs if ref not in written_refs}
            overwritten = {
                ref.storage_id
                for ref in written_refs
                if ref.covers(self.record.storage_nbytes[ref.storage_id])
                and ref.storage_id not in read_elsewhere
            }
        self.record.ops.append(
            RecordedOp(
                op=func,
                args=recorded_args,
                kwargs=recorded_kwargs,
                created=tuple(created),
                written=frozenset(written),
                read=frozenset(ref.storage_id for ref in argument_refs) - overwritten,
                overwritten=frozenset(overwritten),
                generator_state=generator_state,
                generator_argument=generator_state is not None
                and any(argument.name == "generator" for argument in _compat.op_schema(func).arguments),
            )
        )

    def _recorded_value(self, value: Any) -> Any:
        if isinstance(value, self._fake_tensor):
            return self.ref(value)
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, torch.Generator):
            # Replays draw from a fresh generator set to the recorded state.
            return None
        return value
