#!/usr/bin/env bash
# The test command: the whole suite on pytest-xdist workers, or only what you name.
#
#   bash tools/test.sh                         # every package
#   bash tools/test.sh packages/dtensor        # one package (any pytest arguments work)
#   VESCALE_TEST_WORKERS=4 bash tools/test.sh  # more xdist workers (default 2)
#
# Each xdist worker keeps its own pool of rank processes (vescale.dtensor.testing);
# --dist loadfile keeps a test file on one worker so that its multi-rank tests share a warm pool.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
venv_program python
exec "$program" -m pytest -n "${VESCALE_TEST_WORKERS:-2}" --dist loadfile "$@"
