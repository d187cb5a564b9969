"""The errors of the ``vescale`` command, and the one place that turns errors into one line.

A person can act on a bad ``--model`` path, a constraint the world size cannot satisfy or a
checkpoint that does not fit the model: each is printed once, as ``error: <what and how to fix>``,
and the command exits with status 2. Anything else is a bug and keeps its traceback.

Example::

    with reported_errors():
        raise CLIUsageError("--steps must be at least 1; pass --steps 10")
    # prints "error: --steps must be at least 1; pass --steps 10" to stderr, exits 2
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

__all__ = [
    "USER_ERROR_EXIT_CODE",
    "CLIError",
    "CLIUsageError",
    "format_user_error",
    "reported_errors",
    "user_errors",
]

USER_ERROR_EXIT_CODE = 2
"""Exit status of a run stopped by an error the user can fix (click's status for usage errors)."""


class CLIError(Exception):
    """Base class of the errors the ``vescale`` command raises on purpose."""


class CLIUsageError(CLIError, ValueError):
    """An option or argument of the ``vescale`` command is invalid; the message says how to fix it."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception classes whose message is the whole story (typed errors of every vescale package).

    Imported lazily: ``vescale --help`` must not import torch.

    Example::

        try: run()
        except user_errors() as error: print(error)
    """
    from vescale.api.data_loader import DataLoaderError
    from vescale.api.errors import VescaleAPIError
    from vescale.dcheckpoint import CheckpointError
    from vescale.dmodule.errors import DModuleError
    from vescale.doptim.errors import DOptimError
    from vescale.dpipe.errors import PipelineError
    from vescale.planner import PlanError

    return (
        CLIError,
        PlanError,
        CheckpointError,
        VescaleAPIError,
        DataLoaderError,
        DModuleError,
        DOptimError,
        PipelineError,
    )


def format_user_error(error: BaseException) -> str:
    """The one line printed for ``error``: its message, on one line.

    Example::

        format_user_error(CLIUsageError("bad\\nvalue"))   # 'error: bad value'
    """
    message = " ".join(str(error).split()) or type(error).__name__
    return f"error: {message}"


@contextmanager
def reported_errors() -> Iterator[None]:
    """Print a user error as one line on stderr and exit with status 2; let other errors through.

    Example::

        with reported_errors():
            run_the_command()
    """
    try:
        yield
    except Exception as error:
        if isinstance(error, user_errors()):
            _exit_with(error)
        raise


def _exit_with(error: BaseException) -> None:
    print(format_user_error(error), file=sys.stderr)
    raise typer.Exit(USER_ERROR_EXIT_CODE) from None
