"""Every rank's random-number generator states, saved and restored by ``state["rng"]``.

Each rank keeps its own generators (torch CPU and accelerator, Python's ``random``, NumPy's
global one), so a resumed run draws what an uninterrupted one would only if each rank gets
its own states back. They are saved as JSON (byte states in base64), never pickled.

Example::

    state = {"model": model, "rng": RNGState()}
    save("ckpt/step-100", state)
    load("ckpt/step-100", state)   # every generator of this rank is where it was at save time
"""

from __future__ import annotations

import base64
import random
from typing import Any, cast

import numpy as np
import torch
from numpy.typing import NDArray

from vescale.dcheckpoint.errors import CheckpointFormatError

__all__ = ["RNGState"]


def _encode_bytes(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def _decode_bytes(text: object, where: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise CheckpointFormatError(f"rng state {where} in the index is not a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise CheckpointFormatError(f"rng state {where} in the index is not valid base64") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


class RNGState:
    """A marker for ``state["rng"]``: the calling rank's generators are saved and restored.

    Example::

        state["rng"] = RNGState()
        RNGState.capture()["python"][0]   # 3, the version of Python's Mersenne Twister state
    """

    @staticmethod
    def capture() -> dict[str, Any]:
        """This rank's generator states as JSON."""
        # The global generator is the legacy MT19937 one, whose state is a tuple; numpy's stubs
        # give the no-argument call the dict of ``legacy=False``.
        numpy_state = cast(tuple[str, "NDArray[np.uint32]", int, int, float], np.random.get_state())
        captured: dict[str, Any] = {
            "torch": _encode_bytes(torch.get_rng_state()),
            "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
            "numpy": [numpy_state[0], numpy_state[1].tolist(), *(float(x) for x in numpy_state[2:])],
        }
        if torch.cuda.is_available():
            captured["cuda"] = [_encode_bytes(state) for state in torch.cuda.get_rng_state_all()]
        return captured

    @staticmethod
    def restore(captured: object) -> None:
        """Set this rank's generators to ``captured`` (as :meth:`capture` returned it)."""
        try:
            if not isinstance(captured, dict):
                raise TypeError(f"expected a mapping, got {type(captured).__name__}")
            torch_state = _decode_bytes(captured["torch"], "torch")
            version, python_state, gauss = captured["python"]
            kind, numpy_keys, position, has_gauss, cached_gaussian = captured["numpy"]
            cuda_states = [_decode_bytes(state, "cuda") for state in captured.get("cuda", [])]
            torch.set_rng_state(torch_state)
            random.setstate((version, tuple(python_state), gauss))
            np.random.set_state(
                (kind, np.array(numpy_keys, dtype=np.uint32), int(position), int(has_gauss), cached_gaussian)
            )
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointFormatError(
                f"the rng states in the index are damaged ({type(error).__name__}: {error}); "
                'load without state["rng"] to skip them'
            ) from None
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
