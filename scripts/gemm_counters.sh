#!/usr/bin/env bash
# What one kernel of the model step (by default the MLP's gate/up GEMM, the one that runs longer
# after the adaptive route's attention than after FlashInfer's: docs/performance.md, "Which
# neighbour pays") reads and writes in DRAM after each path's attention, in Nsight Compute
# counters. One GPU-machine run of the model step on one trace, its first profiled steps run once
# more per path and rest inside NVTX ranges trace_<path> (experiment.kernel_profiler=external,
# pkv.measure.kernel_trace.trace_range), under ncu filtered to those ranges and to the kernel's
# name. ncu neither flushes the caches nor fixes the clocks, so the kernel meets what the kernels
# before it left; its counters are kept to one replay pass where they fit, since each further pass
# restores memory first and meets another state (the passes ncu took are printed).
#   (from the repository root, with .whl/ filled as scripts/device_site.sh says)
#   GEMM_TRACE (bimodal_b8), GEMM_SEED (20260623), GEMM_STEPS (2: profiled steps), GEMM_MODES ("[eager]"),
#   GEMM_KERNEL (regex of the kernel's name, "nvjet_sm90_hsh_128x8"), GEMM_METRICS (ncu metric names,
#   comma-separated; the summary keeps .sum totals and .avg.per_second rates, such as the SM clock
#   sm__cycles_elapsed.avg.per_second), GEMM_CALIBRATION (default: the committed reference set's of this GPU),
#   PROFILE_OVERRIDES="key=value ..." (more Hydra overrides), BUILD_CACHE_FROM (scripts/device_check.sh's)
# Under $OUT: gemm.ncu-rep (open it in ncu-ui), gemm.csv, the run's log; printed last, the mean of
# each counter per path.
set -uo pipefail
OUT=${OUT:-/tmp/pkv-out}; mkdir -p "$OUT"
source scripts/device_site.sh || exit 1
prepare_run
command -v ncu > /dev/null || { echo "ncu (Nsight Compute) is not on PATH" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
GPU_NAME=$(grep -q H200 "$OUT/gpu.txt" && echo h200 || echo h100)
CALIBRATION=${GEMM_CALIBRATION:-artifacts/reference/$GPU_NAME/calibration/calibration.json}
calibrated=()
[ -f "$CALIBRATION" ] && calibrated=("calibration=$CALIBRATION")
python3 -m pkv.build 2>&1 | tail -1 || exit 1
trace=${GEMM_TRACE:-bimodal_b8}; family=${trace%_b*}; batch=${trace##*_b}
modes=${GEMM_MODES:-[eager]}
includes=()
for mode in $(echo "$modes" | tr -d '[]' | tr ',' ' '); do
  for path in rest adaptive flashinfer; do includes+=(--nvtx-include "pkv@trace_${path}_${mode}/"); done
done
dest=$OUT/run
# shellcheck disable=SC2086  # PROFILE_OVERRIDES is a list of words
ncu --clock-control none --cache-control none --nvtx "${includes[@]}" -k "regex:${GEMM_KERNEL:-nvjet_sm90_hsh_128x8}" \
  --metrics "${GEMM_METRICS:-gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum}" \
  -f -o "$OUT/gemm" python3 -m pkv.cli experiment=model_step "trace=$family" "trace.max_active=$batch" \
  "seed=${GEMM_SEED:-20260623}" "gpu=$GPU_NAME" ${calibrated[@]+"${calibrated[@]}"} \
  "experiment.kernel_profile_steps=${GEMM_STEPS:-2}" experiment.kernel_profiler=external \
  "experiment.engines=[adaptive,flashinfer]" "experiment.modes=$modes" ${PROFILE_OVERRIDES:-} \
  "out=$dest" "hydra.run.dir=$dest/.run" > "$OUT/gemm.log" 2>&1
echo "ncu rc=$? ($(grep -c '==PROF== Profiling' "$OUT/gemm.log") kernels profiled;" \
  "passes: $(grep -o '[0-9]* passes\?' "$OUT/gemm.log" | sort | uniq -c | tr '\n' ' '))"
ncu --import "$OUT/gemm.ncu-rep" --csv --page raw --print-units base > "$OUT/gemm.csv" 2> "$OUT/gemm_import.err" \
  || { tail -3 "$OUT/gemm_import.err"; exit 1; }
python3 - "$OUT/gemm.csv" <<'EOF'
import csv, io, re, statistics, sys

lines = [ln for ln in open(sys.argv[1]).read().splitlines() if ln.strip() and not ln.startswith("==")]
rows = list(csv.reader(io.StringIO("\n".join(lines))))
if len(rows) < 3:
    sys.exit("gemm.csv holds no kernel: did the NVTX ranges or the kernel name match nothing?")
header, units = rows[0], rows[1]
# A metric's .sum is its total over the kernel's units (a launch's DRAM bytes, its duration); the
# .avg, .min and .max ncu exports beside it are over those units (one FBPA, one SM), not launches.
# A rate over the units' mean (.avg.per_second: an SM's clock from sm__cycles_elapsed) is one
# launch's too, so its mean over launches is kept as well.
metrics = [name for name in header if re.fullmatch(r"\w+__\w+(\.\w+)*\.(sum|avg\.per_second)", name)]
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
         "second": 1e6, "byte": 1e-6, "kbyte": 1e-3, "mbyte": 1.0, "gbyte": 1e3, "%": 1.0, "": 1.0,
         "cycle/second": 1e-6, "cycle/nsecond": 1e3, "hz": 1e-6}
shown = {"ns": "us", "nsecond": "us", "us": "us", "usecond": "us", "ms": "us", "msecond": "us", "s": "us",
         "second": "us", "byte": "MB", "kbyte": "MB", "mbyte": "MB", "gbyte": "MB", "%": "%", "": "",
         "cycle/second": "MHz", "cycle/nsecond": "MHz", "hz": "MHz"}
samples = {}
for cells in rows[2:]:
    row = dict(zip(header, cells))
    where = re.search(r"trace_(rest|adaptive|flashinfer)_(eager|graph)", " ".join(cells))
    if where is None:
        continue
    per = samples.setdefault(where.group(0)[len("trace_"):], {m: [] for m in metrics})
    for m in metrics:
        unit = units[header.index(m)].strip().lower()
        per[m].append(float(row[m].replace(",", "")) * scale.get(unit, 1.0))
# Per path, each counter's mean and median over the kernel's launches.
print("| path | launches | " + " | ".join(
    f"{m} ({shown.get(units[header.index(m)].strip().lower(), units[header.index(m)].strip() or '?')}), mean / median"
    for m in metrics) + " |")
print("|---|---:|" + "---:|" * len(metrics))
for path in sorted(samples):
    per = samples[path]
    print(f"| {path} | {len(per[metrics[0]])} | " + " | ".join(
        f"{statistics.fmean(per[m]):.3f} / {statistics.median(per[m]):.3f}" for m in metrics) + " |")
EOF
