#!/usr/bin/env bash
# A third-party benchmark client against `omforge serve`: guidellm 0.8.1 (in its own venv — it pins click ~=8.4,
# so it stays out of the test extra), synchronous profile, 16 requests of synthetic 128-token prompts and 64
# output tokens, the bundle's own tokenizer from a local folder (no hub). Passes when all 16 succeed.
#   bash benchmarks/check_guidellm.sh BUNDLE [PORT]
set -euo pipefail
BUNDLE=$(realpath "$1"); PORT=${2:-18282}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${GUIDELLM_VENV:-/tmp/venv-guidellm}
[ -x "$VENV/bin/guidellm" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "guidellm==0.8.1"; }
WORK=$(mktemp -d); trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
cp "$BUNDLE/tokenizer.json" "$WORK/"
NAME=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['model']['name'])" "$BUNDLE/manifest.json")
"$ROOT/.venv/bin/omforge" serve "$BUNDLE" --port "$PORT" > "$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 120); do curl -s -o /dev/null "http://127.0.0.1:$PORT/health" && break; sleep 0.5; done
(cd "$WORK" && "$VENV/bin/guidellm" run --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=$NAME" \
    --profile kind=synchronous --constraint kind=max_requests,count=16 \
    --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \
    --tokenizer "kind=huggingface_auto,model=$WORK" > "$WORK/guidellm.log" 2>&1)
# the benchmark's own totals (benchmarks.json), not its progress line (sampled before the last count)
python3 - "$WORK/benchmarks.json" <<'PY'
import json, sys
made = json.load(open(sys.argv[1]))["benchmarks"][0]["scheduler_metrics"]["requests_made"]
print("guidellm requests:", made)
assert made["successful"] == 16 and made["errored"] == 0 and made["incomplete"] == 0, made
PY
echo "guidellm: 16/16 requests succeeded against omforge serve"
