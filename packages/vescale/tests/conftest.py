"""Fixtures shared by the meta-package's tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest


def _assert_one_line_error(completed: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit status 2, one ``error:`` line on stderr naming the problem (each of ``fragments``),
    and no traceback on either stream (from the command or any of its ranks)."""
    assert completed.returncode == 2, (completed.returncode, completed.stdout, completed.stderr)
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), completed.stderr
    assert "Traceback" not in completed.stdout + completed.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def assert_one_line_error() -> Callable[..., None]:
    """The check that a ``vescale`` command failed as the CLI promises: ``assert_one_line_error(completed,
    "fragment the error line names", ...)``."""
    return _assert_one_line_error
