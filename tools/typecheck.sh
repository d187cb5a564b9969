#!/usr/bin/env bash
# The type check CI runs: mypy over every package's src/, configured in pyproject.toml's
# [tool.mypy] (which packages, which modules are strict; CONTRIBUTING.md, "Types").
#
#   bash tools/typecheck.sh                      # everything, as CI checks it
#   bash tools/typecheck.sh -p vescale.dpipe     # one package (any mypy arguments work)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
venv_program mypy
exec "$program" "$@"
