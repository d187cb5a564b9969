"""MkDocs hook: one ``vescale`` package tree for mkdocstrings to read the API from.

The components ship ``vescale/<name>/`` without ``vescale/__init__.py`` (PEP 420) and only the
meta-package ships it, so every ``packages/*/src`` holds a piece of ``vescale``. Griffe (under
mkdocstrings) takes a regular package over namespace portions, and would then not find the
components. This hook links the pieces into one tree under ``build/docs-namespace/vescale``
(git-ignored), which ``mkdocs.yml`` puts first on mkdocstrings' search path.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "docs-namespace"


def link_namespace_tree(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Link every ``packages/*/src/vescale/*`` entry into ``tree/vescale``; return ``tree``."""
    package = tree / "vescale"
    shutil.rmtree(tree, ignore_errors=True)
    package.mkdir(parents=True)
    for portion in sorted(root.glob("packages/*/src/vescale")):
        for entry in sorted(portion.iterdir()):
            if entry.name != "__pycache__":
                (package / entry.name).symlink_to(entry)
    return tree


# Before mkdocstrings' own on_config, which sets up its handlers and their search paths.
@event_priority(100)
def on_config(config: Any) -> Any:
    link_namespace_tree()
    return config
