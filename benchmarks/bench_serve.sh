#!/usr/bin/env bash
# Online serving benchmark: `omforge serve BUNDLE` on 127.0.0.1 driven by the peers' own load generator
# (benchmarks/harness/loadgen.py, streaming /v1/completions) at the levels of benchmarks/harness/serve_peers.sh —
# short-chat (128 → 128) at concurrency 1, 8, 32 and Poisson rates, shared-prefix at concurrency 8 — with the
# same seeds, greedy, EOS ignored. One JSON line per level goes to $OUT; a table is printed at the end.
# Usage: benchmarks/bench_serve.sh BUNDLE [extra omforge serve args…]
set -euo pipefail
BUNDLE=${1:?usage: bench_serve.sh BUNDLE [serve args…]}
shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
BENCH=${BENCH:-$HERE/benchmarks/harness}
PY=$HERE/.venv/bin/python
OUT=${OUT:-/tmp/omforge-bench-serve.jsonl}
RATES=${RATES:-"1 2 4"}
LOG=$(mktemp /tmp/omforge-bench-serve.XXXXXX)
"$HERE/.venv/bin/omforge" serve "$BUNDLE" --port 0 "$@" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$LOG"' EXIT
URL=
for _ in $(seq 1 240); do
  URL=$(grep -o 'http://[^ ]*/v1' "$LOG" | sed 's,/v1$,,' || true)
  [ -n "$URL" ] && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.5
done
[ -n "$URL" ] || { echo "server did not start" >&2; exit 1; }
head -1 "$LOG"
: >"$OUT"
E="omforge serve ($(git -C "$HERE" rev-parse --short HEAD))"
lg() { "$PY" "$BENCH/loadgen.py" --base-url "$URL" --tokenizer "$BUNDLE" --engine "$E" --ignore-eos \
         --deadline 900 --timeout 600 --out "$OUT" "$@" | tail -1 >/dev/null; }
lg --workload short-chat --seed 11 --num 8 --concurrency 1
lg --workload short-chat --seed 12 --num 32 --concurrency 8
lg --workload short-chat --seed 13 --num 64 --concurrency 32
seed=20
for r in $RATES; do lg --workload short-chat --seed $((seed++)) --num 32 --rate "$r"; done
lg --workload shared-prefix --seed 15 --num 32 --concurrency 8
"$PY" - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'workload':14} {'load':>10} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>6} {'errors':>6}")
for r in rows:
    load = f"c={r['concurrency']}" if r["concurrency"] else f"{r['rate']} req/s"
    print(f"{r['workload']:14} {load:>10} {r['output_tok_s']:7.1f} {r['ttft_ms_p50']:9.0f} {r['ttft_ms_p99']:7.0f} "
          f"{r['itl_ms_p50']:8.1f} {r['itl_ms_p99']:6.1f} {r['errors']:6d}")
PY
