#!/usr/bin/env bash
# A/B of CUDA kernel sources in one device call: builds this tree ("new") and a copy of it whose
# csrc files are replaced by those in $BASE ("base", default ab/base: files named as in csrc, e.g.
# ab/base/stage_kernels.cuh for csrc/jaxquant/stage_kernels.cuh), runs $TESTS on "new", then
# `jaxquant bench --no-stages --ops $OPS` alternating base, new for two rounds, so both are
# measured on the same machine in one run. JSON per run under $OUT.
#   OPS='quantize_nvfp4*' BENCH_EXTRA='--stages' bash scripts/ab_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ROOT=$PWD BASE=${BASE:-ab/base} OUT=${OUT:-$PWD/gpu_out}
rm -rf /tmp/jq_base && mkdir -p "$OUT" /tmp/jq_base  # a fresh copy: no files left from an earlier call
cp -r build.py pyproject.toml jaxquant csrc /tmp/jq_base/ && rm -f /tmp/jq_base/jaxquant/*.so
for f in "$BASE"/*; do
  target=$(cd csrc && find . -name "$(basename "$f")" | head -1)
  [ -n "$target" ] || { echo "$f: no file of that name under csrc" >&2; exit 2; }
  cp "$f" "/tmp/jq_base/csrc/$target"
done
(python3 build.py --cuda on > "$OUT/build_new.log" 2>&1; echo "new build rc $?") &
(cd /tmp/jq_base && python3 build.py --cuda on > "$OUT/build_base.log" 2>&1; echo "base build rc $?") &
wait
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$ROOT:$ROOT/tests timeout "${TEST_T:-200}" python3 -m pytest \
  ${TESTS:-tests/test_fused_ops.py tests/test_fused_ops_gpu.py tests/test_ops.py} -q -x -p no:cacheprovider 2>&1 | tail -5
for round in 1 2; do
  for v in base new; do
    dir=$ROOT; [ $v = base ] && dir=/tmp/jq_base
    echo "=== $v round $round"
    (cd "$dir" && PYTHONPATH=$dir timeout 200 python3 -m jaxquant bench --no-stages \
      --ops "${OPS:-quantize_fp8*,quantize_nvfp4*}" ${BENCH_EXTRA:-} --json "$OUT/bench_${v}_$round.json" 2>&1 \
      | grep -v "^WARNING\|^I0000\|^E0000")
  done
done
