#!/usr/bin/env bash
# One GPU-machine run of the reduced DAG (config/gpu_smoke.yaml: the calibration seed, one held-out
# seed, every trace family and ablation, the Nsight profile) after the kernel tests. Logs and a
# tarball of artifacts/<gpu>/ land under $OUT. Needs the wheels of ../shared/device/wheels.txt in .whl/.
set -uo pipefail
OUT=${OUT:-/tmp/pkv-out}; mkdir -p "$OUT"
GPU_NAME=${GPU_NAME:-h200}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
export PKV_CACHE_DIR=${PKV_CACHE_DIR:-$PWD/.cache/pkv} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_gpu.py > "$OUT/tests.log" 2>&1; tail -2 "$OUT/tests.log"
timeout "${DAG_TIMEOUT:-420}" python3 -m snakemake --cores 16 --scheduler greedy --configfile config/gpu_smoke.yaml \
  --config gpu="$GPU_NAME" > "$OUT/dag.log" 2>&1
echo "dag rc=$?"
tar czf "$OUT/artifacts.tgz" "artifacts/$GPU_NAME" 2>/dev/null
grep -cE "^\[.*\]$" "$OUT/dag.log" >/dev/null; grep -E "Finished jobid|Error in rule|steps done" "$OUT/dag.log" | tail -12
for t in 2 4 5; do head -30 "artifacts/$GPU_NAME/tables/table$t.md" 2>/dev/null; done
