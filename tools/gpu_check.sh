#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the GPU machine: GPU tests first, then benchmarks.
# Results land in $OUT (default benchmarks/out) as results.tar.gz + summary.txt (the device returns
# at most 8 files, so the per-benchmark JSON/markdown files are bundled).
#
#   bash tools/gpu_check.sh                 # every stage
#   bash tools/gpu_check.sh tests profile   # some stages, in this order
#
# Stages: tests graphtests profile evaluate templates search dispatch packs fusion graphs
#   packs: builds a pack per reference recipe and times eager / pack / graphs / pack+graphs /
#          torch.compile / reduce-overhead side by side (issues 6, 7, 8), then renders the report of
#          the Llama prefill build. Knobs: PACK_BUDGET (24), PACK_TIME (seconds before no new recipe
#          starts, 420), PACK_RECIPES.
set -uo pipefail
cd "$(dirname "$0")/.."

export OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FORGEPACK_HOME=${FORGEPACK_HOME:-/tmp/forgepack-home}
export FORGEPACK_CACHE=${FORGEPACK_CACHE:-/tmp/forgepack-cache}
export TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1

# Pure-Python packages the GPU image lacks (tomli_w, anthropic) travel as wheels in .whl/.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# stage NAME SECONDS CMD...: each stage has its own time limit, so one slow stage cannot cost the
# others their turn (the device call has a hard limit, and the results bundle is made at the end).
stage() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/results/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}

REFERENCE="llama-1b-prefill qwen2-0.5b-prefill gpt2 vit-base resnet-50 llama-1b-decode"
stages=${*:-tests graphtests profile evaluate templates search dispatch packs fusion}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' | tee -a "$OUT/summary.txt"

for s in $stages; do
  case $s in
    tests)     stage tests "${TESTS_TIME:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 150 \
                 ${GPU_TESTS:-tests --ignore tests/test_graphs.py} ;;
    graphtests) # its own process: a failed capture must not be able to disturb the other tests
               stage graphtests 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 100 tests/test_graphs.py ;;
    profile)   stage profile "${PROFILE_TIME:-150}" python3 tools/bench_profile.py $REFERENCE ;;
    evaluate)  stage evaluate "${EVALUATE_TIME:-150}" python3 tools/bench_evaluate.py --count 20 ;;
    templates) stage templates "${TEMPLATES_TIME:-200}" python3 tools/bench_templates.py --budget-s "${TEMPLATES_SEARCH_S:-120}" ;;
    search)    stage search "${SEARCH_TIME:-300}" python3 tools/bench_search.py ${SEARCH_ARGS:-} ;;
    dispatch)  stage dispatch 60 python3 tools/bench_dispatch.py ;;
    packs)     stage packs "$(( ${PACK_TIME:-300} + 200 ))" python3 tools/bench_packs.py ${PACK_RECIPES:-$REFERENCE} \
                 --budget "${PACK_BUDGET:-24}" --heavy llama-1b-prefill,llama-1b-decode,gpt2,resnet-50 \
                 --time-limit "${PACK_TIME:-300}" --workdir /tmp/forgepack-packs
               stage report 60 python3 -m forgepack report /tmp/forgepack-packs/llama-1b-prefill \
                 --out "$OUT/results/report-llama-1b-prefill.html" ;;
    graphs)    stage graphs "${GRAPHS_TIME:-300}" python3 tools/bench_graphs.py ;;
    fusion)    stage fusion "${FUSION_TIME:-300}" python3 tools/bench_fusion.py --budget-s "${FUSION_BUDGET_S:-230}" ;;
    *) echo "unknown stage $s" | tee -a "$OUT/summary.txt" ;;
  esac
done

tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
cat "$OUT/summary.txt"
