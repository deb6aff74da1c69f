#!/usr/bin/env bash
# Issue 60's figures on the device machine (2 GPUs of one host), from the repository root there, with
# .device-wheels carried; COMMIT=<short hash> names the result files.
#
#   COMMIT=abc1234 bash bench/llama.sh 8b      # Llama 3.1 8B's shape, 2 x 8,192 tokens a GPU, fsdp + compile +
#                                               # selective checkpointing: launch, then bench/llama_script.py
#   COMMIT=abc1234 bash bench/llama.sh 1b      # Llama 3.2 1B's shape, 2 x 8,192 a GPU: one GPU, then fsdp on two
#   COMMIT=abc1234 bash bench/llama.sh fp8     # the 8b launch with perf.precision=fp8 (torchao carried in .whl)
#   COMMIT=abc1234 bash bench/llama.sh reshard # Llama 3.2 1B's shape under fsdp on two GPUs, 2 x 8,192 a GPU, with
#                                               # strategy.reshard_after_forward true, false, then auto (the default: its choice in its log)
#   COMMIT=abc1234 bash bench/llama.sh ckpt8b  # 8B's shape on 2 GPUs with sharded checkpoints: 2 epochs without
#                                               # checkpoints, 2 with (checkpoint.keep_previous=false: at most 2 of
#                                               # ~96 GB on disk, so a 235 GB disk: nvidia-h200-x4, GPUs 0-1), that run
#                                               # resumed for a third epoch, and exported to safetensors; OPTIM=sgd
#                                               # (no momentum: ~32 GB a checkpoint) fits the 2-GPU kind's 128 GB disk;
#                                               # PART=a then PART=b splits it over two calls
#   COMMIT=abc1234 bash bench/llama.sh ckpt    # ONE GPU: Llama 3.2 1B's shape under fsdp, 3 epochs without
#                                               # checkpoints, 2 with (each epoch's sharded save written while the
#                                               # next trains), that run resumed for its third, and exported
#
# The data: generated token shards of Llama 3's vocabulary (bench/make_token_shards.py, uint32), nothing like
# text, so losses say nothing; only speed and memory do. Both runs of a pair under the same allocator setting
# (expandable segments, as torchtitan's run script sets it).
set -uo pipefail
source bench/device_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
log=$OUT/llama-$1-$([ "$1" = ckpt ] && echo 1xh200 || echo 2xh200)$([ "${OPTIM:-}" = sgd ] && echo -sgd)-$commit.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$log"
common=(recipe=text recipe.vocab_size=128256 recipe.context=8192 recipe.sample_bytes=0 checkpoint=false
        eval.every=0 eval.batch_size=4 perf.compile=true progress=lines)

keep() {  # keep NAME RUN_DIR: its results.json and metrics.jsonl under $OUT
    cp "$2/results.json" "$OUT/$1-results.json" 2>/dev/null
    cp "$2/metrics.jsonl" "$OUT/$1-metrics.jsonl" 2>/dev/null
}

held() {  # held RUN_DIR...: how long each run's steps stood between epochs (an epoch's start after the last
          # one's start and length: what an epoch end held the steps for, a checkpoint's included), a JSON line
    python3 -c "import json, sys
for run in sys.argv[1:]:
    rows = [json.loads(line) for line in open(run + '/metrics.jsonl')]
    print(json.dumps({'run': run, 'held_s': [round(b['started_unix'] - a['started_unix'] - a['epoch_s'], 2)
                                             for a, b in zip(rows, rows[1:])]}))" "$@"
}

case "$1" in
    8b)
        data=/tmp/shards-8b  # 40 windows of 8,192: 10 steps an epoch at 2 x 2 windows
        python3 bench/make_token_shards.py $data --shards 1 --tokens-per-shard 330000 --val-tokens 20000 \
            --vocab-size 128256 >/dev/null
        timeout 170 python3 -m launcher "${common[@]}" "recipe.corpus=$data/gen_*.bin" recipe.size=8b gpus=[0,1] \
            strategy=fsdp strategy.meta_init=true perf.activation_checkpointing=selective batch_size=4 epochs=2 \
            hydra.run.dir=/tmp/run-8b 2>&1 | tee -a "$log"
        keep "llama8b-launch-$commit" /tmp/run-8b
        timeout 150 torchrun --standalone --nproc-per-node=2 bench/llama_script.py --size 8b --context 8192 \
            --batch-per-gpu 2 --warmup 3 --steps 10 --recompute selective 2>&1 | tee -a "$log"
        ;;
    fp8)
        data=/tmp/shards-8b
        python3 bench/make_token_shards.py $data --shards 1 --tokens-per-shard 330000 --val-tokens 20000 \
            --vocab-size 128256 >/dev/null
        python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1 | tee -a "$log"
        timeout 170 python3 -m launcher "${common[@]}" "recipe.corpus=$data/gen_*.bin" recipe.size=8b gpus=[0,1] \
            strategy=fsdp strategy.meta_init=true perf.activation_checkpointing=selective batch_size=4 epochs=2 \
            perf.precision=fp8 hydra.run.dir=/tmp/run-8b-fp8 2>&1 | tee -a "$log"
        keep "llama8b-fp8-$commit" /tmp/run-8b-fp8
        ;;
    1b)
        data=/tmp/shards-1b  # 244 windows: 122 steps an epoch on one GPU at 2 windows, 61 on two
        python3 bench/make_token_shards.py $data --shards 1 --tokens-per-shard 2000000 --val-tokens 20000 \
            --vocab-size 128256 >/dev/null
        for gpus in "[0]" "[0,1]"; do
            n=$(( ${#gpus} > 3 ? 2 : 1 ))
            strategy=$([ $n = 2 ] && echo fsdp || echo single)
            timeout 130 python3 -m launcher "${common[@]}" "recipe.corpus=$data/gen_*.bin" recipe.size=1b \
                gpus=$gpus strategy=$strategy batch_size=$((2 * n)) epochs=2 hydra.run.dir=/tmp/run-1b-$n \
                2>&1 | tee -a "$log"
            keep "llama1b-${n}gpu-$commit" /tmp/run-1b-$n
        done
        ;;
    reshard)
        data=/tmp/shards-1b
        python3 bench/make_token_shards.py $data --shards 1 --tokens-per-shard 2000000 --val-tokens 20000 \
            --vocab-size 128256 >/dev/null
        for r in true false auto; do
            timeout 140 python3 -m launcher "${common[@]}" "recipe.corpus=$data/gen_*.bin" recipe.size=1b gpus=[0,1] \
                strategy=fsdp strategy.meta_init=true strategy.reshard_after_forward=$r batch_size=4 epochs=2 \
                hydra.run.dir=/tmp/run-1b-reshard-$r 2>&1 | tee -a "$log"
            keep "llama1b-reshard-$r-$commit" /tmp/run-1b-reshard-$r
        done
        ;;
    ckpt8b)
        data=/tmp/shards-8b  # 40 windows of 8,192: 10 steps an epoch at 2 x 2 windows
        python3 bench/make_token_shards.py $data --shards 1 --tokens-per-shard 330000 --val-tokens 20000 \
            --vocab-size 128256 >/dev/null
        optim=$([ "${OPTIM:-adamw}" = sgd ] && echo "optim=sgd optim.momentum=0" || echo "optim=adamw")
        eight=("${common[@]}" "recipe.corpus=$data/gen_*.bin" recipe.size=8b gpus=[0,1] strategy=fsdp
               strategy.meta_init=true perf.activation_checkpointing=selective batch_size=4 $optim)
        # PART=a: the runs without and with checkpoints; PART=b (the next call, the machine still warm): the
        # resume and the export. Unset: both, which can pass one call's 600 s.
        if [ "${PART:-a}" = a ]; then
            df -h /tmp | tee -a "$log"
            timeout 170 python3 -m launcher "${eight[@]}" epochs=2 hydra.run.dir=/tmp/ck8-none 2>&1 | tee -a "$log"
            keep "llama8b-ckpt-none-$commit" /tmp/ck8-none
            timeout 300 python3 -m launcher "${eight[@]/checkpoint=false/checkpoint.keep_previous=false}" epochs=2 \
                hydra.run.dir=/tmp/ck8-saved 2>&1 | tee -a "$log"
            keep "llama8b-ckpt-saved-$commit" /tmp/ck8-saved
            du -sh /tmp/ck8-saved/checkpoints/* 2>&1 | tee -a "$log"
            held /tmp/ck8-none /tmp/ck8-saved | tee -a "$log"
        fi
        if [ "${PART:-b}" = b ]; then
            timeout 250 python3 -m launcher "${eight[@]/checkpoint=false/checkpoint.keep_previous=false}" \
                resume=/tmp/ck8-saved epochs=3 hydra.run.dir=/tmp/ck8-resumed 2>&1 | tee -a "$log"
            keep "llama8b-ckpt-resumed-$commit" /tmp/ck8-resumed
            du -sh /tmp/ck8-resumed/checkpoints/* 2>&1 | tee -a "$log"
            rm -rf /tmp/ck8-resumed/checkpoints  # (room for the export beside the saved run's)
            timeout 280 python3 -c "import resource, subprocess, sys, time
t = time.time(); done = subprocess.run(sys.argv[1:])
print('export: exit', done.returncode, 'wall_s', round(time.time() - t, 1), 'max_rss_gib',
      round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2))" \
                python3 -m launcher export /tmp/ck8-saved /tmp/ck8.safetensors 2>&1 | tee -a "$log"
            ls -la /tmp/ck8.safetensors 2>&1 | tee -a "$log"
            df -h /tmp | tee -a "$log"
        fi
        ;;
    ckpt)
        data=/tmp/shards-ck  # 85 windows of 8,192: 42 steps an epoch at 2 windows
        python3 bench/make_token_shards.py $data --shards 1 --tokens-per-shard 700000 --val-tokens 20000 \
            --vocab-size 128256 >/dev/null
        one=(recipe=text recipe.vocab_size=128256 recipe.context=8192 recipe.sample_bytes=0 eval.every=0
             eval.batch_size=4 perf.compile=true progress=lines "recipe.corpus=$data/gen_*.bin" recipe.size=1b
             gpus=[0] strategy=fsdp strategy.meta_init=true perf.activation_checkpointing=selective batch_size=2)
        timeout 150 python3 -m launcher "${one[@]}" checkpoint=false epochs=3 hydra.run.dir=/tmp/ck-none 2>&1 \
            | tee -a "$log"
        keep "llama1b-ckpt-none-$commit" /tmp/ck-none
        timeout 150 python3 -m launcher "${one[@]}" epochs=2 hydra.run.dir=/tmp/ck-saved 2>&1 | tee -a "$log"
        keep "llama1b-ckpt-saved-$commit" /tmp/ck-saved
        du -sh /tmp/ck-saved/checkpoints/* 2>&1 | tee -a "$log"
        held /tmp/ck-none /tmp/ck-saved | tee -a "$log"
        timeout 120 python3 -m launcher "${one[@]}" resume=/tmp/ck-saved epochs=3 hydra.run.dir=/tmp/ck-resumed 2>&1 \
            | tee -a "$log"
        keep "llama1b-ckpt-resumed-$commit" /tmp/ck-resumed
        timeout 120 python3 -c "import resource, subprocess, sys, time
t = time.time(); done = subprocess.run(sys.argv[1:])
print('export: exit', done.returncode, 'wall_s', round(time.time() - t, 1), 'max_rss_gib',
      round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2))" \
            python3 -m launcher export /tmp/ck-saved /tmp/ck-1b.safetensors 2>&1 | tee -a "$log"
        ls -la /tmp/ck-1b.safetensors 2>&1 | tee -a "$log"
        ;;
esac
