#!/usr/bin/env bash
# The README's test command: set up (install + Release build), run every test with ctest, then
# build again with AddressSanitizer + UBSan (build-asan/) and run the tests there too.
# EPX_SKIP_SANITIZE=1 skips the sanitizer pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Test-only: Debian's chromium runs `epx report`'s page headless (report.page_in_headless_chromium).
if ! command -v chromium >/dev/null && [[ $(id -u) -eq 0 ]]; then
  echo "test: installing chromium for the report's browser test"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
fi
# Open MPI refuses to run as root without these; MPI tests use --oversubscribe on 2 cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"

if [[ "${EPX_SKIP_SANITIZE:-0}" != 1 ]]; then
  echo "== sanitizer build (ASan + UBSan)"
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DEPX_SANITIZE=ON \
    -DEPX_BUILD_BENCH=OFF >/dev/null
  cmake --build build-asan -j "$(nproc)"
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j "$(nproc)" "$@"
fi
