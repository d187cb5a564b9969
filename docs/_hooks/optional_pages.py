"""MkDocs hook: pages written by other tools or changes may be missing; the site builds anyway.

``extra.optional_pages`` in ``mkdocs.yml`` lists them (the CLI guide, the model-coverage table,
the planner's cost model). While one does not exist, its nav entry is left out and links to it
from other pages become plain text, instead of failing ``mkdocs build --strict``. Every other
page stays required: a missing one still fails the build.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.optional_pages")
_missing: set[str] = set()
# A Markdown link: [text](target) or [text](target#anchor).
_LINK = re.compile(r"\[([^\]]+)\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _without_missing(entries: list[Any]) -> list[Any]:
    kept = []
    for entry in entries:
        if isinstance(entry, dict):
            (title, target), *_ = entry.items()
            if isinstance(target, list):
                kept.append({title: _without_missing(target)})
            elif target not in _missing:
                kept.append(entry)
        elif entry not in _missing:
            kept.append(entry)
    return kept


def on_config(config: Any) -> Any:
    _missing.clear()
    for page in config.extra.get("optional_pages", []):
        if not (Path(config.docs_dir) / page).is_file():
            log.info("optional_pages: %s is not written yet; left out of the site", page)
            _missing.add(page)
    if config.nav:
        config.nav = _without_missing(config.nav)
    return config


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if not _missing:
        return markdown
    here = posixpath.dirname(page.file.src_uri)

    def unlink(match: re.Match[str]) -> str:
        target = posixpath.normpath(posixpath.join(here, match.group(2)))
        return match.group(1) if target in _missing else match.group(0)

    return _LINK.sub(unlink, markdown)
