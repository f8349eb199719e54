#!/usr/bin/env bash
# A/B of CUDA kernel sources in one device call: builds this tree ("new") and, for each directory of
# $VARIANTS (default ab/base), a copy of the tree whose csrc files are replaced by the files in that
# directory (named as in csrc or jaxquant, e.g. ab/base/stage_kernels.cuh for csrc/jaxquant/stage_kernels.cuh;
# scripts/ab_make_base.sh REV fills ab/base from a git revision);
# runs $TESTS on "new" (TEST_ALL=1: on every build), writes each build's SASS under $OUT, then `jaxquant bench
# --no-stages --ops $OPS` over all builds in turn for $ROUNDS rounds (default 2), so that all are
# measured on the same machine in one run. JSON per build and round under $OUT.
#   OPS='quantize_nvfp4*' BENCH_EXTRA='--stages' VARIANTS='ab/base ab/try1' bash scripts/ab_bench.sh
# BENCH_CMD replaces `jaxquant bench` (e.g. BENCH_CMD='python3 $PWD/benchmarks/bench_distributed.py --skip-group');
# its output goes to $OUT/bench_<build>_<round>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ROOT=$PWD OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
names=(new) dirs=("$ROOT")
for v in ${VARIANTS:-${BASE:-ab/base}}; do
  # ab/ is git-ignored: without the device call's carry the variant would silently be a copy of "new"
  [ -d "$v" ] && [ -n "$(ls -A "$v")" ] || { echo "$v: no such variant directory (pass it in carry)" >&2; exit 2; }
  name=$(basename "$v") dir=/tmp/jq_ab_$(basename "$v")
  rm -rf "$dir" && mkdir -p "$dir"  # a fresh copy: no files left from an earlier call
  cp -r build.py pyproject.toml jaxquant csrc benchmarks "$dir"/ && rm -f "$dir"/jaxquant/*.so
  for f in "$v"/*; do
    target=$(find csrc jaxquant -name "$(basename "$f")" | head -1)
    [ -n "$target" ] || { echo "$f: no file of that name under csrc or jaxquant" >&2; exit 2; }
    cp "$f" "$dir/$target"
  done
  names+=("$name") dirs+=("$dir")
done
for i in "${!names[@]}"; do
  (cd "${dirs[$i]}" && python3 build.py --cuda on > "$OUT/build_${names[$i]}.log" 2>&1; echo "${names[$i]} build rc $?") &
done
wait
# clocks and power beside the name: the same kernels ran 6-16% slower against the same copy bandwidth on
# one H200 machine than on another (2026-11-25), which memory alone does not explain
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv
for i in "${!names[@]}"; do
  cuobjdump --dump-sass "${dirs[$i]}"/jaxquant/_jaxquant_cuda*.so 2> /dev/null | gzip > "$OUT/sass_${names[$i]}.txt.gz"
done
for i in "${!names[@]}"; do
  [ "${TEST_ALL:-0}" = 1 ] || [ "${names[$i]}" = new ] || continue
  echo "=== tests: ${names[$i]}"
  (cd "${dirs[$i]}" && PYTHONPATH=${dirs[$i]}:$ROOT/tests timeout "${TEST_T:-200}" python3 -m pytest \
    ${TESTS:-$ROOT/tests/test_fused_ops.py $ROOT/tests/test_fused_ops_gpu.py $ROOT/tests/test_ops.py} -q -x \
    -p no:cacheprovider --rootdir="${dirs[$i]}" > "$OUT/tests_${names[$i]}.log" 2>&1; tail -2 "$OUT/tests_${names[$i]}.log")
done
for round in $(seq "${ROUNDS:-2}"); do
  for i in "${!names[@]}"; do
    echo "=== ${names[$i]} round $round"
    if [ -n "${BENCH_CMD:-}" ]; then   # another benchmark, run from the build's tree
      (cd "${dirs[$i]}" && PYTHONPATH=${dirs[$i]} timeout 200 $BENCH_CMD 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" \
        | tee "$OUT/bench_${names[$i]}_$round.txt")
      continue
    fi
    (cd "${dirs[$i]}" && PYTHONPATH=${dirs[$i]} timeout 200 python3 -m jaxquant bench --no-stages \
      --ops "${OPS:-quantize_fp8*,quantize_nvfp4*}" ${BENCH_EXTRA:-} --json "$OUT/bench_${names[$i]}_$round.json" 2>&1 \
      | grep -v "^WARNING\|^I0000\|^E0000")
  done
done
