#!/usr/bin/env bash
# One GPU-machine run of the DAG after the kernel tests. Under $OUT: dag.log, dag_timing.md, a
# tarball of artifacts/<gpu>/ (artifacts.tgz), the build caches and the small logs (the kernel
# tests', the GPU's name, graph_gain.md, ...) packed as logs.tgz. Needs .whl/ filled as
# scripts/device_site.sh says.
#   DAG_CONFIG=config/gpu_smoke.yaml (default): the reduced DAG (calibration seed, one held-out
#     seed, every trace family and ablation, the Nsight profile);
#   DAG_CONFIG=config/config.yaml: the full DAG (five held-out seeds). Its GPU jobs run in the
#     device's warm worker (pkv.worker: Python, torch, the CUDA context and FlashInfer loaded once
#     per device, not once per job); before that it took about 50 minutes on an H200 (the build
#     48 s, the calibration 160 s, a model-step job about 20 s, an evaluate job about 10 s, vLLM's
#     build about 5 minutes); with them, 15.9 minutes on an H100 with the caches carried, in two
#     parts (commit 487846a, artifacts/reference/h100/). docs/performance.md ("GPU jobs in warm
#     workers") has the targets and the per-rule table this script writes. Where runs have a
#     shorter time limit, run it in parts with DAG_TIMEOUT and RESUME_FROM.
#   PKV_WORKER=0 runs every GPU job in a fresh process, as before warm workers (the "before" figures).
#   DAG_TIMEOUT=<s>: stop the DAG after this long. RESUME=1 continues a stopped run whose
#     artifacts/<gpu>/ is in place (left on the machine, or unpacked from artifacts.tgz, which
#     keeps file times): the copied tree's files are dated back so that only missing and
#     incomplete results run. Use it only with the tree that produced those results.
#     RESUME_FROM=<artifacts.tgz of an earlier run, carried in an ignored folder such as .device/>
#     replaces artifacts/<gpu>/ with it first (a machine may hold results of other trees, or
#     none) and implies RESUME=1.
#   BUILD_CACHE_FROM="<build_cache.tgz> <flashinfer_jit_cache.tgz> <vllm_build_cache.tgz>" of an
#     earlier run of the same sources (and the same FlashInfer) unpacks the built extension,
#     FlashInfer's JIT modules and vLLM's kernels first, so a run on a fresh machine compiles none
#     of them; every run leaves its own in $OUT (a tarball over 15 MiB in parts NAME.00, NAME.01,
#     ...: name the first). The run says how many FlashInfer modules it compiled.
#   WORKER_AB="<result folder or file under artifacts/<gpu>/> ..." (or 1 for a default set) reruns
#     those DAG runs after the DAG, AB_ROUNDS times (default 3), in fresh processes and in the warm
#     worker, alternating, and writes $OUT/ab/ab.md: each engine's ratio and per-step times, fresh
#     against warm, with their spread (pkv.dag_timing ab). WORKER_CHECK=1 runs the worker's reset
#     check on the device first (python -m pkv.worker selfcheck --device).
#   SKIP_TESTS=1 skips the kernel tests. DAG_TARGETS="tables ...": build only these targets.
#   DAG_SET="key=value ...": more --config axes, e.g. calibration_repeats=0 (no repeated calibration).
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
# The build cache (the extension, FlashInfer's JIT modules) at the working tree's .cache/pkv, also
# under DAG_TREE: FlashInfer's ninja files name resolved paths, so a carried cache is reused only
# at the path it was saved from.
export PKV_CACHE_DIR=${PKV_CACHE_DIR:-$PWD/.cache/pkv}
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
export PYTHONUNBUFFERED=1
[ -f .device/source_stamp.json ] && export PKV_SOURCE_STAMP=${PKV_SOURCE_STAMP:-$PWD/.device/source_stamp.json}
restore_builds
# The time mark of FlashInfer's JIT count stays off $OUT: a device run sends back only a few files.
jit_mark=$(mktemp); touch "$jit_mark"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_gpu.py > "$OUT/tests.log" 2>&1; tail -2 "$OUT/tests.log"
fi
if [ -n "${WORKER_CHECK:-}" ]; then
  python3 -m pkv.worker selfcheck --device > "$OUT/worker_check.log" 2>&1; echo "worker check rc=$?"
  tail -12 "$OUT/worker_check.log"
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
dag_start=$(date +%s)
# shellcheck disable=SC2086  # DAG_UNTIL, DAG_TARGETS and DAG_SET are lists of words
timeout "${DAG_TIMEOUT:-420}" python3 -m snakemake ${DAG_TARGETS:-} ${DAG_UNTIL:+--until $DAG_UNTIL} --cores 16 \
  --scheduler greedy --keep-going \
  --configfile "$DAG_CONFIG" --config gpu="$GPU_NAME" ${DAG_SET:-} > "$OUT/dag.log" 2>&1
echo "dag rc=$? in $(( $(date +%s) - dag_start )) s (PKV_WORKER=${PKV_WORKER:-1})"
# A DAG stopped by the timeout ran no onsuccess/onerror: its warm workers go here.
python3 -m pkv.worker stop --slot-dir "${PKV_SLOT_DIR:-artifacts/.slots}" > /dev/null 2>&1
# Per rule: jobs, wall seconds, the median job, seconds not measuring (docs/performance.md's table).
python3 -m pkv.dag_timing rules --json "$OUT/dag_timing.json" > "$OUT/dag_timing.md" 2>&1 && cat "$OUT/dag_timing.md"
fi_jit="$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer"
echo "FlashInfer JIT: $(find "$fi_jit" -name '*.so' -newer "$jit_mark" 2>/dev/null | wc -l) modules compiled" \
  "in this run, $(find "$fi_jit" -name '*.so' 2>/dev/null | wc -l) in the cache ($fi_jit)"
rm -f "$jit_mark"
grep -h "the worker retires" artifacts/"$GPU_NAME"/logs -r 2>/dev/null | sort | uniq -c | head -5
tar czf "$OUT/artifacts.tgz" "artifacts/$GPU_NAME" 2>/dev/null
save_builds
if [ -n "${WORKER_AB:-}" ]; then
  seed=$(python3 -c "import yaml; print(yaml.safe_load(open('$DAG_CONFIG'))['held_out_seeds'][0])" 2>/dev/null || echo 20260623)
  [ "$WORKER_AB" = 1 ] && WORKER_AB="evaluate/bucketed_b1/seed$seed evaluate/bimodal_b8/seed$seed \
    model_step/bimodal_b4/seed$seed ablate/graph/splits=28/bimodal_b4/seed$seed"
  # shellcheck disable=SC2086  # a list of runs
  python3 -m pkv.dag_timing ab --root "artifacts/$GPU_NAME" --out "$OUT/ab" --rounds "${AB_ROUNDS:-3}" $WORKER_AB \
    > "$OUT/ab.log" 2>&1; echo "worker A/B rc=$?"; cat "$OUT/ab/ab.md" 2>/dev/null
  python3 -m pkv.worker stop --slot-dir "${PKV_SLOT_DIR:-artifacts/.slots}" > /dev/null 2>&1
fi
grep -E "Finished jobid|Error in rule|steps done" "$OUT/dag.log" | tail -12
# Each failed job's own log, where the reason is.
for log in $(grep -A12 "^Error in rule" "$OUT/dag.log" | grep -o "log: [^ ,]*" | cut -d' ' -f2 | sort -u); do
  echo "== $log"; tail -5 "$log" 2>/dev/null | cut -c1-300
done
for t in 2 4 5; do head -30 "artifacts/$GPU_NAME/tables/table$t.md" 2>/dev/null; done
# What Table 9's graph kept of Table 2's attention lead (pkv.report.graph_gain), once both have run;
# written to $OUT too, since a reference set is promoted from this run's per-seed files.
python3 -m pkv.report.graph_gain "artifacts/$GPU_NAME" > "$OUT/graph_gain.md" 2>/dev/null && cat "$OUT/graph_gain.md"
# A device run sends back at most 8 files: the small logs go back as one tarball beside dag.log,
# dag_timing.md, artifacts.tgz and the build caches.
small=$(cd "$OUT" && ls gpu.txt tests.log worker_check.log dag_timing.json graph_gain.md ab.log 2>/dev/null)
# shellcheck disable=SC2086  # file names without spaces
[ -n "$small" ] && tar czf "$OUT/logs.tgz" -C "$OUT" $small && (cd "$OUT" && rm -f $small)
