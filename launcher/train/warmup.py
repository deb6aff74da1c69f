"""The warm-up, and the decisions it carries out: whether the step is compiled and replayed as a CUDA graph.

Before the first epoch (and again once perf.compile=auto decided to compile: `after_first_epoch`), a run
that compiles or captures its step runs WARMUP_STEPS steps on the real shapes, captures the step as one
CUDA graph (perf.cuda_graph on a GPU), then puts the model, optimizers and RNG back as they were: the
warm-up leaves no trace but speed, and its time is kept out of the timings (`Timings.warmup_s`).

perf.cuda_graph=auto (strategies single and ddp on GPUs: strategies/__init__.py) captures the step, then
times it eagerly and replayed and keeps the faster (`keeps_graph`), every rank alike. perf.compile=auto
trains the first epoch uncompiled and compiles after it where the rest of the run earns the compile time
back (compiling.py). cuDNN's autotuning follows the compile decision (`autotune`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from launcher.config import Toggle
from launcher.train import checkpoint, compiling
from launcher.train.stall import StepClock

if TYPE_CHECKING:
    from launcher.config import Config, PerfConfig
    from launcher.recipes import Recipe
    from launcher.strategies import Nets, Strategy
    from launcher.train.evaluation import Evaluation
    from launcher.train.misfit import FirstSteps
    from launcher.train.results import Timings
    from launcher.train.step import TrainStep
    from launcher.train.timeline import StartupTimeline

log = logging.getLogger("launcher.train")

WARMUP_STEPS = 3
# perf.cuda_graph=auto: steps timed each way after the capture, and how much shorter a replayed step must be
# for the graph to be kept (a tie keeps the eager step: nothing frozen, no graph memory held)
AUTO_GRAPH_STEPS = 8
AUTO_GRAPH_S = 0.1  # (fewer steps a try where one step is longer: 2 at least)
GRAPH_GAIN = 0.95


def keeps_graph(graph_ms: float, eager_ms: float, workers: bool) -> bool:
    """perf.cuda_graph=auto's rule (WarmUp._keep_faster_step): the replayed step at least 5% shorter, or, where
    DataLoader workers share the host's cores with the step's launches, no longer."""
    return graph_ms <= (1.0 if workers else GRAPH_GAIN) * eager_ms


def tries_graph(cfg: Config, strategy: Strategy, recipe: Recipe) -> bool:
    """Whether the warm-up captures the step and keeps the graph only where it measures faster
    (perf.cuda_graph=auto, where the strategy set up static gradients for it). A recipe's own training_step
    is not captured under auto (a replay runs none of its Python), so its gradients stay plain (under ddp:
    DDP's own reducer)."""
    from launcher.recipes import Recipe

    auto = cfg.perf.cuda_graph is Toggle.auto and strategy.static_gradients
    if auto and type(recipe).training_step is not Recipe.training_step:
        strategy.static_gradients = False
        return False
    return auto


def autotune(device: torch.device, perf: PerfConfig, compiled: compiling.Decision) -> None:
    """cuDNN's autotuning (perf.cudnn_benchmark): as set, or with auto, when the run compiles. Set before
    the warm-up that captures the step, so the captured graph keeps the algorithms picked."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = compiling.autotunes(perf.cudnn_benchmark, compiled)


def compiled_nets(strategy: Strategy, nets: Nets, perf: PerfConfig) -> Nets:
    """The nets compiled as the strategy compiles them (a step that is not captured)."""
    mode = compiling.compiled_mode(perf.compile_mode.value)
    return strategy.compile(nets, lambda fn: compiling.compiled(fn, mode))


def after_first_epoch(perf: PerfConfig, epoch_s: float, epochs_left: int, say: bool) -> compiling.Decision:
    """perf.compile=auto after the first epoch: compile where the rest of the run is long enough to earn the
    compile time back (compiling.py). Every rank decides alike: `epoch_s` is the slowest rank's."""
    compiled = compiling.after_first_epoch(epoch_s, epochs_left, perf.compile_auto_min_s)
    if say:
        autotunes = compiled.compile and perf.cudnn_benchmark is Toggle.auto
        doing = "compiling and autotuning cuDNN" if autotunes else "compiling"
        log.info("%s (%s)", doing if compiled.compile else "not compiling", compiled.why)
    return compiled


def compile_step(step: TrainStep, strategy: Strategy, perf: PerfConfig, captures: bool) -> Nets:
    """Compile a step that trained uncompiled (perf.compile=auto's decision); the nets it trains are returned.
    A captured step's graph goes and its parts are compiled (the warm-up captures it again)."""
    if captures:
        step.captured = None
        step.compile_captured(compiling.compiled_mode(perf.compile_mode.value))
    else:
        step.nets = compiled_nets(strategy, step.nets, perf)
    return step.nets


class WarmUp:
    """The warm-up of one run's step (`__call__`), with what stays the same for the whole run."""

    def __init__(self, cfg: Config, strategy: Strategy, device: torch.device, timings: Timings,
                 timeline: StartupTimeline, evaluation: Evaluation, auto_graph: bool):
        self.cfg, self.strategy, self.device = cfg, strategy, device
        self.timings, self.timeline, self.evaluation = timings, timeline, evaluation
        self.auto_graph = auto_graph  # perf.cuda_graph=auto: the graph kept where it measures faster
        self.is_main = strategy.is_main

    def __call__(self, step: TrainStep, train: Any, order: Callable[[int], torch.Tensor], generator: torch.Generator,
                 first_steps: FirstSteps, compiled: bool, captures: bool) -> None:
        """Compile, autotune and (`captures`) capture the step on the real shapes (the first batches of
        `train`, the training split, in epoch 0's `order`), then put the model, optimizers and RNG back."""
        if not (compiled or captures):
            return
        start = time.perf_counter()
        # (each rank's own shards under fsdp: nothing gathered, every rank puts back its own)
        saved = checkpoint.capture(self.strategy, step.nets, step.steppers, self.device, clone=True, local=True,
                                   scaler=step.scaler)
        step.nets.train.train()
        generator.manual_seed(0)
        rows = order(0)[:WARMUP_STEPS]
        # Graph capture wants the eager warm-up on a side stream (lazily made state then belongs to it).
        side = torch.cuda.Stream(self.device) if captures else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            batch = idx = None
            for batch, idx in train.batches(rows):
                with first_steps(batch):
                    step(batch, idx, 0, generator)
            if side is not None:
                self._sync()
                self.timeline.mark("warmup_steps")
                self._capture(step, batch, idx, generator, side)
                if self.auto_graph and self.strategy.distributed:  # (every rank keeps a graph, or none does)
                    failed = self.strategy.reduce_host([float(step.captured is None)], op="max")[0]
                    if failed and step.captured is not None:
                        step.captured = None
                        step.optimizers_in_graph = False
                        if self.is_main:
                            log.info("perf.cuda_graph=auto: the step runs eagerly (capturing it failed on "
                                     "another rank)")
                if self.auto_graph and step.captured is not None:
                    self._keep_faster_step(step, batch, idx, generator, getattr(train, "workers", 0) > 0)
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._sync()
            self.timeline.mark("captured")
        # Evaluation warms up later, at the first evaluation (evaluation.py): not before the first step.
        self.evaluation.warm = False
        checkpoint.restore(saved, self.strategy, step.nets, step.steppers, self.device, local=True,
                           scaler=step.scaler)
        step.zero_grads()
        if compiled:
            compiling.settle_heap()
        self._sync()
        seconds = time.perf_counter() - start
        if self.timings.warmup_s is None:
            self.timeline.mark("warmed_up")
        self.timings.warmup_s = (self.timings.warmup_s or 0.0) + seconds
        if self.is_main:
            done = ["compiled"] * compiled + ["captured the step as one CUDA graph"] * captures
            log.info("%s in %.1fs (not counted in the timings)", " and ".join(done), seconds)

    def _capture(self, step: TrainStep, batch: Any, idx: torch.Tensor, generator: torch.Generator,
                 side: torch.cuda.Stream) -> None:
        """Capture the step as one CUDA graph; a recipe's step that cannot be captured (it reads a value
        to the host, say) runs eagerly instead, said once."""
        try:
            step.capture(batch, idx, generator, stream=side)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            if isinstance(exc, torch.cuda.OutOfMemoryError) and not self.auto_graph:
                raise
            step.captured = None
            step.optimizers_in_graph = False
            self._sync()
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            if self.is_main and self.auto_graph:
                log.info("perf.cuda_graph=auto: the step runs eagerly (capturing it failed: %s)", first)
            elif self.is_main:
                log.warning("perf.cuda_graph: %s's step cannot be captured as a CUDA graph (%s); it runs eagerly "
                            "(no .item(), printing or other host reads in training_step lets it be captured; "
                            "perf.cuda_graph=false says so up front)", self.cfg.recipe.name, first)

    def _keep_faster_step(self, step: TrainStep, batch: Any, idx: torch.Tensor, generator: torch.Generator,
                          workers: bool) -> None:
        """perf.cuda_graph=auto, right after the capture: the warm-up's last batch stepped eagerly, then
        replayed (the better of two tries each, by the device's clock: StepClock); the graph is kept where
        its steps are at least 5% shorter, which is where the host's launches pace the step (a small
        network or batch). Where DataLoader workers feed the run (`workers`), a tie goes to the graph: they
        share the host's cores with the step's launches once training runs (the warm-up times the step while
        they rest), and a replayed step needs almost none (BENCHMARKS.md). Each try is as many steps as fill
        AUTO_GRAPH_S of one eager step's time (2 to AUTO_GRAPH_STEPS), so a large network's start is not held
        up by it. The warm-up puts weights and optimizer state back afterwards. Under ddp every rank runs the
        same steps (each one all-reduces) and keeps the same way, by the slowest rank's times."""
        graph = step.captured
        agreed = self.strategy.reduce_host  # (the slowest rank's figures; one process: its own)

        def per_step_ms(captured: Any, steps: int, tries: int = 2) -> float:
            step.captured = captured
            best = math.inf
            for _ in range(tries):
                self._sync()
                clock = StepClock(self.device)
                clock.start()
                for _ in range(steps):
                    step(batch, idx, 0, generator)
                    clock.step_end()
                best = min(best, 1000 * clock.finish().span_s / steps)
            return best

        try:
            one_ms = agreed([per_step_ms(None, 1, tries=1)], op="max")[0]
            steps = max(2, min(AUTO_GRAPH_STEPS, math.ceil(1000 * AUTO_GRAPH_S / max(one_ms, 1e-3))))
            eager_ms = per_step_ms(None, steps)
        except torch.cuda.OutOfMemoryError:  # (the graph's memory held beside eager steps': the graph fits)
            if self.strategy.distributed:
                raise  # (the other ranks' steps are past the point where this one stopped: no agreeing now)
            step.captured = graph
            self._sync()
            if self.is_main:
                log.info("perf.cuda_graph=auto: the step replayed as one CUDA graph (eager steps beside it ran "
                         "out of memory)")
            return
        graph_ms = per_step_ms(graph, steps)
        graph_ms, eager_ms = agreed([graph_ms, eager_ms], op="max")
        keep = keeps_graph(graph_ms, eager_ms, workers)
        step.captured = graph if keep else None
        step.optimizers_in_graph = step.optimizers_in_graph and keep
        step.eager_steps = 0
        self._sync()
        if self.is_main:
            both = (" (ddp: both ways average the gradients in the launcher's flat buckets; "
                    "perf.cuda_graph=false keeps DDP's reducer)" if self.strategy.distributed else "")
            tie = ("; with DataLoader workers beside it a tie goes to the graph, whose steps need almost no host "
                   "time" if workers and keep and graph_ms > GRAPH_GAIN * eager_ms else "")
            log.info("perf.cuda_graph=auto: %s (%.2f ms a step replayed, %.2f ms eagerly%s; perf.cuda_graph=%s "
                     "decides it)%s", "the step replayed as one CUDA graph" if keep else "the step runs eagerly",
                     graph_ms, eager_ms, tie, "false" if keep else "true", both)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
