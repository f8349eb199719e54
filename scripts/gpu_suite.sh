#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA extension there, run the GPU tests, compute-sanitizer
# (memcheck, racecheck) over a small op-test selection, and the benchmarks; everything goes under
# $OUT (default ./gpu_out) with a summary in $OUT/report.md. About 10 minutes on one H200; each
# phase has a time limit (TEST_TIMEOUT 480 s, SANITIZE_TIMEOUT 110 s per tool, BENCH_TIMEOUT 360 s: the table includes profiler kernel times).
#   bash scripts/gpu_suite.sh [pytest selection...]      e.g. bash scripts/gpu_suite.sh tests/test_ops.py
# Env: TESTS=0 skips the tests; TEST_PART=1 / 2 / 3 runs a part of the default selection; BENCH=0 skips benchmarks; BENCH_SIZES overrides the `jaxquant bench` sizes (RxC,...) and
# BENCH_ARGS adds arguments (e.g. --no-stages);
# OPS_BENCH=1 also runs benchmarks/bench_ops.py (per-primitive timings); SANITIZE=0 skips the
# sanitizer; SANITIZE_TESTS (default tests/test_fused_ops.py) and SANITIZE_K (its pytest -k selection) choose what
# runs under it; DIST=1 runs the multi-GPU distributed
# benchmark on every visible GPU (fsdp = 1 on one GPU: no real all-gather; DIST_ARGS, default "--profile --pieces 1,2,8": per-kernel breakdown and other gather piece counts; DIST_NCCL_PROTOS, e.g. "default Simple", repeats it per NCCL protocol; DIST_NCCL_TUNING=1 logs NCCL's protocol choice); TRAIN=1 runs the demo per recipe and mesh and benchmarks/bench_train.py
# (TRAIN_ARGS overrides its model size, TRAIN_BATCH its sequences per GPU, default "2 8"; TRAIN_DEMO=0
# skips the demo runs) and benchmarks/bench_dense.py; E2E=1 runs benchmarks/bench_e2e.py (E2E_ARGS); SP=1 runs
# benchmarks/bench_sp.py (SP_ARGS, SP_FLAG_SETS); FLAX=1 runs benchmarks/bench_flax.py (FLAX_ARGS); E2E_PROFILE=DIR adds --profile DIR to
# bench_e2e and brings back its breakdown.png and compiled HLO; TORCHAO_WHEEL=PATH installs torchao from a carried wheel; CGEMM=1 runs benchmarks/bench_collective_gemm.py (CGEMM_ARGS). SKIP_BUILD=1 reuses the
# extension a previous call built on this (still warm) machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
report=$OUT/report.md
status=0
section() { printf '\n## %s\n' "$1" | tee -a "$report"; }
{
  # the source digest names the measured code: a working tree copied here may keep a stale git HEAD
  echo "# jaxquant GPU report ($(date -u +%Y-%m-%dT%H:%MZ), sources $(bash scripts/source_digest.sh), git HEAD here $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  nvcc --version | tail -1
  echo '```'
} > "$report" 2>&1

# TORCHAO_WHEEL: a torchao wheel carried to the machine (nothing outside it can be reached), for the torch-fp8 peer
if [ -n "${TORCHAO_WHEEL:-}" ]; then
  python3 -m pip install -q --no-deps "$TORCHAO_WHEEL" > "$OUT/pip_torchao.log" 2>&1 \
    && python3 -c "import torchao; print('torchao', torchao.__version__)" >> "$report" 2>&1
fi

section "build"
if [ "${SKIP_BUILD:-0}" = 1 ] && ls jaxquant/_jaxquant_cuda*.so > /dev/null 2>&1; then
  echo "SKIP_BUILD=1: using the extension built by the previous call on this machine" | tee -a "$report"
elif ! python3 build.py --cuda on -v > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log" | tee -a "$report"; exit 1
fi
python3 - <<'PY' 2>&1 | tee -a "$report"
import jaxquant.primitives._ffi as f, jax
print("registered platforms:", f.built_platforms(), "default backend:", jax.default_backend())
PY

if [ "${TESTS:-1}" = 1 ]; then
section "tests"
sel=("$@")
# The default selection takes over 520 s on one H100, past a device call's 600 s with the build:
# TEST_PART=1 runs its first half (~350 s), TEST_PART=2 (with SKIP_BUILD=1 on the warm machine) the rest, TEST_PART=3 the GEMMs and the schedule.
part1=(tests/test_ops.py tests/test_reference_spec.py tests/test_e2m1_magnitude.py tests/test_group_ops.py)
part2=(tests/test_fused_ops.py tests/test_fused_ops_gpu.py tests/test_bench_cli.py tests/test_layerwise_gpu.py
       tests/test_dense_gpu.py tests/test_distributed_gpu.py tests/test_sharding_gpu.py
       tests/test_train_gpu.py tests/test_sp_gpu.py tests/test_sp_step.py tests/test_train_rounding.py)
# jaxquant's own GEMMs (FP8, bf16) and the one-pass NVFP4 operand against XLA's bytes; the two-GPU schedule (compiled
# for compile-only devices: one GPU runs it); on 2 GPUs or more, training from the precomputed amaxes with the CUDA casts
part3=(tests/test_fp8_gemm_gpu.py tests/test_bf16_gemm_gpu.py tests/test_nvfp4_bf16_operand_gpu.py
       tests/test_schedule_gpu.py tests/test_precomputed_weight_amax.py)
if [ ${#sel[@]} -eq 0 ]; then
  case "${TEST_PART:-all}" in
    1) sel=("${part1[@]}") ;;
    2) sel=("${part2[@]}") ;;
    3) sel=("${part3[@]}") ;;
    *) sel=("${part1[@]}" "${part2[@]}" "${part3[@]}") ;;
  esac
fi
timeout "${TEST_TIMEOUT:-480}" python3 -m pytest "${sel[@]}" -q -rs -p no:cacheprovider > "$OUT/tests.log" 2>&1 \
  || status=1
{ echo '```'; tail -25 "$OUT/tests.log"; echo '```'; } | tee -a "$report"
fi

# Sanitizer: tiny tensors, the platform allocator (so that memcheck sees each buffer's bounds
# instead of one pool), no autotuning (fewer kernels to instrument), no command buffers.
if [ "${SANITIZE:-1}" = 1 ]; then
  # the quantize cases take their statistics from the reference; the last two put the statistics
  # passes (zero kernel, programmatic launch, atomics) under the tools too
  san_k=${SANITIZE_K:-"float32-bf16-48x80 or bfloat16-none-48x80 or 65x63 or sweep or float32-bf16-32x48 or bfloat16-none-144x80 or 16x1040 or fp8_stats_custom_equals_reference or nvfp4_stats_nonfinite_tiles"}
  for tool in memcheck racecheck; do
    section "compute-sanitizer --tool $tool"
    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" \
      timeout "${SANITIZE_TIMEOUT:-110}" compute-sanitizer --tool "$tool" --error-exitcode 7 --print-limit 50 \
      python3 -m pytest ${SANITIZE_TESTS:-tests/test_fused_ops.py} -k "$san_k" -q -p no:cacheprovider \
      > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    { echo "exit code $rc (0: clean, 7: errors found, 124: timed out)"; echo '```'
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|Hazard|passed|failed" "$OUT/sanitizer_$tool.log" | tail -12
      echo '```'; } | tee -a "$report"
  done
fi

if [ "${BENCH:-1}" = 1 ]; then
  section "jaxquant bench"
  { echo '```'
    timeout "${BENCH_TIMEOUT:-360}" python3 -m jaxquant bench ${BENCH_SIZES:+--sizes $BENCH_SIZES} ${BENCH_ARGS:-} \
      --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
    echo '```'; } | tee -a "$report"
  if [ "${OPS_BENCH:-0}" = 1 ]; then
    section "bench_ops (primitives)"
    { echo '```'; python3 benchmarks/bench_ops.py --json "$OUT/bench_ops.json" 2>&1 | tee "$OUT/bench_ops.txt"
      echo '```'; } | tee -a "$report"
  fi
fi
ngpu=$(nvidia-smi -L | wc -l)
if [ "${DIST:-0}" = 1 ]; then
  # DIST_NCCL_PROTOS="default Simple" runs it once per NCCL protocol (NCCL_PROTO; "default" leaves NCCL's
  # choice). The profile's kernel names do not tell the protocol (NCCL names its ring all-gather kernel
  # _RING_LL whatever it runs); DIST_NCCL_TUNING=1 writes NCCL's tuning log (its choice per call size)
  # to $OUT/nccl_tuning<proto>.log.
  for proto in ${DIST_NCCL_PROTOS:-default}; do
    tag=${proto/default/}
    tuning=()
    [ "${DIST_NCCL_TUNING:-0}" = 1 ] && tuning=(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING
                                            "NCCL_DEBUG_FILE=$OUT/nccl_tuning${tag:+-$tag}.log")
    section "bench_distributed ($ngpu GPUs${tag:+, NCCL_PROTO=$tag})"
    { echo '```'; env ${tag:+NCCL_PROTO=$tag} "${tuning[@]}" timeout "${DIST_TIMEOUT:-240}" python3 benchmarks/bench_distributed.py \
        ${DIST_ARGS:---profile --pieces 1,2,8} 2>&1 | tee "$OUT/bench_distributed${tag:+-$tag}.txt"; echo '```'; } | tee -a "$report"
  done
fi
# Issue 9's GPU figures: the demo (nvfp4 / fp8 / bf16 weights; fsdp=N and, with 2+ GPUs, tp=2 meshes) and
# bench_train (step time, tokens/s and the report_nan cost of a larger model than the demo's).
if [ "${TRAIN:-0}" = 1 ] && [ "${TRAIN_DEMO:-1}" = 1 ]; then
  section "jaxquant demo ($ngpu GPUs)"
  meshes="${ngpu}x1"; [ "$ngpu" -ge 2 ] && meshes="$meshes 1x$ngpu"
  { echo '```'
    for mesh in $meshes; do for recipe in nvfp4 fp8 bf16; do
      model=llama; [ "${mesh#1x}" != "$mesh" ] && [ "$ngpu" -ge 2 ] && model=tp-sp   # the flax Llama: FSDP only
      echo "-- demo --model $model --mesh $mesh --recipe $recipe"
      timeout 90 python3 -m jaxquant demo --model "$model" --mesh "$mesh" --recipe "$recipe" --steps 40 --no-progress \
        --ckpt-dir "/tmp/jq-demo-$mesh-$recipe" 2>&1 | grep -v "^\s*$" | tail -6
    done; done
    echo '```'; } | tee -a "$report"
fi
if [ "${TRAIN:-0}" = 1 ]; then
  for b in ${TRAIN_BATCH:-2 8}; do
    section "bench_train ($ngpu GPUs, $b sequences per GPU)"
    { echo '```'; timeout 240 python3 benchmarks/bench_train.py --batch-per-device "$b" \
        ${TRAIN_ARGS:---d-model 2048 --d-ff 8192 --layers 4 --seq 1024 --profile} \
        --json "$OUT/bench_train-b$b.json" 2>&1 | tail -45; echo '```'; } | tee -a "$report"
  done
  section "bench_dense (FP8 vs bf16 dense, forward + backward)"
  { echo '```'; timeout 120 python3 benchmarks/bench_dense.py --json "$OUT/bench_dense.json" 2>&1 | tail -8
    echo '```'; } | tee -a "$report"
fi
# The training step end to end: plain JAX bf16 beside make_train_step (bf16 / FP8 / NVFP4), every GPU,
# each config in its own process; E2E_ARGS overrides the model / flag sets (benchmarks/bench_e2e.py --help).
if [ "${E2E:-0}" = 1 ]; then
  section "bench_e2e ($ngpu GPUs)"
  prof=()
  [ -n "${E2E_PROFILE:-}" ] && prof=(--profile "$E2E_PROFILE")
  { echo '```'; timeout "${E2E_TIMEOUT:-500}" python3 benchmarks/bench_e2e.py ${E2E_ARGS:-} "${prof[@]}" --json "$OUT/e2e.json" \
      2>&1 | grep -v "^WARNING\|^I0000\|^E0000\|^W0000" | tee "$OUT/e2e.txt"; echo '```'; } | tee -a "$report"
  # the traces stay there (large); the stacked bars and each config's compiled HLO come back (nested too deep as they lie)
  if [ -n "${E2E_PROFILE:-}" ]; then
    cp "$E2E_PROFILE/breakdown.png" "$OUT/" 2>/dev/null
    (cd "$E2E_PROFILE" && find . -name "*.hlo.txt" | tar czf "$OUT/e2e_hlo.tgz" -T -)
  fi
fi
# FLAX=1: benchmarks/bench_flax.py (FLAX_ARGS, e.g. "--model einsum --batch 4 --configs flax-plain,flax-jq-fp8").
if [ "${FLAX:-0}" = 1 ]; then
  section "bench_flax ($ngpu GPUs)"
  { echo '```'; timeout "${FLAX_TIMEOUT:-300}" python3 benchmarks/bench_flax.py ${FLAX_ARGS:-} --json "$OUT/flax.json" \
      2>&1 | grep -v "^WARNING\|^I0000\|^E0000\|^W0000" | tail -30; echo '```'; } | tee -a "$report"
fi
# CGEMM=1: benchmarks/bench_collective_gemm.py (overlap="fused"'s kernels alone against NCCL + cuBLAS, per
# tiling; CGEMM_ARGS, e.g. "--configs all").
if [ "${CGEMM:-0}" = 1 ]; then
  section "bench_collective_gemm ($ngpu GPUs)"
  { echo '```'; timeout "${CGEMM_TIMEOUT:-300}" python3 benchmarks/bench_collective_gemm.py ${CGEMM_ARGS:-} \
      --json "$OUT/collective_gemm.json" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000\|^W0000" | tail -40; echo '```'; } \
    | tee -a "$report"
fi
# SP=1: benchmarks/bench_sp.py (TP/SP overlap modes sync / off / fused on all GPUs as the tp axis), once per
# XLA flag set in SP_FLAG_SETS ("default" = none; any other entry is added to XLA_FLAGS as written, ";"-separated).
if [ "${SP:-0}" = 1 ]; then
  IFS=';' read -ra sp_sets <<< "${SP_FLAG_SETS:-default}"
  for fs in "${sp_sets[@]}"; do
    extra=$([ "$fs" = default ] && echo "" || echo "$fs")
    tag=$(echo "${fs:0:40}" | tr -c 'a-zA-Z0-9_\n' '_')
    section "bench_sp ($ngpu GPUs, flags: $fs)"
    { echo '```'; timeout "${SP_TIMEOUT:-400}" python3 benchmarks/bench_sp.py ${SP_ARGS:-} --extra-flags="$extra" \
        --json "$OUT/sp_$tag.json" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000\|^W0000" | tail -40; echo '```'; } \
      | tee -a "$report"
  done
fi
exit $status
