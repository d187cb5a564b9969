"""Reading the values of a deferred model's tensors after ``deferred_init``: a clear error.

A deferred parameter has a shape and no values. Inside the function given to ``deferred_init``
a read of values (``.item()``, ``nonzero``, the covariance ``resize_token_embeddings`` draws
new rows from) is recorded and computed for real; the planner's shapes-only trace answers
the reads it meets (:mod:`.fake_values`). Anywhere else torch's fake tensors raise
``DataDependentOutputException: aten._local_scalar_dense.default``, which names neither the
cause nor the fix. The mode deferred tensors belong to (:func:`deferred_fake_mode`) raises
:class:`DeferredValueReadError` instead, which says both. It is still the data-dependent
exception torch defines, so the recorder and :class:`~.fake_values.FakeValuePolicy`, which
catch that, answer it as before.

Example::

    model = deferred_init(AutoModelForCausalLM.from_config, config)
    model.resize_token_embeddings(72)      # DeferredValueReadError: ... inside deferred_init(...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vescale.dtensor import _compat
from vescale.dtensor.deferred.errors import DeferredInitError

if TYPE_CHECKING:
    _DataDependentBase = RuntimeError

    class _FakeModeBase:  # what this module uses of FakeTensorMode
        def __init__(self, *, allow_non_fake_inputs: bool = False) -> None: ...

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any: ...
else:
    _DataDependentBase = _compat.fake_tensor_data_dependent_errors()[0]
    _FakeModeBase = _compat.fake_tensor_mode_class()

__all__ = ["DeferredValueReadError", "deferred_fake_mode"]


class DeferredValueReadError(DeferredInitError, _DataDependentBase):
    """Code read the values of a deferred tensor (or of one computed from it) outside construction.

    Example::

        try:
            deferred_init(torch.nn.Linear, 4, 4).weight.sum().item()
        except DeferredValueReadError as error:
            print(error)   # names the op and the two places such code works
    """

    def __init__(self, func: Any) -> None:
        RuntimeError.__init__(
            self,
            f"{func} reads the values of a tensor of a deferred model (built by deferred_init, "
            "which holds shapes only until it is materialised), so it cannot run here. Run this "
            "code inside the function given to deferred_init, where it is recorded and computed "
            "for real: deferred_init(lambda: prepare(Model(config))), e.g. "
            "model.resize_token_embeddings(n) in prepare; or run it after vescale.parallelize "
            "(or materialize_module)",
        )
        self.func = func


class _DeferredFakeMode(_FakeModeBase):
    """The fake-tensor mode of deferred tensors: torch's, with the clear error above."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except DeferredValueReadError:
            raise
        except _compat.fake_tensor_data_dependent_errors() as error:
            raise DeferredValueReadError(func) from error


def deferred_fake_mode() -> Any:
    """A new fake-tensor mode for one deferred construction (``deferred_init`` makes one).

    Example::

        with deferred_fake_mode(), recorder:
            module = Model(config)
    """
    return _DeferredFakeMode(allow_non_fake_inputs=True)
