# Why launch's uncaptured step trails a Lightning Trainer on a recipe's TensorDatasets (issue 33): one call.
export COMMIT=${COMMIT:-$(git log -1 --format=%h 2>/dev/null || echo wip)}; source bench/device_env.sh
L="python3 bench/lightning_dataset.py"; R=$OUT/dataset-path-h200-$commit.jsonl
timeout 100 $L launch | tee -a $R
echo "{\"next\": \"OMP_NUM_THREADS=16\"}" | tee -a $R; OMP_NUM_THREADS=16 timeout 100 $L launch | tee -a $R
timeout 100 $L lightning --profile $OUT/lightning-trace-$commit.json | tee -a $R
gzip $OUT/lightning-trace-$commit.json
timeout 100 $L lightning | tee -a $R
timeout 100 $L launch | tee -a $R
