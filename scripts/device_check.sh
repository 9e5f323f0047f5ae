#!/usr/bin/env bash
# One GPU-machine run: build, GPU tests, compute-sanitizer, kernel benchmark, device-planned step
# benchmark, host-time split.
# Logs under $OUT.
#   (from the repository root, with .whl/ filled as scripts/device_site.sh says; results
#   name the commit of .device/source_stamp.json, if carried, when the sources match it)
# vLLM's rows need its sources carried: run scripts/vllm_carry.sh here and name third_party/vllm
# in the run's carry (without them the rows record why they did not run).
#   BUILD_CACHE_FROM=<build_cache.tgz of an earlier run of the same sources, carried> unpacks the
#     built extensions first, so a run on a fresh machine skips their builds; every run leaves its
#     own as $OUT/build_cache.tgz (vLLM's build as $OUT/vllm_build_cache.tgz, where it fits).
#   GPU_TESTS=<test files or node ids> narrows the tests; SKIP_TESTS=1 skips them, SKIP_SANITIZE=1
#   compute-sanitizer, SKIP_BENCH=1 the kernel benchmark, SKIP_STEP=1 the device-step benchmark and
#   SKIP_HOST=1 the host-time split (a run that has to fit one call's time limit takes a subset);
#   STEP_ARGS="--cases ..." narrows the device-step benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/pkv-out}; mkdir -p "$OUT"
source scripts/device_site.sh || exit 1
prepare_run
# The builds, for the next run (scripts/device_site.sh): after the build and on exit.
trap save_builds EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# vLLM's kernels (minutes of nvcc) build beside the project's extension, not after it.
if [ -d third_party/vllm ]; then
  python3 -m pkv.engines.vllm_build record --record "$OUT/vllm_build.json" > "$OUT/vllm_build.log" 2>&1 &
  vllm_build=$!
fi
if ! python3 -m pkv.build --record "$OUT/build.json" 2>&1 | tail -5; then
  [ -n "${vllm_build:-}" ] && kill "$vllm_build" 2>/dev/null
  exit 1
fi
save_builds  # now too: a run stopped at its time limit runs no exit trap
if [ -n "${vllm_build:-}" ]; then
  wait "$vllm_build"; echo "vllm build rc=$? $(grep -o '"built": [a-z]*' "$OUT/vllm_build.json" 2>/dev/null | tr '\n' ' ')"
  save_builds
fi
# Every GPU test, the project's kernels first (a run stopped at its time limit has checked what
# matters most): kernels, device-planned step and routed graphs, the model step, the baselines,
# vLLM's rows where third_party/vllm was carried. GPU_TESTS narrows it, e.g. tests/test_kernels_gpu.py.
# $OUT/test_times.tsv: each test's seconds as it ends (tests/conftest.py), there even when the
# run is stopped at its time limit; the slowest are printed.
if [ -z "${SKIP_TESTS:-}" ]; then
  PKV_TEST_TIMES="$OUT/test_times.tsv" python3 -X faulthandler -m pytest -v -p no:cacheprovider -m gpu \
    ${GPU_TESTS:-tests/test_kernels_gpu.py tests/test_device_step_gpu.py tests/test_large_pool_gpu.py tests/test_model_step.py tests/test_kernel_trace.py tests/test_baselines_gpu.py tests/test_vllm_engines.py} \
    > "$OUT/tests.log" 2>&1
  grep -E "FAILED|ERROR|passed|failed|Fatal|^E  " "$OUT/tests.log" | tail -30
  sort -t$'\t' -k3 -rn "$OUT/test_times.tsv" 2>/dev/null | head -8 | cut -c1-160
fi
for tool in $([ -z "${SKIP_SANITIZE:-}" ] && echo memcheck racecheck); do
  compute-sanitizer --tool $tool --error-exitcode 3 python3 scripts/sanitize_cases.py > "$OUT/$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)"
done
if [ -z "${SKIP_BENCH:-}" ]; then  # SKIP_BENCH=1: checks and host times only
  python3 -m pkv.measure.kernel_bench --out "$OUT/kernel_bench.json" ${BENCH_ARGS:-} 2>"$OUT/bench.err"
  tail -3 "$OUT/bench.err"
fi
# BENCH_NHD=1: PersistentKV over the same pages stored NHD (vLLM's cache layout, read in place).
[ -n "${BENCH_NHD:-}" ] && python3 -m pkv.measure.kernel_bench --kv-layout nhd --out "$OUT/kernel_bench_nhd.json" --cases b1_32k b8_bimodal b64_4k 2>/dev/null | tail -4
[ -n "${BENCH_WRITE_FLUSH:-}" ] && python3 -m pkv.measure.kernel_bench --flush write --out "$OUT/kernel_bench_writeflush.json" --cases b1_8k b1_32k b8_bimodal 2>/dev/null | tail -4
if [ -z "${SKIP_STEP:-}" ]; then  # SKIP_STEP=1: no device-planned step benchmark; STEP_ARGS: its options
  # shellcheck disable=SC2086
  python3 -m pkv.measure.device_step_bench --out "$OUT/device_step_bench.json" ${STEP_ARGS:-} 2>&1 | tail -8
fi
if [ -z "${SKIP_HOST:-}" ]; then  # SKIP_HOST=1: no host-time split
  python3 -m pkv.measure.host_bench --calibration conf/gpu/h200.yaml --out "$OUT/host_bench.json" 2>&1 | tail -25
fi
