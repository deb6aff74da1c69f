#!/usr/bin/env bash
# Where compiled fsdp on 2 GPUs stalls (BENCHMARKS.md, "fsdp on two GPUs: a figure at last, and a stall").
# Run on the device machine from the repository root (nvidia-h200-x2), the wheels in bench/probe/fsdp_stall_wheels
# (hydra & co. from shared/device-wheels, and py-spy 0.4.3: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux1_x86_64 py-spy==0.4.3`; both folders were made for the 3cb8580 calls
# and removed afterwards; TREE was `git archive 3cb8580 -- . ':!bench/results'` unpacked into bench/probe/fsdp_stall_tree):
#   COMMIT=3cb8580 [TREE=bench/probe/fsdp_stall_tree] bash bench/probe/fsdp_stall.sh NAME LIMIT_S [launch overrides]
# Each run is `launch recipe=text strategy=fsdp perf.compile=true` with the overrides bench/gpt.py gives it
# (GPT-2 124M, 16 x 1024 tokens a GPU, the /tmp/shards GPT-2 token shards, 4 epochs), started directly so
# that its whole console (TORCH_LOGS=recompiles,graph_breaks; NCCL_DEBUG=WARN) and its run dir are kept.
# A watcher takes py-spy dumps (native frames) of both ranks and the launcher, /proc stacks and an
# nvidia-smi reading whenever train.log has been quiet for 22 s and again at 45 s. NCCL's flight recorder
# is dumped on a watchdog timeout (pass strategy.timeout_s=N to get one) and decoded into fr.txt.
# Results: /tmp/fsdpstall/NAME/ (run dir without its checkpoints), summarized into $OUT/NAME-fsdpstall-*.txt.
set -uo pipefail
name=$1; limit=$2; shift 2
W=/tmp/fsdpstall
if [ ! -e /tmp/site/.carried ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench/probe/fsdp_stall_wheels/*.whl \
        || exit 1
    touch /tmp/site/.carried
fi
cd "${TREE:-.}" || exit 1  # (TREE: a `git archive` of the commit to run, where the checkout holds edits in progress)
source bench/device_env.sh
export PATH=/tmp/site/bin:$PATH
tag=fsdpstall-2xh200-$commit
repo=$PWD
[ -e /tmp/shards/val.bin ] || ls /tmp/shards/*.bin >/dev/null 2>&1 || \
    python3 bench/make_token_shards.py /tmp/shards --shards 4 --tokens-per-shard 655360 --val-tokens 65536 >/dev/null \
    || exit 1
dir=$W/$name
mkdir -p "$dir/fr" "$dir/dumps" "$W/data"
summary=$OUT/$name-$tag.txt

dump() {  # $1: label
    local d=$dir/dumps/$1
    mkdir -p "$d"
    { date +%T.%N; nvidia-smi --query-gpu=index,utilization.gpu,memory.used,power.draw --format=csv;
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv; } > "$d/smi.txt" 2>&1
    for p in $(pgrep -f python3); do
        readlink /proc/$p/exe 2>/dev/null | grep -q python || continue
        [ "$p" = "$$" ] && continue
        cmd=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-200)
        case "$cmd" in *compile_worker*|*fsdp_stall*|*py-spy*|*resource_tracker*|*pgrep*) continue ;; esac
        rank=$(tr '\0' '\n' < /proc/$p/environ 2>/dev/null | sed -n 's/^RANK=//p')
        who=${rank:+rank$rank}; who=${who:-pid}
        {
            echo "=== pid $p ($who) $cmd"
            for t in /proc/$p/task/*; do
                printf '%s %s state=%s wchan=%s\n' "${t##*/}" "$(cat $t/comm 2>/dev/null)" \
                    "$(awk '{print $3}' $t/stat 2>/dev/null)" "$(cat $t/wchan 2>/dev/null)"
            done
            echo "--- py-spy dump --native"
            timeout 30 py-spy dump --native --pid "$p" 2>&1 || { echo "--- py-spy dump (no native)";
                timeout 20 py-spy dump --pid "$p" 2>&1; }
        } > "$d/$who-$p.txt" 2>&1
    done
}

echo "$(date +%T) run $name: limit ${limit}s, overrides: $*" | tee -a "$dir/events.txt"
cd "$dir"
env TORCH_LOGS=recompiles,graph_breaks NCCL_DEBUG=WARN TORCH_NCCL_TRACE_BUFFER_SIZE=4096 \
    TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE="$dir/fr/rank_" TORCH_NCCL_ASYNC_ERROR_HANDLING=3 \
    TORCH_NCCL_DESYNC_DEBUG=1 PYTHONFAULTHANDLER=1 \
    timeout -s TERM -k 30 "$limit" python3 -m launcher recipe=text 'gpus=[0,1]' strategy=fsdp recipe.layers=12 \
    recipe.width=768 recipe.heads=12 recipe.context=1024 batch_size=32 'recipe.corpus=/tmp/shards/*.bin' \
    recipe.vocab_size=50257 epochs=4 recipe.sample_bytes=0 eval.every=0 "data.root=$W/data" progress=lines \
    perf.compile=true "$@" > "$dir/console.txt" 2>&1 &
lp=$!
cd "$repo"
last_size=-1; last_change=$(date +%s); dumps=0; armed1=1; armed2=1
while kill -0 $lp 2>/dev/null; do
    sleep 1
    log=$(find "$dir/outputs" -name train.log 2>/dev/null | head -1)
    size=$( [ -n "$log" ] && stat -c %s "$log" || echo 0)
    now=$(date +%s)
    if [ "$size" != "$last_size" ]; then last_size=$size; last_change=$now; armed1=1; armed2=1; continue; fi
    idle=$((now - last_change))
    if [ $dumps -lt 4 ] && { { [ $armed1 = 1 ] && [ $idle -ge 22 ]; } || { [ $armed2 = 1 ] && [ $idle -ge 45 ]; }; }; then
        [ $idle -ge 45 ] && armed2=0; armed1=0
        dumps=$((dumps + 1))
        echo "$(date +%T) train.log quiet ${idle}s: dump $dumps" >> "$dir/events.txt"
        dump "d$dumps-idle${idle}s"
    fi
done
wait $lp; rc=$?
echo "$(date +%T) launch exit $rc" >> "$dir/events.txt"
python3 - "$dir/fr" > "$dir/fr.txt" 2>&1 <<'PY'
import pickle, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("rank_*")):
    try:
        d = pickle.loads(f.read_bytes())
    except Exception as e:  # noqa
        print(f, "unreadable", e); continue
    es = d.get("entries", [])
    print(f"=== {f.name}: {len(es)} entries; keys {sorted(d)}")
    for e in es[-25:]:
        print({k: e.get(k) for k in ("record_id", "pg_id", "collective_seq_id", "p2p_seq_id", "profiling_name",
                                     "state", "input_sizes", "timeout_ms", "is_p2p")},
              "frames:", [fr.get("name") for fr in (e.get("frames") or [])[:6]])
PY
{
    echo "### events"; cat "$dir/events.txt"
    echo "### train.log (run dir: $(dirname "$(find "$dir/outputs" -name train.log | head -1)"))"
    cat "$(find "$dir/outputs" -name train.log | head -1)" 2>/dev/null
    echo "### metrics.jsonl"; cat "$(find "$dir/outputs" -name metrics.jsonl | head -1)" 2>/dev/null
    echo "### run dir files"; find "$dir/outputs" -maxdepth 5 | grep -v '\.dcp/' | head -60
    echo "### console: recompile / graph-break / NCCL / error lines"
    grep -n -i 'recompil\|graph break\|graph_break\|NCCL\|watchdog\|timeout\|Traceback\|Error\|guard' \
        "$dir/console.txt" | cut -c1-400 | head -150
    echo "### console, last 60 lines"; tail -60 "$dir/console.txt" | cut -c1-400
    echo "### flight recorder"; cat "$dir/fr.txt"
    for d in "$dir"/dumps/*; do
        [ -d "$d" ] || continue
        echo "### dump ${d##*/}"; cat "$d/smi.txt"
        for f in "$d"/*-*.txt; do cat "$f"; done
    done
} > "$summary" 2>&1
exit 0
