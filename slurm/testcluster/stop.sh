#!/usr/bin/env bash
# Stops what start.sh started, by the pids in its pid files (never by process name: other daemons of
# the same name on this machine are not ours). Safe to call twice.
DIR=$(realpath -m "${1:-/tmp/launch-slurm}")
# All are asked to stop at once, then each is given up to 10 s before SIGKILL (one after another they took
# 12 s at the end of every CI run, mostly mariadb's and slurmctld's shutdowns).
pids=()
for pidfile in "$DIR"/pids/slurmd*.pid "$DIR"/pids/{slurmctld,slurmdbd,mariadbd,munged}.pid; do
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    rm -f "$pidfile"
    kill "$pid" 2>/dev/null && pids+=("$pid")
done
for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
done
# Job steps the daemons left behind (a requeued job's first slurmstepd and its srun outlived slurmd): any
# process whose working directory, open files or SLURM_CONF lie in DIR is this cluster's.
for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    [ "$pid" = $$ ] && continue
    cwd=$(readlink "$proc/cwd" 2>/dev/null)
    if [[ "$cwd" == "$DIR" || "$cwd" == "$DIR/"* ]] \
        || tr '\0' '\n' 2>/dev/null < "$proc/environ" | grep -qx "SLURM_CONF=$DIR/slurm.conf" \
        || ls -l "$proc/fd" 2>/dev/null | grep -q -- "-> $DIR/"; then
        kill -9 "$pid" 2>/dev/null || true
    fi
done
# the two-node cluster's namespaces and bridge (start.sh DIR 2)
if [ -s "$DIR/netns" ]; then
    while read -r ns; do
        ip netns delete "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done < "$DIR/netns"
    rm -f "$DIR/netns"
fi
if [ -s "$DIR/bridge" ]; then
    ip link delete "$(cat "$DIR/bridge")" 2>/dev/null || true
    rm -f "$DIR/bridge"
fi
