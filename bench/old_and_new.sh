#!/usr/bin/env bash
# The main benchmarks through two trees of the launcher in one device call, so that a change that moves code
# can be told from one that costs speed: the older tree (.bench-base, made here before the call:
#   mkdir .bench-base && git archive REV | tar -x -C .bench-base && echo REV > .bench-base/.commit
# and carried as an ignored folder) and this one, the two at once on two GPUs of one host. The older tree goes first on PYTHONPATH (pip --target /tmp/base), so `python -m launcher` in the
# bench scripts' subprocesses is that tree's; the bench scripts themselves are this tree's. Raw output:
# $OUT/old-and-new-<what>-<commit>.jsonl, each line with "tree": the commit it ran.
#   bash bench/old_and_new.sh side     on a machine with two GPUs: the older tree on GPU 0 and this one on GPU 1 at
#                                      the same time (the same host load on both), benchmark by benchmark:
#                                      cifar10_fast, the JPEG folder, GPT-2 124M on shards (launch only)
#   bash bench/old_and_new.sh one-gpu [fast] [jpeg] [gpt] [resnet18]
#                                      on a machine with one GPU: the older tree, then this one, benchmark by
#                                      benchmark (the ones named; all four without names); resnet18 is
#                                      bench/peers.py on 1 GPU: launch graph+compile against the plain script
#   bash bench/old_and_new.sh peers    on a machine with four GPUs: CIFAR ResNet-18, launch against the plain DDP
#                                      script (bench/peers.py, 1 and 2 GPUs), the older tree on GPUs 0-1 and this
#                                      one on GPUs 2-3 at the same time
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
case "$1" in
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
one-gpu)
    out="$OUT/old-and-new-one-gpu-$commit.jsonl"
    shift
    wanted=" ${*:-fast jpeg gpt resnet18} "
    both() {  # LIMIT COMMAND...: the older tree, then this one, on the same GPU
        local limit=$1
        shift
        PYTHONPATH=/tmp/base:$PYTHONPATH timeout "$limit" "$@" 2>&1 | tagged "$base" "$out"
        timeout "$limit" "$@" 2>&1 | tagged "$commit" "$out"
    }
    if [[ $wanted == *" fast "* ]]; then
        both 150 python3 bench/fast_recipe.py --runs 2
    fi
    if [[ $wanted == *" jpeg "* ]]; then
        (cd bench && python3 -c "from pathlib import Path; from imagefolder import make_folder
make_folder(Path('/tmp/imagenet-gen'), 20000, 100)") || exit 1
        both 170 python3 bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen --gpus 1 --only launch --epochs 3
    fi
    if [[ $wanted == *" gpt "* ]]; then
        python3 bench/make_token_shards.py /tmp/shards --shards 4 --tokens-per-shard 655360 --val-tokens 65536 \
            >/dev/null || exit 1
        both 150 python3 bench/gpt.py compare --gpus 1 --no-script --shards '/tmp/shards/*.bin' --epochs 3 --steps 40
    fi
    if [[ $wanted == *" resnet18 "* ]]; then
        both 200 python3 bench/peers.py --models resnet18 --epochs 5 --runs launch:graph+compile:1 script:reduce-overhead:1
    fi
    ;;
peers)
    out="$OUT/old-and-new-peers-$commit.jsonl"
    CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH=/tmp/base:$PYTHONPATH timeout 560 python3 bench/peers.py --models resnet18 \
        --epochs 5 2>&1 | tagged "$base" "$out" &
    CUDA_VISIBLE_DEVICES=2,3 timeout 560 python3 bench/peers.py --models resnet18 --epochs 5 2>&1 | tagged "$commit" "$out"
    wait
    ;;
*)
    echo "usage: bash bench/old_and_new.sh side|one-gpu [fast] [jpeg] [gpt] [resnet18]|peers" >&2
    exit 2
    ;;
esac
