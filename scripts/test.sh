#!/usr/bin/env bash
# Set up, lint (ruff, configured in pyproject.toml) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check --quiet .
exec .venv/bin/pytest -q "$@"
