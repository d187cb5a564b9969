"""``--constraints``: planner constraints given inline as JSON or as the path of a JSON file.

Example::

    parse_constraints('{"tensor_parallel.size": 2}')   # {'tensor_parallel.size': 2}
    parse_constraints("constraints.json")             # the file's object
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vescale.cli.errors import CLIUsageError

__all__ = ["parse_constraints"]


def parse_constraints(text: str | None) -> dict[str, Any]:
    """The constraint dict ``text`` gives (inline JSON object, or a file holding one); ``{}`` for ``None``.

    Keys and values are checked by the planner (``vescale.planner.Constraints``), not here.

    Example::

        constraints = parse_constraints('{"zero": {"stage": 1}}')
    """
    if text is None:
        return {}
    stripped = text.strip()
    if stripped.startswith("{"):
        source, body = "--constraints", stripped
    else:
        path = Path(text)
        if not path.is_file():
            raise CLIUsageError(
                f"--constraints {text!r} is neither a JSON object nor an existing file; pass e.g. "
                "'{\"tensor_parallel.size\": 2}' or the path of a JSON file"
            )
        source, body = f"--constraints file {text!r}", path.read_text()
    try:
        constraints = json.loads(body)
    except json.JSONDecodeError as error:
        raise CLIUsageError(f"{source} is not valid JSON ({error}); fix the JSON") from None
    if not isinstance(constraints, dict):
        raise CLIUsageError(
            f'{source} must be a JSON object of constraint keys, e.g. {{"tensor_parallel.size": 2}}; '
            f"got {type(constraints).__name__}"
        )
    return constraints
