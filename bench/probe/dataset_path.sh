# launch on a recipe's TensorDatasets against a Lightning Trainer (issue 33), interleaved in one call, with
# every garbage collection of 5 ms or more traced (bench/probe/gc_trace), and launch's heap left unfrozen after
# compiling (GC_NO_FREEZE=1) beside the default. Raw: $OUT/dataset-path-<commit>.jsonl, $OUT/gc-<run>/
export COMMIT=${COMMIT:-$(git log -1 --format=%h 2>/dev/null || echo wip)}; source bench/device_env.sh
L="python3 bench/lightning_dataset.py"; R=$OUT/dataset-path-$commit.jsonl
export PYTHONPATH=$PWD/bench/probe/gc_trace:$PYTHONPATH
for round in 1 2; do
  for what in launch launch-nofreeze lightning; do
    echo "{\"next\": \"$what\", \"round\": $round}" | tee -a $R
    export GC_TRACE_DIR=$OUT/gc-$what-$round
    if [ $what = launch-nofreeze ]; then GC_NO_FREEZE=1 timeout 100 $L launch | tee -a $R
    else timeout 100 $L ${what%-*} | tee -a $R; fi
  done
done
unset GC_TRACE_DIR
echo '{"next": "launch perf.cuda_graph=true"}' | tee -a $R
timeout 100 $L launch --launch-args perf.cuda_graph=true | tee -a $R
