#!/usr/bin/env bash
# Start `stepserve serve` on 127.0.0.1, run bench/serving.py against it, stop the server.
# It starts Ray: run it under the shared lock, e.g.
#   flock /tmp/stepserve-ray.lock bench/serve_and_bench.sh "--model tiny --replicas 2" \
#       --dataset long-tail --request-rate 2,4,8 --label "stepserve 2 replicas" \
#       --result-file bench/results/serving_2_replicas.json
# `--model tiny` stands for the benchmarks' tiny random Llama (built on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
SERVE_ARGS=${1:?usage: serve_and_bench.sh "<stepserve serve args>" <bench/serving.py args>}
shift
TINY=$($PY -c 'from bench._models import tiny_model_dir; print(tiny_model_dir())')
SERVE_ARGS=${SERVE_ARGS//--model tiny/--model $TINY}
PORT=${PORT:-8011}
LOG=$(mktemp /tmp/stepserve-serve.XXXXXX.log)

# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
.venv/bin/stepserve serve $SERVE_ARGS --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
stop() {
    kill -INT "$SERVER" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || return 0; sleep 1; done
    kill -TERM "$SERVER" 2>/dev/null || true
}
trap stop EXIT

for _ in $(seq 300); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    kill -0 "$SERVER" 2>/dev/null || { cat "$LOG"; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server not healthy"; cat "$LOG"; exit 1; }
$PY bench/serving.py --base-url "http://127.0.0.1:$PORT" "$@"
