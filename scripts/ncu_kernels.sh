#!/usr/bin/env bash
# Nsight Compute view of the quantize kernels (single tensor, or the master-weight step's grouped ones) in one device call: builds the CUDA
# extension (SKIP_BUILD=1 reuses a warm machine's build), runs each op of $NCU_OPS on an $NCU_SHAPE
# input under `ncu --set full` (kernels of this extension matching $NCU_KERNELS; each op runs twice and
# both calls are profiled), and writes the details page, a CSV of key metrics and the SASS of
# the extension under $OUT. Needs the Firecracker runtime (ncu reads no counters under gVisor).
# NCU_OPS items mw_nvfp4 / mw_fp8 (T: + columnwise) run quantize_master_weights of the Llama-3-8B layer on one GPU.
#   NCU_OPS='nvfp4:bfloat16,fp8T:bfloat16' NCU_KERNELS='nvfp4_quantize|fp8_rows_cols' NCU_SHAPE=8192x8192 bash scripts/ncu_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
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
def master_weights(recipe, columnwise):
    """quantize_master_weights of the Llama-3-8B layer (benchmarks/bench_distributed.py) on one device."""
    import numpy as np
    from jaxquant.zero.distributed import quantize_master_weights
    from jaxquant.zero.layout import FlatLayout
    from bench_distributed import LLAMA3_8B_LAYER
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    layout = FlatLayout([s for _, s in LLAMA3_8B_LAYER], 1)
    def fn(x):
        w = quantize_master_weights(x.reshape(-1), layout, mesh=mesh, recipe=recipe, columnwise=columnwise,
                                    manual_post_all_gather_processing=False)
        return sum(jnp.ravel(leaf)[0].astype(jnp.float32) for leaf in jax.tree.leaves(w))
    return fn, (layout.total_size,)
for item in os.environ.get("NCU_OPS", "nvfp4:bfloat16,nvfp4T:bfloat16,fp8T:bfloat16").split(","):
    name, dt = item.split(":")
    shape = (rows, cols)
    if name.startswith("mw_"):   # e.g. mw_nvfp4, mw_fp8T: the master-weight step's grouped kernels
        recipe = name[3:].rstrip("T")
        ops[name], shape = master_weights(recipe, name.endswith("T"))
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dt)
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
  gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,launch__registers_per_thread \
  > "$OUT/ncu_metrics.csv" 2>&1
gzip -k "$OUT/ncu_details.txt"
ls -la "$OUT"
