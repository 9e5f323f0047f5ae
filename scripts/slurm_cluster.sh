#!/usr/bin/env bash
# A single-node SLURM cluster on localhost, for running the DAG through a real scheduler in CI and
# in tests (tests/test_slurm.py, profile workflow/profiles/slurm-local).
#
#   scripts/slurm_cluster.sh start    # install slurm-wlm + munge if missing, start munged, slurmctld
#                                     # and slurmd, wait for the node to be idle; prints the line
#                                     #   export SLURM_CONF=<dir>/slurm.conf
#                                     # (eval "$(scripts/slurm_cluster.sh start)") and writes it to <dir>/env.sh
#   scripts/slurm_cluster.sh status   # exit 0 when the node answers sinfo, 1 otherwise
#   scripts/slurm_cluster.sh stop     # stop the daemons this script started (by their pid files)
#
# Everything (munge key and socket, slurm.conf, state, spool, logs, the job completion log) lives in
# one folder: $PKV_SLURM_DIR, or else a fresh mktemp folder remembered in $PKV_SLURM_POINTER
# (default ${TMPDIR:-/tmp}/pkv-slurm.dir) so that a later `stop` or `status` finds it. Outside it
# only the link /etc/slurm/slurm.conf is made (below); the system's munged and slurm services, if
# any, are left alone (the ports are $PKV_SLURM_PORT and the one after it, default 6917/6918, not
# SLURM's 6817/6818).
#
# Containers: no cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, and on SLURM 24.05+
# CgroupPlugin=disabled), the daemons run as root (SlurmUser=SlurmdUser=root; start and stop
# re-run themselves through sudo for another user, whose jobs then run under their own uid).
# The node is NodeName=localhost with the CPU count and memory `slurmd -C` reports, in the one
# partition "debug" (Default=YES). Every finished job leaves a line in <dir>/jobcomp.log
# (JobCompType=jobcomp/filetxt): JobId, JobName, JobState=COMPLETED|FAILED|..., so a test can check
# that each job of a run went through the scheduler.
#
# Job status and accounting: snakemake-executor-plugin-slurm (2.x) asks for job states with
# `sacct` by default, which needs slurmdbd and a MariaDB/MySQL database. It also has
# `--slurm-status-command squeue` (status_command: squeue in a profile), which reads states from
# slurmctld; the plugin itself keeps using squeue as long as MinJobAge (how long slurmctld keeps a
# finished job) is at least 3 x --slurm-init-seconds-before-status-checks (and falls back to sacct
# otherwise, which here would see no job). So there is no slurmdbd
# and no database here (AccountingStorageType=accounting_storage/none): MinJobAge=300 below is
# well above 3 x 2 s, the polling interval of workflow/profiles/slurm-local. That is much less
# to install and start than slurmdbd + MariaDB and is the path the plugin documents for clusters
# without accounting; jobcomp/filetxt keeps the per-job record that accounting would have given.
#
# The default config path: the jobstep executor that runs inside each job
# (snakemake-executor-plugin-slurm-jobstep 0.6) starts the rule with `srun` in an environment from
# which it removes every SLURM_* variable, SLURM_CONF included, so that srun reads the compiled-in
# $PKV_SLURM_DEFAULT_CONF (/etc/slurm/slurm.conf). `start` links that path to this cluster's
# slurm.conf when it does not exist and `stop` removes the link; an existing file there belongs to
# another cluster and `start` refuses to replace it.
set -euo pipefail

SCRIPT="$(basename "$0")"
PORT="${PKV_SLURM_PORT:-6917}"
POINTER="${PKV_SLURM_POINTER:-${TMPDIR:-/tmp}/pkv-slurm.dir}"
WAIT_S="${PKV_SLURM_WAIT_S:-60}"
DEFAULT_CONF="${PKV_SLURM_DEFAULT_CONF:-/etc/slurm/slurm.conf}"

log() { echo "$SCRIPT: $*" >&2; }
die() { log "$*"; exit 1; }

# The cluster folder: $PKV_SLURM_DIR, else the one remembered in $POINTER; with `new`, a new
# mktemp folder when neither exists.
cluster_dir() {
    if [ -n "${PKV_SLURM_DIR:-}" ]; then
        echo "$PKV_SLURM_DIR"
    elif [ -f "$POINTER" ] && [ -d "$(cat "$POINTER")" ]; then
        cat "$POINTER"
    elif [ "${1:-}" = new ]; then
        local dir
        dir="$(mktemp -d "${TMPDIR:-/tmp}/pkv-slurm.XXXXXX")"
        echo "$dir" > "$POINTER"
        echo "$dir"
    fi
}

install_if_missing() {
    local missing=0 tool
    for tool in munged slurmctld slurmd sbatch sinfo squeue scontrol srun; do
        command -v "$tool" > /dev/null || missing=1
    done
    [ "$missing" -eq 0 ] && return 0
    command -v apt-get > /dev/null || die "slurm-wlm and munge are missing and there is no apt-get to install them"
    log "installing slurm-wlm and munge (apt-get)"
    env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurm-wlm munge >&2
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2> /dev/null; }

node_state() { { SLURM_CONF="$1/slurm.conf" timeout 10 sinfo -h -N -n localhost -o %T 2> /dev/null || true; } | head -1; }

slurm_major_minor() {  # "slurm-wlm 22.05.8" -> 2205
    slurmd -V | sed -E 's/^[^0-9]*([0-9]+)\.([0-9]+).*/\1\2/'
}

write_config() {
    local dir="$1" cpus mem spec
    spec="$(slurmd -C | head -1)"
    cpus="$(sed -E 's/.*CPUs=([0-9]+).*/\1/' <<< "$spec")"
    mem="$(sed -E 's/.*RealMemory=([0-9]+).*/\1/' <<< "$spec")"
    [[ "$cpus" =~ ^[0-9]+$ && "$mem" =~ ^[0-9]+$ ]] || die "cannot read CPUs and RealMemory from slurmd -C: $spec"
    cat > "$dir/slurm.conf" << EOF
# Written by scripts/slurm_cluster.sh: a single-node test cluster on localhost.
ClusterName=pkvtest
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
# No cgroups in a container.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
# No slurmdbd: job states come from slurmctld (squeue), which keeps a finished job MinJobAge seconds.
AccountingStorageType=accounting_storage/none
MinJobAge=300
# One line per finished job.
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    if [ "$(slurm_major_minor)" -ge 2405 ]; then
        echo "CgroupPlugin=disabled" > "$dir/cgroup.conf"
    elif [ "$(slurm_major_minor)" -ge 2302 ]; then
        # 23.x loads a cgroup plugin in slurmd whatever the proctrack/task plugins; outside systemd
        # it must not look for a systemd scope.
        printf 'CgroupPlugin=autodetect\nIgnoreSystemd=yes\n' > "$dir/cgroup.conf"
    fi
    echo "export SLURM_CONF=$dir/slurm.conf" > "$dir/env.sh"
}

start_munge() {
    local dir="$1"
    pid_alive "$dir/munge/munged.pid" && return 0
    mkdir -p "$dir/munge"
    chmod 755 "$dir/munge"  # the socket's folder: clients of any user reach munged through it
    if [ ! -s "$dir/munge/munge.key" ]; then
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$dir/munge/munge.key"
    fi
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    local i
    for i in $(seq 50); do
        [ -S "$dir/munge/munge.socket" ] && return 0
        sleep 0.1
    done
    die "munged did not start (see $dir/munge/munged.log)"
}

# Point the default config path at this cluster's slurm.conf (see the header).
link_default_conf() {
    local dir="$1"
    if [ -L "$DEFAULT_CONF" ] && [ "$(readlink "$DEFAULT_CONF")" = "$dir/slurm.conf" ]; then
        return 0
    fi
    if [ -L "$DEFAULT_CONF" ] && [ ! -e "$DEFAULT_CONF" ]; then
        rm -f "$DEFAULT_CONF"  # left by a cluster folder that no longer exists
    fi
    if [ -e "$DEFAULT_CONF" ] || [ -L "$DEFAULT_CONF" ]; then
        die "$DEFAULT_CONF exists and is not this cluster's ($dir/slurm.conf); srun inside the jobs would read it (set PKV_SLURM_DEFAULT_CONF if slurm was built with another default path)"
    fi
    mkdir -p "$(dirname "$DEFAULT_CONF")"
    ln -s "$dir/slurm.conf" "$DEFAULT_CONF"
}

cmd_start() {
    install_if_missing
    local dir
    dir="$(cluster_dir new)"
    mkdir -p "$dir"
    chmod 755 "$dir"
    if pid_alive "$dir/slurmctld.pid" && pid_alive "$dir/slurmd.pid"; then
        case "$(node_state "$dir")" in
            idle|mixed|allocated|completing)
                log "already running in $dir"
                echo "export SLURM_CONF=$dir/slurm.conf"
                return 0 ;;
        esac
    fi
    mkdir -p "$dir/state" "$dir/spool"
    write_config "$dir"
    link_default_conf "$dir"
    export SLURM_CONF="$dir/slurm.conf"
    start_munge "$dir"
    pid_alive "$dir/slurmctld.pid" || slurmctld -f "$SLURM_CONF"
    pid_alive "$dir/slurmd.pid" || slurmd -f "$SLURM_CONF" -N localhost
    local state="" deadline=$((SECONDS + WAIT_S))
    while [ "$SECONDS" -lt "$deadline" ]; do
        state="$(node_state "$dir")"
        [ "$state" = idle ] && break
        # A node left down by an earlier run comes back.
        case "$state" in down*|drain*) scontrol update NodeName=localhost State=RESUME > /dev/null 2>&1 || true ;; esac
        sleep 1
    done
    if [ "$state" != idle ]; then
        log "the node is not idle after ${WAIT_S}s (state: '${state:-no answer}'); last log lines:"
        tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 2> /dev/null || true
        exit 1
    fi
    log "node localhost idle, partition debug; folder $dir"
    echo "export SLURM_CONF=$dir/slurm.conf"
}

cmd_stop() {
    local dir
    dir="$(cluster_dir)"
    if [ -z "$dir" ] || [ ! -d "$dir" ]; then
        log "no cluster folder (PKV_SLURM_DIR unset and nothing in $POINTER)"
        return 0
    fi
    local name pidfile pid i
    for name in slurmd slurmctld munge/munged; do
        pidfile="$dir/$name.pid"
        pid_alive "$pidfile" || continue
        pid="$(cat "$pidfile")"
        kill "$pid" 2> /dev/null || true
        for i in $(seq 100); do
            kill -0 "$pid" 2> /dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2> /dev/null && kill -9 "$pid" 2> /dev/null || true
    done
    rm -f "$dir/munge/munge.socket" "$dir/munge/munge.socket.lock"
    if [ -L "$DEFAULT_CONF" ] && [ "$(readlink "$DEFAULT_CONF")" = "$dir/slurm.conf" ]; then
        rm -f "$DEFAULT_CONF"
    fi
    log "stopped (folder $dir kept: logs and jobcomp.log)"
}

cmd_status() {
    local dir state
    dir="$(cluster_dir)"
    [ -n "$dir" ] && [ -f "$dir/slurm.conf" ] || { log "not started"; return 1; }
    state="$(node_state "$dir")"
    if [ -z "$state" ]; then
        log "not answering (folder $dir)"
        return 1
    fi
    log "node localhost $state (folder $dir)"
    echo "export SLURM_CONF=$dir/slurm.conf"
}

# The daemons run as root (and apt-get needs it): start and stop go through sudo for other users,
# whose jobs then run under their own uid.
if [ "$(id -u)" -ne 0 ] && { [ "${1:-}" = start ] || [ "${1:-}" = stop ]; }; then
    command -v sudo > /dev/null || die "$1 needs root, or sudo"
    exec sudo -E "$0" "$@"
fi

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $SCRIPT start|stop|status" >&2; exit 2 ;;
esac
