#!/usr/bin/env bash
# A/B of two revisions in one sitting: omforge at REV (a git worktree, run through PYTHONPATH with this checkout's
# venv and kernel library — valid while no kernel source differs) against this working tree, SmolLM2-135M fp32:
# serving short-chat at concurrency 32 (64 requests, loadgen) and offline short-chat 64 (offline.py), alternated
# twice. The load generators are the peers' harness (BENCH, default benchmarks/harness, as bench_serve.sh uses).
# Usage: benchmarks/ab_revisions.sh REV   → JSON lines in $OUT (default /tmp/ab.jsonl)
set -euo pipefail
REV=${1:?usage: ab_revisions.sh REV}
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE"
PY=$HERE/.venv/bin/python; BENCH=${BENCH:-$HERE/benchmarks/harness}; OUT=${OUT:-/tmp/ab.jsonl}; WORK=${WORK:-/tmp/ab}
: > "$OUT"; mkdir -p "$WORK/path"
git diff --quiet "$REV" -- runtime/ort/kernels || { echo "kernel sources differ from $REV: rebuild instead" >&2; exit 2; }
[ -d "$WORK/old" ] || git worktree add -f "$WORK/old" "$REV" -q
cp runtime/ort/kernels/*.so "$WORK/old/runtime/ort/kernels/"
ln -sfn "$WORK/old" "$WORK/path/omforge"
[ -f "$WORK/new-bundle/manifest.json" ] || "$PY" -m omforge compile models/smollm2-135m.yaml -o "$WORK/new-bundle"
[ -f "$WORK/old-bundle/manifest.json" ] || (cd /tmp && PYTHONPATH=$WORK/path "$PY" -m omforge compile \
  "$WORK/old/models/smollm2-135m.yaml" -o "$WORK/old-bundle")
serve_c32() {  # LABEL PYTHONPATH BUNDLE
  local log; log=$(mktemp)
  (cd /tmp && PYTHONPATH=$2 exec "$PY" -m omforge serve "$3" --port 0) > "$log" 2>&1 &
  local pid=$! url=""
  for _ in $(seq 1 240); do
    url=$(grep -o 'http://[^ ]*/v1' "$log" | sed 's,/v1$,,' || true); [ -n "$url" ] && break; sleep 0.5
  done
  [ -n "$url" ] || { cat "$log"; kill $pid; return 1; }
  "$PY" "$BENCH/loadgen.py" --base-url "$url" --tokenizer "$3" --engine "omforge $1" --ignore-eos --deadline 900 \
    --timeout 600 --out "$OUT" --workload short-chat --seed 13 --num 64 --concurrency 32 | tail -1
  kill -TERM $pid; wait $pid 2>/dev/null || true; rm -f "$log"
}
offline64() {  # LABEL PYTHONPATH BUNDLE
  (cd /tmp && PYTHONPATH=$2 "$PY" "$BENCH/offline.py" --engine omforge --model "$3" --engine-model "$3" --threads 2 \
    --workload short-chat --num 64 --runs 2 --label "$1" --out "$OUT" 2>&1 | grep -v -i warn | tail -2)
}
for round in 1 2; do
  serve_c32 "old-r$round" "$WORK/path" "$WORK/old-bundle"
  serve_c32 "new-r$round" "" "$WORK/new-bundle"
  offline64 "old-r$round" "$WORK/path" "$WORK/old-bundle"
  offline64 "new-r$round" "" "$WORK/new-bundle"
done
git worktree remove --force "$WORK/old"
