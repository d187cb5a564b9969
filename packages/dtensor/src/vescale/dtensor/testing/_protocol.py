"""Messages between the test process and its rank processes (pickled over a socket pair)."""

from __future__ import annotations

from dataclasses import dataclass

from vescale.dtensor.testing._function_ref import FunctionRef

__all__ = ["READY", "SHUTDOWN", "RunReply", "RunRequest"]

READY = "ready"
SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class RunRequest:
    """Run ``function`` as ``rank`` of ``world_size`` in a new process group."""

    function: FunctionRef
    arguments: bytes  # pickle of (args, kwargs), unpickled after the function's module is loaded
    rank: int
    world_size: int
    backend: str
    store_path: str
    timeout_s: float
    seed: int


@dataclass(frozen=True)
class RunReply:
    """What a rank sends back: its return value or its exception, and what it printed."""

    rank: int
    ok: bool
    value: bytes | None = None  # pickle of the return value
    exception: bytes | None = None  # pickle of the exception, None where it does not pickle
    exception_type: str = ""
    exception_message: str = ""
    traceback_text: str = ""
    output: str = ""
    seconds: float = 0.0
    failed_at: float = 0.0  # time.time() when the exception was caught: the first one is the cause
    in_setup: bool = False  # failed while joining the process group: the rank process is spent
    threads: int = 0  # threads alive in the rank process after the run (its process group destroyed)
