"""The ``vescale`` command: ``vescale train``, ``vescale plan``, ``vescale checkpoint inspect|export-hf``.

Built on ``typer``; each command imports torch only when it runs, so ``vescale --help`` is quick.

Example::

    vescale train --steps 50
    vescale plan --model llama-3-70b --world-size 1024 --json plan.json
    vescale checkpoint inspect vescale_checkpoints/tiny-llama
"""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """The console script ``vescale`` (also ``python -m vescale.cli``)."""
    from vescale.cli.app import app

    app()
