"""The training wing: what each worker process runs (entry point: worker.py's worker_main).

    worker.py       apply the worker env, log with the rank, train, record a failure, exit
    loop.py         train(): device, process group, Trainer (setup -> resume -> warm-up -> epochs -> results)
    restart.py      where a run starts (its own checkpoint after a restart, or resume=), whether a checkpoint fits
    warmup.py       the warm-up: compile and CUDA-graph capture on the real shapes; the graph and compile choices
    epoch_end.py    an epoch's end: queued on the device, read a few steps into the next epoch, its Verdict
    saving.py       the checkpoints a run writes as it trains, and the best ones
    threads.py      set-up work on threads beside the training thread; the profiler
    step.py         one training step; CUDA-graph capture; flat gradients with a bucketed all-reduce
    optim.py        optimizers and schedules (the `optim` group)
    checkpoint.py   capture/restore of the training state, atomic checkpoints, background writes
    stall.py        input wait measured on the device's clock
    metrics.py, reporting.py, progress.py, timeline.py   what a run reports while and after it trains
    preemption.py   SIGUSR2 under SLURM: checkpoint, requeue, resume
    faults.py       fault.*: deliberate failures
    preload.py      what the forkserver imports before any worker exists

What feeds the step (the epoch's order, placement, loaders, prefetch, augmentation, decoding) is the data
wing, launcher/data/.
"""
