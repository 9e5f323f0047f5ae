#!/usr/bin/env bash
# One GPU-machine run of the DAG after the kernel tests. Logs and a tarball of artifacts/<gpu>/
# land under $OUT. Needs .whl/ filled as scripts/device_site.sh says.
#   DAG_CONFIG=config/gpu_smoke.yaml (default): the reduced DAG (calibration seed, one held-out
#     seed, every trace family and ablation, the Nsight profile), about 5 minutes on an H200;
#   DAG_CONFIG=config/config.yaml: the full DAG (five held-out seeds), about 50 minutes on an H200
#     (the build 48 s, the calibration 160 s, a model-step job about 20 s, an evaluate job about
#     10 s, vLLM's build about 5 minutes): where runs have a shorter time limit, run it in parts
#     with DAG_TIMEOUT and RESUME_FROM.
#   DAG_TIMEOUT=<s>: stop the DAG after this long. RESUME=1 continues a stopped run whose
#     artifacts/<gpu>/ is in place (left on the machine, or unpacked from artifacts.tgz, which
#     keeps file times): the copied tree's files are dated back so that only missing and
#     incomplete results run. Use it only with the tree that produced those results.
#     RESUME_FROM=<artifacts.tgz of an earlier run, carried in an ignored folder such as .device/>
#     replaces artifacts/<gpu>/ with it first (a machine may hold results of other trees, or
#     none) and implies RESUME=1.
#   BUILD_CACHE_FROM=<build_cache.tgz of an earlier run of the same sources> unpacks the built
#     extension first, so a resumed run on a fresh machine skips the one-minute build; every run
#     leaves its own as $OUT/build_cache.tgz.
#   SKIP_TESTS=1 skips the kernel tests. DAG_TARGETS="tables ...": build only these targets.
#   DAG_UNTIL="<rule> ...": run only these rules' jobs and what they need (snakemake --until), so the
#     full DAG runs in parts that each finish whole rules, for example, each resumed from the last
#     (job counts of DAG_CONFIG=config/config.yaml):
#       DAG_UNTIL="calibrate_repeat evaluate"   the calibrations and Table 2 (53 jobs)
#       DAG_UNTIL="model_step"                  the calibration and Table 9 (42 jobs)
#       (nothing)                               the ablations, benchmarks, profile, tables, figures
#   PKV_SOURCE_STAMP=<file from `python -m pkv.provenance --stamp`, carried>: results name that
#     commit when the copied sources match it (default .device/source_stamp.json if present).
# vLLM's rows need its sources carried: run scripts/vllm_carry.sh here and name third_party/vllm
# in the run's carry (without them the rows record why they did not run).
set -uo pipefail
OUT=${OUT:-/tmp/pkv-out}; mkdir -p "$OUT"
GPU_NAME=${GPU_NAME:-h200}
DAG_CONFIG=${DAG_CONFIG:-config/gpu_smoke.yaml}
# DAG_TREE=<dir>: run in an exported tree of one commit instead of the working tree, so the parts of
# a full run that spans several device runs all run that commit, whatever the working tree holds by then:
#   mkdir -p .device/dag && git archive <rev> | tar -x -C .device/dag \
#     && python -m pkv.provenance --stamp .device/dag/.device/source_stamp.json   # with <rev> checked out
# The wheels and vLLM's sources come from the working tree; carried tarballs are named from it too.
if [ -n "${DAG_TREE:-}" ]; then
  for carried in BUILD_CACHE_FROM RESUME_FROM PKV_SOURCE_STAMP; do
    # shellcheck disable=SC2046  # each word a path
    [ -n "${!carried:-}" ] && export "$carried=$(realpath ${!carried} | tr '\n' ' ' | sed 's/ $//')"
  done
  ln -sfn "$PWD/.whl" "$DAG_TREE/.whl" || exit 1
  if [ -d third_party/vllm ]; then mkdir -p "$DAG_TREE/third_party" && ln -sfn "$PWD/third_party/vllm" "$DAG_TREE/third_party/vllm"; fi
  site="$PWD/scripts/device_site.sh"  # this tree's, which the exported one may predate
  cd "$DAG_TREE" || exit 1
fi
source "${site:-scripts/device_site.sh}" || exit 1
export PKV_CACHE_DIR=${PKV_CACHE_DIR:-$PWD/.cache/pkv} PYTHONUNBUFFERED=1
[ -f .device/source_stamp.json ] && export PKV_SOURCE_STAMP=${PKV_SOURCE_STAMP:-$PWD/.device/source_stamp.json}
restore_builds
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_gpu.py > "$OUT/tests.log" 2>&1; tail -2 "$OUT/tests.log"
fi
if [ -n "${RESUME_FROM:-}" ]; then
  # The tarball is the whole state of the run to resume: results left on the machine by other
  # trees must not pass for its results once every source file is dated back below.
  rm -rf "artifacts/$GPU_NAME"
  tar xzf "$RESUME_FROM" || exit 1
  RESUME=1
fi
if [ -n "${RESUME:-}" ]; then
  find Snakefile workflow config conf csrc pkv scripts traces -type f -exec touch -d 2000-01-01 {} +
fi
# --keep-going: a failed job stops only what depends on it; the rest of a part's device time still
# yields results, and the failure is in dag.log and the job's log.
# shellcheck disable=SC2086  # DAG_UNTIL and DAG_TARGETS are lists of words
timeout "${DAG_TIMEOUT:-420}" python3 -m snakemake ${DAG_TARGETS:-} ${DAG_UNTIL:+--until $DAG_UNTIL} --cores 16 \
  --scheduler greedy --keep-going \
  --configfile "$DAG_CONFIG" --config gpu="$GPU_NAME" > "$OUT/dag.log" 2>&1
echo "dag rc=$?"
tar czf "$OUT/artifacts.tgz" "artifacts/$GPU_NAME" 2>/dev/null
save_builds
grep -E "Finished jobid|Error in rule|steps done" "$OUT/dag.log" | tail -12
# Each failed job's own log, where the reason is.
for log in $(grep -A12 "^Error in rule" "$OUT/dag.log" | grep -o "log: [^ ,]*" | cut -d' ' -f2 | sort -u); do
  echo "== $log"; tail -5 "$log" 2>/dev/null | cut -c1-300
done
for t in 2 4 5; do head -30 "artifacts/$GPU_NAME/tables/table$t.md" 2>/dev/null; done
