# launch on a recipe's TensorDatasets against a Lightning Trainer (issue 33), interleaved in one call: launch as
# it comes (perf.cuda_graph=auto), launch with the step eager (perf.cuda_graph=false), Lightning; ROUNDS rounds.
# GC_TRACE=1: every garbage collection of 5 ms or more traced (bench/probe/gc_trace), and launch's heap also left
# unfrozen after compiling (GC_NO_FREEZE=1) as a fourth run. Raw: $OUT/dataset-path-<commit>.jsonl, $OUT/gc-*/
export COMMIT=${COMMIT:-$(git log -1 --format=%h 2>/dev/null || echo wip)}; source bench/device_env.sh
L="python3 bench/lightning_dataset.py"; R=$OUT/dataset-path-$commit.jsonl
runs="launch launch-eager lightning"
if [ -n "${GC_TRACE:-}" ]; then export PYTHONPATH=$PWD/bench/probe/gc_trace:$PYTHONPATH; runs="$runs launch-nofreeze"; fi
for round in $(seq ${ROUNDS:-2}); do
  for what in $runs; do
    echo "{\"next\": \"$what\", \"round\": $round}" | tee -a $R
    [ -n "${GC_TRACE:-}" ] && export GC_TRACE_DIR=$OUT/gc-$what-$round
    case $what in
      launch-nofreeze) GC_NO_FREEZE=1 timeout 100 $L launch --launch-args perf.cuda_graph=false | tee -a $R ;;
      launch-eager) timeout 100 $L launch --launch-args perf.cuda_graph=false | tee -a $R ;;
      *) timeout 100 $L $what | tee -a $R ;;
    esac
  done
done
