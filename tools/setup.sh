#!/usr/bin/env bash
# One-command development set-up: a virtual environment in .venv with the CPU build of
# torch, every veScale package in editable mode, and the test tools.
# Idempotent: re-running it reuses .venv and only installs what changed.
#
#   bash tools/setup.sh            # creates or updates .venv
#   VESCALE_PYTHON=python3.12 bash tools/setup.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python_bin="${VESCALE_PYTHON:-python3}"
venv="$root/.venv"
start=$(date +%s)

say() { printf '[setup] %s\n' "$*"; }

# Torch is pinned to the CPU build that lies on disk; an unpinned torch pulls a multi-GB CUDA build.
torch_spec="torch==2.13.0"
# The packages in dependency order (a sibling is installed before the packages that pin it).
packages=(dtensor dmodule doptim dcheckpoint dpipe planner vescale)
test_tools=(pytest==9.2.0 pytest-xdist==3.8.0 pytest-timeout==2.4.0 ruff==0.17.5 mypy==2.4.1 transformers==5.23.0
    tokenizers==0.23.3 pyarrow==26.0.1 tensorboard==2.21.0)

if [[ -x "$venv/bin/python" ]]; then
    say "reusing $venv ($("$venv/bin/python" --version))"
else
    say "creating $venv with $("$python_bin" --version)"
    "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

say "installing $torch_spec and the build back-end"
"${pip[@]}" install -q "$torch_spec" "hatchling==1.33.0" "editables"

editable_args=()
# The meta-package with its hf extra (the `vescale` command's default model is a transformers one),
# its plot extra (`vescale train --plot`, matplotlib), its data extra (tokenizers, Parquet), its
# datasets extra (`--data` a save_to_disk directory) and its tensorboard extra (`--tensorboard`).
declare -A extras=([vescale]="[hf,plot,data,datasets,tensorboard]")
for name in "${packages[@]}"; do editable_args+=(-e "packages/$name${extras[$name]:-}"); done
say "installing ${#packages[@]} packages in editable mode: ${packages[*]}"
# No build isolation: hatchling is already in .venv, so no throw-away build environments.
"${pip[@]}" install -q --no-build-isolation "${editable_args[@]}"

say "installing the test tools: ${test_tools[*]}"
"${pip[@]}" install -q "${test_tools[@]}"

# The documentation site (mkdocs.yml): `.venv/bin/mkdocs build --strict`, `mkdocs serve`.
docs_tools=(mkdocs==1.6.1 mkdocs-material==9.8.2 "mkdocstrings[python]==1.0.8" mkdocstrings-python==2.0.11)
say "installing the documentation tools: ${docs_tools[*]}"
"${pip[@]}" install -q "${docs_tools[@]}"

installed_torch=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
say "torch $installed_torch; vescale packages:"
"${pip[@]}" list 2>/dev/null | grep -E '^vescale' | sed 's/^/[setup]   /'
say "done in $(( $(date +%s) - start )) s; activate with: source .venv/bin/activate"
