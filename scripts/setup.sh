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
  curl ca-certificates python3      # `epx report`'s plotting library from the npm registry
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

# `epx report` inlines plotly.js (the basic bundle) into its pages: fetched once from the npm
# registry at a pinned version, checked against the registry's sha512 integrity, never committed.
plotly_version=4.1.1
plotly_integrity=sha512-1oNF8PeQx2hv/y7tqEVWKD3JGwn/MGEMQ8mL9HUwsaqG9FGy/OU5FHUHvzqbqxN4mnwZGI9abTiE775C4kkjMQ==
vendor=vendor  # gitignored; every build dir reads it
if [[ ! -f $vendor/plotly-basic.min.js ]]; then
  echo "setup: fetching plotly.js-basic-dist-min $plotly_version from the npm registry"
  mkdir -p "$vendor"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  curl -fsSL --retry 3 -o "$tmp/plotly.tgz" \
    "https://registry.npmjs.org/plotly.js-basic-dist-min/-/plotly.js-basic-dist-min-$plotly_version.tgz"
  got="sha512-$(openssl dgst -sha512 -binary "$tmp/plotly.tgz" | base64 -w0)"
  if [[ $got != "$plotly_integrity" ]]; then
    echo "setup: plotly.js-basic-dist-min $plotly_version: integrity $got, expected $plotly_integrity" >&2
    exit 1
  fi
  # Unpacked aside, then moved in: an interrupted setup never leaves a truncated file behind.
  tar -xzf "$tmp/plotly.tgz" -C "$tmp" --strip-components=1 package/plotly-basic.min.js package/LICENSE
  mv "$tmp/LICENSE" "$vendor/plotly-LICENSE"
  mv "$tmp/plotly-basic.min.js" "$vendor/plotly-basic.min.js"
  rm -rf "$tmp"
  trap - EXIT
fi

build_type=${EPX_BUILD_TYPE:-Release}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$build_type" ${EPX_CMAKE_ARGS:-}
cmake --build build -j "$(nproc)"
