"""The training loop every recipe shares: what one worker process does, top to bottom.

    train(spec, world, timeline)     the worker's device, its strategy's process group, one Trainer, teardown
    Trainer.run()
      setup     the data where it trains (Data), the model as the strategy wraps it (Nets), the
                optimizers, the step (TrainStep)
      resume    from this run's own checkpoint after a restart or requeue, else from `resume`
      warm up   torch.compile and/or the CUDA-graph capture on the real shapes, then everything put back
      epochs    train; queue the epoch's end (average buffers, evaluate, copy the sums and the
                checkpoint's tensors to host memory); a few steps into the next epoch (DeferredEnd),
                read it: stop on a NaN loss, save (and the best: best.py), report to the trackers
                (trackers.py), stop early (early_stop.py) or for preemption
      results   rank 0's results.json (results.py)

Beside it: evaluation.py (the held-out figures, queued on the device), results.py (the epoch line and
results.json), stops.py (the NaN and out-of-memory messages).

Per epoch: this rank's shard of the epoch's order (launcher/train/data.py) streams through the data
path (`data.placement`), augmentation and normalization run on the training device, and nothing syncs
the host inside an epoch: losses and accuracies are summed on the device and read once per epoch,
while the next epoch's first steps keep the device busy (`Trainer._epochs`).
Training and evaluation are timed on the device's own clock (CUDA events), along with the share of
each epoch the compute stream spent waiting for input (launcher/train/stall.py). The strategy
(launcher/strategies) does everything that depends on how devices share the work; this module never
asks which one it is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from launcher.config import (
    Config,
    Precision,
    figure_key,
    model_name,
    smaller_is_better,
    to_plain,
)
from launcher.errors import ConfigError
from launcher.figures import NamedFigures, check_report
from launcher.files import CURVES, RESULTS, last_checkpoint
from launcher.models import configured, from_config, lazy_modules, materialize_lazy
from launcher.recipes import Recipe, TokenSplits, recipe_class
from launcher.spec import WorkerSpec
from launcher.strategies import Nets, Strategy
from launcher.train import (
    checkpoint,
    compiling,
    misfit,
    nodes,
    optim,
    progress,
    reporting,
    restart,
    results,
    stops,
    trackers,
    warmup,
)
from launcher.train.best import BestCheckpoints
from launcher.train.data import Data, rank_order
from launcher.train.early_stop import EarlyStop, check_named, default_figure
from launcher.train.evaluation import Evaluation, QueuedEvaluation
from launcher.train.faults import Faults
from launcher.train.metrics import MetricsLog
from launcher.train.optim import Stepper
from launcher.train.preemption import Preempted, PreemptionWatch
from launcher.train.restart import Start
from launcher.train.results import RankFacts, RunRecord, Timings
from launcher.train.stall import Readback, StepClock, StepPace, input_advice, thread_advice
from launcher.train.step import Figures, TrainStep
from launcher.train.stops import NonFiniteLoss, OutOfMemory
from launcher.train.threads import Asides, profiled
from launcher.train.timeline import StartupTimeline
from launcher.train.warmup import WarmUp, tries_graph
from launcher.world import WorldInfo, available_cores

log = logging.getLogger("launcher.train")

# On GPUs an epoch's figures are read (and it is logged and checkpointed) a few steps into the next
# epoch, with those steps queued for the device to run meanwhile (`Trainer._epochs`): enough steps for
# OVERLAP_S of device time by the last epoch's pace (OVERLAP_STEPS before any epoch was read).
OVERLAP_S = 0.05
OVERLAP_STEPS = 4


def train(spec: WorkerSpec, world: WorldInfo, timeline: StartupTimeline) -> dict[str, Any] | None:
    """Train one worker's part of the run. Returns the results on rank 0, None elsewhere."""
    cfg, strategy = spec.config, spec.strategy
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # torch may have been imported before the worker env was applied (a joined world): apply it now.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = strategy.select_device(world, spec.device_index)
    timeline.mark("device_set")
    if device.type == "cuda":  # (cuDNN's autotuning is set with the compile decision: warmup.autotune)
        torch.set_float32_matmul_precision("high")
    strategy.setup(world, device)
    if strategy.distributed:
        timeline.mark("process_group")
    trainer = None
    try:
        # (a world over several machines: rank 0's run dir, and whether every rank sees it)
        dirs = nodes.meet(world, Path(spec.run_dir), strategy.sharded, cfg.saves and not spec.evaluate,
                          settings=to_plain(cfg), typed=spec.typed)
        trainer = Trainer(spec, world, device, timeline, dirs)
        outcome = trainer.evaluate(spec.evaluate) if spec.evaluate else trainer.run()
        # Let go of the nets and a captured step before teardown: destroying NCCL's communicator while
        # a CUDA graph that captured its all-reduce is alive blocks forever (seen on 2x H200).
        trainer = None
        compiling.release_heap()
    except torch.OutOfMemoryError as exc:
        nets = getattr(trainer, "nets", None)
        params = list(nets.module.parameters()) if nets is not None else []
        raise OutOfMemory(stops.oom_message(cfg, strategy, device, params)) from exc
    # On failure nothing is torn down (see DDP.teardown); here every rank finished.
    strategy.teardown()
    return outcome


@dataclass
class QueuedEpoch:
    """An epoch whose steps and end are queued on the device and whose figures the host has not read
    yet (`Trainer._conclude` reads them while the next epoch's first steps run)."""

    epoch: int
    row: dict[str, Any]  # what the host knew when it queued the epoch's end
    clock: StepClock
    started: float  # perf_counter() when the host began the epoch
    steps: int  # the steps this run took in the epoch (fewer than an epoch's when it resumed inside it)
    names: list[str]  # the training figures' names (the loss first)
    figures: Readback  # finite steps, each training figure's sum and count (, the evaluation's)
    evaluation: QueuedEvaluation | None
    memory_mb: list[float]  # this rank's peak allocated and reserved (-1 without a GPU)
    snapshot: checkpoint.HostSnapshot | None  # rank 0: the state after the epoch, being copied to host memory
    skipped: int = 0  # training samples this rank's Dataset skipped in the epoch
    first: int = 0  # the step of the epoch it started at
    snapshot_s: float = 0.0  # rank 0's host time queuing the snapshot's copies


class DeferredEnd:
    """The epoch whose end is queued on the device and not read yet: held from the end of its steps to step
    `at` of the next epoch (OVERLAP_S of device time; 0 on the CPU, where nothing runs ahead of the host),
    where `read_if_due` hands it to `conclude` (Trainer._conclude: NaN stop, log, checkpoint, preemption)
    while the GPU runs those steps; or read at once (`read_now`: the last epoch, a compile decision,
    early stopping, a strategy whose epoch ends do not overlap)."""

    def __init__(self, conclude: Callable[[QueuedEpoch, float | None], None]):
        self._conclude = conclude
        self._held: QueuedEpoch | None = None
        self.at = 0

    @property
    def held(self) -> bool:
        return self._held is not None

    def hold(self, queued: QueuedEpoch) -> None:
        self._held = queued

    def read_now(self, queued: QueuedEpoch) -> None:
        self._conclude(queued, None)

    def read_if_due(self, step: int, next_started: float) -> None:
        """At step `step` of the next epoch (begun at `next_started`): read the held end if this is its step."""
        if self._held is not None and step == self.at:
            queued, self._held = self._held, None
            self._conclude(queued, next_started)


class Trainer:
    # What run() sets up, in this order; nothing else is added to a Trainer.
    data: Data  # the splits where they train, and how a batch is normalized
    steps_per_epoch: int
    nets: Nets  # the model as the strategy wrapped it (and compiled, when asked)
    compiled: compiling.Decision  # whether this run compiles (perf.compile), and why
    steppers: list[Stepper]  # the optimizers with their schedules
    step: TrainStep  # one training step and the epoch's sums on the device
    writer: checkpoint.BackgroundWriter  # checkpoints, written off the training thread
    preemption: PreemptionWatch  # SIGUSR2 under SLURM
    tensorboard: reporting.TensorBoardLog
    bar: progress.EpochBar
    history: list[dict[str, Any]]  # every finished epoch's row (`_epochs`, `_conclude`)
    metrics_log: MetricsLog

    def __init__(self, spec: WorkerSpec, world: WorldInfo, device: torch.device, timeline: StartupTimeline,
                 dirs: nodes.RunDirs | None = None):
        self.spec = spec
        self.cfg: Config = spec.config
        self.strategy: Strategy = spec.strategy
        self.world = world
        self.device = device
        self.timeline = timeline
        self.dirs = dirs or nodes.RunDirs(Path(spec.run_dir), Path(spec.run_dir), True)
        # The run's dir: rank 0's, where every rank sees it; else (another machine) this node's own
        self.run_dir = self.dirs.main if self.dirs.shared else self.dirs.own
        self.recipe: Recipe = recipe_class(self.cfg.recipe.name)(self.cfg)
        self.recipe.step_pace = StepPace()  # (the training steps' own times, for the recipe: stall.py)
        self.timings = Timings()
        self.faults = Faults(self.cfg.fault, world, device, last_checkpoint(self.run_dir))
        precision = self.cfg.perf.precision
        self.bf16 = precision is Precision.bf16 or (precision is Precision.auto and device.type == "cuda")
        self.fp16 = precision is Precision.fp16
        # (bf16 autocast on GPUs with perf.precision=auto; a function that holds no reference to the trainer,
        # so that nothing the trainer holds refers back to it: `trainer = None` in train() frees its captured
        # graph at once, before the process group is torn down)
        self.autocast = functools.partial(autocast, device.type, self.bf16, self.fp16)
        self.evaluation = Evaluation(self.cfg, self.recipe, self.strategy, device, self.autocast, self.timings)
        # (perf.cuda_graph=auto: the warm-up captures the step and keeps the graph where it measures faster)
        self.warm_up = WarmUp(self.cfg, self.strategy, device, self.timings, timeline, self.evaluation,
                              tries_graph(self.cfg, self.strategy, self.recipe))
        # The augmentation's generator, on the device: seeded per (seed, epoch, rank) at each epoch.
        self.generator = torch.Generator(device=device)
        # (until a step has run, a network that does not take the batches says so in one line)
        self.first_steps = misfit.FirstSteps(self.cfg, type(self.recipe).__module__.startswith("launcher.recipes."))
        self.advised = False  # the input-bound advice was logged (once per run)
        self.said_sharded_steps = False  # checkpoint_every_steps under a sharded strategy was said (once)
        self.step_s: float | None = None  # the last epoch's seconds per step (the slowest rank's)
        self.stager: checkpoint.Stager | None = None  # rank 0 on a GPU: checkpoint copies staged on the device
        self.asides = Asides()  # set-up work on threads, waited for at the first epoch's end
        self.early_stop = EarlyStop.from_config(self.cfg)  # early_stop.metric: None when not asked
        # early_stop.metric, checkpoint.metric, sweep.objective: checked at the first row that can have each
        self.named_figures = NamedFigures(self.cfg, type(self.recipe).figures, self.cfg.recipe.name)
        self.stopped_early: dict[str, Any] | None = None  # why the run stopped before its last epoch
        self.best: BestCheckpoints | None = None  # checkpoint.keep_best (rank 0, from the first evaluation)
        self.trackers = trackers.Trackers(self.cfg, self.run_dir, self.is_main)  # log=[mlflow,csv,wandb]

    # ---- the run, top to bottom --------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        t_start = time.perf_counter()
        self.data = self._load_data()
        self.timeline.mark("data_loaded")
        self.nets = self._build_model()
        self.steppers = optim.build(self.cfg.optim, self.cfg.lr, self.cfg.epochs, self.nets.module,
                                    self.steps_per_epoch, fused=self.device.type == "cuda", graphed=self.captures)
        self.step = self._build_step()
        start = restart.resume(self.spec, self.world, self.run_dir, self.dirs.shared, self.strategy, self.device,
                               self.step, self.steps_per_epoch)
        self.faults.check_reach(self.cfg.epochs * self.steps_per_epoch, start.epoch * self.steps_per_epoch + start.step)
        self.timeline.mark("model_built")
        try:
            return self._run(start, t_start)
        finally:
            if getattr(self, "tensorboard", None) is not None:
                with contextlib.suppress(Exception):  # (a run that failed: its own error is what is said)
                    self.tensorboard.close()
            self.trackers.close()  # (what they were sent goes first; FAILED where the run did not end well)

    def _run(self, start: Start, t_start: float) -> dict[str, Any] | None:
        self.trackers.start(start.history, restarted=start.own)
        # (TensorBoard's writer is closed, its last events written, after results.json: `_end`; on the way out
        # of a failed run, by run())
        self.tensorboard = reporting.TensorBoardLog(self.run_dir, self.is_main and self.cfg.tensorboard
                                                    and self.cfg.log.tensorboard is not None,
                                                    self.cfg.log.tensorboard.folder if self.cfg.log.tensorboard
                                                    else None)
        with contextlib.ExitStack() as stack:
            self.writer = stack.enter_context(contextlib.closing(checkpoint.BackgroundWriter(self.world)))
            self.preemption = stack.enter_context(contextlib.closing(PreemptionWatch(self.spec.requeue)))
            # (the writer opened beside the warm-up; the first epoch's end waits for it, and so does
            # the exit, before the writer is closed)
            if self.tensorboard.enabled:
                self.asides.start(None, self.tensorboard.open)
            stack.callback(self.asides.wait, quiet=True)
            self.bar = progress.EpochBar(progress.wanted(str(self.cfg.progress), self.is_main), self.device,
                                         self.cfg.epochs, self.data.unit)
            self._warm_up()
            self.trackers.wait_started()
            history = self._epochs(start)
            self.data.close()  # (its DataLoader workers, if any: nothing reads from them any more)
        # (the writer is closed: the last checkpoint is on disk before the run reports itself done)
        ranks = RankFacts.gather(self.strategy, self.nets, self.device)
        return self._end(history, self._record(ranks, start.source, time.perf_counter() - t_start))

    def _record(self, ranks: RankFacts, source: str | None, worker_s: float) -> RunRecord:
        """What results.json says of this run beside its epochs' rows (results.py)."""
        s, best = self.strategy, self.best
        return RunRecord(
            cfg=self.cfg, strategy=s.name, world_size=s.world_size, batch_per_process=s.batch_per_process,
            gradient_sync=s.gradient_sync, sharding=s.layout, device_type=self.device.type, ranks=ranks,
            synthetic_data=self.data.synthetic, data_placement=self.data.placement, compiled=self.compiled.compile,
            compile_decision=self.compiled.why, cuda_graph=self.step.captured is not None,
            cudnn_benchmark=self.device.type == "cuda" and torch.backends.cudnn.benchmark, fp16=self.fp16,
            stopped_early=self.stopped_early,
            best_checkpoint={"metric": best.key, "kept": best.kept} if best is not None else None,
            timings=self.timings, started_unix=self.spec.started_at, startup=self.timeline.as_dict(),
            resumed_from=source, restarts=self.world.restart_count, worker_s=worker_s)

    def _end(self, history: list[dict[str, Any]], record: RunRecord) -> dict[str, Any] | None:
        """The run's files at its end, the figures first: results.json (rank 0; small, atomic), then the
        recipe's finish (a sample; its facts join results.json), TensorBoard's last events, curves.png and the
        trackers, each attempted on its own (results.EndWrites): a file that cannot be written (a full disk)
        is named, leaves no partial file, and ends the run with exit 1, the figures kept."""
        ending = results.EndWrites(self.run_dir)
        outcome = results.write(self.run_dir, record, history) if self.is_main else None
        # (a sharded model's forward takes every rank, so all of them run the recipe's finish)
        if self.is_main or self.strategy.sharded:
            with ending.attempt(f"what recipe={self.cfg.recipe.name}'s finish writes in {self.run_dir}"):
                finished = self.recipe.finish(self.nets.module, self.run_dir, self.device, self.is_main)
                if outcome is not None and finished:
                    results.add_facts(self.run_dir, outcome, finished)
        # (the trained weights for MLflow or W&B to keep; gathered from every rank's shards under fsdp)
        state = self.strategy.state_dict(self.nets) if self.trackers.want_weights or (
            self.strategy.sharded and (self.cfg.log.mlflow or self.cfg.log.wandb)) else None
        if outcome is None:
            return None
        with ending.attempt(self.tensorboard.folder):
            self.tensorboard.close()
        with ending.attempt(self.run_dir / CURVES):
            reporting.plot_curves(history, self.run_dir / CURVES)
        if self.trackers.active:
            weights = trackers.weights_file(state) if state else None
            self.trackers.finish(outcome, [self.run_dir / CURVES, self.run_dir / RESULTS], weights)
            self.trackers.ok = True
        ending.check()
        self.named_figures.check_results(outcome)  # (a sweep.objective that is no figure: a value of results.json)
        return outcome

    def evaluate(self, source: str) -> dict[str, Any] | None:
        """`launch eval`: the saved weights of `source` on the test split (the recipe's predict, so its
        test-time augmentation too), on every rank's shard; accuracy per class and the confusion matrix."""
        t_start = time.perf_counter()
        self.data = self._load_data()
        self.timeline.mark("data_loaded")
        self.nets = self._build_model()
        read = self.spec.evaluate_read or source  # (launch eval's hard links to it: held still for every rank)
        state = checkpoint.load(read, map_location=self.device)
        with restart.fitting(self.spec, source, state):
            if "sharded" in state:
                checkpoint.load_sharded_weights(state, Path(read), self.nets)
            else:
                self.strategy.load_state_dict(self.nets, state["net_state_dict"])
        self.strategy.barrier()
        row = self.evaluation.read_now(self.nets, self.data, self.compiled.compile or self.captures,
                                       confusion=self._classifies)
        self.data.close()
        if not self.is_main:
            return None
        if not self._classifies:  # (the built-in classifiers' report: accuracy per class, the confusion matrix)
            self.recipe.report(row, self.device, self.strategy.world_size)
        facts = {"evaluated": source, "recipe": self.cfg.recipe.name, "model": model_name(self.cfg),
                 "trained_epochs": state.get("epoch"), "strategy": self.strategy.name,
                 "world_size": self.strategy.world_size, "device_type": self.device.type,
                 "synthetic_data": self.data.synthetic}
        return self.evaluation.write_report(self.run_dir, facts, row, self.data, t_start)

    @property
    def is_main(self) -> bool:
        return self.strategy.is_main

    @property
    def _classifies(self) -> bool:
        """Built-in classification (the default eval_step on classes): `launch eval` adds accuracy per class
        and the confusion matrix."""
        return (self.recipe.classifies and type(self.recipe).eval_step is Recipe.eval_step
                and self.data.num_classes > 0 and self.data.unit != "tokens")

    # ---- setup --------------------------------------------------------------------------------------
    def _load_data(self) -> Data:
        cfg = self.cfg
        splits = self.recipe.load()
        if isinstance(splits, TokenSplits):
            return self._place_tokens(splits)
        if isinstance(splits, (tuple, list)):
            return self._place_datasets(*splits) if len(splits) == 2 else self._place_datasets(splits, None)
        n = len(splits.train_y)
        if cfg.batch_size > n:
            raise ConfigError("batch_size", cfg.batch_size,
                              f"larger than the {n} training images of {cfg.recipe.name}", f"batch_size={n // 4}")
        translate = getattr(cfg.recipe, "translate", 0)
        side = min(splits.train_x.shape[-2:]) if splits.train_x.dim() >= 3 else None
        if isinstance(translate, int) and side is not None and translate >= side:
            raise ConfigError("recipe.translate", translate, f"must be smaller than the {side}-pixel images of "
                              f"{cfg.recipe.name} (reflect padding)", f"recipe.translate={max(0, side // 4)}")
        if splits.synthetic and self.is_main:
            log.warning("SYNTHETIC data (data.synthetic=true): for timing only, accuracy says nothing about "
                        "the real dataset")
        data = Data.place(splits, cfg.data, self.device, cfg.perf.channels_last)
        if self.is_main and self.device.type == "cuda":
            where = "on the GPU" if data.placement == "gpu" else "in pinned host memory, prefetched on a side stream"
            log.info("data: %s, %.0f MB, %s (%s)", cfg.recipe.name, data.megabytes, where, data.why)
        self.steps_per_epoch = n // cfg.batch_size
        return data

    def _place_datasets(self, train: Any, test: Any) -> Data:
        """A recipe's own (train, eval) Datasets, each streamed through a DataLoader (launcher/train/loader.py)."""
        from launcher.train.loader import DatasetSplit, check_datasets

        cfg, s = self.cfg, self.strategy
        if test is None:
            raise ConfigError("recipe", cfg.recipe.name, "load() must return (train, eval): two Datasets (the same "
                              "one twice, or a random_split of it, if you have one)", f"recipe={cfg.recipe.name}")
        check_datasets(train, test, cfg.recipe.name)
        local = max(1, s.processes)
        splits = [DatasetSplit(ds, self.recipe, cfg.data, self.device, training, s.world_size, s.rank, local, per_rank,
                               upcoming=self._upcoming)
                  for ds, training, per_rank in ((train, True, s.batch_per_process),
                                                 (test, False, max(1, cfg.eval.batch_size // s.world_size)))]
        n = len(splits[0])
        if cfg.batch_size > n:
            raise ConfigError("batch_size", cfg.batch_size, f"larger than the {n} training samples of "
                              f"{cfg.recipe.name}", f"batch_size={max(1, n // 4)}")
        workers = splits[0].workers
        why = (f"{workers} DataLoader worker{'s' if workers != 1 else ''} per rank (data.workers)" if workers
               else "loaded in the training process (data.workers=0)")
        data = Data(splits[0], splits[1], "workers", why, 0.0, self.recipe.num_classes(train) or 0, False, None, None,
                    cfg.perf.channels_last and self.device.type == "cuda", None, unit=self.recipe.unit,
                    in_memory=False)
        if self.is_main:
            log.info("data: %s, %d training and %s evaluation samples, %s", cfg.recipe.name, n,
                     len(splits[1]) if splits[1].length is not None else "a stream of", why)
        self.steps_per_epoch = n // cfg.batch_size
        return data

    def _place_tokens(self, splits: TokenSplits) -> Data:
        cfg = self.cfg
        data = Data.place_tokens(splits, cfg.data, self.device)
        windows = data.drawn_per_epoch or 0
        if cfg.batch_size > windows:
            raise ConfigError("batch_size", cfg.batch_size, f"larger than the {windows} windows of {splits.context} "
                              f"tokens in {cfg.recipe.name}'s training stream", f"batch_size={max(1, windows // 4)}")
        if len(data.test) < 1:
            raise ConfigError("recipe.context", splits.context, f"longer than {cfg.recipe.name}'s held-out stream "
                              f"({len(splits.test)} tokens)", f"recipe.context={max(2, len(splits.test) // 4)}")
        if splits.synthetic and self.is_main:
            log.warning("SYNTHETIC data (data.synthetic=true): for timing only, the loss says nothing about a real "
                        "corpus")
        if self.is_main and self.device.type == "cuda":
            where = ("on the GPU" if data.placement == "gpu"
                     else "memory-mapped on the host, prefetched on a side stream")
            log.info("data: %s, %.0f MB of tokens, %s (%s)", cfg.recipe.name, data.megabytes, where, data.why)
        self.steps_per_epoch = windows // cfg.batch_size
        return data

    def _build_model(self) -> Nets:
        """The recipe's model on the device, set up from data, wrapped by the strategy, compiled if asked."""
        torch.manual_seed(self.cfg.seed)  # same initial weights on every rank (DDP also broadcasts them)
        model = self.strategy.build_model(self._new_model, self.device)
        self.timeline.mark("model_on_device")
        self._materialize_lazy(model)
        if self.data.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if type(self.recipe).prepare_model is not Recipe.prepare_model and self.data.host_train_x is not None:
            # (a sample costs a copy to the device)
            if any(p.is_meta for p in model.parameters()):
                raise ConfigError("strategy.meta_init", True, f"recipe.model={self.cfg.recipe.model} sets itself up "
                                  "from training data, which a model on the meta device cannot",
                                  "strategy.meta_init=false")
            sample = self.data.host_train_x[:self.recipe.prepare_model_sample].to(self.device)
            self.recipe.prepare_model(model, self.data.normalize(sample))
        if not any(p.requires_grad for p in model.parameters()):
            raise misfit.nothing_to_train(self.cfg, type(self.recipe).__module__.startswith("launcher.recipes."))
        if self.is_main and self._classifies and configured(self.cfg.model):
            surplus = misfit.surplus_outputs(model, self.data.num_classes, self.cfg.model["_target_"],
                                             self.cfg.recipe.name)
            if surplus:
                log.warning("%s", surplus)
        nets = self.strategy.wrap(model, self.device)
        if self.is_main and self.strategy.layout:
            log.info("%s", self.strategy.layout)
        self.compiled = compiling.decide(self.cfg.perf.compile_setting, self.device.type)
        warmup.autotune(self.device, self.cfg.perf, self.compiled)
        captured = nets.grads is not None and self.device.type == "cuda"  # (a captured step compiles itself)
        return warmup.compiled_nets(self.strategy, nets, self.cfg.perf) if self.compiled.compile and not captured \
            else nets

    def _materialize_lazy(self, model: torch.nn.Module) -> None:
        """Lazy layers (nn.LazyLinear, ...) get their shapes from this rank's first batch before the strategy
        wraps the model (launcher/models.py materialize_lazy): one forward without gradients, under every
        strategy; on the meta device (strategy.meta_init) with the batch's shapes only."""
        if not lazy_modules(model):
            return
        batches = self.data.train.batches(self._order(0)[:1])
        try:
            batch, _ = next(iter(batches))
        finally:
            batches.close()
        if self.data.in_memory:  # (the images as the network takes them: normalized, as TrainStep.inputs does)
            batch = (self.data.normalize(batch[0]), *batch[1:])
        if any(p.is_meta for p in model.parameters()):
            batch = torch.utils._pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)
        builtin = type(self.recipe).__module__.startswith("launcher.recipes.")
        try:
            left = materialize_lazy(model, lambda: self.recipe.training_step(model, batch), self.device)
        except Exception as exc:  # noqa: BLE001 - only a shape mismatch is turned into the one line
            line = misfit.does_not_take(self.cfg, builtin, batch, exc)
            if line is None:
                raise
            raise line from None
        if left:
            raise misfit.lazy_unreached(self.cfg, builtin, left)

    def _new_model(self) -> torch.nn.Module:
        """The network: the config's `model._target_` where given (launcher/models.py), else the recipe's."""
        if configured(self.cfg.model):
            return from_config(self.cfg.model, self.data.num_classes or None)
        return self.recipe.build_model(self.data.num_classes)

    def _build_step(self) -> TrainStep:
        step = TrainStep(self.nets, self.steppers, self.recipe.training_step,
                         self.data.normalize if self.data.in_memory else None,
                         self.recipe.augmentation(), self.autocast, self.device, self.faults.poison,
                         self.strategy.accumulate, lambda: self.strategy.no_sync(self.nets),
                         self.cfg.optim.clip_grad_norm,
                         scaler=torch.amp.GradScaler(self.device.type) if self.fp16 else None)
        if self.compiled.compile and self.captures:
            step.compile_captured(compiling.compiled_mode(self.cfg.perf.compile_mode.value))
        return step

    @property
    def captures(self) -> bool:
        """The step is replayed as a CUDA graph (perf.cuda_graph on a GPU; on the CPU it runs eagerly)."""
        return self.nets.grads is not None and self.device.type == "cuda"

    def _warm_up(self) -> None:
        """Compile, autotune and (perf.cuda_graph) capture the step on the real shapes (warmup.py)."""
        self.warm_up(self.step, self.data.train, self._order, self.generator, self.first_steps,
                     self.compiled.compile, self.captures)

    def _compile_if_it_pays(self, epoch_s: float, epochs_left: int) -> None:
        """perf.compile=auto after the first epoch: compile, and warm up again, where the rest of the run is long
        enough to earn the compile time back. Every rank decides alike (`epoch_s`: the slowest rank's)."""
        self.compiled = warmup.after_first_epoch(self.cfg.perf, epoch_s, epochs_left, self.is_main)
        if self.compiled.compile:
            warmup.autotune(self.device, self.cfg.perf, self.compiled)
            self.nets = warmup.compile_step(self.step, self.strategy, self.cfg.perf, self.captures)
            self._warm_up()

    # ---- epochs -------------------------------------------------------------------------------------
    def _epochs(self, start: Start) -> list[dict[str, Any]]:
        """Every epoch's steps, with each epoch's end overlapping the next epoch's first steps: the
        host queues the epoch's end on the device (buffer averaging, evaluation, the sums and the
        checkpoint copied to pinned memory) and starts the next epoch; a few steps into it (OVERLAP_S of
        device time), it reads the finished epoch's figures, logs them and writes its checkpoint, while
        the GPU runs those steps. Nothing is decided later than before: a NaN loss or a preemption stops the run
        before any state of the next epoch is saved. The last epoch, and the first one of a
        perf.compile=auto run (whose time decides the compile), end at once."""
        cfg = self.cfg
        self.history = list(start.history)
        self.metrics_log = MetricsLog(self.run_dir)
        if self.is_main:
            self.metrics_log.rewrite(self.history)
            if start.source:
                log.info("resumed from %s after epoch %d", start.source, start.epoch)
        ends = DeferredEnd(self._conclude)
        for epoch in range(start.epoch, cfg.epochs):
            # Seeded per (seed, epoch, rank), so a resumed run augments exactly as an uninterrupted one.
            self.generator.manual_seed((cfg.seed * 100_003 + epoch) * 1_009 + self.strategy.rank)
            first = start.step if epoch == start.epoch else 0
            if first and start.generator is not None and self.strategy.world_size == 1:
                self.generator.set_state(start.generator.cpu())  # (rank 0's, where it stopped: exact on one rank)
            if first and self.is_main:
                log.info("resuming epoch %d at step %d of %d", epoch + 1, first + 1, self.steps_per_epoch)
            profiling = cfg.profile and epoch == min(start.epoch + 1, cfg.epochs - 1) and self.is_main
            with profiled(self.run_dir) if profiling else contextlib.nullcontext():
                queued = self._train_epoch(epoch, ends, first)
            deciding = self.compiled.pending and epoch + 1 < cfg.epochs
            # (early stopping decides before the next epoch changes the weights: its epochs end at once)
            if epoch + 1 == cfg.epochs or deciding or not self.strategy.overlaps_epoch_ends or self.early_stop:
                ends.read_now(queued)
            else:
                ends.hold(queued)
            if self.stopped_early is not None:
                break
        return self.history

    def _upcoming(self, epoch: int) -> torch.Tensor | None:
        """This rank's order of `epoch`, None past the last: a data path reading ahead asks for it."""
        return self._order(epoch) if epoch < self.cfg.epochs else None

    def _order(self, epoch: int) -> torch.Tensor:
        return rank_order(len(self.data.train), self.cfg.batch_size, self.cfg.seed, epoch, self.strategy.world_size,
                          self.strategy.rank, drawn=self.data.drawn_per_epoch)

    def _train_epoch(self, epoch: int, ends: DeferredEnd, first: int = 0) -> QueuedEpoch:
        """Queue one epoch's steps from step `first` (a resume in the middle of the epoch), reading the end of
        the epoch before (`ends`, where it is held) a few steps in, and queue this epoch's end."""
        strategy, sums = self.strategy, self.step.sums
        started = time.perf_counter()
        row: dict[str, Any] = {"epoch": epoch + 1, "started_unix": round(time.time(), 3)}
        if first:
            row["resumed_at_step"] = first  # (its figures cover the steps from there)
        self.nets.train.train()
        order = self._order(epoch)[first:]
        sums.zero()
        skipped_before = self.data.skipped
        self.step.epoch.fill_(epoch)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        steps = len(order)
        # Where the epoch before is read: the same step on every rank (its reading is a collective); on
        # the CPU, where nothing runs ahead of the host, before this epoch's clock starts.
        ends.at = 0
        if self.device.type == "cuda":  # (step_s is agreed by every rank, so they all stop at the same step)
            cover = OVERLAP_STEPS if self.step_s is None else max(1, math.ceil(OVERLAP_S / self.step_s))
            ends.at = min(cover, steps - 1)
        ends.read_if_due(0, started)
        # A bounded wait at the epoch's end when collectives run inside a graph (no NCCL watchdog there).
        clock = StepClock(self.device, strategy.collective_timeout(), self.recipe.step_pace)
        if not ends.held:
            # Start every rank's clock when all have arrived: rank 0's work before this epoch (the
            # start-up timeline's log, a compile) would otherwise count as the other ranks' training
            # time. After an overlapped epoch end there is nothing to wait for: the devices kept running.
            strategy.align(self.device)
        clock.start()
        host_start = time.perf_counter()
        batches = self.bar.wrap(self.data.train.batches(order, epoch), epoch, steps,
                                self.cfg.batch_size * self.data.targets_per_sample)
        every = self.cfg.checkpoint_every_steps if self.cfg.saves else 0
        with contextlib.closing(batches):
            for step, (batch, idx) in enumerate(batches):
                ends.read_if_due(step, started)
                clock.batch_ready()
                done = first + step  # steps of this epoch before this one, on every rank
                self.faults.at(epoch * self.steps_per_epoch + done)
                with self.first_steps(batch):
                    self.step(batch, idx, epoch, self.generator)
                clock.step_end()
                if self.timings.first_step_s is None:
                    self._first_step_done()
                if every and (done + 1) % every == 0 and done + 1 < self.steps_per_epoch and not ends.held:
                    self._save_within_epoch(epoch, done + 1)
        # How long the host took to issue the epoch. Close to the device's span: the host is what limits
        # the speed (Python, launches), and CUDA graphs or a larger batch would help more than kernels.
        row["host_issue_s"] = round(time.perf_counter() - host_start, 4)
        return self._queue_epoch_end(epoch, row, clock, started, steps, self.data.skipped - skipped_before, first)

    def _save_within_epoch(self, epoch: int, done: int) -> None:
        """`checkpoint_every_steps`: the state after `done` steps of `epoch`, with that position, so a
        restart or a resume continues the epoch's order from the next step (on any number of ranks: the
        order is global). Not under sharded strategies (their checkpoints are written at epoch ends)."""
        if self.strategy.sharded:
            if not self.said_sharded_steps and self.is_main:
                log.warning("checkpoint_every_steps: strategy=%s writes its sharded checkpoints at epoch ends only",
                            self.strategy.name)
            self.said_sharded_steps = True
            return
        if not self.is_main:
            return
        if self.stager is None and self.device.type == "cuda":
            self.stager = checkpoint.Stager(self.device)
        snapshot = checkpoint.HostSnapshot(checkpoint.capture(self.strategy, self.nets, self.steppers, self.device,
                                                              scaler=self.step.scaler), self.stager)
        snapshot.add(epoch=epoch, step_in_epoch=done, batch_size=self.cfg.batch_size,
                     generator=self.generator.get_state(), history=list(self.history), config=to_plain(self.cfg))
        self.writer.submit(snapshot, last_checkpoint(self.run_dir))

    def _queue_epoch_end(self, epoch: int, row: dict[str, Any], clock: StepClock, started: float, steps: int,
                         skipped: int, first: int = 0) -> QueuedEpoch:
        """The epoch's end as device work, queued behind its steps without waiting for them: buffers
        averaged, the evaluation, the sums and (rank 0) the checkpoint's tensors copied to host memory."""
        self.asides.wait()  # (TensorBoard's writer; the pinned memory the snapshot below takes)
        self.strategy.average_buffers(self.nets.module)
        evaluation = self.evaluation.queue(self.nets, self.data, self.compiled.compile or self.captures) \
            if self.evaluation.after(epoch) else None
        sums = self.step.sums
        figures = [sums.finite_steps, sums.overflowed, *sums.figures.tensors()]
        if evaluation is not None:
            figures += evaluation.figures.tensors()
        row["lr"] = self.steppers[0].scheduler.get_last_lr()[0]
        snapshot, snapshot_start = None, time.perf_counter()
        if self.is_main and self.cfg.saves and not self.strategy.sharded:
            # copied now (the next steps change the weights in place), completed and written at the conclusion
            if self.stager is None and self.device.type == "cuda":
                self.stager = checkpoint.Stager(self.device)
            snapshot = checkpoint.HostSnapshot(checkpoint.capture(self.strategy, self.nets, self.steppers,
                                                                  self.device, scaler=self.step.scaler), self.stager)
        return QueuedEpoch(epoch, row, clock, started, steps, sums.figures.names, Readback(figures, self.device),
                           evaluation, self._local_memory_mb(), snapshot, skipped, first,
                           time.perf_counter() - snapshot_start if snapshot is not None else 0.0)

    def _conclude(self, queued: QueuedEpoch, next_started: float | None = None) -> None:
        """Read a queued epoch's figures (agreed by every rank), stop on a NaN loss, then record, log and
        checkpoint it, and stop for a preemption or compile after it where asked."""
        cfg, strategy, row, epoch = self.cfg, self.strategy, queued.row, queued.epoch
        local = queued.figures.values(strategy.collective_timeout())
        timing = queued.clock.finish()
        steps = queued.steps
        finite_steps, overflowed, sums = local[0], local[1], local[2:]
        trained = 2 * len(queued.names)
        # Sums and counts add up over the ranks (each figure exact over every rank's samples). The
        # preemption flag rides along, so every rank learns of a SIGUSR2 that reached any of them.
        eval_skipped = float(queued.evaluation.skipped) if queued.evaluation is not None else 0.0
        *sums, stop, skipped, eval_skipped = strategy.reduce_host(
            [*sums, float(self.preemption.requested), float(queued.skipped), eval_skipped])
        train = Figures.means(queued.names, sums[:trained])
        # The slowest rank sets the pace: its span and its input wait. The rank with the most
        # non-finite steps rides along, as it hit the first one earliest.
        span_s, stall, non_finite, alloc_mb, reserved_mb = strategy.reduce_host(
            [timing.span_s, timing.stall_fraction, steps - finite_steps, *queued.memory_mb], op="max")
        row["loss"] = train.pop("loss")
        row.update({f"train_{name}": value for name, value in train.items()})
        row.update({"train_s": span_s, f"{self.data.unit}_per_s":
                    steps * cfg.batch_size * self.data.targets_per_sample / span_s, "input_stall": round(stall, 4)})
        if skipped:
            row["skipped"] = int(skipped)
        if eval_skipped:
            row["eval_skipped"] = int(eval_skipped)
        if self.fp16:  # (every rank skips the same steps: their gradients were averaged first)
            row["overflow_steps"] = int(overflowed)
        if non_finite > 0:
            raise self._non_finite_loss(epoch, row["loss"],
                                        epoch * self.steps_per_epoch + queued.first + steps - int(non_finite))
        if queued.evaluation is not None:
            eval_s = queued.evaluation.clock.finish().span_s
            row.update({f"test_{k}": v for k, v in Figures.means(queued.evaluation.figures.names,
                                                                 sums[trained:]).items()})
            row["eval_s"] = eval_s
            self.timings.eval_s += eval_s
        self.timings.train_s += span_s
        self.step_s = span_s / steps
        if alloc_mb >= 0:
            row["max_mem_allocated_mb"], row["max_mem_reserved_mb"] = round(alloc_mb, 1), round(reserved_mb, 1)
        else:
            row["max_mem_allocated_mb"] = row["max_mem_reserved_mb"] = None
        # Wall time from this epoch's start to the next one's (to now when nothing was started after it).
        row["epoch_s"] = (next_started or time.perf_counter()) - queued.started
        self._report(row)
        if queued.snapshot is not None:
            # What the checkpoint cost training on rank 0 (under ddp every rank waits for it at its next
            # all-reduce): queuing the copies and waiting for earlier writes; and how long a write takes.
            waited = self.writer.make_room()
            row["checkpoint_wait_s"] = round(queued.snapshot_s + waited, 4)
            if self.writer.last_write_s is not None:
                row["checkpoint_write_s"] = round(self.writer.last_write_s, 3)
        self.history.append(row)
        if self.early_stop is not None and epoch + 1 < cfg.epochs:  # (the same on every rank: the rows are)
            self.stopped_early = self.early_stop.judge(self.history)
            if self.stopped_early is not None:
                row["stopped_early"] = self.stopped_early["reason"]
        then = self._best_after(row)  # (checkpoint.keep_best: this epoch is among the best)
        if queued.snapshot is not None:
            queued.snapshot.add(epoch=epoch + 1, history=list(self.history), config=to_plain(cfg))
            self.writer.submit(queued.snapshot, last_checkpoint(self.run_dir), then=then)
        elif self.strategy.sharded and cfg.saves:  # (its epochs end at once: the state is the epoch's)
            checkpoint.save_sharded(strategy, self.nets, self.steppers, self.device, last_checkpoint(self.run_dir),
                                    epoch + 1, {"epoch": epoch + 1, "history": list(self.history),
                                                "config": to_plain(cfg)}, writer=self.writer, then=then)
        if self.is_main:
            self.metrics_log.append(row)
            self.tensorboard.epoch(row)
            self.trackers.epoch(row)
            self.bar.epoch_done(row)
            self._log_epoch(row)
            self.advised = self.advised or self._advise(row, epoch)
        more_to_do = epoch + 1 < cfg.epochs and cfg.saves and self.stopped_early is None
        if stop > 0 and more_to_do and self.preemption.may_requeue(warn=self.is_main):
            self._stop_for_requeue(epoch + 1)
        if self.compiled.pending and epoch + 1 < cfg.epochs and self.stopped_early is None:
            self._compile_if_it_pays(span_s, cfg.epochs - epoch - 1)

    def _report(self, row: dict[str, Any]) -> None:
        """The recipe's derived figures added to the epoch's row, on every rank (each has the same figures,
        so early stopping and the best checkpoints watch a derived one alike everywhere), checked for names
        the launcher keeps (launcher/figures.py); then the settings that name a figure, where this row is
        the first that can have it."""
        before = dict(row)
        self.recipe.report(row, self.device, self.strategy.world_size)
        check_report(before, row, {*(f"train_{n}" for n in self.step.sums.named),
                                   *(f"test_{n}" for n in self.evaluation.named)})
        self.named_figures.check(row)

    def _best_after(self, row: dict[str, Any]) -> Callable[[Path, str | None], None] | None:
        """checkpoint.keep_best on rank 0: where this epoch is among the best so far by checkpoint.metric,
        what the checkpoint writer does once its last.pt is on disk (link it as one of the best)."""
        section = self.cfg.checkpoint
        if not (section.keep_best and self.is_main and self.cfg.saves):
            return None
        if self.best is None:
            typed = section.metric or self.cfg.early_stop.metric
            key = figure_key(typed) if typed else default_figure(row)
            if key is None or (key.startswith("test_") and not any(k.startswith("test_") for k in row)):
                return None  # (not evaluated after this epoch: eval.every)
            check_named(key, typed or key, "checkpoint.metric", row)
            mode = section.mode if section.metric or not self.cfg.early_stop.metric else self.cfg.early_stop.mode
            self.best = BestCheckpoints(last_checkpoint(self.run_dir).parent, section.keep_best, key,
                                        smaller_is_better(key, mode))
        best, epoch, value = self.best, int(row["epoch"]), row.get(self.best.key)
        if not best.ranks(epoch, value):
            return None
        return lambda last, shards: best.keep(epoch, float(value), last, shards)

    def _first_step_done(self) -> None:
        self._sync()
        self.timings.first_step_s = time.time() - self.spec.started_at
        self.timeline.mark("first_step")
        if self.is_main:
            log.info(self.timeline.describe())
        # What the epochs' ends use, set up now rather than at the first ones: the host-side reduction's
        # group (a collective: every rank is here), and pinned memory for the checkpoints in flight (the
        # one being copied and those the writer holds), allocated on a thread (cudaHostAlloc: ~65 ms for
        # ResNet-18's state). Done here on this thread, with TensorBoard's import and writer, that work
        # left recipe=cifar10_fast's first epoch GPU idle 0.1 s, 0.4 s on a fresh machine (BENCHMARKS.md).
        self.strategy.prepare_reduce_host()
        if self.is_main and self.cfg.saves and self.device.type == "cuda" and not self.strategy.sharded:
            state = checkpoint.capture(self.strategy, self.nets, self.steppers, self.device)
            self.asides.start(self.device, checkpoint.warm_pinned_memory, state,
                              copies=checkpoint.BackgroundWriter.QUEUED + 1)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _local_memory_mb(self) -> list[float]:
        """This rank's peak allocated and reserved GPU memory in the epoch (-1 on the CPU), read from the
        allocator's own counts: no wait for the device."""
        devices = self.strategy.memory_devices(self.device)
        if not devices:
            return [-1.0, -1.0]
        return [max(torch.cuda.max_memory_allocated(d) for d in devices) / 2**20,
                max(torch.cuda.max_memory_reserved(d) for d in devices) / 2**20]

    # ---- ending early -------------------------------------------------------------------------------
    def _non_finite_loss(self, epoch: int, loss: float, bad_step: int) -> NonFiniteLoss:
        """Every rank gets here at the same epoch (the step came through an all-reduce) and stops;
        this epoch is not saved, so the last checkpoint is the last good state."""
        self.writer.wait()
        return stops.non_finite_loss(self.cfg, self.run_dir, epoch, loss, bad_step, self.steps_per_epoch)

    def _stop_for_requeue(self, epochs_done: int) -> None:
        """SIGUSR2 reached a rank during this epoch: checkpoint, requeue the job, and leave on every rank."""
        self.writer.wait()  # this epoch's checkpoint is on disk
        if self.is_main:
            log.warning("SIGUSR2 (preemption or time limit): stopping after epoch %d, checkpoint written; the "
                        "job is requeued and resumes from it in this run dir", epochs_done)
            self.preemption.requeue(self.run_dir)
        self.strategy.barrier()  # nobody leaves (and ends the others) before rank 0 has requeued the job
        raise Preempted()

    # ---- reporting ----------------------------------------------------------------------------------
    def _log_epoch(self, row: dict[str, Any]) -> None:
        log.info("%s", results.epoch_line(row, self.cfg.epochs, self.data.unit))

    def _advise(self, row: dict[str, Any], epoch: int) -> bool:
        """Say once per run what held training up (not judged on a first epoch that has more): its input, on
        a GPU; on the CPU, the threads of a run on a busy machine (stall.py)."""
        if epoch == 0 and self.cfg.epochs > 1:
            return False
        if self.device.type == "cpu":
            advice = thread_advice(torch.get_num_threads(), max(1, self.strategy.processes),
                                   available_cores(os.environ), os.getloadavg()[0], "OMP_NUM_THREADS" in self.spec.env)
        elif self.device.type == "cuda":
            advice = input_advice(row["input_stall"], self.data.placement, self.data.megabytes,
                                  self.compiled.compile)
        else:
            return False
        if advice:
            log.warning(advice)
        return advice is not None


def autocast(device_type: str, bf16: bool, fp16: bool) -> torch.autocast:
    """The autocast a step runs under: float16 (perf.precision=fp16), else bf16 where `bf16`, else none."""
    if fp16:
        return torch.autocast(device_type, dtype=torch.float16)
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)
