"""The training loop every recipe shares: what one worker process does, top to bottom.

    train(spec, world, timeline)   the worker's device, its strategy's process group, one Trainer, teardown
    Trainer.run()
      setup     the data where it trains (Data), the model as the strategy wraps it (Nets), the optimizers,
                the step (TrainStep)
      resume    from this run's own checkpoint after a restart or requeue, else from `resume` (restart.py)
      warm up   torch.compile and/or the CUDA-graph capture on the real shapes, then all put back (warmup.py)
      epochs    each epoch's steps; its end queued on the device and read a few steps into the next epoch
                (epoch_end.py), its verdict acted on: go on, stop (a NaN loss, a preemption, early
                stopping) or compile now; checkpoints written off the training thread (saving.py)
      results   results.json from the run's record, then the end's other files (results.py)
    Trainer.evaluate()   `launch eval`: the same setup, a checkpoint's weights, one evaluation (evaluation.py)

Per epoch, this rank's shard of the epoch's order (data.py) streams through the data path, augmentation and
normalization run on the training device, and nothing syncs the host: losses and figures are summed on the
device and read once per epoch, timed on the device's own clock (CUDA events) with the share of the epoch
spent waiting for input (stall.py). The strategy (launcher/strategies) does everything that depends on how
devices share the work; this module never asks which one it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from launcher import heap
from launcher.config import Config, Precision, model_name, to_plain
from launcher.data.placement import Data, rank_order
from launcher.errors import ConfigError
from launcher.figures import NamedFigures
from launcher.files import last_checkpoint
from launcher.models import configured, from_config, lazy_modules, materialize_lazy
from launcher.recipes import Recipe, TokenSplits, recipe_class
from launcher.spec import WorkerSpec
from launcher.strategies import Nets, Strategy, float8, recompute
from launcher.train import checkpoint, compiling, misfit, nodes, optim, progress, restart, results, shard_writer, warmup
from launcher.train.epoch_end import DeferredEnd, EpochEnds, Next, QueuedEpoch, Reporters, Verdict
from launcher.train.evaluation import Evaluation, named_classes
from launcher.train.faults import Faults
from launcher.train.metrics import MetricsLog
from launcher.train.optim import Stepper
from launcher.train.preemption import PreemptionWatch
from launcher.train.reporting import TensorBoardLog, counted
from launcher.train.restart import Start
from launcher.train.results import RankFacts, RunRecord, Timings
from launcher.train.saving import Saves
from launcher.train.stall import StepClock
from launcher.train.step import TrainStep, autocast_for
from launcher.train.stops import OutOfMemory, oom_message
from launcher.train.threads import Asides, profiled
from launcher.train.timeline import StartupTimeline
from launcher.train.trackers import Trackers
from launcher.train.warmup import WarmUp, tries_graph
from launcher.world import WorldInfo

log = logging.getLogger("launcher.train")


def train(spec: WorkerSpec, world: WorldInfo, timeline: StartupTimeline) -> dict[str, Any] | None:
    """Train one worker's part of the run. Returns the results on rank 0, None elsewhere."""
    cfg, strategy = spec.config, spec.strategy
    if strategy.sharded and cfg.saves and not spec.evaluate:  # (first: before any thread or CUDA)
        shard_writer.start_early(world, getattr(strategy.options, "timeout_s", 600))
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
        heap.release()
    except torch.OutOfMemoryError as exc:
        nets = getattr(trainer, "nets", None)
        params = list(nets.module.parameters()) if nets is not None else []
        raise OutOfMemory(oom_message(cfg, strategy, device, params)) from exc
    # On failure nothing is torn down (see DDP.teardown); here every rank finished.
    strategy.teardown()
    return outcome


class Trainer:
    # What run() sets up, in this order; nothing else is added to a Trainer.
    data: Data  # the splits where they train, and how a batch is normalized
    steps_per_epoch: int
    nets: Nets  # the model as the strategy wrapped it (and compiled, when asked)
    compiled: compiling.Decision  # whether this run compiles (perf.compile), and why
    steppers: list[Stepper]  # the optimizers with their schedules
    step: TrainStep  # one training step and the epoch's sums on the device
    saves: Saves  # the checkpoints it writes, off the training thread
    preemption: PreemptionWatch  # SIGUSR2 under SLURM
    bar: progress.EpochBar
    ends: EpochEnds  # what each epoch's end does, and the finished epochs' rows

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
        self.timings = Timings()
        self.faults = Faults(self.cfg.fault, world, device, last_checkpoint(self.run_dir))
        self.fp16 = self.cfg.perf.precision is Precision.fp16  # (its losses scaled: GradScaler)
        self.autocast = autocast_for(self.cfg.perf.precision, device.type)
        self.evaluation = Evaluation(self.cfg, self.recipe, self.strategy, device, self.autocast, self.timings)
        # (perf.cuda_graph=auto: the warm-up captures the step and keeps the graph where it measures faster)
        self.warm_up = WarmUp(self.cfg, self.strategy, device, self.timings, timeline, self.evaluation,
                              tries_graph(self.cfg, self.strategy, self.recipe))
        # The augmentation's generator, on the device: seeded per (seed, epoch, rank) at each epoch.
        self.generator = torch.Generator(device=device)
        # (until a step has run, a network that does not take the batches says so in one line)
        self.first_steps = misfit.FirstSteps(self.cfg, type(self.recipe).__module__.startswith("launcher.recipes."))
        self.asides = Asides()  # set-up work on threads, waited for at the first epoch's end
        # early_stop.metric, checkpoint.metric, sweep.objective: checked at the first row that can have each
        self.named_figures = NamedFigures(self.cfg, type(self.recipe).figures, self.cfg.recipe.name)
        self.trackers = Trackers(self.cfg, self.run_dir, self.is_main)  # log=[mlflow,csv,wandb]
        board = self.cfg.log.tensorboard  # (its writer opened on a thread: `run`)
        self.tensorboard = TensorBoardLog(self.run_dir, self.is_main and self.cfg.tensorboard and board is not None,
                                          board.folder if board else None)

    # ---- the run, top to bottom --------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        """Setup, resume, warm-up, epochs, results: the run; what results.json holds returned on rank 0."""
        t_start = time.perf_counter()
        self.data = self._load_data()
        self.timeline.mark("data_loaded")
        self.nets = self._build_model()
        self.steppers = optim.build(self.cfg.optim, self.cfg.lr, self.cfg.epochs, self.nets.module,
                                    self.steps_per_epoch, fused=self.device.type == "cuda", graphed=self.captures)
        if self.is_main:
            log.info("%s", optim.describe(self.cfg.optim, self.cfg.lr, self.cfg.epochs, self.steps_per_epoch))
        self.step = self._build_step()
        start = restart.resume(self.spec, self.world, self.run_dir, self.dirs.shared, self.strategy, self.device,
                               self.step, self.steps_per_epoch)
        self.faults.check_reach(self.cfg.epochs * self.steps_per_epoch, start.epoch * self.steps_per_epoch + start.step)
        self.timeline.mark("model_built")
        try:
            self.trackers.start(start.history, restarted=start.own)
            with contextlib.ExitStack() as stack:
                writer = stack.enter_context(contextlib.closing(checkpoint.BackgroundWriter(self.world)))
                self.faults.settle = writer.wait
                self.saves = Saves(self.cfg, self.strategy, self.device, self.run_dir, writer, self.step,
                                   named_classes(self.recipe, self.data, self.data.train))
                self.preemption = stack.enter_context(contextlib.closing(PreemptionWatch(self.spec.requeue)))
                # (TensorBoard's writer opened beside the warm-up; the first epoch's end waits for it, and so
                # does the exit, before the checkpoint writer is closed)
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
            record = self._record(RankFacts.gather(self.strategy, self.nets, self.device), start.source,
                                  time.perf_counter() - t_start)
            return results.finish(self.run_dir, record, history, self.recipe, self.nets, self.strategy, self.device,
                                  self.tensorboard, self.trackers, self.named_figures)
        finally:  # (TensorBoard's last events are written after results.json; a failed run's own error is said)
            with contextlib.suppress(Exception):
                self.tensorboard.close()
            self.trackers.close()  # (what they were sent goes first; FAILED where the run did not end well)

    def _record(self, ranks: RankFacts, source: str | None, worker_s: float) -> RunRecord:
        """What results.json says of this run beside its epochs' rows (results.py)."""
        s = self.strategy
        return RunRecord(
            cfg=self.cfg, strategy=s.name, world_size=s.world_size, batch_per_process=s.batch_per_process,
            gradient_sync=s.gradient_sync, sharding=s.layout, device_type=self.device.type, ranks=ranks,
            synthetic_data=self.data.synthetic, data_placement=self.data.placement, compiled=self.compiled.compile,
            compile_decision=self.compiled.why, cuda_graph=self.step.captured is not None,
            cudnn_benchmark=self.device.type == "cuda" and torch.backends.cudnn.benchmark, fp16=self.fp16,
            stopped_early=self.ends.stopped_early, best_checkpoint=self.saves.kept,
            timings=self.timings, started_unix=self.spec.started_at, startup=self.timeline.as_dict(),
            resumed_from=source, restarts=self.world.restart_count, worker_s=worker_s)

    def evaluate(self, source: str) -> dict[str, Any] | None:
        """`launch eval`: the saved weights of `source` on the test split (the recipe's predict, so its
        test-time augmentation too), on every rank's shard; accuracy per class and the confusion matrix."""
        t_start = time.perf_counter()
        self.data = self._load_data()
        self.timeline.mark("data_loaded")
        self.nets = self._build_model()
        state = restart.load_weights(self.spec, source, self.strategy, self.nets, self.device)
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
        """A recipe's own (train, eval) Datasets, each streamed through a DataLoader (launcher/data/loader.py)."""
        from launcher.data.loader import DatasetSplit, check_datasets

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
        empty = misfit.no_outputs(model, self.data.num_classes, getattr(self.data.train, "dataset", None),
                                  self.cfg.recipe.name)
        if empty:
            raise empty
        if self.is_main:  # (as nanoGPT: a size typed wrong is seen before the first epoch)
            log.info("model: %s, %s parameters", model_name(self.cfg), counted(model))
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
        if configured(self.cfg.model) and self.data.unit == "tokens":
            short = misfit.short_vocabulary(model, getattr(self.recipe, "vocab", None) or self.data.num_classes,
                                            self.cfg.model["_target_"])
            if short:
                raise short
        if self.is_main and self._classifies:  # (a config network's, or the recipe's own)
            target = self.cfg.model["_target_"] if configured(self.cfg.model) else None
            surplus = misfit.surplus_outputs(model, self.data.num_classes, target, self.cfg.recipe.name)
            if surplus:
                log.warning("%s", surplus)
        float8.check_device(self.device, self.cfg.perf.precision)
        converted = float8.apply(model, self.cfg.perf.precision)  # (perf.precision=fp8; before checkpointing wraps)
        if self.is_main and converted:
            log.info("%s", converted)
        recomputed = recompute.apply(model, recompute.mode_of(self.cfg))  # (before the strategy wraps it)
        if self.is_main and recomputed:
            log.info("%s", recomputed)
        nets = self.strategy.wrap(model, self.device)
        if self.is_main and self.strategy.layout:
            log.info("%s", self.strategy.layout)
        self.compiled = compiling.decide(self.cfg.perf.compile, self.device.type)
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
        """Every epoch's steps, each epoch's end overlapping the next epoch's first steps (epoch_end.py): the
        host queues the end on the device and starts the next epoch; a few steps into it, the end is read
        (its figures logged, its checkpoint written) while the GPU runs those steps, and its verdict acted on
        before the next step: a NaN loss or a preemption stops the run before anything of the next epoch is
        saved. The last epoch, and the first one of a perf.compile=auto run (whose time decides the compile),
        end at once."""
        cfg = self.cfg
        reporters = Reporters(MetricsLog(self.run_dir), self.tensorboard, self.trackers, self.bar)
        self.ends = EpochEnds(cfg, self.strategy, self.device, self.step, self.data, self.recipe, self.evaluation,
                              self.named_figures, self.saves, reporters, self.preemption, self.asides, self.timings,
                              list(start.history), self.spec.env, self.run_dir, self.steps_per_epoch)
        if self.is_main:
            reporters.metrics_log.rewrite(self.ends.history)
            if start.source:
                log.info("resumed from %s after epoch %d", start.source, start.epoch)
        deferred = DeferredEnd(self.ends.conclude)
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
                queued = self._train_epoch(epoch, deferred, first)
                if isinstance(queued, Verdict):  # the end before, read a few steps into this epoch, stops the run
                    self._act(queued)
                    break
            deciding = self.compiled.pending and epoch + 1 < cfg.epochs
            # (early stopping decides before the next epoch changes the weights: its epochs end at once)
            if epoch + 1 == cfg.epochs or deciding or not self.strategy.overlaps_epoch_ends or self.ends.early_stop:
                verdict = deferred.read_now(queued)
                self._act(verdict)
                if verdict.stops:
                    break
            else:
                deferred.hold(queued)
        return self.ends.history

    def _act(self, verdict: Verdict) -> None:
        """An epoch end's verdict: stop for a NaN loss or a preemption (what the worker exits with says which),
        compile now (perf.compile=auto), or go on (early stopping ends the loop)."""
        if verdict.next in (Next.NAN, Next.PREEMPTED):
            raise self.ends.stopping(verdict)
        if verdict.next is Next.COMPILE:
            self._compile_if_it_pays(verdict.epoch_s, self.cfg.epochs - verdict.epoch - 1)

    def _upcoming(self, epoch: int) -> torch.Tensor | None:
        """This rank's order of `epoch`, None past the last: a data path reading ahead asks for it."""
        return self._order(epoch) if epoch < self.cfg.epochs else None

    def _order(self, epoch: int) -> torch.Tensor:
        return rank_order(len(self.data.train), self.cfg.batch_size, self.cfg.seed, epoch, self.strategy.world_size,
                          self.strategy.rank, drawn=self.data.drawn_per_epoch)

    def _train_epoch(self, epoch: int, deferred: DeferredEnd, first: int = 0) -> QueuedEpoch | Verdict:
        """Queue one epoch's steps from step `first` (a resume in the middle of the epoch), reading the end of
        the epoch before (`deferred`, where it is held) a few steps in, and queue this epoch's end; or stop where
        that end's verdict stops the run (returned: nothing of this epoch is saved)."""
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
        deferred.place(steps, self.ends.step_s, self.device.type == "cuda")  # (where the epoch before is read)
        if (verdict := deferred.read_if_due(0, started)) is not None and verdict.stops:
            return verdict
        # A bounded wait at the epoch's end when collectives run inside a graph (no NCCL watchdog there).
        clock = StepClock(self.device, strategy.collective_timeout(), self.data.pace)
        if not deferred.held:
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
                if (verdict := deferred.read_if_due(step, started)) is not None and verdict.stops:
                    return verdict
                clock.batch_ready()
                done = first + step  # steps of this epoch before this one, on every rank
                self.faults.at(epoch * self.steps_per_epoch + done)
                with self.first_steps(batch):
                    self.step(batch, idx, epoch, self.generator)
                clock.step_end()
                if self.timings.first_step_s is None:
                    self._first_step_done()
                if every and (done + 1) % every == 0 and done + 1 < self.steps_per_epoch and not deferred.held:
                    self.saves.within_epoch(epoch, done + 1, self.generator, self.ends.history)
        # How long the host took to issue the epoch. Close to the device's span: the host is what limits
        # the speed (Python, launches), and CUDA graphs or a larger batch would help more than kernels.
        row["host_issue_s"] = round(time.perf_counter() - host_start, 4)
        return self.ends.queue(epoch, row, clock, started, steps, self.data.skipped - skipped_before, first,
                               self.compiled, self.compiled.compile or self.captures)

    def _first_step_done(self) -> None:
        """The first step's time, from the command's start; and what the epochs' ends use, set up now rather
        than at the first one, whose GPU would idle meanwhile (BENCHMARKS.md): the host-side reduction's group
        (a collective: every rank is here), and page-locked memory for the checkpoints, on a thread."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timings.first_step_s = time.time() - self.spec.started_at
        self.timeline.mark("first_step")
        if self.is_main:
            log.info(self.timeline.describe())
        self.strategy.prepare_reduce_host()
        self.saves.warm_pinned_memory(self.asides)

