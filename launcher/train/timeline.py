"""Where a launch's start-up time goes: seconds from `launch` starting to each milestone of a worker.

    spawn            the launcher hands the workers to torch.distributed.elastic
    worker_process   the worker's Python is running our code (forked from the forkserver, or under
                     `spawn` a new interpreter that imported torch in elastic's bootstrap)
    device_set       the worker's GPU is selected (CUDA starts lazily, so this is cheap)
    process_group    init_process_group returned (ddp: rendezvous and, with NCCL, communicator set-up)
    data_loaded      the dataset is in memory where it trains (synthetic data is generated here)
    model_on_device  the model is built and moved to its device
    model_built      the model is wrapped (DDP broadcasts the weights) and optimizers exist
    warmup_steps     (perf.cuda_graph on a GPU) the eager warm-up steps finished: cuDNN autotuned each
                     convolution, torch.compile compiled (when compiling before the first step)
    captured         the step was captured as a CUDA graph
    warmed_up        the warm-up finished and the model, optimizers and RNG were put back (evaluation
                     warms up at the first evaluation instead, outside its clock)
    first_step       the first training step finished on the device (cuDNN autotuning included)

Rank 0's timeline goes into results.json (`startup`) and one log line, so the seconds a multi-GPU
launch can take before its first step (measured: BENCHMARKS.md section 4) are itemized rather than
guessed at.
"""

from __future__ import annotations

import time

ORDER = ("spawn", "worker_process", "device_set", "process_group", "data_loaded", "model_on_device",
         "model_built", "warmup_steps", "captured", "warmed_up", "first_step")


class StartupTimeline:
    def __init__(self, started_at: float, marks: dict[str, float] | None = None):
        self.started_at = started_at
        self.marks: dict[str, float] = dict(marks or {})

    def mark(self, name: str) -> None:
        if name not in self.marks:  # the first time counts (a restart keeps the original start-up)
            self.marks[name] = round(time.time() - self.started_at, 3)

    def as_dict(self) -> dict[str, float]:
        return {name: self.marks[name] for name in ORDER if name in self.marks}

    def describe(self) -> str:
        parts = [f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in self.as_dict().items()]
        return "start-up, seconds since launch: " + ", ".join(parts)
