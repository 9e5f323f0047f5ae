#!/usr/bin/env bash
# Fetch vLLM's pinned sources into the git-ignored third_party/vllm on a machine with network, so
# the folder can be carried to a GPU machine that has none (carry: ["third_party/vllm"]). Only the
# files the kernels need are kept (a few hundred KiB); the sdists themselves are not.
#   scripts/vllm_carry.sh [--sdist FILE ...]      (run from the repository root)
set -euo pipefail
DEST=${VLLM_DEST:-third_party/vllm}
python3 -m pkv.engines.vllm_sources fetch --dest "$DEST" "$@"
echo "carry: $DEST ($(du -sk "$DEST" | cut -f1) KiB, $(find "$DEST" -type f | wc -l) files)"
