# Sourced by the tools that run a program of the repository's .venv (test.sh, typecheck.sh).
#
#   source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
#   venv_program mypy      # cd to the repository root; $program is .venv/bin/mypy
#
# Exits 2, naming the calling tool and the command that creates the .venv, when it is missing.
venv_program() {
    local caller="${BASH_SOURCE[1]}"
    root="$(cd "$(dirname "$caller")/.." && pwd)"
    cd "$root"
    program="$root/.venv/bin/$1"
    if [[ ! -x "$program" ]]; then
        echo "tools/$(basename "$caller"): $program is missing; run: bash tools/setup.sh" >&2
        exit 2
    fi
}
