export COMMIT=$(git log -1 --format=%h 2>/dev/null || echo wip); source bench/device_env.sh
L="python3 bench/lightning_dataset.py"; R=$OUT/dataset-path-h200-$commit.jsonl
for m in launch lightning; do timeout 90 $L $m --model linear --epochs 4 | tee -a $R; done
timeout 100 $L launch --launch-args perf.cuda_graph=true | tee -a $R
timeout 100 $L launch --launch-args data.workers=4 | tee -a $R
timeout 100 $L launch --launch-args checkpoint=false data.prefetch_depth=6 | tee -a $R
timeout 100 $L lightning | tee -a $R
mkdir -p /tmp/ld && python3 -c "import sys; sys.path.insert(0,'bench'); import lightning_dataset as m, pathlib; m.write_recipe(pathlib.Path('/tmp/ld'))"
(cd /tmp/ld && timeout 120 launch recipe=cifar_tensors gpus=[0] batch_size=512 epochs=3 data.workers=15 perf.compile=true eval.every=0 profile=true 2>&1 | grep -v Warn | tail -8; cp outputs/*/*/profile.txt $OUT/dataset-path-profile-$commit.txt; gzip -c outputs/*/*/trace.json > $OUT/dataset-path-trace-$commit.json.gz)
