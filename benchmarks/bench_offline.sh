#!/usr/bin/env bash
# Offline throughput of omforge with the peers' own harness (benchmarks/harness/offline.py, its OmforgeAdapter),
# on the workloads of docs/peers.md. Usage: benchmarks/bench_offline.sh BUNDLE [RUNS]
# The bundle's tokenizer.json builds the exact-length prompts; greedy, EOS ignored, fixed output lengths.
set -euo pipefail
BUNDLE=${1:?usage: bench_offline.sh BUNDLE [RUNS]}
RUNS=${2:-2}
HERE=$(cd "$(dirname "$0")/.." && pwd)
BENCH=${BENCH:-$HERE/benchmarks/harness}
PY=$HERE/.venv/bin/python
run() { "$PY" "$BENCH/offline.py" --engine omforge --model "$BUNDLE" --engine-model "$BUNDLE" --runs "$RUNS" "$@"; }
run --workload single --ttft
run --workload short-chat --num 16
run --workload short-chat --num 64
run --workload shared-prefix
run --workload long-prompt
