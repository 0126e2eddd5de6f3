#!/usr/bin/env bash
# The README's test command: set up (install + build), then run every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Open MPI refuses to run as root without these; tests use --oversubscribe on 2 cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
