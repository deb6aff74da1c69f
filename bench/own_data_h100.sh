#!/usr/bin/env bash
# Issue 33's one-GPU figures in one device call (BENCHMARKS.md "Your own data"): recipe=imagefolder against the
# model's limit and torchvision's DataLoader, `launch recipe=imagefolder` itself, and GPT-2 124M on token
# shards through launch against the nanoGPT-style script (its loss inside and outside its compiled forward).
# Run from the repository root on the device machine, .device-wheels carried, and .whl holding nvImageCodec's
# wheels (nvidia-nvimgcodec-cu13, nvidia-nvjpeg) where the hardware decoder is to be measured.
# Raw output: $OUT/own-data-<commit>.*
#   bash bench/own_data_h100.sh [all | imagefolder | launch-imagefolder | gpt | lightning]
#   launch-imagefolder: `launch recipe=imagefolder` alone, once per DECODES (default "auto"), EPOCHS epochs
#   lightning: a recipe's TensorDatasets through launch against a Lightning Trainer (bench/lightning_dataset.py)
#   gpt-levers: the nanoGPT-style script under each attention kernel and compile mode (what could beat it)
#     (LEVERS='--sdpa cudnn;--loss outside' picks some; the max-autotune modes autotune for minutes each, and all eight
#     do not fit one 600 s call)
set -uo pipefail
source bench/device_env.sh
python3 -c "from nvidia import nvimgcodec; print('nvimgcodec', nvimgcodec.__version__)" 2>&1 | tail -1
what=${1:-all}
if [ "$what" = all ] || [ "$what" = imagefolder ]; then
    timeout 300 python3 bench/imagefolder.py --root /tmp/imagenet-gen --n 20000 --no-feed \
        --only "${ONLY:-limit,baseline,gpu,auto,gpu-nvjpeg}" 2>&1 | tee "$OUT/own-data-imagefolder-$commit.jsonl"
fi
if [ "$what" = all ] || [ "$what" = imagefolder ] || [ "$what" = launch-imagefolder ]; then
    python3 -c "import sys, pathlib; sys.path.insert(0, 'bench'); import imagefolder as f; \
f.make_folder(pathlib.Path('/tmp/imagenet-gen'), 20000, 100)"  # (the folder, where the bench did not make it)
    for decode in ${DECODES:-auto}; do
    (cd /tmp && timeout "${LAUNCH_LIMIT:-200}" launch recipe=imagefolder data.root=/tmp/imagenet-gen gpus=[0] \
        perf.compile=true eval.every=0 data.decode=$decode epochs=${EPOCHS:-2} ${LAUNCH_ARGS:-}) 2>&1 \
        | grep -v Warning | tee "$OUT/own-data-launch-imagefolder-$decode-$commit.txt"
    done
fi
if [ "$what" = all ] || [ "$what" = lightning ]; then
    timeout "${LIGHTNING_LIMIT:-300}" python3 bench/lightning_dataset.py compare 2>&1 \
        | tee "$OUT/own-data-lightning-$commit.jsonl"
fi
if [ "$what" = all ] || [ "$what" = gpt ]; then
    python3 bench/make_token_shards.py /tmp/shards --shards 2 --tokens-per-shard 327680 --val-tokens 65536 >/dev/null
    timeout 300 python3 bench/gpt.py compare --gpus 1 --shards '/tmp/shards/*.bin' --epochs "${EPOCHS:-2}" \
        --steps 40 2>&1 | tee "$OUT/own-data-gpt-$commit.jsonl"
fi
if [ "$what" = gpt-levers ]; then
    python3 bench/make_token_shards.py /tmp/shards --shards 2 --tokens-per-shard 327680 --val-tokens 65536 >/dev/null
    levers=("--sdpa default" "--sdpa cudnn" "--sdpa flash" "--sdpa efficient"
            "--compile-mode max-autotune-no-cudagraphs" "--sdpa cudnn --compile-mode max-autotune-no-cudagraphs"
            "--compile-mode max-autotune" "--loss outside")
    [ -n "${LEVERS:-}" ] && IFS=';' read -ra levers <<< "$LEVERS"
    for lever in "${levers[@]}"; do
        timeout 240 python3 bench/gpt_script.py --shards '/tmp/shards/*.bin' --steps 40 --epochs 3 $lever 2>&1 \
            | grep '"what"' | tee -a "$OUT/gpt-levers-$commit.jsonl"
    done
fi
