#!/usr/bin/env bash
# One-node SLURM on localhost for the real-SLURM tests (`make slurm`).
#
# Idempotent: installs Debian's slurmctld/slurmd/slurm-client/munge if missing,
# writes /etc/slurm/slurm.conf, starts munged, slurmctld and slurmd directly
# (no systemd here), and leaves a healthy cluster alone when re-run. A stale
# state from an earlier run (dead pid files, a node left DOWN/DRAIN, daemons
# running an older config) is repaired. Needs root.
#
# Known-good settings on these machines: proctrack/linuxproc, task/none,
# select/cons_tres, NodeName = `hostname`, munged started first.
set -euo pipefail

CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
HOST=$(hostname)
# The tests start small jobs side by side (a 2-task probe next to a 2-task
# training run); declaring at least 4 CPUs lets them run concurrently on a
# 2-core CI machine (SlurmdParameters=config_overrides accepts the gap).
NCPU=$(nproc)
(( NCPU < 4 )) && NCPU=4

log() { echo "slurm_up: $*"; }
die() { echo "slurm_up: ERROR: $*" >&2; exit 1; }
# Any other failing command stops the script (set -e); say which, so `make slurm` fails loudly.
trap 'echo "slurm_up: ERROR: line $LINENO: \`$BASH_COMMAND\` failed; the SLURM test-bed is NOT up" >&2' ERR

[[ $(id -u) == 0 ]] || die "must run as root (it installs packages and starts daemons)"

# --- packages --------------------------------------------------------------
missing=()
for p in slurmctld slurmd slurm-client munge; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; } \
        || die "apt-get install ${missing[*]} failed"
fi

alive() { [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null; }
pid_from() { [[ -f $1 ]] && cat "$1" 2>/dev/null || true; }
# A pid file names our daemon only if that pid is alive AND runs that program.
daemon_pid() {  # pidfile progname
    local pid; pid=$(pid_from "$1")
    if alive "$pid" && [[ $(cat /proc/"$pid"/comm 2>/dev/null) == "$2" ]]; then echo "$pid"; fi
}
stop_daemon() {  # pidfile progname
    local pid; pid=$(daemon_pid "$1" "$2")
    if [[ -n $pid ]]; then
        log "stopping $2 (pid $pid)"
        kill "$pid"
        for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
        alive "$pid" && kill -9 "$pid"
    fi
    rm -f "$1"
}

# --- munge (first: slurm authenticates every RPC with it) -------------------
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/log/munge /etc/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating munge key"
    mungekey --create --keyfile=/etc/munge/munge.key --force
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    stop_daemon /run/munge/munged.pid munged
    log "starting munged"
    # --force: start even if a previous munged left its socket/lock behind.
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- slurm.conf ---------------------------------------------------------------
install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"
new_conf=$(cat <<CONF
# Written by cluster/testbed/slurm_up.sh: one-node test cluster on localhost.
ClusterName=bertdist
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (slurm.conf(5); default
# 120). The preemption tests requeue three jobs, so that wait was 6 of CI's minutes; a
# localhost job starts in well under 10 s, well inside a credential's lifetime.
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# Keep finished jobs visible to scontrol for 10 min (there is no slurmdbd/sacct).
MinJobAge=600
KillWait=30
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$NCPU State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
)
changed=0
if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$new_conf" ]]; then
    log "writing $CONF"
    printf '%s\n' "$new_conf" > "$CONF"
    changed=1
fi

ctld_pid=$(daemon_pid /run/slurmctld.pid slurmctld)
slurmd_pid=$(daemon_pid /run/slurmd.pid slurmd)
if (( changed )) || [[ -z $ctld_pid ]] || [[ -z $slurmd_pid ]] || ! scontrol ping 2>/dev/null | grep -q UP; then
    # Restart both from a clean slate: a changed config or a half-dead pair
    # is cheaper to restart than to diagnose.
    stop_daemon /run/slurmd.pid slurmd
    stop_daemon /run/slurmctld.pid slurmctld
    log "starting slurmctld"
    # -c: drop job state from an earlier run (its jobs cannot be resumed anyway).
    slurmctld -c -i
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
    scontrol ping | grep -q UP || die "slurmctld did not come up (see $LOG_DIR/slurmctld.log)"
    log "starting slurmd"
    slurmd -c
fi

# --- node ready --------------------------------------------------------------
state=""
for _ in $(seq 150); do
    state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1)
    case $state in
        idle|mixed|allocated|completing) break ;;
        down*|drain*|fail*) scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.2
done
case $state in
    idle|mixed|allocated|completing) log "ready: node $HOST is $state" ;;
    *) die "node $HOST is '$state' (see $LOG_DIR/slurmd.log; scontrol show node $HOST)" ;;
esac
