"""Every ``python`` example on the documentation site runs, as a reader would run it.

The examples are the fenced ``python`` blocks of ``docs/**/*.md``, with the files they include
through ``--8<--`` snippet lines (the package READMEs' examples) expanded as the site expands
them. Each runs as a script in a fresh process: ``python example.py``, or, when its first line
is ``# torchrun --nproc-per-node N ...``, under ``torch.distributed.run`` on N gloo processes
(holding the harness's machine-wide rank lock, as every multi-rank test does). The examples
check their own results against single-device computations; here they must exit 0.

An *excerpt* of code that lives in a file of the repository, shown to explain it, is fenced as
``python title="path/to/file.py"``: the site shows that title, and the test checks that the file
exists and holds every line of the excerpt (that file is run by its own tests).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vescale.dtensor.testing._rank_pool import _machine_wide_rank_lock

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
SNIPPET_LINE = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"[ \t]*$', re.MULTILINE)
PYTHON_BLOCK = re.compile(r"^```python(?P<attributes>[^\n]*)\n(?P<code>.*?)^```", re.MULTILINE | re.DOTALL)
EXCERPT_TITLE = re.compile(r'title="(?P<path>[^"]+\.py)"')
TORCHRUN_LINE = re.compile(r"# torchrun --nproc-per-node (?P<ranks>\d+)\b")
TIMEOUT_S = 540


def _section(text: str, name: str, path: str) -> str:
    start = re.search(rf"^.*--8<-- \[start:{name}\].*\n", text, re.MULTILINE)
    end = re.search(rf"^.*--8<-- \[end:{name}\].*$", text, re.MULTILINE)
    assert start and end, f"{path} has no '{name}' snippet section for the docs to include"
    return text[start.end() : end.start()]


def _expanded(text: str) -> str:
    """``text`` with each ``--8<-- "path[:section]"`` line replaced by what it includes."""

    def include(match: re.Match[str]) -> str:
        included = (ROOT / match["path"]).read_text()
        if match["section"]:
            included = _section(included, match["section"], match["path"])
        return _expanded(included)

    return SNIPPET_LINE.sub(include, text)


def _blocks() -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """``({"docs/page.md:N": code}, {"docs/page.md:N": (file, code)})``: the examples, each distinct
    one once (a page may include another's), and the excerpts with the file each comes from."""
    examples: dict[str, str] = {}
    excerpts: dict[str, tuple[str, str]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        blocks = PYTHON_BLOCK.finditer(_expanded(page.read_text()))
        for number, block in enumerate(blocks, start=1):
            name = f"{page.relative_to(ROOT)}:{number}"
            excerpt = EXCERPT_TITLE.search(block["attributes"])
            if excerpt:
                excerpts[name] = (excerpt["path"], block["code"])
            elif block["code"] not in examples.values():
                examples[name] = block["code"]
    return examples, excerpts


EXAMPLES, EXCERPTS = _blocks()


def test_the_site_has_examples_and_every_component_page_includes_its_readme_example():
    assert len(EXAMPLES) >= 7, sorted(EXAMPLES)
    for component in ("dtensor", "dmodule", "doptim", "dcheckpoint", "dpipe"):
        page = (DOCS / "components" / f"{component}.md").read_text()
        assert f'--8<-- "packages/{component}/README.md:example"' in page, component


@pytest.mark.parametrize("name", sorted(EXCERPTS))
def test_an_excerpt_is_taken_from_the_file_its_title_names(name: str):
    path, code = EXCERPTS[name]
    source = (ROOT / path).read_text()
    missing = [line.strip() for line in code.splitlines() if line.strip() and line.strip() not in source]
    assert not missing, f"{name}: {path} has no line {missing[0]!r}; update the excerpt or its title"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_runs(name: str, tmp_path: Path):
    code = EXAMPLES[name]
    script = tmp_path / "example.py"
    script.write_text(code)
    torchrun = TORCHRUN_LINE.match(code)
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", torchrun["ranks"], script.name]
        with _machine_wide_rank_lock():
            result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    else:
        command = [sys.executable, script.name]
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
