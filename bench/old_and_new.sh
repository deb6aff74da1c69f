#!/usr/bin/env bash
# The main benchmarks through two trees of the launcher in one device call, so that a change that moves code
# can be told from one that costs speed: the older tree (.bench-base, made here before the call:
#   mkdir .bench-base && git archive REV | tar -x -C .bench-base && echo REV > .bench-base/.commit
# and carried as an untracked folder) and this one, each benchmark's runs of the two trees back to back, the
# older first. The older tree goes first on PYTHONPATH (pip --target /tmp/base), so `python -m launcher` in the
# bench scripts' subprocesses is that tree's; the bench scripts themselves are this tree's. Raw output:
# $OUT/old-and-new-<what>-<commit>.jsonl, each line with "tree": the commit it ran.
#   bash bench/old_and_new.sh cifar    recipe=cifar10_fast (2 runs a tree); ResNet-18 on one GPU, launch's default
#                                      and graph+compile settings, beside the DDP + compile(reduce-overhead) script
#   bash bench/old_and_new.sh gpt      GPT-2 124M on generated uint16 shards, one GPU, beside the nanoGPT-style script
#   bash bench/old_and_new.sh jpeg     recipe=imagefolder (ResNet-50 @224, 20,000 generated JPEGs), one GPU
#   bash bench/old_and_new.sh side     on a machine with two GPUs: the older tree on GPU 0 and this one on GPU 1 at
#                                      the same time (the same host load on both), benchmark by benchmark:
#                                      cifar10_fast, GPT-2 124M on shards, the JPEG folder (launch only)
set -uo pipefail
source bench/device_env.sh
base=$(cat .bench-base/.commit 2>/dev/null || echo base)
if [ ! -e /tmp/base/.done ]; then
    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/base .bench-base >/dev/null || exit 1
    touch /tmp/base/.done
fi
tagged() {  # TREE FILE: each JSON line read on stdin, marked with the tree, appended to FILE and shown
    python3 -c "
import json, sys
for line in sys.stdin:
    line = line.strip()
    if line.startswith('{'):
        row = {'tree': sys.argv[1], **json.loads(line)}
        print(json.dumps(row), flush=True)
" "$1" | tee -a "$2"
}
both() {  # FILE COMMAND...: the command through the older tree, then through this one
    local file=$1
    shift
    PYTHONPATH=/tmp/base:$PYTHONPATH "$@" 2>&1 | tagged "$base" "$file"
    "$@" 2>&1 | tagged "$commit" "$file"
}
case "$1" in
cifar)
    out="$OUT/old-and-new-cifar-$commit.jsonl"
    both "$out" python3 bench/fast_recipe.py --runs 2
    both "$out" python3 bench/peers.py --models resnet18 --epochs 4 --runs launch:default:1 launch:graph+compile:1
    python3 bench/peers.py --models resnet18 --epochs 4 --runs script:reduce-overhead:1 2>&1 | tagged script "$out"
    ;;
gpt)
    out="$OUT/old-and-new-gpt-$commit.jsonl"
    python3 bench/make_token_shards.py /tmp/shards --shards 4 --tokens-per-shard 655360 --val-tokens 65536 \
        >/dev/null || exit 1
    both "$out" timeout 200 python3 bench/gpt.py compare --gpus 1 --no-script --shards '/tmp/shards/*.bin' \
        --epochs 3 --steps 40
    timeout 150 python3 bench/gpt.py compare --gpus 1 --shards '/tmp/shards/*.bin' --epochs 3 --steps 40 \
        --script-loss inside 2>&1 | grep '"what": "script' | tagged script "$out"
    ;;
jpeg)
    out="$OUT/old-and-new-jpeg-$commit.jsonl"
    (cd bench && python3 -c "from pathlib import Path; from imagefolder import make_folder
make_folder(Path('/tmp/imagenet-gen'), 20000, 100)") || exit 1
    both "$out" timeout 200 python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 1 --only launch \
        --epochs 4
    ;;
side)
    out="$OUT/old-and-new-side-$commit.jsonl"
    python3 bench/make_token_shards.py /tmp/shards --shards 4 --tokens-per-shard 655360 --val-tokens 65536 \
        >/dev/null || exit 1
    (cd bench && python3 -c "from pathlib import Path; from imagefolder import make_folder
make_folder(Path('/tmp/imagenet-gen'), 20000, 100)") || exit 1
    pair() {  # LIMIT COMMAND...: the older tree on GPU 0 and this one on GPU 1, at once
        local limit=$1
        shift
        CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/base:$PYTHONPATH timeout "$limit" "$@" 2>&1 | tagged "$base" "$out" &
        CUDA_VISIBLE_DEVICES=1 timeout "$limit" "$@" 2>&1 | tagged "$commit" "$out"
        wait
    }
    pair 120 python3 bench/fast_recipe.py --runs 2
    pair 170 python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 1 --only launch --epochs 3
    pair 150 python3 bench/gpt.py compare --gpus 1 --no-script --shards '/tmp/shards/*.bin' --epochs 3 --steps 40
    ;;
*)
    echo "usage: bash bench/old_and_new.sh cifar|gpt|jpeg|side" >&2
    exit 2
    ;;
esac
