#!/usr/bin/env bash
# Stops what start.sh started, by the pids in its pid files (never by process name: other daemons of
# the same name on this machine are not ours). Safe to call twice.
DIR=$(realpath -m "${1:-/tmp/launch-slurm}")
for pidfile in "$DIR"/pids/slurmd*.pid "$DIR"/pids/{slurmctld,slurmdbd,mariadbd,munged}.pid; do
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
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
