#!/usr/bin/env bash
# Issue 36's figures on a machine with two GPUs, in one device call each (BENCHMARKS.md "Language models,
# FSDP2, GPT-2 124M" and "Your own data"). Run from the repository root on the device machine, .device-wheels
# carried (and .whl holding nvImageCodec's wheels: nvidia-nvimgcodec-cu13, nvidia-nvjpeg). Raw output:
# $OUT/*-<commit>.*
#   bash bench/own_data_2gpu.sh imagefolder     launch on 1 and 2 GPUs; torchvision's DataLoader + DDP on 2
#   bash bench/own_data_2gpu.sh scaling         launch on 1 and 2 GPUs in one call: imagefolder, then GPT-2 124M
#   bash bench/own_data_2gpu.sh gpt             GPT-2 124M on uint16 shards: launch (single, ddp) against the
#                                               nanoGPT-style script on 1 and 2 GPUs, then fsdp on 2
#   bash bench/own_data_2gpu.sh ddp-levers      the script on 1 GPU, then on 2 under each DDP setting
#   bash bench/own_data_2gpu.sh split           data.decode=auto's measured split on 2 GPUs and 1, then
#                                               test_gpu_own_data.py
#   bash bench/own_data_2gpu.sh graph-load      decode=cpu on 2 GPUs under DDP's reducer and replayed
#   bash bench/own_data_2gpu.sh tests           the GPU tests: the 2-GPU ones and the rest side by side
#   bash bench/own_data_2gpu.sh epoch-end       the snapshot tests; the defaults on 2 GPUs (8 epochs) and 1 (5);
#                                               torchvision's DDP baseline (BASELINE=0: left out); SPY=1: py-spy
#   bash bench/own_data_2gpu.sh gpu-tests       the one-GPU suite on both GPUs at once, then test_gpu_own_data.py
#   bash bench/own_data_2gpu.sh sharded-save    GPT-2 124M under fsdp on 2 GPUs (GPUS=1: one) with its sharded
#                                               checkpoints and without (MODES="default none")
set -uo pipefail
source bench/device_env.sh
shards() {  # generated GPT-2 token shards in /tmp/shards: 4 of $1 tokens each
    python3 bench/make_token_shards.py /tmp/shards --shards 4 --tokens-per-shard "$1" --val-tokens 65536 \
        >/dev/null || exit 1
}
folder() {  # the 20,000 generated JPEGs of the one-GPU benchmark in /tmp/imagenet-gen (made once)
    (cd bench && python3 -c "from pathlib import Path; from imagefolder import make_folder
make_folder(Path('/tmp/imagenet-gen'), 20000, 100)") || exit 1
}
watch_cpu() {  # vmstat every second into $OUT/vmstat-$1-$commit.txt, in the background ($vm: its pid)
    vmstat -t 1 > "$OUT/vmstat-$1-$commit.txt" 2>&1 &
    vm=$!
    cpu_log="$OUT/vmstat-$1-$commit.txt"
}
runs() {  # NAME LIMIT GPUS EPOCHS [launch overrides...]: bench/imagefolder_ddp.py's launch run, appended to
    # $OUT/imagefolder-NAME-$commit.jsonl, marked in the vmstat log
    local name=$1 limit=$2 gpus=$3 epochs=$4
    shift 4
    echo "--- $gpus GPUs $*" >> "$cpu_log"
    timeout "$limit" python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus "$gpus" --only launch \
        --epochs "$epochs" ${1:+--launch-args "$@"} 2>&1 | tee -a "$OUT/imagefolder-$name-$commit.jsonl"
}
case "${1:-imagefolder}" in
imagefolder)
    vmstat -t 2 > "$OUT/vmstat-imagefolder-$commit.txt" 2>&1 &
    vm=$!
    timeout "${ONE_LIMIT:-200}" python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 1 \
        --only launch --epochs "${EPOCHS:-3}" 2>&1 | tee "$OUT/imagefolder-1gpu-$commit.jsonl"
    echo "--- two GPUs" >> "$OUT/vmstat-imagefolder-$commit.txt"
    timeout "${TWO_LIMIT:-330}" python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 2 \
        --epochs "${EPOCHS:-3}" 2>&1 | tee "$OUT/imagefolder-2gpu-$commit.jsonl"
    kill $vm
    ;;
scaling)
    # 2 GPUs against 1 in one call: recipe=imagefolder (decode=auto on 1 and 2, decode=cpu on 2; 5 epochs, so
    # that auto's trial, which spans the first ~66 batches, is over before the last epochs), then GPT-2 124M
    vmstat -t 2 > "$OUT/vmstat-scaling-$commit.txt" 2>&1 &
    vm=$!
    timeout 200 python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 1 2 --only launch \
        --epochs 5 2>&1 | tee "$OUT/imagefolder-scaling-auto-$commit.jsonl"
    timeout 110 python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 2 --only launch \
        --epochs 5 --launch-args data.decode=cpu 2>&1 | tee "$OUT/imagefolder-scaling-cpu-$commit.jsonl"
    kill $vm
    shards 655360
    timeout "${GPT_LIMIT:-240}" python3 bench/gpt.py compare --gpus 1 2 --no-script --shards '/tmp/shards/*.bin' \
        --epochs 3 --steps 40 2>&1 | tee "$OUT/gpt-scaling-$commit.jsonl"
    ;;
gpt)
    shards 655360
    timeout "${GPT_LIMIT:-280}" python3 bench/gpt.py compare --gpus 1 2 --shards '/tmp/shards/*.bin' --epochs 3 \
        --steps 40 --script-loss inside 2>&1 | tee "$OUT/gpt-ddp-$commit.jsonl"
    timeout 100 python3 bench/gpt.py compare --gpus 2 --no-script --shards '/tmp/shards/*.bin' --epochs 3 \
        --steps 40 --launch-args perf.cuda_graph=true 2>&1 | tee "$OUT/gpt-ddp-graph-$commit.jsonl"
    # (fsdp ran past 170 s and 200 s without an epoch on 2 H100 and 2 H200: --timeout stops it and keeps its log)
    python3 bench/gpt.py compare --gpus 2 --strategy fsdp --no-script --timeout "${FSDP_LIMIT:-200}" \
        --shards '/tmp/shards/*.bin' --epochs 3 --steps 40 2>&1 | tee "$OUT/gpt-fsdp-$commit.jsonl"
    ;;
ddp-levers)
    # what DDP itself costs GPT-2 124M on two GPUs, and which of DDP's settings win it back: the script on one
    # GPU, then on two under each setting (bucket size, static graph, bf16 all-reduce, one compiled graph)
    shards 655360
    timeout 120 python3 bench/gpt_script.py --shards '/tmp/shards/*.bin' --steps 40 --epochs 3 2>&1 \
        | grep '"what"' | tee -a "$OUT/gpt-ddp-levers-$commit.jsonl"
    levers=("--bucket-mb 25" "--bucket-mb 100" "--bucket-mb 300" "--static-graph" "--ddp-hook bf16" "--no-optimize-ddp")
    [ -n "${LEVERS:-}" ] && IFS=';' read -ra levers <<< "$LEVERS"  # (LEVERS='--bucket-mb 50;--static-graph')
    for lever in "${levers[@]}"; do
        timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/gpt_script.py \
            --shards '/tmp/shards/*.bin' --steps 40 --epochs 3 $lever 2>&1 | grep '"what"' \
            | tee -a "$OUT/gpt-ddp-levers-$commit.jsonl"
    done
    ;;
auto)
    # perf.cuda_graph=auto under ddp (39c7085): recipe=imagefolder's defaults on 1 and 2 GPUs (decode=auto,
    # cuda_graph=auto), GPT-2 124M on 2 GPUs under auto and under DDP's reducer (perf.cuda_graph=false), then
    # the two-GPU tests that run ddp's default path
    timeout 270 python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 1 2 --only launch \
        --epochs 5 2>&1 | tee "$OUT/imagefolder-auto-graph-$commit.jsonl"
    shards 655360
    for graph in auto false; do
        timeout 100 python3 bench/gpt.py compare --gpus 2 --no-script --shards '/tmp/shards/*.bin' --epochs 3 \
            --launch-args perf.cuda_graph=$graph 2>&1 | grep '"what"' | tee -a "$OUT/gpt-auto-graph-$commit.jsonl"
    done
    timeout "${TESTS_LIMIT:-200}" python3 -m pytest -v -m two_gpus --timeout 150 -p no:cacheprovider tests/gpu \
        -k "test_ddp_on_two_gpus or imagefolder_saved_inside or new_lr_then_eval" \
        > "$OUT/gpu-tests-two-auto-$commit.txt" 2>&1; echo "exit $?" >> "$OUT/gpu-tests-two-auto-$commit.txt"
    tail -6 "$OUT/gpu-tests-two-auto-$commit.txt"
    ;;
split)
    # data.decode=auto's trial (the workers alone, then a split sized from their times where they fall behind)
    # and perf.cuda_graph=auto's tie going to the graph beside DataLoader workers: the defaults on 2 GPUs (8
    # epochs: the trial spans the second epoch and more of this folder's 39 steps a rank) and on 1, 1 GPU eager
    # for reference; then test_gpu_own_data.py. (At aa01096 this mode was split3; split and split2 there were
    # its first two versions: git show aa01096:bench/own_data_2gpu.sh)
    folder
    watch_cpu split
    runs split-2gpu 150 2 8
    runs split-1gpu 100 1 5 perf.cuda_graph=auto
    runs split-1gpu 100 1 5 perf.cuda_graph=false
    kill $vm
    timeout "${TESTS_LIMIT:-200}" python3 -m pytest -v --timeout 150 -p no:cacheprovider tests/gpu/test_gpu_own_data.py \
        > "$OUT/gpu-tests-imagefolder-$commit.txt" 2>&1
    echo "exit $?" >> "$OUT/gpu-tests-imagefolder-$commit.txt"; tail -4 "$OUT/gpu-tests-imagefolder-$commit.txt"
    ;;
graph-load)
    # do 30 busy workers slow the host's launches? decode=cpu on 2 GPUs under DDP's reducer and replayed (the
    # second half of ef98ff8's split mode)
    folder
    watch_cpu graph-load
    runs cpu-graph-2gpu 120 2 8 data.decode=cpu perf.cuda_graph=false
    runs cpu-graph-2gpu 120 2 8 data.decode=cpu perf.cuda_graph=true
    kill $vm
    ;;
regions)
    # the workers' crops resized on the GPU (data.decode=gpu/auto on CUDA: Regions): the new path's CUDA tests,
    # then the defaults on 2 GPUs (8 epochs, as split) and on 1 (5 epochs)
    folder
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_own_data.py -k "kernel or crops" \
        > "$OUT/gpu-tests-regions-$commit.txt" 2>&1; echo "exit $?" >> "$OUT/gpu-tests-regions-$commit.txt"
    tail -3 "$OUT/gpu-tests-regions-$commit.txt"
    watch_cpu regions
    (sleep 40; for _ in $(seq 30); do  # the training processes' busiest threads, every 2 s
        for p in $(pgrep -f "imagefolder|launcher"); do
            [ "$(pgrep -P $p | wc -l)" -gt 4 ] || continue
            echo "--- $(date +%T) pid $p"; top -H -b -n 1 -d 0.5 -p $p | sed -n '8,12p'
        done; sleep 2; done > "$OUT/regions-threads-$commit.txt" 2>&1) &
    runs regions-2gpu 150 2 8
    runs regions-1gpu 110 1 5
    kill $vm
    ;;
regions-nockpt)
    # the same as regions without the checkpoint at each epoch's end (on this folder a 2-GPU epoch is 1.5 s: a
    # fixed cost an epoch weighs twice what it does on one GPU)
    folder
    watch_cpu regions-nockpt
    runs regions-nockpt-2gpu 150 2 8 checkpoint=false
    runs regions-nockpt-1gpu 110 1 5 checkpoint=false
    kill $vm
    ;;
regions-why)
    # where 2 GPUs' batches of Regions wait: the defaults on 2 GPUs for 8 epochs while, every 2 s, each training
    # process (the DataLoader workers' parents) has its threads' stacks dumped (py-spy, carried in .whl) and its
    # threads' CPU shares taken (top -H), with /dev/shm's and the host's memory in use
    folder
    # (py-spy in a folder of its own: device_env.sh's second install into /tmp/site skips the bin/ the first
    # one made, so its py-spy never lands there, and d0035ae's stacks came out empty)
    python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl >/dev/null 2>&1
    spy=$(command -v py-spy || ls /tmp/pyspy/bin/py-spy 2>/dev/null)
    watch_cpu regions-why
    runs regions-why-2gpu 150 2 8 &
    run=$!
    sleep 20
    while kill -0 $run 2>/dev/null; do
        {
            echo "=== $(date +%T.%N | cut -c1-12) shm $(df -m /dev/shm | awk 'NR==2 {print $3}') MB, free $(free -g | awk 'NR==2 {print $4}') GB"
            for p in $(pgrep -f "imagefolder|launcher" ); do
                n=$(ls /proc/$p/task 2>/dev/null | wc -l)
                [ "$n" -gt 12 ] || continue
                kids=$(pgrep -P $p | wc -l)
                [ "$kids" -gt 4 ] || continue
                echo "--- pid $p threads $n children $kids"
                top -H -b -n 1 -d 0.5 -p $p | sed -n '8,16p'
                timeout 5 $spy dump --nonblocking --pid $p 2>&1 | grep -v "^ *$" | head -80
            done
        } >> "$OUT/regions-why-stacks-$commit.txt" 2>&1
        sleep 2
    done
    wait $run
    kill $vm
    ;;
epoch-end)
    # what rank 0's checkpoint at each epoch's end costs 2 GPUs: the snapshot tests, the defaults on 2 GPUs for 8
    # epochs and on 1 for 5, torchvision's DataLoader + DDP on 2; then, with SPY=1, 2 GPUs once more while py-spy samples both ranks' threads with
    # their native frames (50 Hz; collapsed stacks with line numbers, a file a process: over the device tool's
    # size limit at 7d8bcc8, and its pauses slowed the run 2x). (At 281df37 this mode sampled without native
    # frames, both ranks into one file, and ran checkpoint=false after)
    folder
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k snapshot \
        > "$OUT/gpu-tests-snapshot-$commit.txt" 2>&1; echo "exit $?" >> "$OUT/gpu-tests-snapshot-$commit.txt"
    tail -2 "$OUT/gpu-tests-snapshot-$commit.txt"
    watch_cpu epoch-end
    runs epoch-end-2gpu 150 2 8
    runs epoch-end-1gpu 110 1 5
    kill $vm
    # torchvision's ImageFolder + DataLoader + DDP under torchrun, the same 15 workers a rank (3 epochs, the first
    # untimed; BASELINE=0 leaves it out)
    [ "${BASELINE:-1}" = 1 ] && timeout 170 python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 2 --only baseline --epochs 3 \
        2>&1 | tee "$OUT/imagefolder-epoch-end-baseline-2gpu-$commit.jsonl"
    [ "${SPY:-0}" = 1 ] || exit 0
    python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl >/dev/null 2>&1
    spy=$(command -v py-spy || ls /tmp/pyspy/bin/py-spy 2>/dev/null)
    runs epoch-end-spy-2gpu 150 2 8 &
    run=$!
    for _ in $(seq 60); do  # the two ranks: the processes with DataLoader workers as children
        ranks=$(for p in $(pgrep -f "imagefolder|launcher"); do [ "$(pgrep -P $p | wc -l)" -gt 4 ] && echo $p; done)
        [ "$(echo $ranks | wc -w)" -ge 2 ] && break
        sleep 1
    done
    for p in $ranks; do
        $spy record --pid $p --rate 50 --native --idle --threads --format raw \
            -o "$OUT/epoch-end-spy-pid$p-$commit.txt" >> "$OUT/epoch-end-spy-$commit.txt" 2>&1 &
    done
    wait $run
    sleep 2
    ;;
sharded-save)
    # GPT-2 124M under fsdp with its sharded checkpoints after each epoch (default) and without (none): per-epoch
    # rows, epochs 2..E the mean. (At 152bc87 MODES also took plain, pinned and process: LAUNCHER_PROBE_SHARDED_SAVE,
    # dcp.async_save as it was, staged into a kept host copy with a thread writing, and torch's writer process.)
    shards 2621440
    for mode in ${MODES:-default none}; do
        extra=()
        [ "$mode" = none ] && extra=(checkpoint=false)
        timeout "${RUN_LIMIT:-150}" python3 bench/gpt.py compare --gpus ${GPUS:-2} \
            --strategy fsdp --no-script --shards '/tmp/shards/*.bin' --epochs ${EPOCHS:-3} --timeout $(( ${RUN_LIMIT:-150} - 10 )) \
            ${extra[@]:+--launch-args "${extra[@]}"} 2>&1 | sed "s/^/$mode /" | tee -a "$OUT/sharded-save-$commit.jsonl"
    done
    ps -eo pid,ppid,etimes,args | grep -v grep | grep -i "multiprocessing\|launch" > "$OUT/sharded-save-left-$commit.txt"
    ;;
gpu-tests)
    # the one-GPU suite on the two GPUs at once (two parts, as at aa01096), then test_gpu_own_data.py whole
    # (its two-GPU test included)
    folder
    (CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m pytest -q -m "gpu and not two_gpus" --timeout 150 -p no:cacheprovider \
        tests/gpu/test_gpu.py tests/gpu/test_gpu_user_day.py tests/gpu/test_gpu_trust.py tests/gpu/test_gpu_run_keeping.py \
        > "$OUT/gpu-tests-one-a-$commit.txt" 2>&1; echo "exit $?" >> "$OUT/gpu-tests-one-a-$commit.txt") &
    CUDA_VISIBLE_DEVICES=1 timeout 330 python3 -m pytest -q -m "gpu and not two_gpus" --timeout 150 -p no:cacheprovider \
        tests/gpu/test_gpu_data_path.py tests/gpu/test_step_graph_gpu.py tests/gpu/test_gpu_epoch_ends.py \
        tests/gpu/test_gpu_text_fsdp.py > "$OUT/gpu-tests-one-b-$commit.txt" 2>&1
    echo "exit $?" >> "$OUT/gpu-tests-one-b-$commit.txt"
    wait
    timeout 220 python3 -m pytest -v --timeout 200 -p no:cacheprovider tests/gpu/test_gpu_own_data.py \
        > "$OUT/gpu-tests-own-data-$commit.txt" 2>&1; echo "exit $?" >> "$OUT/gpu-tests-own-data-$commit.txt"
    tail -n 3 "$OUT"/gpu-tests-*.txt
    ;;
tests)
    (timeout "${LIMIT:-500}" python3 -m pytest -q -m "gpu and not two_gpus" tests/gpu -p no:cacheprovider \
        > "$OUT/gpu-tests-one-$commit.txt" 2>&1; echo "one-GPU tests exit $?" >> "$OUT/gpu-tests-one-$commit.txt") &
    timeout "${LIMIT:-500}" python3 -m pytest -q -m two_gpus tests/gpu -p no:cacheprovider \
        > "$OUT/gpu-tests-two-$commit.txt" 2>&1; echo "two-GPU tests exit $?" >> "$OUT/gpu-tests-two-$commit.txt"
    wait
    tail -3 "$OUT"/gpu-tests-*.txt
    ;;
esac
