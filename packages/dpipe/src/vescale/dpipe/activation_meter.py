"""Activation memory of the pipeline stages on one rank: per micro-batch and in flight.

Autograd keeps the tensors a forward saved for backward until that micro-batch's backward
has used them (zero-bubble schedules keep them through the weight-gradient step). The meter
wraps each saved tensor in a small handle when autograd packs it; the handle's lifetime is
the saved tensor's lifetime in the graph, so the bytes of the distinct storages whose
handles are alive are the activations in flight. Their maximum over a schedule is the peak
the schedule needs (1F1B keeps at most ``size - stage`` micro-batches alive where GPipe
keeps all of them). Parameters (and a DTensor parameter's local shard) are not counted.

The hooks cost Python on every saved tensor (a Llama stage saves ~50 per micro-batch), so a
meter counts only while :attr:`ActivationMeter.enabled` (``PipelineModule.measure_activations``
switches it); otherwise :meth:`ActivationMeter.recording` is a no-op.

Example::

    meter = ActivationMeter(enabled=True)
    with meter.recording(parameters=stage_module.parameters):
        loss = stage_module(hidden_state)
    print(meter.live_bytes, meter.peak_bytes)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from vescale.dpipe.dtensor_boundary import local_tensor

__all__ = ["ActivationMeter"]


class _SavedActivation:
    """A saved tensor as autograd holds it; its storage is counted while any such handle lives."""

    __slots__ = ("meter", "storage_key", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, storage_key: int) -> None:
        self.tensor, self.meter, self.storage_key = tensor, meter, storage_key

    def __del__(self) -> None:
        self.meter._release(self.storage_key)


class ActivationMeter:
    """Counts the bytes of saved-for-backward storages alive on this rank, and their peak."""

    def __init__(self, *, enabled: bool = False) -> None:
        self.enabled = enabled
        # Whether a block was ever recorded (the figures mean something).
        self.measured = False
        self.live_bytes = 0
        self.peak_bytes = 0
        # storage key -> (handles alive, bytes)
        self._storages: dict[int, tuple[int, int]] = {}

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (call before a schedule runs)."""
        self.peak_bytes = self.live_bytes

    @contextlib.contextmanager
    def recording(self, parameters: Callable[[], Iterable[torch.Tensor]]) -> Iterator[dict[int, int]]:
        """Count what autograd saves inside the block; yields this block's ``{storage: bytes}``
        (empty when the meter is not :attr:`enabled`). ``parameters`` gives what not to count.

        Example::

            with meter.recording(module.parameters) as saved:
                module(x)
            print(sum(saved.values()))
        """
        if not self.enabled:
            yield {}
            return
        self.measured = True
        parameter_storages = {local_tensor(p).untyped_storage().data_ptr() for p in parameters()}
        saved_in_block: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> object:
            storage = local_tensor(tensor).untyped_storage()
            storage_key = storage.data_ptr()
            if storage_key in parameter_storages:
                return tensor
            saved_in_block[storage_key] = storage.nbytes()
            self._hold(storage_key, storage.nbytes())
            # Detached: an op that saves its own output (rsqrt, attention) would otherwise hold,
            # through this handle, the output's grad_fn, i.e. the node itself. That cycle runs
            # through C++ where Python's collector cannot see it, so the node lives until its
            # saved tensors are released by backward, which zero-bubble schedules never do for
            # the nodes off the weight-gradient path (their input pass retains the graph).
            return _SavedActivation(tensor.detach(), self, storage_key)

        def unpack(packed: _SavedActivation | torch.Tensor) -> torch.Tensor:
            return packed.tensor if isinstance(packed, _SavedActivation) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield saved_in_block

    def _hold(self, storage_key: int, nbytes: int) -> None:
        handles, _ = self._storages.get(storage_key, (0, nbytes))
        if handles == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._storages[storage_key] = (handles + 1, nbytes)

    def _release(self, storage_key: int) -> None:
        handles, nbytes = self._storages[storage_key]
        if handles == 1:
            del self._storages[storage_key]
            self.live_bytes -= nbytes
        else:
            self._storages[storage_key] = (handles - 1, nbytes)
