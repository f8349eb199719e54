#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA extension there, run the GPU test suite and the
# benchmarks, and write a report under $OUT (default ./gpu_out).
#   bash scripts/gpu_suite.sh [pytest selection...]      e.g. bash scripts/gpu_suite.sh tests/test_ops.py
# Env: BENCH=0 skips benchmarks; BENCH_SIZES overrides bench_ops sizes; DIST=1 runs the
# multi-GPU distributed benchmark when 2+ GPUs are visible.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
report=$OUT/report.md
{
  echo "# jaxquant GPU report ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  nvcc --version | tail -1
  echo '```'
} > "$report" 2>&1

echo "== build" | tee -a "$report"
if ! python3 build.py --cuda on -v > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log" | tee -a "$report"; exit 1
fi
python3 - <<'PY' | tee -a "$report"
import jaxquant._ffi as f, jax
print("registered platforms:", f.built_platforms(), "default backend:", jax.default_backend())
PY

echo "== tests" | tee -a "$report"
sel=("$@"); [ ${#sel[@]} -eq 0 ] && sel=(tests/test_ops.py tests/test_reference_spec.py tests/test_group_ops.py tests/test_distributed_gpu.py)
python3 -m pytest "${sel[@]}" -q -rs -p no:cacheprovider > "$OUT/tests.log" 2>&1
test_rc=$?
tail -25 "$OUT/tests.log" | tee -a "$report"

if [ "${BENCH:-1}" = 1 ]; then
  echo "== bench_ops" | tee -a "$report"
  python3 benchmarks/bench_ops.py ${BENCH_SIZES:+--sizes $BENCH_SIZES} --json "$OUT/bench_ops.json" 2>&1 \
    | tee "$OUT/bench_ops.txt" | tee -a "$report"
fi
ngpu=$(nvidia-smi -L | wc -l)
if [ "${DIST:-0}" = 1 ] && [ "$ngpu" -ge 2 ] && [ -f benchmarks/bench_distributed.py ]; then
  echo "== bench_distributed ($ngpu GPUs)" | tee -a "$report"
  python3 benchmarks/bench_distributed.py 2>&1 | tee "$OUT/bench_distributed.txt" | tee -a "$report"
fi
exit $test_rc
