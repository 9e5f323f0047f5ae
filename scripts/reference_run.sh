#!/usr/bin/env bash
# A GPU's reference set (artifacts/reference/<gpu>/): the full configuration at one commit, run on a
# GPU machine in two parts of at most ten minutes each, then promoted. Three places, three steps:
#
#   scripts/reference_run.sh prepare           on a machine with network, in a clean checkout of the commit:
#       fills the ignored .whl/ (../shared/device/wheels.sh and flashinfer_slim.sh, trimmed as
#       scripts/device_site.sh says), third_party/vllm (scripts/vllm_carry.sh) and .device/dag, the
#       exported tree of HEAD with its source stamp (pkv.provenance --stamp), and checks
#       that the tracked tree and the carry fit the 64 MiB a run may take.
#   scripts/reference_run.sh part1             on the GPU machine (carry .whl, .device, third_party/vllm):
#       the kernel tests, then the DAG for DAG_TIMEOUT (400) s.
#   scripts/reference_run.sh part2             at once, on the same machine (carry .whl, third_party/vllm):
#       the rest of the DAG (RESUME=1) for DAG_TIMEOUT (420) s, from the results and build cache
#       part 1 left there. Each part leaves gpu_dag.sh's files in $OUT.
#   scripts/reference_run.sh promote PART1_OUT PART2_OUT [NOTES.md]    back on the first machine:
#       the run's artifacts from part 2's artifacts.tgz, both parts' DAG logs kept in the set's
#       logs/dag/ (part1_dag.log, part1_dag_timing.md, ...), promoted with pkv.report.reference_set
#       (which refuses a run of several commits or a dirty tree) and the README's headline block
#       rewritten with pkv.report.headline. NOTES.md is the README's "how it ran" section. A card's
#       first set needs the block's two markers in the README: promote names them and moves
#       nothing until they are there.
#
# The card names the set: GPU_NAME (h200 or h100) defaults to what nvidia-smi reports, so a run
# that asked for one kind and got the other files its results under the card it ran on.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 1

card_name() {
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$name" in
    *H200*) echo h200 ;;
    *H100*) echo h100 ;;
    *) echo "reference_run.sh: GPU '${name:-none}' is neither an H200 nor an H100: set GPU_NAME" >&2; return 1 ;;
  esac
}

case "${1:-}" in
  prepare)
    set -e
    if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
      echo "reference_run.sh prepare: the tree has uncommitted changes; a reference set runs a commit" >&2
      exit 1
    fi
    shared=${SHARED_DEVICE:-../shared/device}
    bash "$shared/wheels.sh"
    bash "$shared/flashinfer_slim.sh"
    # The slim tarball replaces FlashInfer's wheels; cuDNN's frontend and nccl4py stay out (device_site.sh).
    rm -f .whl/flashinfer_python-*.whl .whl/nvidia_cudnn_frontend-*.whl .whl/nccl4py-*.whl
    bash scripts/vllm_carry.sh
    rm -rf .device/dag && mkdir -p .device/dag/.device
    git archive HEAD | tar -x -C .device/dag
    # The exported tree runs the DAG into artifacts/<gpu>/; the committed sets stay behind.
    rm -rf .device/dag/artifacts/reference
    python3 -m pkv.provenance --stamp .device/dag/.device/source_stamp.json
    cp .device/dag/.device/source_stamp.json .device/source_stamp.json
    tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    carried=$(du -sb .whl .device third_party/vllm | awk '{s += $1} END {print s}')
    echo "tracked tree $((tracked / 1048576)) MiB + carry $((carried / 1048576)) MiB (.whl, .device, third_party/vllm)"
    if [ $((tracked + carried)) -gt $((64 * 1048576)) ]; then
      echo "reference_run.sh prepare: over the 64 MiB a run may carry" >&2
      exit 1
    fi
    echo "part 1: scripts/reference_run.sh part1   (carry .whl, .device, third_party/vllm; timeout 600)"
    ;;
  part1)
    gpu=${GPU_NAME:-$(card_name)} || exit 1
    [ -d .device/dag ] || { echo "reference_run.sh part1: no .device/dag: run prepare first" >&2; exit 1; }
    echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) -> GPU_NAME=$gpu"
    GPU_NAME=$gpu DAG_TREE=.device/dag DAG_TIMEOUT=${DAG_TIMEOUT:-400} DAG_CONFIG=config/config.yaml \
      bash scripts/gpu_dag.sh 2>&1 | tail -70
    ;;
  part2)
    gpu=${GPU_NAME:-$(card_name)} || exit 1
    [ -d ".device/dag/artifacts/$gpu" ] || {
      echo "reference_run.sh part2: no .device/dag/artifacts/$gpu on this machine: part 1 ran elsewhere" >&2
      exit 1
    }
    # Part 1's build cache is still at .cache/pkv on this machine, so nothing compiles again.
    GPU_NAME=$gpu SKIP_TESTS=1 RESUME=1 DAG_TREE=.device/dag DAG_TIMEOUT=${DAG_TIMEOUT:-420} \
      DAG_CONFIG=config/config.yaml bash scripts/gpu_dag.sh 2>&1 | tail -60
    ;;
  promote)
    set -e
    part1=${2:?part 1\'s OUT folder} part2=${3:?part 2\'s OUT folder} notes=${4:-}
    for f in "$part1/dag.log" "$part2/dag.log" "$part2/artifacts.tgz"; do
      [ -f "$f" ] || { echo "reference_run.sh promote: $f: missing" >&2; exit 1; }
    done
    run=$(mktemp -d)
    trap 'rm -rf "$run"' EXIT
    tar xzf "$part2/artifacts.tgz" -C "$run"
    gpu=$(ls "$run/artifacts")
    # The README's headline block is rewritten last: a set without one would be promoted and its
    # headline left unwritten, so the markers are asked for before anything moves.
    python3 - "artifacts/reference/$gpu" <<'PY'
import sys
from pathlib import Path

from pkv.report.headline import markers, readme_block

name = sys.argv[1]
if readme_block(Path("README.md"), name) is None:
    sys.exit(f"reference_run.sh promote: README.md has no headline block for {name}: put these two lines "
             f"where it goes (README, 'Reference results'), then promote again:\n" + "\n".join(markers(name)))
PY
    logs=()
    for part in 1 2; do
      dir=part$part; dir=${!dir}
      cp "$dir/dag.log" "$run/part${part}_dag.log" && logs+=("$run/part${part}_dag.log")
      if [ -f "$dir/dag_timing.md" ]; then
        cp "$dir/dag_timing.md" "$run/part${part}_dag_timing.md" && logs+=("$run/part${part}_dag_timing.md")
      fi
    done
    python3 -m pkv.report.reference_set "$run/artifacts/$gpu" "artifacts/reference/$gpu" \
      --dag-logs "${logs[@]}" ${notes:+--notes "$notes"}
    python3 -m pkv.report.headline "artifacts/reference/$gpu" --write README.md
    echo "then: docs/performance.md (the set's section, 'Where things stand'), the full test suite"
    ;;
  *)
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    [ "${1:-}" = -h ] || [ "${1:-}" = --help ]
    ;;
esac
