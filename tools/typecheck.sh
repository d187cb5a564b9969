#!/usr/bin/env bash
# The type check CI runs: mypy over every package's src/, configured in pyproject.toml's
# [tool.mypy] (which packages, which modules are strict; CONTRIBUTING.md, "Types").
#
#   bash tools/typecheck.sh                      # everything, as CI checks it
#   bash tools/typecheck.sh -p vescale.dpipe     # one package (any mypy arguments work)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mypy="$root/.venv/bin/mypy"
if [[ ! -x "$mypy" ]]; then
    echo "tools/typecheck.sh: $mypy is missing; run: bash tools/setup.sh" >&2
    exit 2
fi
exec "$mypy" "$@"
