#!/usr/bin/env bash
# The checks that need a GPU or TPU, in one run (a lent machine's time is short); results and logs
# go to OUT (default accelerator-results/):
#   1. tests on the device (`scripts/test.sh --device`: full-fp32 matmuls, batch-invariant
#      numerics), TEST_FILES (default: test_kernels on the device's compiled kernels and at model
#      shapes, and test_numerics); tests.log lists each test's outcome. On an H200 the compiles
#      dominate: 12 tests of the exactness files of issue 16 finished in 200 s (12 workers); on an
#      H100 with the autotuner off, 116 of their 128 in 330 s (14 workers), so run those files
#      (test_hf_roundtrip, test_decoding, test_kv_cache, test_psd, test_mrp, test_policies) in a
#      call of their own, or name the tests still owed (gpu-h100.md);
#   2. benchmarks/decode_gpu.py at SDAR-1.7B shape: the kernels' tile choices, each kernel alone
#      against its XLA path (bench-tiles/: flash attention at 2k and 8k prefills, residual_argmax at
#      64 and 1,024 positions, to pick the dispatchers' defaults), then the decode step (8 chained
#      steps per call) vs the HBM roofline, prefill at 2k and 32k, transformers' eager step
#      (bench-step/), then tokens/s per decoder (bench-decoders/); each prints its rows as it goes
#      (bench-*.log);
#   3. the 32k-token prefill at SDAR-8B shape (bench-8b/);
#   4. benchmarks/exactness.py's cost part at SDAR-1.7B shape: the invariant mode's decode step
#      against the fast mode's at batch 1/16/64 (exactness/);
#   5. bench-moe, named in STAGES only (not in the default plan): decode_gpu.py at an MoE shape (MOE_SHAPE,
#      default llada-moe-7b-a1b, blocks of 32): the step against the active-expert roofline and prefill,
#      kernels on, each with the experts dense (GPU's default) and grouped (through dlmjax's
#      grouped_matmul kernel, which "on" runs; MOE_EXPERTS), then tokens/s of DECODERS (issue 21). On an
#      H100 (2026-11-27) grouped through ragged_dot ran at the FLOPs of XLA's rewrite (every row
#      against every expert); XLA's cuDNN ragged-dot fusion
#      (XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true, where the jaxlib knows the flag,
#      with --kernels auto) is another grouped path to time;
#   6. agreement and exactness-buffers, named in STAGES only (issue 16): the fast mode's token agreement
#      at SDAR-1.7B shape (PSD vs policy, batch 16 vs 1, mrp-spec vs static, or those COMPARISONS names; ~200 s), and the invariant
#      mode's cost at batch 1 and 16 with XLA's command buffers taking while loops and conditionals
#      (compare with the exactness stage's rows: is its cost the loops' host round trips?).
# Each stage has its own time limit (seconds: TEST_S, TILES_S, STEP_S, DECODERS_S, PREFILL_8B_S, MOE_S,
# EXACTNESS_S; by default 575 in all, about one call's worth of a lent machine) so a slow one cannot
# starve the next; STAGES names the stages to run (default: all but stages 5 and 6, in the order above). On the H200 the
# step section, the prefill to 2k and compiles took 150 s, and three decoders (DECODERS) printed no
# row in 125 s: one decoder per run. On an H100 (2026-11-26) every benchmark stage of this default
# plan stopped at its limit mid-table (benchmarks/results/decode_gpu/gpu-h100.md): a 28-layer program
# compiles in ~30 s and a Triton tile choice in 10-20 s, so give a stage fewer rows, not more.
# BENCH_OUT puts the benchmarks' result folders elsewhere than OUT (a lent machine returns at most 8
# files: the logs hold every table).
# On a machine whose python3 holds jax for its accelerator:
#   DLMJAX_PYTHON=python3 scripts/accelerator_checks.sh OUT [gpu|tpu]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-accelerator-results}" && cd "${1:-accelerator-results}" && pwd)"
DEVICE="${2:-gpu}"
BENCH_OUT="${BENCH_OUT:-$OUT}"
PY="${DLMJAX_PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# compiles dominate a lent call: stages and test workers that compile the same program (the step
# forward of bench-step and exactness, a test model's decode loop) reuse it from jax's persistent cache
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/dlmjax-jax-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-1}"
cd "$ROOT"
# A lent machine's python lacks some of dlmjax's dependencies (tensorboardX for training's metrics log,
# gguf for test_smollm2) and cannot fetch them: wheels carried in .whl/ (pip download --no-deps
# tensorboardX gguf, here) are installed beside it
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/dlmjax-wheels "$ROOT"/.whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/dlmjax-wheels"
fi
STAGES="${STAGES:-tests bench-tiles bench-step bench-decoders bench-8b exactness}"
stage() {  # stage NAME SECONDS COMMAND...: run under a time limit (SIGINT first, so pytest prints its summary)
  local name=$1 limit=$2; shift 2
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/stages.txt"
  local start=$SECONDS
  timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   rc $? in $((SECONDS - start))s" | tee -a "$OUT/stages.txt"
  # pytest-xdist's workers can outlive a killed run, holding device memory the next stage needs
  pkill -9 -f 'exec\(eval\(sys\.stdin\.readline\(\)\)\)' 2>/dev/null  # a regex: parentheses escaped
  return 0
}

"$PY" - > "$OUT/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as md, jax
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "torch", "transformers", "hypothesis"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
print("devices", jax.devices(), [d.device_kind for d in jax.devices()])
EOF
cat "$OUT/versions.txt"

# -v -v: test.sh passes -q, and one -v would cancel it
stage tests "${TEST_S:-80}" env DLMJAX_PYTHON="$PY" scripts/test.sh --device "$DEVICE" -n "${TEST_WORKERS:-12}" -v -v \
  -p no:cacheprovider ${TEST_FILES:-tests/test_kernels.py tests/test_numerics.py}
[ -f "$OUT/tests.log" ] && grep -E "(passed|failed|error)" "$OUT/tests.log" | tail -3

BENCH=(benchmarks/decode_gpu.py --shape sdar-1.7b --repeats 10)
stage bench-tiles "${TILES_S:-120}" "$PY" "${BENCH[@]}" --skip step prefill argmax decoders transformers \
  --prefill 2048 8192 --argmax-positions 64 1024 --out "$BENCH_OUT/bench-tiles"
stage bench-step "${STEP_S:-140}" "$PY" "${BENCH[@]}" --skip tiles argmax decoders --prefill 2048 32768 \
  --out "$BENCH_OUT/bench-step"
stage bench-decoders "${DECODERS_S:-130}" "$PY" "${BENCH[@]}" --skip step prefill argmax tiles transformers \
  --batches 1 16 64 --prompts 64 --max-new 64 --out "$BENCH_OUT/bench-decoders" \
  --decoders ${DECODERS:-threshold:tau=0.9}
stage bench-8b "${PREFILL_8B_S:-45}" "$PY" benchmarks/decode_gpu.py --shape sdar-8b --repeats 4 --kernels auto \
  --skip step argmax tiles decoders transformers --prefill 32768 --out "$BENCH_OUT/bench-8b"
stage exactness "${EXACTNESS_S:-60}" "$PY" benchmarks/exactness.py --shape sdar-1.7b --skip-agreement --repeats 10 \
  --out "$BENCH_OUT/exactness"
stage bench-moe "${MOE_S:-240}" "$PY" benchmarks/decode_gpu.py --shape "${MOE_SHAPE:-llada-moe-7b-a1b}" --block 32 \
  --repeats 10 --kernels on --skip tiles argmax transformers --batches 1 16 --prefill 2048 --prompts 16 \
  --max-new 64 --moe-experts ${MOE_EXPERTS:-dense grouped} --decoders ${DECODERS:-threshold:tau=0.9} \
  --out "$BENCH_OUT/bench-moe"
stage agreement "${AGREEMENT_S:-240}" "$PY" benchmarks/exactness.py --shape sdar-1.7b --skip-cost --modes fast \
  --prompts 16 --max-new 32 --batches 16 --comparisons ${COMPARISONS:-psd batch mrp-spec} --out "$BENCH_OUT/agreement"
stage exactness-buffers "${BUFFERS_S:-200}" env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
  "$PY" benchmarks/exactness.py --shape sdar-1.7b --skip-agreement --repeats 10 --batches 1 16 \
  --out "$BENCH_OUT/exactness-buffers"
[ ! -f "$OUT/stages.txt" ] || cat "$OUT/stages.txt"
