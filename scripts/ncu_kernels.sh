#!/usr/bin/env bash
# Nsight Compute view of the single-tensor quantize kernels in one device call: builds the CUDA
# extension (SKIP_BUILD=1 reuses a warm machine's build), runs each op of $NCU_OPS on an $NCU_SHAPE
# input under `ncu --set full` (kernels of this extension matching $NCU_KERNELS; each op runs twice and
# both calls are profiled), and writes the details page, a CSV of key metrics and the SASS of
# the extension under $OUT. Needs the Firecracker runtime (ncu reads no counters under gVisor).
#   NCU_OPS='nvfp4:bfloat16,fp8T:bfloat16' NCU_KERNELS='nvfp4_quantize|fp8_rows_cols' NCU_SHAPE=8192x8192 bash scripts/ncu_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# no preallocated pool: ncu saves and restores all device memory for each replay pass
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "${SKIP_BUILD:-0}" != 1 ] || ! ls jaxquant/_jaxquant_cuda*.so > /dev/null 2>&1; then
  python3 build.py --cuda on > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
cuobjdump --dump-sass jaxquant/_jaxquant_cuda*.so 2> /dev/null | gzip > "$OUT/sass.txt.gz"
cat > /tmp/ncu_driver.py <<'PY'
import os, jax, jax.numpy as jnp
import jaxquant as jq
rows, cols = map(int, os.environ.get("NCU_SHAPE", "8192x8192").split("x"))
ops = {"fp8": lambda x: jq.quantize_fp8(x), "fp8T": lambda x: jq.quantize_fp8(x, columnwise=True),
       "nvfp4": lambda x: jq.quantize_nvfp4(x), "nvfp4T": lambda x: jq.quantize_nvfp4(x, columnwise=True)}
for item in os.environ.get("NCU_OPS", "nvfp4:bfloat16,nvfp4T:bfloat16,fp8T:bfloat16").split(","):
    name, dt = item.split(":")
    x = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32).astype(dt)
    fn = jax.jit(ops[name])
    for _ in range(2):
        jax.block_until_ready(fn(x))
    print("ran", name, dt, flush=True)
PY
timeout "${NCU_TIMEOUT:-400}" ncu --clock-control none --set full -k "regex:${NCU_KERNELS:-nvfp4|fp8_rows|amax}" \
  --target-processes all -o "$OUT/ncu" python3 /tmp/ncu_driver.py > "$OUT/ncu_run.log" 2>&1
echo "ncu rc $?"
tail -5 "$OUT/ncu_run.log"
ncu -i "$OUT/ncu.ncu-rep" --page details --print-units base > "$OUT/ncu_details.txt" 2>&1
ncu -i "$OUT/ncu.ncu-rep" --page raw --csv --metrics \
  gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,launch__registers_per_thread \
  > "$OUT/ncu_metrics.csv" 2>&1
gzip -k "$OUT/ncu_details.txt"
ls -la "$OUT"
