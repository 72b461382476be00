#!/usr/bin/env bash
# The main job on the embedded default: install, prepare target and drafter, serve with DSpark, show it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/dspark-ctl --help
