#!/usr/bin/env bash
# The main job on the embedded default: install, prepare SmolLM2-135M-Instruct and the shipped
# drafter, serve with DSPARK_LIVE on CPU through plain `python -m sglang.launch_server`, send a few
# requests of each domain, print what happened and how to reach the server (left running).
#
# Environment: PORT (default 30000), DSPARK_DRAFTER (a drafter folder instead of the shipped one),
# DSPARK_MAIN_STOP=1 (stop the server at the end instead of leaving it up), plus the DSPARK_*
# knobs of the README section "Serving with DSPARK_LIVE".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=.venv/bin/python
PORT=${PORT:-30000}
RUN_DIR=runs/main
mkdir -p "$RUN_DIR"

TARGET=$(.venv/bin/dspark-ctl prepare --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["model_path"])')
DRAFTER=${DSPARK_DRAFTER:-$("$PY" -c 'from dspark_ctl.serve import find_shipped_drafter as f; print(f() or "")')}
if [ -z "$DRAFTER" ]; then
    echo "error: no shipped drafter under drafters/ or profiles/; set DSPARK_DRAFTER=/path/to/drafter" >&2
    exit 2
fi
echo "target:  $TARGET"
echo "drafter: $DRAFTER"

SERVE=(env SGLANG_USE_CPU_ENGINE=1 "$PY" -m sglang.launch_server
       --model-path "$TARGET" --speculative-algorithm DSPARK_LIVE --speculative-draft-model-path "$DRAFTER"
       --device cpu --dtype bfloat16 --host 127.0.0.1 --port "$PORT"
       --max-total-tokens 16384 --max-running-requests 16 --sleep-on-idle)
echo "serving: ${SERVE[*]}"
setsid "${SERVE[@]}" > "$RUN_DIR/server.log" 2>&1 &
SERVER_PID=$!
echo "$SERVER_PID" > "$RUN_DIR/server.pid"

for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
    if ! kill -0 "$SERVER_PID" 2> /dev/null; then
        echo "error: the server exited; last lines of $RUN_DIR/server.log:" >&2
        tail -40 "$RUN_DIR/server.log" >&2
        exit 1
    fi
    sleep 2
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "error: server not healthy after 600 s" >&2; exit 1; }

"$PY" - "$TARGET" "$PORT" <<'EOF'
"""Two requests of each domain, then what happened: tau, tokens/s, verify budgets."""
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from transformers import AutoTokenizer

target, port = sys.argv[1], sys.argv[2]
url = f"http://127.0.0.1:{port}"
prompts = {
    "math": ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?",
             "What is 15 + 27? Explain step by step."],
    "code": ["Write a Python function that returns the n-th Fibonacci number.",
             "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n"],
    "chat": ["Hi! How are you today?", "Can you recommend a good book for a long train ride?"],
}
tokenizer = AutoTokenizer.from_pretrained(target)
client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=8))  # open connections, as a serving client keeps


def ask(domain_prompt):
    domain, prompt = domain_prompt
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    started = time.perf_counter()
    reply = client.post(f"{url}/generate", json={
        "text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": 128}}).json()
    return domain, prompt, reply, time.perf_counter() - started


jobs = [(d, p) for d, ps in prompts.items() for p in ps]
ask(jobs[0])  # warm-up
print("\n== one request at a time ==")
for domain, prompt, reply, seconds in map(ask, jobs):
    meta = reply["meta_info"]
    print(f"[{domain}] {prompt[:60]!r}")
    print(f"   -> {reply['text'][:160]!r}")
    print(f"   {meta['completion_tokens']} tokens in {seconds:.1f} s = {meta['completion_tokens'] / seconds:.1f} tok/s, "
          f"tau {meta.get('spec_accept_length', 0):.2f} tokens/step, verify budget "
          f"{meta.get('spec_cap_length', 0):.2f} tokens/step over {meta.get('spec_verify_ct', 0)} steps")
print("\n== all six at once ==")
started = time.perf_counter()
with ThreadPoolExecutor(len(jobs)) as pool:
    results = list(pool.map(ask, jobs))
wall = time.perf_counter() - started
tokens = sum(r[2]["meta_info"]["completion_tokens"] for r in results)
steps = sum(r[2]["meta_info"].get("spec_verify_ct", 0) for r in results)
print(f"{tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s aggregate; tau {tokens / max(steps, 1):.2f}; "
      f"verify budget {statistics.mean(r[2]['meta_info'].get('spec_cap_length', 0) for r in results):.2f} tokens/step")
EOF

echo
echo "The server is up (pid $SERVER_PID, log $RUN_DIR/server.log):"
echo "  curl http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "       -d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'"
echo "  OpenAI-compatible base URL: http://127.0.0.1:$PORT/v1   (also /generate, /v1/completions)"
echo "  stop it with: kill -- -$SERVER_PID"
if [ "${DSPARK_MAIN_STOP:-0}" = "1" ]; then
    kill -- "-$SERVER_PID"
    echo "stopped (DSPARK_MAIN_STOP=1)"
fi
