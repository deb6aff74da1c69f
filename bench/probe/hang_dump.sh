#!/usr/bin/env bash
# A launch that may hang, run in a scratch dir on the device: if it is still running after WAIT seconds, every
# Python process under it has its stacks dumped by py-spy (carried in .whl) into $OUT/hang-<name>-*.txt, then
# it is stopped (SIGINT, then SIGKILL to its own process tree). Its console and train.log come back either way.
#   NAME=fast2 WAIT=150 bash bench/probe/hang_dump.sh recipe=cifar10_fast data.synthetic=true gpus=[0,1]
set -uo pipefail
source bench/device_env.sh
name=${NAME:-run}; wait_s=${WAIT:-150}
scratch=$(mktemp -d)
(cd "$scratch" && exec python3 -m launcher "$@" progress=lines) > "$OUT/hang-$name-console.txt" 2>&1 &
pid=$!
spy=$(command -v py-spy || find /tmp/site -name py-spy -type f 2>/dev/null | head -1)
tree() {  # $1 and every process below it (this launch's own, nobody else's)
    echo "$1"
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$child"; done
}
start=$(date +%s)
while kill -0 $pid 2>/dev/null && [ $(( $(date +%s) - start )) -lt "$wait_s" ]; do sleep 2; done
if kill -0 $pid 2>/dev/null; then
    echo "still running after ${wait_s}s: dumping" | tee -a "$OUT/hang-$name-console.txt"
    own=$(tree $pid)
    for p in $own; do
        grep -q python /proc/$p/cmdline 2>/dev/null || continue
        { echo "=== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-200)"; ${spy:-py-spy} dump --pid $p 2>&1; } \
            >> "$OUT/hang-$name-stacks.txt"
    done
    kill -INT $pid; sleep 15
    kill -KILL $own 2>/dev/null  # (what is left of the launch's own tree, as it was at the dump)
fi
wait $pid; echo "exit $? after $(( $(date +%s) - start ))s" | tee -a "$OUT/hang-$name-console.txt"
find "$scratch" -name train.log -exec sh -c 'for f; do echo "--- $f"; tail -60 "$f"; done' sh {} + \
    > "$OUT/hang-$name-trainlog.txt" 2>&1
tail -5 "$OUT/hang-$name-console.txt"
