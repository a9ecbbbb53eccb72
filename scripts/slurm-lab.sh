#!/usr/bin/env bash
# A two-node Slurm cluster on one machine, for real sbatch/srun runs of wiretrain: Debian's
# Slurm (slurmctld, slurmd) and munge, three network namespaces joined by a bridge (the wiring
# lab's, scripts/lab-net.sh), each with a host name of its own (UTS namespace) and an
# /etc/hosts that names the others (`ip netns exec` mounts /etc/netns/NS/hosts):
#   wtctl  namespace 0, $net.1: slurmctld; the client commands run here
#   wtn1   namespace 1, $net.2: slurmd (Slurm node 0 of a job)
#   wtn2   namespace 2, $net.3: slurmd
# munged runs outside the namespaces with a key and socket of its own (a Unix socket, so every
# namespace reaches it). Everything is removed on exit; every wait is bounded.
#
#   scripts/slurm-lab.sh CMD...    # runs CMD as host wtctl with SLURM_CONF set, once both
#                                  # nodes are idle; exits with CMD's status
#
# Needs root and the packages slurmctld, slurmd, slurm-client, munge (exit 77 without them).
# Env: BIN (the wiretrain binary, exported to CMD), LIMIT (seconds for CMD, default 300),
#      SLURM_LAB_LOGS (a directory to copy the daemons' logs into on exit).
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=3; LIMIT=${LIMIT:-300}
for c in slurmctld slurmd srun sbatch sinfo munged unshare; do
  command -v "$c" >/dev/null || { echo "slurm-lab: SKIP: $c is not installed (apt-get install slurmctld slurmd slurm-client munge)"; exit 77; }
done
# shellcheck source=scripts/lab-net.sh
source "$(dirname "$0")/lab-net.sh"
HOSTS=(wtctl wtn1 wtn2)
chmod 755 "$tmp"   # munged wants every directory above its socket searchable
etc_dirs=()
slurm_cleanup() {
  [ -n "${SLURM_LAB_LOGS:-}" ] && mkdir -p "$SLURM_LAB_LOGS" && cp "$tmp"/*.log "$SLURM_LAB_LOGS"/ 2>/dev/null
  [ -s "$tmp/munge/pid" ] && kill "$(cat "$tmp/munge/pid")" 2>/dev/null
  for d in "${etc_dirs[@]}"; do rm -rf "$d"; done
  rmdir /etc/netns 2>/dev/null || true
  cleanup
}
trap slurm_cleanup EXIT

# Names: every namespace's /etc/hosts lists the three hosts.
for i in 0 1 2; do
  d="/etc/netns/$(ns "$i")"; mkdir -p "$d"; etc_dirs+=("$d")
  { echo "127.0.0.1 localhost"; for j in 0 1 2; do echo "$net.$((j + 1)) ${HOSTS[$j]}"; done; } >"$d/hosts"
done

# munge: a key of this cluster's own.
mkdir -m 700 "$tmp/munge"; mkdir -m 755 "$tmp/sock"
head -c 1024 /dev/urandom >"$tmp/munge/key"; chmod 600 "$tmp/munge/key"
munged --socket="$tmp/sock/munge" --key-file="$tmp/munge/key" --pid-file="$tmp/munge/pid" \
  --log-file="$tmp/munged.log" --seed-file="$tmp/munge/seed"
for _ in $(seq 1 100); do [ -S "$tmp/sock/munge" ] && break; sleep 0.05; done
[ -S "$tmp/sock/munge" ] || { echo "slurm-lab: munged did not start" >&2; cat "$tmp/munged.log" >&2; exit 1; }

conf="$tmp/slurm.conf"
mkdir -p "$tmp/state" "$tmp/spool"
cat >"$conf" <<EOF
ClusterName=wtlab
SlurmctldHost=wtctl($net.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$tmp/sock/munge
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool/%n
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd-%n.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/linear
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=wtn1 NodeAddr=$net.2 CPUs=2 State=UNKNOWN
NodeName=wtn2 NodeAddr=$net.3 CPUs=2 State=UNKNOWN
PartitionName=lab Nodes=wtn1,wtn2 Default=YES MaxTime=INFINITE State=UP
EOF
# Processes are tracked without cgroups (proctrack/linuxproc, task/none), but slurmd still
# opens a cgroup plugin: v1, which this kernel mounts (autodetection reads /sys/fs/cgroup's
# tmpfs as "no cgroup file system").
printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' >"$tmp/cgroup.conf"
export SLURM_CONF="$conf"

as_host() { # $1 namespace index, then a command run there under that host's name
  local i=$1; shift
  ip netns exec "$(ns "$i")" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "${HOSTS[$i]}" "$@"
}
as_host 0 slurmctld -D -c -f "$conf" >"$tmp/slurmctld.out" 2>&1 &
for i in 1 2; do
  mkdir -p "$tmp/spool/${HOSTS[$i]}"
  as_host "$i" slurmd -D -f "$conf" >"$tmp/slurmd-$i.out" 2>&1 &
done
idle=""
for _ in $(seq 1 300); do
  idle=$(as_host 0 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | tr '\n' ' ' || true)
  [ "$idle" = "wtn1 wtn2 " ] && break
  sleep 0.1
done
if [ "$idle" != "wtn1 wtn2 " ]; then
  echo "slurm-lab: the nodes never became idle (idle: '$idle')" >&2
  tail -n 20 "$tmp"/slurm*.log "$tmp"/*.out >&2 || true
  exit 1
fi
echo "slurm-lab: cluster up (wtctl + wtn1, wtn2 idle)" >&2
export BIN
rc=0
as_host 0 timeout "$LIMIT" "$@" || rc=$?
exit "$rc"
