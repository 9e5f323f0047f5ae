#!/usr/bin/env bash
# One GPU-machine run of the long-context checks: the build, the GPU test of a KV pool past 2^32
# elements, the device-planned step benchmark, and traces/long_context_conv.jsonl replayed through
# the README's own-trace command on the recycled KV pool (every step of its first 384 and 1024
# requests), then its first 384 requests on the up-front layout, whose pool is past 2^32 elements,
# where the harness names the engine that is wrong; the device-planned step benchmark last
# (STEP_TIMEOUT seconds at most). Logs and result files under $OUT; a short table of the replays. Needs .whl/ filled as scripts/device_site.sh says.
#   LONG_REQUESTS="384 1024"   the request counts replayed whole on the recycled pool
#   LONG_CALIBRATION=<file>    the calibration the adaptive engine decides with
#   BUILD_CACHE_FROM=<build_cache.tgz of an earlier run of the same sources> skips the build
#   SKIP_TESTS=1, SKIP_STEP=1, SKIP_UP_FRONT=1 leave out those parts
set -uo pipefail
OUT=${OUT:-/tmp/pkv-out}; mkdir -p "$OUT"
source scripts/device_site.sh || exit 1
prepare_run
trap save_builds EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pkv.build --record "$OUT/build.json" 2>&1 | tail -2 || exit 1
save_builds  # now too: a run stopped at its time limit runs no exit trap
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -v -p no:cacheprovider tests/test_large_pool_gpu.py > "$OUT/large_pool_tests.log" 2>&1
  echo "large-pool GPU tests: $(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$OUT/large_pool_tests.log" | tail -4 | tr '\n' ' ')"
fi
calibration=${LONG_CALIBRATION:-artifacts/reference/h200/history/4ff4a2f_measured_gates/calibration.json}
replay() {  # replay <name> <requests> <measured steps> [overrides...]
  local name=$1 requests=$2 steps=$3; shift 3
  local start=$SECONDS
  python3 -m pkv.cli experiment=evaluate trace=external trace.path=traces/long_context_conv.jsonl \
    trace.name=long_conv_b8 trace.max_active=8 trace.num_requests="$requests" \
    experiment.measured_steps="$steps" experiment.check_every=64 calibration="$calibration" \
    out="$OUT/long/$name" hydra.run.dir="$OUT/long/$name/.run" "$@" > "$OUT/long_$name.log" 2>&1
  echo "long_conv $name: rc=$? in $((SECONDS - start)) s"
}
for n in ${LONG_REQUESTS:-384 1024}; do
  replay "recycled_n$n" "$n" 20000
done
[ -z "${SKIP_UP_FRONT:-}" ] && replay up_front_n384 384 16 trace.page_layout=up_front
python3 - "$OUT/long" <<'EOF'
import json, sys
from pathlib import Path
print(f"{'run':<16} {'engine':<10} {'pool pages':>10} {'steps':>6} {'tokens':>7} {'dev ms/step':>11} "
      f"{'wall ms/step':>12} {'float64 rel':>11} wrong")
for run in sorted(Path(sys.argv[1]).iterdir()):
    for f in sorted(run.glob("*.json")):
        r = json.loads(f.read_text())
        m, t = r.get("metrics"), r["trace"]
        if m is None:
            print(f"{run.name:<16} {f.stem:<10} skipped: {r.get('skipped')}")
            continue
        print(f"{run.name:<16} {f.stem:<10} {t.get('kv_pool_pages', t.get('page_layout')):>10} {m['steps']:>6} "
              f"{m['decode_tokens']:>7} {m['cuda_ms_per_step']:>11.4f} {m['wall_ms_per_step']:>12.4f} "
              f"{m['ref_max_rel_err']:>11.2e} {m.get('wrong_steps', 'n/a')}")
EOF
if [ -z "${SKIP_STEP:-}" ]; then
  timeout "${STEP_TIMEOUT:-300}" python3 -m pkv.measure.device_step_bench --out "$OUT/device_step_bench.json" > "$OUT/device_step_bench.log" 2>&1
  echo "device_step_bench rc=$?"; tail -12 "$OUT/device_step_bench.log"
fi
