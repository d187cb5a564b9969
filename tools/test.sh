#!/usr/bin/env bash
# The test command: the whole suite, or only what you name.
#
#   bash tools/test.sh                         # every package's tests, each run once (below)
#   bash tools/test.sh packages/dtensor        # a selection, in .venv (any pytest arguments work)
#   VESCALE_TEST_WORKERS=4 bash tools/test.sh  # more xdist workers (default 2)
#
# The whole suite runs each component's tests with that component installed alone, from its
# wheel, beside only the siblings it declares (tools/check_components.sh: the GUIDE's rule that a
# component passes its tests without the meta-package), then the meta-package's tests in .venv,
# where every package is installed. A component's tests passing alone is the stricter check, so
# they do not run a second time in .venv.
#
# Each xdist worker keeps its own pool of rank processes (vescale.dtensor.testing);
# --dist loadfile keeps a test file on one worker so that its multi-rank tests share a warm pool.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
venv_program python
if [[ $# -eq 0 ]]; then
    bash tools/check_components.sh
    exec "$program" -m pytest -n "${VESCALE_TEST_WORKERS:-2}" --dist loadfile --durations=0 --durations-min=5 packages/vescale/tests
fi
exec "$program" -m pytest -n "${VESCALE_TEST_WORKERS:-2}" --dist loadfile "$@"
