#!/usr/bin/env bash
# Install (if needed) and run the test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
# pytest exits 5 when it collected no tests; that is not a failure of the suite.
if [ "$rc" -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi
exit "$rc"
