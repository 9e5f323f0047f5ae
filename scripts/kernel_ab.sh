#!/usr/bin/env bash
# A/B of the decode kernels in one GPU-machine run: this tree's (kernel tests, sanitizers,
# kernel and device-step benchmarks) and then a baseline tree's benchmarks on the same machine and
# page tables, so the two are compared without run-to-run drift. Logs under $OUT.
#   BASELINE=<dir>: a checkout of the baseline, inside this tree so it travels with it, e.g.
#     mkdir -p .device/baseline && git archive <rev> | tar -x -C .device/baseline
#     (the GPU machine's copy of .git may be stale, so the baseline is exported here, not there)
#   CASES="b1_8k b1_32k ...": the pkv.measure.kernel_bench cases (default below).
#   STEP_CASES="b8_bimodal ...": the pkv.measure.device_step_bench cases, the device-planned step
#     (host_planned_graph against device_planned_decode_graph, and host_planned_balanced against
#     device_planned_balanced_decode_graph: what a graphed layer replays).
set -uo pipefail
OUT=${OUT:-/tmp/pkv-out}; mkdir -p "$OUT"
BASELINE=${BASELINE:?set BASELINE to the baseline checkout}
CASES=${CASES:-b1_8k b1_16k b1_32k b1_64k b1_128k b4_bimodal b8_bimodal b8_32k}
STEP_CASES=${STEP_CASES:-b8_bimodal b4_bimodal skewed_b64}
SKIP_HOST=1 BENCH_ARGS="--cases $CASES" STEP_ARGS="--cases $STEP_CASES" bash scripts/device_check.sh
cd "$BASELINE" || exit 1
export PYTHONPATH=/tmp/site:$PWD PKV_CACHE_DIR=$PWD/.cache/pkv PYTHONUNBUFFERED=1
python3 -m pkv.build 2>&1 | tail -1
echo "== baseline ($BASELINE)"
# shellcheck disable=SC2086
python3 -m pkv.measure.kernel_bench --out "$OUT/baseline_bench.json" --cases $CASES 2>"$OUT/baseline_bench.err"
# shellcheck disable=SC2086
python3 -m pkv.measure.device_step_bench --out "$OUT/baseline_device_step_bench.json" --cases $STEP_CASES 2>&1 | tail -8
# The device tool brings back a limited number of files: the logs travel as one archive too.
cd "$OUT" && tar czf logs.tgz ./*.log ./*.err 2>/dev/null
