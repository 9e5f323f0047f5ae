#!/usr/bin/env bash
# Where attention's time goes inside a graphed model step, kernel by kernel (Table 9's traces): one
# GPU-machine run of the model step per trace with its first measured steps traced again under the
# CUDA profiler (experiment.kernel_profile_steps, pkv.measure.kernel_trace), then
# `python -m pkv.report.graph_gain`'s table of each path's attention kernels per layer. Logs and
# results under $OUT, packed as $OUT/kernel_profile.tgz (artifacts/<gpu>/model_step/<trace>/seed<S>/ and
# each trace's log: a device run sends back a few files, and these folders hold dozens).
#   (from the repository root, with .whl/ filled as scripts/device_site.sh says)
#   PROFILE_TRACES="bimodal_b8 zipf_b8 ...": results trace names (<family>_b<max_active>, or a name
#     under config/config.yaml's external_traces: azure_conv_b8, azure_code_b8, ...)
#   PROFILE_SEED (20260623), PROFILE_STEPS (8: traced steps), PROFILE_MODES ("[graph]")
#   PROFILE_CALIBRATION: a calibration JSON (default: the committed reference set's of this GPU;
#     where there is none, conf/gpu/<gpu>.yaml's constants, as a run without calibration= takes)
#   PROFILE_OVERRIDES="key=value ...": more Hydra overrides for every run, e.g. engine.merge=fused or
#     engine.num_splits=4 (every regime's split count, over the calibration's), to see which part of
#     a route moves a kernel
#   BUILD_CACHE_FROM: as in scripts/device_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/pkv-out}; mkdir -p "$OUT"
source scripts/device_site.sh || exit 1
prepare_run
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
GPU_NAME=$(grep -q H200 "$OUT/gpu.txt" && echo h200 || echo h100)
CALIBRATION=${PROFILE_CALIBRATION:-artifacts/reference/$GPU_NAME/calibration/calibration.json}
calibrated=()
[ -f "$CALIBRATION" ] && calibrated=("calibration=$CALIBRATION")
echo "calibration: ${calibrated[*]:-conf/gpu/$GPU_NAME.yaml}"
python3 -m pkv.build 2>&1 | tail -1 || exit 1
SEED=${PROFILE_SEED:-20260623}
for trace in ${PROFILE_TRACES:-bimodal_b8 zipf_b8 uniform_b8 homogeneous_b8 bucketed_b1}; do
  dest=$OUT/artifacts/$GPU_NAME/model_step/$trace/seed$SEED
  # The trace's overrides as the DAG gives them (workflow/rules/common.smk, trace_overrides): an
  # external_traces entry of config/config.yaml, else <family>_b<max_active>.
  mapfile -t trace_args < <(python3 - "$trace" <<'PY'
import sys
import yaml
name = sys.argv[1]
spec = (yaml.safe_load(open("config/config.yaml")).get("external_traces") or {}).get(name)
if spec:
    print(f"trace=external\ntrace.path={spec['path']}\ntrace.name={name}\ntrace.max_active={spec['max_active']}")
else:
    family, _, batch = name.rpartition("_b")
    print(f"trace={family}\ntrace.max_active={batch}")
PY
)
  # shellcheck disable=SC2086  # PROFILE_OVERRIDES is a list of words
  python3 -m pkv.cli experiment=model_step "${trace_args[@]}" "seed=$SEED" \
    "gpu=$GPU_NAME" ${calibrated[@]+"${calibrated[@]}"} "experiment.kernel_profile_steps=${PROFILE_STEPS:-8}" \
    "experiment.engines=[adaptive,flashinfer]" "experiment.modes=${PROFILE_MODES:-[graph]}" \
    ${PROFILE_OVERRIDES:-} "out=$dest" "hydra.run.dir=$dest/.run" > "$OUT/$trace.log" 2>&1
  echo "$trace rc=$? $(tail -1 "$OUT/$trace.log")"
done
python3 -m pkv.report.graph_gain "$OUT/artifacts/$GPU_NAME" --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.md"
logs=$(cd "$OUT" && ls ./*_b*.log 2>/dev/null)
# shellcheck disable=SC2086  # the trace logs, names without spaces
tar czf "$OUT/kernel_profile.tgz" -C "$OUT" artifacts $logs && rm -rf "$OUT/artifacts" && (cd "$OUT" && rm -f $logs)
