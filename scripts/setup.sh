#!/usr/bin/env bash
# Idempotent setup: install the Debian packages epx needs (when missing), then configure and
# build Release into build/. Safe to run again; it only installs what is absent.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake g++ ninja-build pkg-config
  libopenmpi-dev openmpi-bin        # the distributed engine
  libdnnl-dev                       # oneDNN: BF16/FP32 GEMM with AMX where present
  libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  iproute2 util-linux hostname      # the emulated cluster: ip, tc, unshare (scripts/cluster.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: these Debian packages are missing and installing them needs root: ${missing[*]}" >&2
    echo "setup: run 'sudo bash scripts/setup.sh' or install them with apt-get." >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

build_type=${EPX_BUILD_TYPE:-Release}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$build_type" ${EPX_CMAKE_ARGS:-}
cmake --build build -j "$(nproc)"
