#!/usr/bin/env bash
# Issue 17 on GPUs: two launches as two nodes (nodes=2, one GPU each, NCCL over a loopback rdzv) beside
# one launch on both GPUs, same call, same global batch. One JSON line per run: img/s, wall, loss curve.
#   bash bench/on_device.sh py -c 'import subprocess; subprocess.run(["bash", "bench/two_nodes_gpu.sh"])'
# or, with the launcher installed:  EPOCHS=6 bash bench/two_nodes_gpu.sh
set -uo pipefail
EPOCHS=${EPOCHS:-6}
common=(recipe=cifar10 data.synthetic=true batch_size=1024 epochs=$EPOCHS progress=lines)
scratch=$(mktemp -d /tmp/two-nodes-XXXX)
report() {  # label run_dir started_unix
    python3 - "$1" "$2" "$3" <<'PY'
import json, sys, time
label, run, wall = sys.argv[1], sys.argv[2], round(time.time() - float(sys.argv[3]), 3)
r = json.load(open(f"{run}/results.json"))
rows = [json.loads(x) for x in open(f"{run}/metrics.jsonl")]
later = rows[1:] or rows
print(json.dumps({"what": "two_nodes_gpu", "label": label,
                  "img_per_s_epochs_2_on": round(sum(x["img_per_s"] for x in later) / len(later)),
                  "epoch_s": [x.get("epoch_s") for x in rows], "timed": r.get("timed"), "wall_s": wall,
                  "first_step_s": (r.get("startup") or {}).get("first_step"), "devices": r.get("devices"),
                  "world_size": r.get("world_size"), "ranks_agree": r.get("ranks_agree"),
                  "loss": [round(x["loss"], 5) for x in rows], "test_acc": [x.get("test_acc") for x in rows],
                  "torch": r.get("torch")}))
PY
}
for attempt in 1 2; do
    start=$(date +%s.%N)
    launch "${common[@]}" gpus=[0,1] hydra.run.dir=$scratch/one-$attempt > $scratch/one-$attempt.log 2>&1 \
        || { tail -5 $scratch/one-$attempt.log; exit 1; }
    report "one launch, gpus=[0,1] (#$attempt)" $scratch/one-$attempt $start
    port=$((29400 + attempt))
    start=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=0 launch "${common[@]}" gpus=[0] nodes=2 node_rank=0 rdzv=127.0.0.1:$port \
        hydra.run.dir=$scratch/n0-$attempt > $scratch/n0-$attempt.log 2>&1 &
    node0=$!
    CUDA_VISIBLE_DEVICES=1 launch "${common[@]}" gpus=[0] nodes=2 node_rank=1 rdzv=127.0.0.1:$port \
        hydra.run.dir=$scratch/n1-$attempt > $scratch/n1-$attempt.log 2>&1
    code1=$?
    wait $node0
    code0=$?
    if [ $code0 -ne 0 ] || [ $code1 -ne 0 ]; then tail -5 $scratch/n0-$attempt.log $scratch/n1-$attempt.log; exit 1; fi
    report "two launches, nodes=2, one GPU each (#$attempt)" $scratch/n0-$attempt $start
done
