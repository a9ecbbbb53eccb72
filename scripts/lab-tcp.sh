#!/usr/bin/env bash
# The TCP reference for the wiring lab: the same two namespaces, veth pair and tbf shaping as
# lab-tbf.sh, with a plain kernel TCP connection carrying N MiB each way at once (Python
# sockets, no encryption). Prints the per-direction rate, the ceiling a transport can reach on
# that link. Needs root; cleans up after itself.
#
#   MTU=1500 RATE=1gbit N=256 scripts/lab-tcp.sh
set -euo pipefail
RATE=${RATE:-1gbit}; MTU=${MTU:-1500}; QLAT=${QLAT:-50ms}; N=${N:-256}
[ "$(id -u)" = 0 ] || { echo "lab-tcp: SKIP: needs root for ip netns and tc"; exit 77; }
command -v python3 >/dev/null || { echo "lab-tcp: SKIP: no python3"; exit 77; }
id=$$; ns0="wttcp${id}a"; ns1="wttcp${id}b"; va="wc${id}a"; vb="wc${id}b"
a_ip=10.214.$((id % 250)).1; b_ip=10.214.$((id % 250)).2
tmp=$(mktemp -d)
cleanup() {
  ip netns pids "$ns0" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns pids "$ns1" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns del "$ns0" 2>/dev/null || true; ip netns del "$ns1" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
ip netns add "$ns0" 2>/dev/null || { echo "lab-tcp: SKIP: cannot create network namespaces here"; exit 77; }
ip netns add "$ns1"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$ns0"; ip link set "$vb" netns "$ns1"
ip -n "$ns0" addr add "$a_ip/24" dev "$va"; ip -n "$ns1" addr add "$b_ip/24" dev "$vb"
ip -n "$ns0" link set "$va" mtu "$MTU" up; ip -n "$ns1" link set "$vb" mtu "$MTU" up
tc -n "$ns0" qdisc add dev "$va" root tbf rate "$RATE" burst 128kb latency "$QLAT"
tc -n "$ns1" qdisc add dev "$vb" root tbf rate "$RATE" burst 128kb latency "$QLAT"
cat > "$tmp/tcp.py" <<'PY'
import socket, sys, threading, time
mode, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
buf = b"x" * (1 << 20)
if mode == "server":
    l = socket.socket(); l.bind((addr, 5201)); l.listen(1); s, _ = l.accept()
else:
    for _ in range(100):
        try:
            s = socket.create_connection((addr, 5201)); break
        except OSError:
            time.sleep(0.05)
s.sendall(b"g"); assert s.recv(1) == b"g"
t0 = time.perf_counter(); done = []
def drain():
    got = 0
    while got < n << 20:
        d = s.recv(1 << 20)
        if not d: break
        got += len(d)
    done.append(time.perf_counter())
t = threading.Thread(target=drain); t.start()
for _ in range(n): s.sendall(buf)
t.join()
print(f"{mode}: {n} MiB each way at once in {done[0] - t0:.3f} s: {(n << 20) / (done[0] - t0) / 1e9:.4f} GB/s per direction")
PY
echo "# lab-tcp: veth MTU $MTU, tbf rate $RATE each way, queue $QLAT; kernel TCP, both directions at once"
ip netns exec "$ns0" timeout 120 python3 "$tmp/tcp.py" server "$a_ip" "$N" &
p0=$!
ip netns exec "$ns1" timeout 120 python3 "$tmp/tcp.py" client "$a_ip" "$N"
wait "$p0"
