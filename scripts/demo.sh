#!/usr/bin/env bash
# The main job end to end on the test model: set up, compile SmolLM2-135M into a bundle, serve it on
# 127.0.0.1, answer one chat request through the OpenAI-compatible API, stop the server (SIGTERM drain).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
OUT=${OUT:-build/smollm2-135m}
.venv/bin/omforge compile models/smollm2-135m.yaml -o "$OUT"
.venv/bin/omforge inspect "$OUT" --no-verify
LOG=$(mktemp /tmp/omforge-demo-serve.XXXXXX)
.venv/bin/omforge serve "$OUT" --port 0 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; cat "$LOG"; rm -f "$LOG"' EXIT
URL=
for _ in $(seq 1 240); do  # bounded: at most 120 s to load the bundle
  URL=$(grep -o 'http://[^ ]*/v1' "$LOG" || true)
  [ -n "$URL" ] && break
  kill -0 $SERVER 2>/dev/null || { echo "omforge serve exited" >&2; exit 1; }
  sleep 0.5
done
[ -n "$URL" ] || { echo "omforge serve did not start within 120 s" >&2; exit 1; }
.venv/bin/python - "$URL" <<'PY'
import sys
import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
r = client.chat.completions.create(model="smollm2-135m", max_tokens=32, temperature=0,
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
print(r.choices[0].message.content)
print(f"[{r.usage.prompt_tokens} prompt + {r.usage.completion_tokens} completion tokens, "
      f"finish={r.choices[0].finish_reason}, served at {sys.argv[1]}]", file=sys.stderr)
PY
echo "
To keep a server running:  .venv/bin/omforge serve $OUT --port 8000
and ask it from another terminal:
  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32}'" >&2
