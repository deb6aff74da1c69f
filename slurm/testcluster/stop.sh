#!/usr/bin/env bash
# Stops what start.sh started, by the pids in its pid files (never by process name: other daemons of
# the same name on this machine are not ours). Safe to call twice.
DIR=$(realpath -m "${1:-/tmp/launch-slurm}")
for name in slurmd slurmctld slurmdbd mariadbd munged; do
    pidfile="$DIR/pids/$name.pid"
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
done
