"""Keep every veScale package at one version: the one in the repository's VERSION file.

    python tools/bump_version.py 0.2.0    # write 0.2.0 to VERSION, every package and every sibling pin
    python tools/bump_version.py --check  # exit 1, naming each file, where anything disagrees with VERSION

The packages release in lockstep: each pyproject.toml carries ``version = "<VERSION>"`` and
pins each sibling it needs as ``vescale-<name>==<VERSION>``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_FILE = ROOT / "VERSION"
PACKAGE_VERSION = re.compile(r'^version = "(?P<version>[^"]+)"$', re.MULTILINE)
# An item of a dependency array: an indented, quoted requirement on its own line.
SIBLING_PIN = re.compile(
    r'^(?P<indent>\s+)"(?P<name>vescale(?:-[a-z]+)?)(?P<specifier>[^"]*)",$', re.MULTILINE
)
RELEASE = re.compile(r"^\d+\.\d+\.\d+([.-]?(a|b|rc|dev|post)\d+)?$")


def pyproject_files() -> list[Path]:
    return sorted(ROOT.glob("packages/*/pyproject.toml"))


def disagreements(version: str) -> list[str]:
    """Every place that does not carry ``version``, as 'file: what it says'."""
    problems = []
    for pyproject in pyproject_files():
        text = pyproject.read_text()
        declared = PACKAGE_VERSION.search(text)
        relative = pyproject.relative_to(ROOT)
        if declared is None or declared["version"] != version:
            problems.append(
                f"{relative}: version is {declared and declared['version']!r}, VERSION says {version}"
            )
        for pin in SIBLING_PIN.finditer(text):
            if pin["specifier"] != f"=={version}":
                requirement = f"{pin['name']}{pin['specifier']}"
                problems.append(f"{relative}: dependency {requirement!r} must be {pin['name']}=={version}")
    return problems


def bump(version: str) -> None:
    if not RELEASE.match(version):
        raise SystemExit(f"bump_version: {version!r} is not a release number like 0.2.0 or 0.2.0rc1")
    for pyproject in pyproject_files():
        text = PACKAGE_VERSION.sub(f'version = "{version}"', pyproject.read_text(), count=1)
        text = SIBLING_PIN.sub(lambda pin: f'{pin["indent"]}"{pin["name"]}=={version}",', text)
        pyproject.write_text(text)
    VERSION_FILE.write_text(f"{version}\n")
    print(f"bump_version: {len(pyproject_files())} packages now at {version}; re-run bash tools/setup.sh")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("version", nargs="?", help="the new version of every package")
    group.add_argument("--check", action="store_true", help="verify that everything matches VERSION")
    arguments = parser.parse_args(argv)
    if arguments.version:
        bump(arguments.version)
        return 0
    version = VERSION_FILE.read_text().strip()
    problems = disagreements(version)
    for problem in problems:
        print(f"bump_version: {problem}", file=sys.stderr)
    if problems:
        print("bump_version: fix with: python tools/bump_version.py " + version, file=sys.stderr)
        return 1
    print(f"bump_version: {len(pyproject_files())} packages in lockstep at {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
