#!/usr/bin/env bash
# The first run of omforge's Ascend path, for the day an NPU exists (one Atlas 800I A2 / 910B or 300I Duo; about
# 10 minutes). It compiles the 2-layer tiny recipe (tests/recipes/tiny-llama.yaml: two gears per profile at most) once
# per paged-attention mode for ascend and once for ort, builds each OM with its bundle's build.sh (atc, or the RefData
# builder for inplace), then scripts/ascend_first_run.py checks every gear against the ORT twin, runs a prefill and
# three decode steps through the real pyACL, compares greedy tokens with the ORT bundle and prints one table with the
# decode step time per mode. Nothing here has run: no NPU was available where it was written.
#
# usage: bash scripts/ascend-first-run.sh [SOC_VERSION] [OUT_DIR]   (SOC_VERSION from `npu-smi info`, e.g. Ascend910B3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
soc="${1:-Ascend910B3}"
out="${2:-build/ascend-first-run}"
python="${PYTHON:-python3}"
modes=(inplace gather)  # readonly: add it once the recipe accepts it

if ! "$python" -c "import acl" >/dev/null 2>&1; then
  echo "ascend-first-run: pyACL (import acl) is not importable; source the CANN set_env.sh on a machine with an NPU" >&2
  exit 2
fi
mkdir -p "$out"
recipe_for() {  # recipe_for MODE: the tiny recipe, float16 on $soc, paged_attention MODE
  "$python" - "$1" "$soc" "$out/tiny-$1.yaml" <<'PY'
import sys, yaml
mode, soc, path = sys.argv[1:]
recipe = yaml.safe_load(open("tests/recipes/tiny-llama.yaml"))
recipe.setdefault("compile", {}).update({"soc_version": soc, "weights": "float16", "paged_attention": mode})
yaml.safe_dump(recipe, open(path, "w"))
PY
  echo "$out/tiny-$1.yaml"
}
"$python" -m omforge compile tests/recipes/tiny-llama.yaml --target ort -o "$out/ort"
pairs=()
for mode in "${modes[@]}"; do
  recipe="$(recipe_for "$mode")"
  "$python" -m omforge compile "$recipe" --target ascend -o "$out/$mode" || [[ $? -eq 3 ]]  # 3: the OM step left
  if [[ -z "$(compgen -G "$out/$mode/ascend/om/step*.om" || true)" ]]; then  # compile builds it where atc is found
    bash "$out/$mode/ascend/build.sh"
  fi
  pairs+=("$mode=$out/$mode")
done
"$python" scripts/ascend_first_run.py "$(recipe_for "${modes[0]}")" "$out/ort" "${pairs[@]}"
