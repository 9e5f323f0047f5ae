#!/usr/bin/env bash
# Sourced by the GPU-machine scripts: installs what a run carried in .whl/ into /tmp/site and puts
# it on the path. The GPU machine can download nothing, so everything comes from there:
#   .whl/*.whl                          the wheels of ../shared/device/wheels.txt (cp312)
#   .whl/flashinfer-*-slim.tgz          FlashInfer 0.7.2 slimmed to fit the carry limit
#                                       (../shared/device/flashinfer_slim.sh; leave its full
#                                       wheel and the 0.5.3 wheel out of .whl/ when carrying it)
# Two wheels of that list stay out of .whl/ as well: nvidia-cudnn-frontend (11.6 MB) and nccl4py
# (3.7 MB). FlashInfer imports cudnn inside a try (its cuDNN backends) and nccl only in its MoE
# expert-parallel package; decode uses neither, and the 15 MB they free carry the build caches
# below (build_cache.tgz and flashinfer_jit_cache.tgz) beside an exported tree within 64 MiB:
#   rm -f .whl/flashinfer_python-*.whl .whl/nvidia_cudnn_frontend-*.whl .whl/nccl4py-*.whl
# A run that carries vLLM's sources names their folder in its carry (scripts/vllm_carry.sh).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
for slim in .whl/flashinfer-*-slim.tgz; do
  [ -f "$slim" ] || continue
  rm -rf /tmp/site/flashinfer /tmp/site/flashinfer_python-*.dist-info
  tar xzf "$slim" -C /tmp/site || return 1
done
# One fixed date on every installed file: FlashInfer's JIT builds run ninja, whose dependencies
# include the headers of these packages (tvm_ffi's, FlashInfer's), and pip dates what it installs
# by the clock. Dated back, they stay older than the modules a carried cache holds (below), so
# ninja rebuilds none of them on a fresh machine.
find /tmp/site -exec touch -h -d 2000-01-01 {} + 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null || echo "flashinfer: not importable"

# The extensions' build cache travels between runs as tarballs in $OUT (each file that comes back
# is at most 16 MiB): the project's, vLLM's and FlashInfer's JIT modules apart, each written whole
# or not at all. FlashInfer's JIT cache lives under the project's ($PKV_CACHE_DIR/flashinfer, as
# FLASHINFER_WORKSPACE_BASE, which restore_builds sets unless it is set), so a carried cache of an
# earlier run skips every JIT compile. FlashInfer's ninja files name resolved absolute paths: its
# cache is reused where PKV_CACHE_DIR is the same path as in the run that saved it (gpu_dag.sh keeps
# it at the repository root's .cache/pkv, also under DAG_TREE).
#   restore_builds: unpacks $BUILD_CACHE_FROM (tarballs of earlier runs of the same sources, space
#     separated; a tarball saved in parts is named by its first, NAME.00, or by NAME); one that
#     does not unpack is dropped with a warning and the build runs instead.
restore_builds() {
  local cache parts
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PKV_CACHE_DIR/flashinfer}
  mkdir -p "$PKV_CACHE_DIR"
  for cache in ${BUILD_CACHE_FROM:-}; do
    cache=${cache%.00}
    if [ -f "$cache" ]; then
      tar xzf "$cache" -C "$PKV_CACHE_DIR" && continue
    elif [ -f "$cache.00" ]; then
      parts=$(ls "$cache".[0-9][0-9])
      # shellcheck disable=SC2086  # the parts, in order
      cat $parts | tar xz -C "$PKV_CACHE_DIR" && continue
    fi
    echo "build cache $cache does not unpack: building instead" >&2
    case "$cache" in
      *flashinfer*) rm -rf "$PKV_CACHE_DIR/flashinfer" ;;
      *vllm*) rm -rf "$PKV_CACHE_DIR"/vllm-* ;;
      *) find "$PKV_CACHE_DIR" -mindepth 1 -maxdepth 1 ! -name flashinfer ! -name 'vllm-*' -exec rm -rf {} + ;;
    esac
  done
}
# _save_tarball NAME DIR ARGS...: tar ARGS (relative to DIR) into $OUT/NAME, or NAME.00, NAME.01,
# ... of 15 MiB each where it is larger than what comes back as one file.
_save_tarball() {
  local name=$1 dir=$2; shift 2
  rm -f "$OUT/.$name.part" "$OUT/.$name.part".[0-9][0-9]
  (cd "$dir" && tar czf - "$@") > "$OUT/.$name.part" || { rm -f "$OUT/.$name.part"; return 1; }
  rm -f "$OUT/$name" "$OUT/$name".[0-9][0-9]
  if [ "$(stat -c %s "$OUT/.$name.part")" -le $((15 * 1024 * 1024)) ]; then
    mv "$OUT/.$name.part" "$OUT/$name"
  else
    split -b 15m -d -a 2 "$OUT/.$name.part" "$OUT/$name." && rm -f "$OUT/.$name.part"
  fi
}
save_builds() {
  [ -d "$PKV_CACHE_DIR" ] || return 0
  _save_tarball build_cache.tgz "$PKV_CACHE_DIR" --exclude='./vllm-*' --exclude='*/build-*' \
    --exclude='./flashinfer' .
  if ls -d "$PKV_CACHE_DIR"/vllm-* >/dev/null 2>&1; then
    # shellcheck disable=SC2046  # the vllm-* folders, names without spaces
    _save_tarball vllm_build_cache.tgz "$PKV_CACHE_DIR" --exclude='*/build-*' $(cd "$PKV_CACHE_DIR" && ls -d vllm-*)
  fi
  # FlashInfer's modules with their objects and ninja's logs: without them ninja rebuilds the module.
  if [ -d "$PKV_CACHE_DIR/flashinfer" ]; then
    _save_tarball flashinfer_jit_cache.tgz "$PKV_CACHE_DIR" --exclude='*/tmp/*.lock' flashinfer
  fi
}

# What every device script does after sourcing this file: the build cache at the working tree's
# .cache/pkv (unless set), the carried builds unpacked (restore_builds), and the source stamp the
# results name where one was carried (pkv.provenance reads PKV_SOURCE_STAMP).
prepare_run() {
  export PKV_CACHE_DIR=${PKV_CACHE_DIR:-$PWD/.cache/pkv} PYTHONUNBUFFERED=1
  restore_builds
  if [ -f .device/source_stamp.json ]; then
    export PKV_SOURCE_STAMP=${PKV_SOURCE_STAMP:-$PWD/.device/source_stamp.json}
  fi
}
