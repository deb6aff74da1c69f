#!/usr/bin/env bash
# What a change to the training path runs on the device machine (BENCHMARKS.md, "Checking a change").
# Run from the repository root there, with .device-wheels carried (../shared/tools/device-prep makes it)
# and, for `versions`, .bench-base holding the older tree to compare with
# (mkdir .bench-base && git archive REV | tar -x -C .bench-base && echo REV > .bench-base/.commit).
# COMMIT=<short hash> names the result files (the device machine gets the tree without .git).
#
#   bash bench/on_device.sh tests tests/gpu/test_gpu.py ...     # GPU tests -> $OUT/gpu-tests-<commit>.txt
#   bash bench/on_device.sh versions airbench resnet18          # bench/versions.py -> $OUT/versions-<commit>.jsonl
#   bash bench/on_device.sh peers --models resnet18             # bench/peers.py -> $OUT/peers-<commit>.jsonl
#   bash bench/on_device.sh py bench/gpt.py ...                 # any script, the launcher installed
set -uo pipefail
source bench/device_env.sh
what=$1
shift
case "$what" in
    tests)
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/gpu-tests-$commit.txt"
        python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu-tests-$commit.txt"
        python3 -m pytest -m gpu -v --durations=30 -p no:cacheprovider "$@" 2>&1 | tee -a "$OUT/gpu-tests-$commit.txt"
        ;;
    py)  # any bench script, with the launcher installed: bash bench/on_device.sh py bench/x.py ARGS
        python3 "$@"
        ;;
    peers)
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        python3 bench/peers.py "$@" | tee -a "$OUT/peers-$commit.jsonl"
        ;;
    versions)
        if [ ! -d /tmp/base ]; then
            python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/base .bench-base >/dev/null || exit 1
        fi
        base=$(cat .bench-base/.commit 2>/dev/null || echo base)
        python3 bench/versions.py --base-path /tmp/base --base-module launcher --label-base "$base" \
            --models "$@" --gpus 0 0,1 --epochs 4 --repeats 2 | tee -a "$OUT/versions-$commit.jsonl"
        ;;
esac
