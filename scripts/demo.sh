#!/usr/bin/env bash
# The main job end to end on the test model: set up, compile SmolLM2-135M into a bundle, generate from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-build/smollm2-135m}
.venv/bin/omforge compile models/smollm2-135m.yaml -o "$OUT"
.venv/bin/omforge inspect "$OUT" --no-verify
.venv/bin/omforge generate "$OUT" --chat --prompt "What is the capital of France?" --max-tokens 32
