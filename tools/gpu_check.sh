#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the GPU machine: GPU tests first, then benchmarks.
# Results land in $OUT (default benchmarks/out) as results.tar.gz + summary.txt (the device returns
# at most 8 files, so the per-benchmark JSON/markdown files are bundled).
#
#   bash tools/gpu_check.sh                          # every stage, one after the other, on GPU 0
#   bash tools/gpu_check.sh tests profile            # some stages, in this order
#   bash tools/gpu_check.sh 0:tests,graphtests 1:search   # lanes: one per GPU, run side by side
#   bash tools/gpu_check.sh 0:search=llama-1b-prefill,packs=gpt2 1:search=resnet-50   # per-lane recipes
#   PACK_BUDGET=48 PACK_TIME=280 bash tools/gpu_check.sh 0:packs=llama-1b-prefill+gpt2         # first call
#   PACK_BUDGET=48 PACK_TIME=280 bash tools/gpu_check.sh 0:packs=resnet-50+qwen2-0.5b-prefill  # and call 2
#   # still to measure (issue 39), first: the gated pack with the attention block (placed at 828741d without the
#   # gate), pack+graphs beside graphs and compiled-loop at b1 and b8 in one call, Qwen2-0.5B's decode, the GEMV
#   # probe of gate_up, the projections and the LM head. A gated decode build needs about 100 s past
#   # DECODE_LIMIT (packing, the gate, its second check); the compiled-loop column about 90 s per column process:
#   FORGEPACK_COMMIT=<sha> DEADLINE=580 DECODE_BUDGET=24 DECODE_LIMIT=100 DECODE_BUILD_TIME=230 DECODE_BATCHES=1,8 \
#     DECODE_PROMPTS=128,1024 DECODE_ROUNDS=5 DECODE_COLUMN_LIMIT=120 DECODE_BENCH_TIME=300 DECODE_COLUMNS=graphs,compiled-loop \
#     bash tools/gpu_check.sh decode=llama-1b-decode
#   GEMV_ARGS="--only gate_up,proj_add,lm_head" bash tools/gpu_check.sh gemv=llama decode=qwen2-0.5b-decode tests=blocks
#   # tests=blocks needs TESTS_TIME >= 130: its test that verifies every block render on the GPU takes 91 s on an
#   # H100 (the per-test limit is TESTS_TIME - 20; at 100 it cut that test: 2026-12-07-h100-decode-kernels-named)
#   # then the Qwen2 envelope pack within 3% of the
#   # exact pack at its prefill shape, now that the rotary folds over batch and tokens (on the CPU it fuses what the
#   # exact pack fuses: benchmarks/2026-12-05-cpu-parity); one call (about 560 s), then the Llama twin, then
#   # `tests=fusion_families` (the size-generic rotary's CUDA cases)
#   ENVELOPE_MARGIN=-0.99 ENVELOPE_STRATEGY=breadth ENVELOPE_BUDGET=80 ENVELOPE_LIMIT=220 ENVELOPE_BUILD_TIME=290 \
#     ENVELOPE_TRACE=0 BUILD_LIMIT=50 PACK_BUDGET=10 BUILD_TIME=100 SHAPES_TIME=110 OVERHEAD_TIME=60 \
#     SHAPES_ARGS="--batches 1,8 --prompts 16,512,2048 --caches 16,2048 --rounds 10" OVERHEAD_ARGS="--shapes base" \
#     DEADLINE=585 bash tools/gpu_check.sh build=qwen2-0.5b-prefill envelope=qwen2-0.5b-prefill \
#     shapes=qwen2-0.5b-prefill overhead=qwen2-0.5b-prefill
#
# Set FORGEPACK_COMMIT to the literal commit sent: on the device machine `git rev-parse HEAD` has
# answered an older commit than the tree it was given.
#
# Without lanes every stage runs in order on GPU 0 (a lane of its own).
#
# A lane `N:a,b,c` runs its stages in order on GPU N (CUDA_VISIBLE_DEVICES=N) with its own results
# folder ($OUT/laneN/results), forgepack home and cache, so two lanes never share a file. Lanes share
# the host's CPUs: eager timings are launch-bound and so CPU-sensitive; every benchmark compares its
# columns interleaved in one process, so the ratios hold, but absolute ms move with the load.
#
# Stages: tests graphtests profile evaluate templates search dispatch packs fusion graphs probe kernels=a+b
#   build=a+b serve=a+b (issue 21: a pack per recipe, then the serving benchmark with it)
#   envelope=a+b (issue 20: per base recipe, tools/bench_envelope.py builds the envelope pack, keeps its
#          wheel under this lane's packs/, then runs the mixed generate() trace on it. Knobs: ENVELOPE_ARGS
#          (the envelope, default --batch 1-8 --seq-len 16-2048), ENVELOPE_BUDGET (48), ENVELOPE_LIMIT (the
#          build's own --time-limit for profile + search, 240 s: it then packs what it has), ENVELOPE_BUILD_TIME
#          (the stage's limit, 420), ENVELOPE_MARGIN (the build's accept margin; -0.99 keeps every verified
#          kernel, for issue 20's served-share target), ENVELOPE_GATE (1: build with the end-to-end gate, as a user
#          would; default off), ENVELOPE_STRATEGY (the build's --strategy; breadth: one call per card first),
#          ENVELOPE_TRACE (0: build only), ENVELOPE_TRACE_ARGS (--requests 8), ENVELOPE_TIME (240), ENVELOPE_PACK (a
#          carried wheel, e.g. under packs/: no build, the trace on it))
#   shapes=a+b (issue 20's speed targets: tools/bench_shapes.py times stock, the envelope pack (an envelope=a stage's
#          wheel, or SHAPES_PACK) and the exact pack (a build=a stage's, or SHAPES_EXACT) side by side at the base shape and
#          over a grid of prefill and decode shapes. Knobs: SHAPES_TIME (240), SHAPES_ARGS. build=a takes BUILD_LIMIT
#          (its --time-limit). One call:  BUILD_LIMIT=150 ENVELOPE_GATE=1 ENVELOPE_TRACE=0 bash tools/gpu_check.sh
#          build=llama-1b-decode envelope=llama-1b-decode shapes=llama-1b-decode)
#   overhead=a+b (tools/probe_overhead.py: host time per op, stock against the envelope and exact packs of shapes=a; OVERHEAD_ARGS)
#   gemv=a+b: tools/probe_gemv_blocks.py per shape (llama, qwen2): the GEMV blocks' template axes swept on the GPU
#   tests=a+b: the GPU tests of tests/test_a.py and tests/test_b.py only (per lane).
#   search=a+b: the allocator-vs-uniform benchmark on these recipes only (per lane).
#   packs: builds a pack per recipe and times eager / pack / graphs / pack+graphs / torch.compile /
#          reduce-overhead side by side (issues 6, 7, 8), then renders the report of the Llama prefill
#          build when it is among them. Knobs: PACK_BUDGET (24), PACK_TIME (seconds before no new recipe
#          starts, 300), PACK_RECIPES (the six reference recipes), PACK_HEAVY (recipes that also get the
#          graphs and reduce-overhead columns: all six).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_ROOT=${OUT:-benchmarks/out}
mkdir -p "$OUT_ROOT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1

# Pure-Python packages the GPU image lacks (tomli_w, anthropic) travel as wheels in .whl/.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

REFERENCE="llama-1b-prefill qwen2-0.5b-prefill gpt2 vit-base resnet-50 llama-1b-decode"

# stage NAME SECONDS CMD...: each stage has its own time limit, so one slow stage cannot cost the
# others their turn (the device call has a hard limit, and the results bundle is made at the end).
# DEADLINE (seconds from the start, default 570): no stage runs past it, so the bundle is always made
# inside the device call's limit (files left deeper than two folders in $OUT would not come back).
stage() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS left=$(( ${DEADLINE:-570} - SECONDS ))
  if (( left < 20 )); then
    echo "=== $LANE$name: skipped, ${left}s left before the deadline" | tee -a "$OUT_ROOT/summary.txt"
    return
  fi
  (( limit > left )) && limit=$left
  echo "=== $LANE$name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/results/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $LANE$name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT_ROOT/summary.txt"
}

# gpu_skips NAME: a GPU test run with -m gpu is expected to run on the device; a skip there (a module whose
# optional package is missing, a test that found no GPU) hides a result, so it fails the check loudly.
# ALLOW_SKIPS=1 accepts them (still listed in the summary).
gpu_skips() {
  local skipped
  skipped=$(grep -E '^SKIPPED ' "$OUT/results/$1.log" 2>/dev/null)
  [ -z "$skipped" ] && return
  { echo "=== $LANE$1: GPU tests skipped that were expected to run:"; echo "$skipped"; } | tee -a "$OUT_ROOT/summary.txt"
  [ "${ALLOW_SKIPS:-0}" = 1 ] || touch "$OUT_ROOT/.skips_failed"
}

# envelope_wheel RECIPE: the wheel an envelope=RECIPE stage kept under this lane's $OUT/packs (empty if none)
envelope_wheel() {
  ls "$OUT/packs/forgepack_pack_${1//[-.]/_}_envelope"-*.whl 2>/dev/null | head -1
}

run_stage() {
  local packs_dir="$FORGEPACK_HOME/packs"
  case $1 in
    tests|tests=*) # one process per file, each with its own limit: a slow file cannot hide another's failures
               # tests=a+b: these files only (tests/test_a.py, tests/test_b.py), per lane
               local files=${GPU_TESTS:-$(grep -l "mark.gpu\|pytestmark" tests/test_*.py | grep -v test_graphs.py)}
               if [[ $1 == tests=* ]]; then files=${1#tests=}; files="tests/test_${files//+/.py tests/test_}.py"; fi
               for f in $files; do
                 stage "tests-$(basename "$f" .py)" "${TESTS_TIME:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider \
                   -rsfE --tb=short --timeout "$(( ${TESTS_TIME:-200} - 20 ))" "$f"
                 gpu_skips "tests-$(basename "$f" .py)"
               done ;;
    graphtests) # its own process: a failed capture must not be able to disturb the other tests
               stage graphtests 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rsfE --timeout 100 tests/test_graphs.py
               gpu_skips graphtests ;;
    profile)   stage profile "${PROFILE_TIME:-150}" python3 tools/bench_profile.py $REFERENCE ;;
    evaluate)  stage evaluate "${EVALUATE_TIME:-150}" python3 tools/bench_evaluate.py --count 20 ;;
    templates) stage templates "${TEMPLATES_TIME:-200}" python3 tools/bench_templates.py --budget-s "${TEMPLATES_SEARCH_S:-120}" ${TEMPLATES_ARGS:-} ;;
    search|search=*) # search=a+b: these recipes (per lane); else SEARCH_ARGS decides
               local search_args=${SEARCH_ARGS:-}
               [[ $1 == search=* ]] && search_args="--recipes ${1#search=}" && search_args=${search_args//+/ }
               stage search "${SEARCH_TIME:-300}" python3 tools/bench_search.py $search_args ;;
    probe)     stage probe "${PROBE_TIME:-150}" python3 tools/probe_layouts.py ${PROBE_ARGS:-} ;;
    kernels=*) # kernels=a+b: the kernels behind one forward per column, with this lane's packs (run packs first)
               local kr=${1#kernels=}
               stage kernels "${KERNELS_TIME:-240}" python3 tools/probe_kernels.py ${kr//+/ } \
                 --columns "${KERNEL_COLUMNS:-graphs,pack+graphs,compile-ro}" --packs-root "$packs_dir" ;;
    dispatch)  stage dispatch 60 python3 tools/bench_dispatch.py ;;
    packs|packs=*) # packs=a+b: these recipes (per lane); else PACK_RECIPES, else the six reference recipes
               local recipes=${PACK_RECIPES:-$REFERENCE}
               [[ $1 == packs=* ]] && recipes=${1#packs=} && recipes=${recipes//+/ }
               stage packs "$(( ${PACK_TIME:-300} + 200 ))" python3 tools/bench_packs.py $recipes \
                 --budget "${PACK_BUDGET:-24}" --heavy "${PACK_HEAVY:-${REFERENCE// /,}}" \
                 --time-limit "${PACK_TIME:-300}" --workdir "$packs_dir" ${PACK_ARGS:-}
               if [ -d "$packs_dir/llama-1b-prefill" ]; then
                 stage report 60 python3 -m forgepack report "$packs_dir/llama-1b-prefill" \
                   --out "$OUT/results/report-llama-1b-prefill.html"
               fi ;;
    build=*)   # build=a+b: a pack per recipe (PACK_BUDGET calls), wheel and workspace under this lane's home
               local r; for r in $(echo "${1#build=}" | tr + ' '); do
                 stage "build-$r" "${BUILD_TIME:-240}" python3 -m forgepack build "$r" --target cuda \
                   --budget "${PACK_BUDGET:-24}" ${BUILD_LIMIT:+--time-limit "$BUILD_LIMIT"} \
                   --workspace "$FORGEPACK_HOME/ws/$r" --out "$packs_dir/$r"
               done ;;
    decode=*)  # decode=a+b: the recipe's pack with its decode blocks, built as a user builds it (gate on), every
               # candidate's verdict (tools/verdicts.py), then the decode step per column in its own process
               # (tools/bench_decode_step.py: compiled-loop, graphs, pack+graphs). Knobs: DECODE_BUDGET (16),
               # DECODE_LIMIT (profile + search seconds, 240), DECODE_BUILD_TIME (330), DECODE_BATCHES (1),
               # DECODE_PROMPTS (128), DECODE_COLUMNS (graphs,compiled-loop), DECODE_BENCH_TIME (240), DECODE_PACK
               # (a carried wheel: no build), DECODE_ARGS (more build options, e.g. --strategy breadth)
               local r wheel; for r in $(echo "${1#decode=}" | tr + ' '); do
                 wheel=${DECODE_PACK:-}
                 if [ -z "$wheel" ]; then
                   stage "decode-build-$r" "${DECODE_BUILD_TIME:-330}" python3 -m forgepack build "$r" --target cuda \
                     --budget "${DECODE_BUDGET:-16}" --time-limit "${DECODE_LIMIT:-240}" ${DECODE_ARGS:-} \
                     --workspace "$FORGEPACK_HOME/ws/$r" --out "$OUT/packs/$r"
                   stage "decode-verdicts-$r" 30 python3 tools/verdicts.py "$FORGEPACK_HOME/ws/$r"
                   wheel=$(ls "$OUT/packs/$r"/*.whl 2>/dev/null | head -1)
                 fi
                 stage "decode-bench-$r" "${DECODE_BENCH_TIME:-240}" python3 tools/bench_decode_step.py --recipes "$r" \
                   --batches "${DECODE_BATCHES:-1}" --prompts "${DECODE_PROMPTS:-128}" \
                   --columns "${DECODE_COLUMNS:-graphs,compiled-loop}" ${wheel:+--pack "$wheel"} \
                   --rounds "${DECODE_ROUNDS:-7}" --limit "${DECODE_COLUMN_LIMIT:-150}" --out "$OUT/results/decode-$r"
               done ;;
    serve|serve=*) # serve=a+b: tools/bench_serve.py per recipe, with the pack build=a built when there is one
               local m wheel ms=${1#serve}; ms=${ms#=}
               for m in $(echo "${ms:-llama-1b-decode+qwen2-0.5b-prefill}" | tr + ' '); do
                 wheel=$(ls "$packs_dir/$m"/*.whl 2>/dev/null | head -1)
                 stage "serve-$m" "${SERVE_TIME:-420}" python3 tools/bench_serve.py --models "$m" \
                   ${wheel:+--pack "$wheel"} ${SERVE_ARGS:-} --out "$OUT/results"
               done ;;
    envelope=*) # the build in one stage and the trace in another: a cut trace still leaves the wheel
               local b whl env=${ENVELOPE_ARGS:---batch 1-8 --seq-len 16-2048}
               for b in $(echo "${1#envelope=}" | tr + ' '); do
                 if [ -n "${ENVELOPE_PACK:-}" ]; then  # a carried wheel: the trace only
                   stage "envelope-trace-$b" "${ENVELOPE_TIME:-240}" python3 tools/bench_envelope.py --base "$b" $env \
                     --pack "$ENVELOPE_PACK" ${ENVELOPE_TRACE_ARGS:---requests 8}
                   continue
                 fi
                 stage "envelope-build-$b" "${ENVELOPE_BUILD_TIME:-420}" python3 tools/bench_envelope.py --base "$b" \
                   $env --budget "${ENVELOPE_BUDGET:-48}" --time-limit "${ENVELOPE_LIMIT:-240}" \
                   ${ENVELOPE_MARGIN:+--margin "$ENVELOPE_MARGIN"} --strategy "${ENVELOPE_STRATEGY:-allocator}" \
                   $([ "${ENVELOPE_GATE:-0}" = 1 ] || echo --no-gate) --build-only
                 whl=$(envelope_wheel "$b")
                 [ -n "$whl" ] && [ "${ENVELOPE_TRACE:-1}" = 1 ] && stage "envelope-trace-$b" "${ENVELOPE_TIME:-240}" \
                   python3 tools/bench_envelope.py --base "$b" $env --pack "$whl" ${ENVELOPE_TRACE_ARGS:---requests 8}
               done ;;
    shapes=*|overhead=*)
               # shapes=b: issue 20's speed targets (tools/bench_shapes.py); overhead=b: where a pack's eager forward
               # spends host time stock's does not, op by op (tools/probe_overhead.py). Both take the envelope wheel
               # under $OUT/packs (an envelope=b stage's; SHAPES_PACK: a carried one) and the exact pack a build=b stage
               # made, if any (SHAPES_EXACT: a carried one)
               local b env_whl exact_whl kind=${1%%=*}
               for b in $(echo "${1#*=}" | tr + ' '); do
                 env_whl=${SHAPES_PACK:-$(envelope_wheel "$b")}
                 exact_whl=${SHAPES_EXACT:-$(ls "$packs_dir/$b"/*.whl 2>/dev/null | head -1)}
                 if [ -z "$env_whl" ]; then echo "=== $LANE$kind-$b: no envelope wheel" | tee -a "$OUT_ROOT/summary.txt"; continue; fi
                 if [ "$kind" = shapes ]; then
                   stage "shapes-$b" "${SHAPES_TIME:-240}" python3 tools/bench_shapes.py --base "$b" --pack "$env_whl" \
                     ${exact_whl:+--exact "$exact_whl"} --time-limit "$(( ${SHAPES_TIME:-240} - 60 ))" ${SHAPES_ARGS:-}
                 else
                   stage "overhead-$b" "${OVERHEAD_TIME:-120}" python3 tools/probe_overhead.py --base "$b" --pack "$env_whl" \
                     ${exact_whl:+--exact "$exact_whl"} ${OVERHEAD_ARGS:-}
                 fi
               done ;;
    gemv=*)    # gemv=llama+qwen2: tools/probe_gemv_blocks.py, each GEMV block of that shape's decode step over its
               # template's axes, one at a time, then the best of each (GEMV_TIME, default 200; GEMV_ARGS, e.g.
               # --only gate_up,proj_add)
               local a; for a in $(echo "${1#gemv=}" | tr + ' '); do
                 stage "gemv-$a" "${GEMV_TIME:-200}" python3 tools/probe_gemv_blocks.py --arch "$a" \
                   --budget-s "$(( ${GEMV_TIME:-200} - 50 ))" --out "$OUT/results/gemv-$a" ${GEMV_ARGS:-}
               done ;;
    graphs)    stage graphs "${GRAPHS_TIME:-300}" python3 tools/bench_graphs.py ;;
    fusion)    stage fusion "${FUSION_TIME:-300}" python3 tools/bench_fusion.py --budget-s "${FUSION_BUDGET_S:-230}" ;;
    *) echo "unknown stage $1" | tee -a "$OUT_ROOT/summary.txt" ;;
  esac
}

# lane GPU STAGES...: a lane's stages in order, with its own results folder, home and cache.
lane() {
  local gpu=$1; shift
  export CUDA_VISIBLE_DEVICES=$gpu LANE="gpu$gpu/"
  export OUT="$OUT_ROOT/lane$gpu" FORGEPACK_HOME="/tmp/forgepack-home-$gpu" FORGEPACK_CACHE="/tmp/forgepack-cache-$gpu"
  mkdir -p "$OUT/results"
  for s in "$@"; do run_stage "$s"; done
}

# A second run in the same device call (two invocations chained in one command) adds to the first's bundle
# instead of replacing it, so a finished trace is never lost.
for bundle in results packs; do
  [ -f "$OUT_ROOT/$bundle.tar.gz" ] && tar -xzf "$OUT_ROOT/$bundle.tar.gz" -C "$OUT_ROOT" && rm -f "$OUT_ROOT/$bundle.tar.gz"
done

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT_ROOT/summary.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' | tee -a "$OUT_ROOT/summary.txt"

args=${*:-tests graphtests profile evaluate templates search dispatch packs fusion}
if [[ "$args" == *:* ]]; then
  for spec in $args; do
    stages=${spec#*:}
    ( lane "${spec%%:*}" ${stages//,/ } ) &
  done
  wait
else
  ( lane 0 $args )
fi

tar -czf "$OUT_ROOT/results.tar.gz" -C "$OUT_ROOT" $(cd "$OUT_ROOT" && ls -d lane*)
# A file over 16 MiB does not come back from the device, and the bundle holds every result: past 15 MiB it is
# made again without the wheels (kept for a later --pack run), which then come back only if small enough.
if (( $(stat -c %s "$OUT_ROOT/results.tar.gz") > 15 * 1024 * 1024 )); then
  tar -czf "$OUT_ROOT/results.tar.gz" -C "$OUT_ROOT" --exclude='lane*/packs' $(cd "$OUT_ROOT" && ls -d lane*)
  tar -czf "$OUT_ROOT/packs.tar.gz" -C "$OUT_ROOT" $(cd "$OUT_ROOT" && ls -d lane*/packs 2>/dev/null)
  echo "results.tar.gz left the wheels out ($(stat -c %s "$OUT_ROOT/packs.tar.gz") bytes in packs.tar.gz)" \
    | tee -a "$OUT_ROOT/summary.txt"
fi
rm -rf "$OUT_ROOT"/lane*
cat "$OUT_ROOT/summary.txt"
if [ -f "$OUT_ROOT/.skips_failed" ]; then
  rm -f "$OUT_ROOT/.skips_failed"
  echo "FAILED: GPU tests were skipped (see summary.txt; ALLOW_SKIPS=1 to accept)"; exit 1
fi
