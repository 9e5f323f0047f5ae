#!/usr/bin/env bash
# An A/B of Hydra overrides inside the graphed model step, kernel by kernel: scripts/kernel_profile.sh
# once per setting and round, one process each, the settings in alternating order from round to
# round. One run a setting is no result: FlashInfer's own step time and its neighbours' extras move
# between two processes of one machine by as much as the effects in question (docs/performance.md,
# "Which neighbour pays").
#   (from the repository root, with .whl/ filled as scripts/device_site.sh says)
#   PROFILE_AB="<overrides of A>|<overrides of B>|...": required; a setting's overrides are
#     space-separated, e.g. PROFILE_AB="engine.discard_merged_states=false|engine.discard_merged_states=true"
#   AB_ROUNDS (2): rounds over every setting; AB_BUDGET_S (420): no run starts after this many seconds
#   and kernel_profile.sh's variables (PROFILE_TRACES, PROFILE_STEPS, PROFILE_MODES, BUILD_CACHE_FROM, ...).
# Each run's kernels.md, kernels.json and log land in $OUT/ab/r<round>.s<setting>/, packed as
# $OUT/kernel_profile_ab.tgz; printed last, every run's per-layer tables (graph_gain's) by setting.
set -uo pipefail
OUT=${OUT:-/tmp/pkv-out}; mkdir -p "$OUT/ab"
[ -n "${PROFILE_AB:-}" ] || { echo "PROFILE_AB: give the settings to compare, separated by '|'" >&2; exit 2; }
IFS='|' read -r -a settings <<< "$PROFILE_AB"
start=$(date +%s)
for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  order=$(seq 0 $(( ${#settings[@]} - 1 )))
  [ $(( round % 2 )) -eq 0 ] && order=$(echo "$order" | tac)
  for s in $order; do
    dest="$OUT/ab/r$round.s$s"
    if [ $(( $(date +%s) - start )) -gt "${AB_BUDGET_S:-420}" ]; then
      echo "r$round.s$s (${settings[$s]}): not started, past AB_BUDGET_S"; continue
    fi
    mkdir -p "$dest"
    printf '%s\n' "${settings[$s]}" > "$dest/setting.txt"
    OUT="$dest" PROFILE_OVERRIDES="${settings[$s]}" bash scripts/kernel_profile.sh > "$dest/run.log" 2>&1
    echo "r$round.s$s rc=$? at $(( $(date +%s) - start )) s: ${settings[$s]}"
  done
done
# Every run's tables as pkv.report.graph_gain renders them, grouped by setting, with the packages
# kernel_profile.sh installed under /tmp/site (scripts/device_site.sh) on the path.
PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} python3 - "$OUT/ab" <<'EOF'
import json, sys
from pathlib import Path

from pkv.report.graph_gain import render_kernels, render_other_kernels

for run in sorted(Path(sys.argv[1]).glob("r*.s*"), key=lambda p: (p.name.split(".")[1], p.name)):
    print(f"\n== {run.name}: {(run / 'setting.txt').read_text().strip()}")
    figures = run / "kernels.json"
    rows = json.loads(figures.read_text())["kernels"] if figures.is_file() else []
    print(render_kernels(rows) + "\n" + render_other_kernels(rows) if rows else "no kernels.json (see its run.log)")
EOF
tar czf "$OUT/kernel_profile_ab.tgz" -C "$OUT" ab && rm -rf "$OUT/ab"
