#!/usr/bin/env bash
# Each package, installed alone, imports and passes its own tests.
#
#   bash tools/check_components.sh               # the six components, then the meta-package
#   bash tools/check_components.sh dcheckpoint   # the ones you name
#
# Each package's README example (the python block between its `--8<-- [start:example]` and
# `[end:example]` lines; the documentation site shows the same block) runs there too, as a
# script: `python example.py`, or under torchrun when its first line says
# `# torchrun --nproc-per-node N`.
#
# "Alone" means: its wheel (not an editable install) in a fresh virtual environment that sees
# torch and the test tools, plus the sibling wheels it declares, and nothing else of veScale:
# for a component, no meta-package and no undeclared sibling. Needs .venv (bash tools/setup.sh)
# for hatchling.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
work="$root/.ci-work"
python_bin="${VESCALE_PYTHON:-python3}"
components=("$@")
[[ ${#components[@]} -gt 0 ]] || components=(dtensor dmodule doptim dcheckpoint dpipe planner vescale)
say() { printf '[check_components] %s\n' "$*"; }
site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# Run packages/<component>/README.md's example with the component's environment ($2).
run_readme_example() {
    local readme="packages/$1/README.md" script="$work/readme-example-$1/example.py" ranks
    if ! grep -q -- '--8<-- \[start:example\]' "$readme"; then
        say "$readme has no example section; nothing to run"
        return
    fi
    mkdir -p "$(dirname "$script")"
    # The lines between the markers, without the opening and closing fences.
    sed -n '/--8<-- \[start:example\]/,/--8<-- \[end:example\]/p' "$readme" | sed '1,2d' | sed '$d' | sed '$d' \
        > "$script"
    ranks=$(sed -n '1s/^# torchrun --nproc-per-node \([0-9][0-9]*\).*/\1/p' "$script")
    say "$1 alone: running its README example${ranks:+ on $ranks processes}"
    if [[ -n "$ranks" ]]; then
        (cd "$(dirname "$script")" && "$2/bin/python" -m torch.distributed.run --standalone \
            --nproc-per-node "$ranks" example.py)
    else
        (cd "$(dirname "$script")" && "$2/bin/python" example.py)
    fi
}

mkdir -p "$work"
rm -rf "$work/wheels"
say "building the wheels of every package"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" packages/*/

# One environment with torch and the test tools only, shared (through a .pth line) by the
# per-component environments so that torch is installed once.
# The meta-package's own third-party dependencies (the CLI's typer and rich) are in it too, since
# the per-component installs below see only the local wheels.
if [[ ! -x "$work/base/bin/python" ]] || ! "$work/base/bin/python" -c "import typer, rich" 2>/dev/null; then
    say "creating the base environment (torch and the test tools, no veScale package)"
    [[ -x "$work/base/bin/python" ]] || "$python_bin" -m venv "$work/base"
    "$work/base/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 \
        pytest==9.2.0 pytest-xdist==3.8.0 pytest-timeout==2.4.0 transformers==5.23.0 "typer>=0.12" "rich>=13"
fi
base_site="$(site_packages "$work/base")"

for component in "${components[@]}"; do
    env="$work/env-$component"
    rm -rf "$env"
    # No pip or setuptools of its own (they would shadow the base's): the base's pip installs into it.
    "$python_bin" -m venv --without-pip "$env"
    echo "$base_site" > "$(site_packages "$env")/_vescale_base_environment.pth"
    distribution="vescale-$component"
    [[ "$component" != vescale ]] || distribution=vescale
    "$work/base/bin/python" -m pip --python "$env/bin/python" install -q --disable-pip-version-check \
        --no-index --find-links "$work/wheels" "$distribution"
    "$env/bin/python" tools/check_alone.py "$component"
    run_readme_example "$component" "$env"
    if [[ "$component" == vescale && -z "${VESCALE_CHECK_META_TESTS:-}" ]]; then
        # The meta-package declares every component, so "alone" adds nothing to its tests beyond a
        # wheel install, checked above; the README's suite runs them (VESCALE_CHECK_META_TESTS=1 here too).
        "$env/bin/vescale" --help > /dev/null
        say "$distribution alone: installs, imports and runs \`vescale --help\`; its tests run in the README's suite"
        continue
    fi
    say "$distribution alone: running packages/$component/tests"
    "$env/bin/python" -m pytest -n "${VESCALE_TEST_WORKERS:-2}" --dist loadfile --durations=0 --durations-min=5 "packages/$component/tests"
done
say "each package installs alone and passes its tests: ${components[*]}"
