#!/usr/bin/env bash
# Sourced by the GPU-machine scripts: installs what a run carried in .whl/ into /tmp/site and puts
# it on the path. The GPU machine can download nothing, so everything comes from there:
#   .whl/*.whl                          the wheels of ../shared/device/wheels.txt (cp312)
#   .whl/flashinfer-*-slim.tgz          FlashInfer 0.7.2 slimmed to fit the carry limit
#                                       (../shared/device/flashinfer_slim.sh; leave its full
#                                       wheel and the 0.5.3 wheel out of .whl/ when carrying it)
# A run that carries vLLM's sources names their folder in its carry (scripts/vllm_carry.sh).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
for slim in .whl/flashinfer-*-slim.tgz; do
  [ -f "$slim" ] || continue
  rm -rf /tmp/site/flashinfer /tmp/site/flashinfer_python-*.dist-info
  tar xzf "$slim" -C /tmp/site || return 1
done
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null || echo "flashinfer: not importable"

# The extensions' build cache travels between runs as tarballs in $OUT (each file that comes back
# is at most 16 MiB): the project's and vLLM's apart, each written whole or not at all.
#   restore_builds: unpacks $BUILD_CACHE_FROM (tarballs of earlier runs of the same sources, space
#     separated); one that does not unpack is dropped with a warning and the build runs instead.
restore_builds() {
  local cache
  for cache in ${BUILD_CACHE_FROM:-}; do
    mkdir -p "$PKV_CACHE_DIR" && tar xzf "$cache" -C "$PKV_CACHE_DIR" && continue
    echo "build cache $cache does not unpack: building instead" >&2
    rm -rf "$PKV_CACHE_DIR"; return 0
  done
}
save_builds() {
  [ -d "$PKV_CACHE_DIR" ] || return 0
  (cd "$PKV_CACHE_DIR" || exit 0
   tar czf "$OUT/.build_cache.tgz.part" --exclude='vllm-*' --exclude='*/build-*' . \
     && mv "$OUT/.build_cache.tgz.part" "$OUT/build_cache.tgz"
   if ls -d vllm-* >/dev/null 2>&1; then
     tar czf "$OUT/.vllm_build_cache.tgz.part" --exclude='*/build-*' vllm-* \
       && mv "$OUT/.vllm_build_cache.tgz.part" "$OUT/vllm_build_cache.tgz"
   fi)
}
