#!/usr/bin/env bash
# An emulated multi-node cluster on one machine (../shared/TESTBED.md): each node is a network
# namespace with a veth link to a bridge in the root namespace, shaped by tbf in both directions,
# named in /etc/hosts, with a hostfile and an mpirun launch agent.
#
#   scripts/cluster.sh up [--nodes N] [--ranks-per-node G] [--link-gbit B] [--burst-ms M]
#                         [--exact-rate [--peak-frame BYTES]]
#                                                       (again: rebuilds it)
#   scripts/cluster.sh down
#   scripts/cluster.sh status
#
# Then `epx launch --cluster -- epx layer ...` runs on it. State lives in $EPX_CLUSTER_DIR
# (default /run/epx-cluster). Addresses: $EPX_CLUSTER_SUBNET.0/24 (default 10.231.7), used by
# nothing else; node i is epxnode<i> at .(11+i), the bridge (mpirun's side) at .1.
set -euo pipefail

STATE=${EPX_CLUSTER_DIR:-/run/epx-cluster}
SUBNET=${EPX_CLUSTER_SUBNET:-10.231.7}
BRIDGE=epxbr0
MTU=9000          # jumbo frames, as on RoCE/IB fabrics: headers stay under 1% of the bytes
HOSTS_TAG="# epx-cluster"

die() { echo "cluster.sh: $*" >&2; exit 1; }

preflight() {
  [ "$(id -u)" = 0 ] || die "needs root to create network namespaces and shape links (run as root or with sudo); nothing was changed"
  local tool
  for tool in ip tc unshare hostname; do
    command -v "$tool" >/dev/null || die "'$tool' is missing (Debian: apt-get install iproute2 util-linux hostname); nothing was changed"
  done
  ip netns list >/dev/null 2>&1 || die "'ip netns' does not work here (no network-namespace support); nothing was changed"
}

node_names() { local n=$1 i; for ((i = 0; i < n; i++)); do echo "epxnode$i"; done; }

down() {
  local ns link
  # Delete the veths first: both ends go at once, whereas a namespace's own end is destroyed
  # asynchronously after `ip netns del`, which would collide with an immediate `up`.
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | grep '^epxv' | cut -d@ -f1 || true); do
    ip link del "$link" 2>/dev/null || true
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^epxnode' || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$ns"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if grep -q "$HOSTS_TAG" /etc/hosts 2>/dev/null; then
    # /etc/hosts may be a bind mount (containers): rewrite it in place rather than replace it.
    local kept
    kept=$(grep -v "$HOSTS_TAG" /etc/hosts)
    printf '%s\n' "$kept" > /etc/hosts
  fi
  rm -rf "$STATE"
}

up() {
  local nodes=2 rpn=2 gbit=1 burst_ms=4 exact=0 peak_frame=65536 peak_frame_set=0
  while [ $# -gt 0 ]; do
    case $1 in
      --nodes) nodes=$2; shift 2 ;;
      --ranks-per-node) rpn=$2; shift 2 ;;
      --link-gbit) gbit=$2; shift 2 ;;
      --burst-ms) burst_ms=$2; shift 2 ;;
      --exact-rate) exact=1; shift ;;
      --peak-frame) peak_frame=$2; peak_frame_set=1; shift 2 ;;
      *) die "unknown option '$1' (expected --nodes N, --ranks-per-node G, --link-gbit B, --burst-ms M, --exact-rate, --peak-frame BYTES)" ;;
    esac
  done
  [[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 64)) || die "--nodes = '$nodes': expected a whole number from 1 to 64"
  [[ $rpn =~ ^[0-9]+$ ]] && ((rpn >= 1 && rpn <= 64)) || die "--ranks-per-node = '$rpn': expected a whole number from 1 to 64"
  [[ $gbit =~ ^[0-9]+([.][0-9]+)?$ ]] && awk -v b="$gbit" 'BEGIN { exit !(b > 0 && b <= 100) }' ||
    die "--link-gbit = '$gbit': expected a rate in Gbit/s above 0 and at most 100 (e.g. 1 or 0.5)"
  [[ $burst_ms =~ ^[0-9]+([.][0-9]+)?$ ]] && awk -v m="$burst_ms" 'BEGIN { exit !(m > 0 && m <= 100) }' ||
    die "--burst-ms = '$burst_ms': expected the link's burst allowance in ms of traffic, above 0 and at most 100 (e.g. 4 or 1)"
  [[ $peak_frame =~ ^[0-9]+$ ]] && ((peak_frame >= MTU && peak_frame <= 1048576)) ||
    die "--peak-frame = '$peak_frame': expected the bytes tbf lets pass at once at the peak rate, from the MTU ($MTU) to 1048576 (e.g. 65536, the veth's segment size)"
  ((peak_frame_set && !exact)) && die "--peak-frame = $peak_frame: only a link with a peak rate meters in frames; add --exact-rate or drop --peak-frame"
  if ip -4 addr show | grep -v "$BRIDGE" | grep -q "inet $SUBNET\."; then
    die "the subnet $SUBNET.0/24 is already used on this machine; set EPX_CLUSTER_SUBNET to a free one (e.g. 10.231.8)"
  fi
  down  # `up` again rebuilds from scratch

  # tbf: rate in kbit; the bucket holds --burst-ms of traffic (default 4 ms, at least 64 KB).
  # A message that finds the bucket full passes at the veth's own speed, so on messages of the
  # bucket's size the link runs well above its nominal rate (bench/RESULTS.md, issue 20's last
  # A/B). --exact-rate adds tbf's peakrate at 1.05x the rate: a burst then drains no faster than
  # the link, as on a real wire (the bucket only absorbs queueing). The peak rate is metered in
  # --peak-frame units, by default the 64 KB segments TCP hands the veth (GSO), as a NIC paces
  # TSO segments in hardware. In MTU frames (--peak-frame 9000) tbf splits every segment and
  # arms a timer per frame on the nodes' cores, which lost about 40% of the rate and took CPU
  # time from the compute (bench/RESULTS.md, issue 20: the link in segments).
  local kbit burst shape
  kbit=$(awk -v b="$gbit" 'BEGIN { printf "%d", b * 1000000 }')
  burst=$(awk -v k="$kbit" -v m="$burst_ms" 'BEGIN { b = k * 1000 / 8 * m / 1000; if (b < 65536) b = 65536; printf "%d", b }')
  # A frame larger than the bucket would be cut back into MTU frames and metered one by one, so
  # with a peak rate the bucket holds at least one peak frame (+ L2 headers, + 2 KB for tc's
  # rounding of the bucket to its clock).
  ((exact && burst < peak_frame + 2248)) && burst=$((peak_frame + 2248))
  shape="rate ${kbit}kbit burst $burst latency 50ms"
  ((exact)) && shape+=" peakrate $((kbit * 105 / 100))kbit mtu $((peak_frame + 200))"

  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" mtu $MTU
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i ns host_if
  for ((i = 0; i < nodes; i++)); do
    ns=epxnode$i
    host_if=epxv$i
    ip netns add "$ns"
    ip link add "$host_if" mtu $MTU type veth peer name eth0 mtu $MTU netns "$ns"
    ip link set "$host_if" master "$BRIDGE" up
    ip -n "$ns" addr add "$SUBNET.$((11 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    # shellcheck disable=SC2086  # $shape is tbf's parameter list
    tc qdisc replace dev "$host_if" root tbf $shape
    # shellcheck disable=SC2086
    ip netns exec "$ns" tc qdisc replace dev eth0 root tbf $shape
    echo "$SUBNET.$((11 + i)) $ns $HOSTS_TAG" >> /etc/hosts
  done

  mkdir -p "$STATE"
  # mpirun's launch agent: `AGENT HOST CMD...` runs CMD in that node's namespace with its own
  # hostname (Open MPI's shared-memory transport keys its segments by hostname).
  cat > "$STATE/agent" <<'AGENT'
#!/usr/bin/env bash
host=$1; shift
exec ip netns exec "$host" unshare --uts bash -c "hostname $host; $*"
AGENT
  chmod +x "$STATE/agent"
  node_names "$nodes" | sed "s/\$/ slots=$rpn/" > "$STATE/hostfile"
  cat > "$STATE/cluster.env" <<EOF
nodes=$nodes
ranks_per_node=$rpn
link_gbit=$gbit
link_burst_ms=$burst_ms
link_exact_rate=$exact
link_peak_frame=$( ((exact)) && echo "$peak_frame" || echo 0)
subnet=$SUBNET.0/24
agent=$STATE/agent
hostfile=$STATE/hostfile
EOF
  echo "cluster up: $nodes nodes x $rpn ranks, links shaped to $gbit Gbit/s each way (bursts of $burst_ms ms$( ((exact)) && echo ", at most 1.05x the rate in $peak_frame-byte frames")), MTU $MTU"
  status
}

status() {
  if [ ! -f "$STATE/cluster.env" ]; then
    echo "no emulated cluster (run: scripts/cluster.sh up --nodes N --ranks-per-node G --link-gbit B)"
    return 0
  fi
  sed 's/^/  /' "$STATE/cluster.env"
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep '^epxnode' | sort -V); do
    printf '  %-9s %s  %s\n' "$ns" "$(ip -n "$ns" -4 -o addr show dev eth0 | awk '{print $4}')" \
      "$(ip netns exec "$ns" tc qdisc show dev eth0 | grep -o 'rate [^ ]*' || echo 'not shaped')"
  done
}

cmd=${1:-}
[ -n "$cmd" ] && shift
case $cmd in
  up) preflight; up "$@" ;;
  down) preflight; down; echo "cluster down" ;;
  status) status ;;
  *) die "usage: scripts/cluster.sh up [--nodes N] [--ranks-per-node G] [--link-gbit B] | down | status" ;;
esac
