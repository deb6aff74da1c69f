"""The training loop every recipe shares: one `TrainingRun` per worker process.

Per epoch: this rank's shard of the epoch's order (launcher/batches.py) streams through the data path
(`data.placement`), augmentation and normalization run on the training device, and nothing syncs the
host inside an epoch: losses and accuracies are summed on the device and read once per epoch. Training
and evaluation are timed on the device's own clock (CUDA events), along with the share of each epoch
the compute stream spent waiting for input (launcher/stall.py).

With `recipe.compile=true` the model is compiled and warmed up (a few steps on the real shapes, then
the weights, BatchNorm statistics and optimizer state are put back) before any clock starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from launcher import checkpoint, optim, preemption, progress, reporting
from launcher.batches import choose_placement, eval_chunks, make_data, rank_order
from launcher.config import ConfigError
from launcher.distenv import WorldInfo
from launcher.metrics import MetricsLog, write_results
from launcher.recipes import Splits, get_recipe
from launcher.stall import SpanTimer, StepClock, input_advice
from launcher.step_graph import CapturedStep, FlatGradients
from launcher.strategy import wrap_model
from launcher.timeline import StartupTimeline

log = logging.getLogger("launcher.train")

WARMUP_STEPS = 3


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite: every rank stops at the end of that epoch."""


PREPARE_MODEL_SAMPLE = 5000  # training images a recipe's prepare_model sees (airbench94 whitens from them)


class TrainingRun:
    def __init__(self, cfg: DictConfig, spec, world: WorldInfo, device: torch.device, timeline: StartupTimeline):
        self.cfg, self.spec, self.world, self.device = cfg, spec, world, device
        self.timeline = timeline
        self.layout = spec.layout
        self.run_dir = Path(spec.run_dir)
        self.ddp = self.layout.strategy == "ddp"
        self.rank = world.rank if self.ddp else 0  # single and dp are one process: rank 0 of 1
        self.world_size = self.layout.world_size
        self.is_main = self.rank == 0
        self.recipe = get_recipe(cfg.recipe.name)
        self.first_step_s: float | None = None

    # ---- set-up -------------------------------------------------------------------------------
    def _load_data(self) -> Splits:
        cfg = self.cfg
        splits = self.recipe.load(cfg)
        n = len(splits.train_y)
        if cfg.batch_size > n:
            raise ConfigError("batch_size", cfg.batch_size,
                              f"larger than the {n} training images of {cfg.recipe.name}", f"batch_size={n // 4}")
        if splits.synthetic and self.is_main:
            log.warning("SYNTHETIC data (data.synthetic=true): for timing only, accuracy says nothing about "
                        "the real dataset")
        nbytes = sum(t.numel() * t.element_size() for t in (splits.train_x, splits.train_y, splits.test_x,
                                                           splits.test_y))
        self.data_mb = nbytes / 2**20
        self.placement, why = choose_placement(cfg.data.placement, self.device, nbytes)
        if self.is_main and self.device.type == "cuda":
            where = "on the GPU" if self.placement == "gpu" else "in pinned host memory, prefetched on a side stream"
            log.info("data: %s, %.0f MB, %s (%s)", cfg.recipe.name, self.data_mb, where, why)
        depth = cfg.data.prefetch_depth
        self.train_data = make_data(splits.train_x, splits.train_y, self.device, self.placement, depth)
        self.test_data = make_data(splits.test_x, splits.test_y, self.device, self.placement, depth)
        self.mean = torch.tensor(splits.mean, device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(splits.std, device=self.device).view(1, -1, 1, 1)
        return splits

    def _build(self, splits: Splits) -> None:
        cfg, r = self.cfg, self.cfg.recipe
        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts them)
        model = self.recipe.build_model(cfg, splits.num_classes).to(self.device)
        self.timeline.mark("model_on_device")
        self.channels_last = self.device.type == "cuda" and r.channels_last and splits.train_x.dim() == 4
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        prepare_model = getattr(self.recipe, "prepare_model", None)
        if prepare_model is not None:
            sample = splits.train_x[:PREPARE_MODEL_SAMPLE].to(self.device)
            prepare_model(cfg, model, self._normalize(sample))
        self.model = model
        self.steps_per_epoch = len(splits.train_y) // cfg.batch_size
        self.steppers = optim.build(cfg, model, self.steps_per_epoch, fused=self.device.type == "cuda")
        self.compiled = bool(r.compile)
        self.graph_step = bool(r.cuda_graph)
        if self.layout.strategy == "dp" and (self.compiled or self.graph_step):
            self.compiled = self.graph_step = False
            if self.is_main:
                log.warning("recipe.compile / recipe.cuda_graph are off under strategy=dp (DataParallel "
                            "re-replicates the model every step); ddp uses them")
        # With a graphed step the gradients are ours (a flat buffer, one all-reduce per step): DDP's
        # reducer does its work in autograd hooks on the host, which a replayed graph would skip.
        # On a CPU device the same step runs eagerly (no graphs there), gradient averaging included.
        self.own_grad_sync = self.graph_step and self.ddp
        if self.own_grad_sync:
            self._broadcast_from_rank0()
        self.grads = FlatGradients(model.parameters(), self.world_size if self.own_grad_sync else 1,
                                   cfg.strategy.bucket_cap_mb) if self.graph_step else None
        net = model if self.own_grad_sync else wrap_model(model, self.layout, self.device, cfg.strategy)
        if self.compiled:
            # Under ddp, compiling the DDP module lets dynamo split the graph at gradient buckets so
            # the all-reduce still overlaps the backward pass; evaluation compiles the bare model.
            self.train_net = torch.compile(net, mode=_mode(r.compile_mode))
            self.eval_net = torch.compile(model, mode=_mode(r.compile_mode)) if net is not model else self.train_net
        else:
            self.train_net = net
            self.eval_net = net if self.layout.strategy == "dp" else model
        self.captures = self.graph_step and self.device.type == "cuda"  # (CPU: the same step, eagerly)
        self.captured: CapturedStep | None = None  # made in _warm_up when self.captures
        self.epoch_t = torch.zeros((), dtype=torch.long, device=self.device)  # the epoch, as graphs read it
        self.loss_sum = torch.zeros((), device=self.device)  # this epoch's sums, accumulated on the device
        self.correct = torch.zeros((), device=self.device, dtype=torch.long)
        # Steps of this epoch whose loss was finite, counted on the device (no host sync), read once
        # per epoch. A non-finite loss poisons the weights, so every later step is non-finite too:
        # the count is the index of the first bad step within the epoch.
        self.finite_steps = torch.zeros((), dtype=torch.long, device=self.device)
        # fault.kind=nan: added to the loss; NaN from the injected step on (a tensor, so graphs see it too)
        self.poison = torch.zeros((), device=self.device) if cfg.fault.kind == "nan" else None
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=r.label_smoothing)
        self.fault_step = cfg.fault.step if cfg.fault.rank is not None else -1
        use_bf16 = r.precision == "bf16" or (r.precision == "auto" and self.device.type == "cuda")
        self.autocast = lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)
        augmentation = getattr(self.recipe, "augmentation", None)
        self.augment = augmentation(cfg) if augmentation is not None and r.augment else None
        predict = getattr(self.recipe, "predict", None)
        self.predict = (lambda net, x: predict(cfg, net, x)) if predict is not None else (lambda net, x: net(x))

    def _resume(self) -> tuple[int, list[dict[str, Any]], str | None]:
        """Where to start: after a restart, this run's own last checkpoint; else `resume`, if given."""
        own = checkpoint.checkpoint_dir(self.run_dir) / checkpoint.LAST
        source = None
        restarted = self.world.restart_count > 0 or preemption.requeued()
        if restarted and own.exists():
            source = str(own)
        elif self.spec.resume_from:
            source = self.spec.resume_from
        if source is None:
            return 0, [], None
        state = checkpoint.load(source, map_location=self.device)
        saved = state.get("config", {}).get("recipe", {})
        for key in ("name", "model", "optimizer"):
            if saved.get(key) not in (None, self.cfg.recipe[key]):
                raise ConfigError(f"recipe.{key}", self.cfg.recipe[key],
                                  f"the checkpoint {source} was trained with recipe.{key}={saved[key]}",
                                  f"recipe.{key}={saved[key]} resume={self.spec.resume_from or source}")
        self.model.load_state_dict(state["net_state_dict"])
        optimizers, schedulers = checkpoint.optimizer_states(state)
        for stepper, opt_state, sched_state in zip(self.steppers, optimizers, schedulers, strict=True):
            stepper.optimizer.load_state_dict(opt_state)
            stepper.scheduler.load_state_dict(sched_state)
        rng = state.get("rng", {})
        if "cpu" in rng:  # dropout and other global randomness continue where they stopped
            torch.set_rng_state(rng["cpu"].cpu())
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"].cpu(), self.device)
        return int(state["epoch"]), list(state.get("history", [])), source

    def _broadcast_from_rank0(self) -> None:
        """Start every rank from rank 0's weights and buffers (what DDP does when it wraps a model)."""
        for tensor in self.model.state_dict().values():
            dist.broadcast(tensor, src=0)

    # ---- one step -----------------------------------------------------------------------------
    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() - self.mean) / self.std
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, epoch: int | torch.Tensor,
                          aug_gen: torch.Generator) -> None:
        """The step's device work up to the gradients, and the epoch's loss/accuracy sums. No host sync:
        this is what a graphed step captures."""
        if self.grads is not None:
            self.grads.zero()
            self.grads.start_backward()
        else:
            self.model.zero_grad(set_to_none=True)
        if self.augment is not None:
            x = self.augment(x, aug_gen, indices=idx, epoch=epoch)
        with self.autocast():
            logits = self.train_net(self._normalize(x))
            loss = self.loss_fn(logits, y)
        if self.poison is not None:
            loss = loss + self.poison
        loss.backward()
        if self.grads is not None:
            self.grads.finish_backward()  # ddp: every bucket's all-reduce issued and waited for
        self.loss_sum += loss.detach().float() * len(y)
        self.correct += (logits.argmax(1) == y).sum()
        self.finite_steps += torch.isfinite(loss.detach())

    def _step(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, epoch: int,
              aug_gen: torch.Generator) -> None:
        if self.captured is not None:
            self.captured.run(x, y, idx)
        else:
            self._forward_backward(x, y, idx, self.epoch_t if self.graph_step else epoch, aug_gen)
        for stepper in self.steppers:
            stepper.step()

    def _maybe_fail(self, global_step: int) -> None:
        # Called every step, so it compares plain ints first (OmegaConf attribute access is slow).
        if global_step != self.fault_step:
            return
        fault = self.cfg.fault
        if fault.rank != self.world.rank or fault.attempt not in (-1, self.world.restart_count):
            return
        log.warning("injecting fault.kind=%s at step %d", fault.kind, global_step)
        if fault.kind == "raise":
            raise RuntimeError(f"injected failure (fault.kind=raise) on rank {self.world.rank} at step {global_step}")
        if fault.kind == "exit":
            os._exit(3)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "oom":  # what the allocator raises, to test the report on any device
            raise torch.OutOfMemoryError(f"injected (fault.kind=oom) on rank {self.world.rank} at step {global_step}")
        if fault.kind == "nan":
            self.poison.fill_(float("nan"))
            return
        if fault.kind == "hang":
            while True:
                time.sleep(60)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _order(self, epoch: int) -> torch.Tensor:
        return rank_order(len(self.train_data), self.cfg.batch_size, self.cfg.seed, epoch, self.world_size, self.rank)

    # ---- epochs -------------------------------------------------------------------------------
    def _train_epoch(self, epoch: int, aug_gen: torch.Generator) -> dict[str, float]:
        self.train_net.train()
        order = self._order(epoch)
        self.loss_sum.zero_()
        self.correct.zero_()
        self.epoch_t.fill_(epoch)
        self.finite_steps.zero_()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # A bounded wait at the epoch's end when collectives run inside a graph (no NCCL watchdog there).
        clock = StepClock(self.device, self.cfg.strategy.timeout_s if self.own_grad_sync else None)
        if self.ddp:
            # Start every rank's clock when all have arrived: rank 0's end-of-epoch work (checkpoint
            # snapshot, logs, TensorBoard) would otherwise count as the other ranks' training time,
            # while a 1-GPU run never counts it. It shows in the wall time between epochs' `started_unix`.
            self._all_reduce(torch.zeros((), device=self.device))
        clock.start()
        host_start = time.perf_counter()
        batches = self.bar.wrap(self.train_data.batches(order), epoch, self.steps_per_epoch, self.cfg.batch_size)
        for step, (x, y, idx) in enumerate(batches):
            clock.batch_ready()
            self._maybe_fail(epoch * self.steps_per_epoch + step)
            self._step(x, y, idx, epoch, aug_gen)
            clock.step_end()
            if self.first_step_s is None:
                self._sync()
                self.first_step_s = time.time() - self.spec.started_at
                self.timeline.mark("first_step")
                if self.is_main:
                    log.info(self.timeline.describe())
        # How long the host took to issue the epoch. Close to the device's span: the host is what limits
        # the speed (Python, launches), and CUDA graphs or a larger batch would help more than kernels.
        host_s = time.perf_counter() - host_start
        timing = clock.finish()
        # The preemption flag rides along, so every rank learns of a SIGUSR2 that reached any of them.
        loss_sum, correct, count, stop = self._all_reduce(torch.stack([
            self.loss_sum, self.correct.float(), torch.tensor(float(order.numel()), device=self.device),
            torch.tensor(float(self.preemption.requested), device=self.device),  # a SIGUSR2 any rank got
        ])).tolist()
        self.stop_requested = stop > 0
        # The slowest rank sets the pace: report its span and its input wait. The rank with the most
        # non-finite steps rides along, as it hit the first one earliest.
        steps = self.steps_per_epoch
        span_s, stall, non_finite = self._all_reduce(torch.stack([
            torch.tensor(timing.span_s, dtype=torch.float64, device=self.device),
            torch.tensor(timing.stall_fraction, dtype=torch.float64, device=self.device),
            steps - self.finite_steps.double(),
        ]), op=dist.ReduceOp.MAX if self.ddp else None).tolist()
        self.bad_step = epoch * steps + steps - int(non_finite) if non_finite > 0 else None
        return {"loss": loss_sum / count, "train_acc": correct / count,
                "train_s": span_s, "img_per_s": steps * self.cfg.batch_size / span_s,
                "input_stall": round(stall, 4), "host_issue_s": round(host_s, 4)}

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        # Under ddp every rank holds the same weights (buffers are averaged first), so each scores a
        # disjoint shard and the counts are summed. DataParallel scores the whole set across its GPUs.
        self.eval_net.eval()
        chunks = eval_chunks(len(self.test_data), max(1, self.cfg.recipe.eval_batch_size // self.world_size),
                             self.world_size, self.rank)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)
        with SpanTimer(self.device) as timer:
            for x, y, _ in self.test_data.batches(chunks):
                with self.autocast():
                    logits = self.predict(self.eval_net, self._normalize(x))
                loss_sum += torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum")
                correct += (logits.argmax(1) == y).sum()
        count = float(sum(len(c) for c in chunks))
        loss_total, correct_total, count = self._all_reduce(
            torch.stack([loss_sum, correct, torch.tensor(count, device=self.device)])).tolist()
        return {"test_loss": loss_total / count, "test_acc": correct_total / count, "eval_s": timer.seconds}

    def _warm_up(self, aug_gen: torch.Generator) -> float:
        """Compile, autotune and (recipe.cuda_graph) capture the step on the real shapes, then put the
        model and optimizers back as they were."""
        start = time.perf_counter()
        saved_model = {k: v.clone() for k, v in self.model.state_dict().items()}
        saved_opt = [(s.optimizer.state_dict(), s.scheduler.state_dict()) for s in self.steppers]
        rng = torch.get_rng_state(), (torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        self.train_net.train()
        aug_gen.manual_seed(0)
        rows = self._order(0)[:WARMUP_STEPS]
        # Graph capture wants the eager warm-up on a side stream (lazily made state then belongs to it).
        side = torch.cuda.Stream(self.device) if self.captures else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            batch = None
            for batch in self.train_data.batches(rows):
                self._step(*batch, 0, aug_gen)
            if self.captures:
                x, y, idx = batch
                step = CapturedStep(lambda x, y, idx: self._forward_backward(x, y, idx, self.epoch_t, aug_gen),
                                    generators=[aug_gen])
                step.capture(x, y, idx, stream=side)
                self.captured = step
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)
        self._evaluate()
        self.model.load_state_dict(saved_model)
        for stepper, (opt_state, sched_state) in zip(self.steppers, saved_opt, strict=True):
            stepper.optimizer.load_state_dict(opt_state)  # from before any step: empty momentum buffers
            stepper.scheduler.load_state_dict(sched_state)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], self.device)
        if self.grads is not None:
            self.grads.zero()
        else:
            self.model.zero_grad(set_to_none=True)
        self._sync()
        return time.perf_counter() - start

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.ddp:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def _average_buffers(self) -> None:
        """BatchNorm running stats drift apart across ranks (each sees its own batches): average them,
        in one all-reduce per dtype rather than one per buffer (ResNet-18 has 40)."""
        if not self.ddp:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buf in self.model.buffers():
            if buf.is_floating_point():
                by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            # copy_ in place: a captured step holds these buffers by address
            for buf, averaged in zip(bufs, flat.split([b.numel() for b in bufs]), strict=True):
                buf.copy_(averaged.view(buf.shape))

    def _memory_mb(self) -> tuple[float | None, float | None]:
        if self.device.type != "cuda":
            return None, None
        devices = range(self.layout.num_devices) if self.layout.strategy == "dp" else [self.device.index]
        alloc = max(torch.cuda.max_memory_allocated(d) for d in devices) / 2**20
        reserved = max(torch.cuda.max_memory_reserved(d) for d in devices) / 2**20
        both = self._all_reduce(torch.tensor([alloc, reserved], device=self.device),
                                op=dist.ReduceOp.MAX if self.ddp else None).tolist()
        return round(both[0], 1), round(both[1], 1)

    def _save(self, epoch: int, history: list[dict[str, Any]]) -> None:
        if not (self.is_main and self.cfg.checkpoint):
            return
        state = {
            "net_state_dict": self.model.state_dict(),
            "optimizer_state_dicts": [s.optimizer.state_dict() for s in self.steppers],
            "scheduler_state_dicts": [s.scheduler.state_dict() for s in self.steppers],
            "epoch": epoch,
            "history": list(history),
            "rng": {"cpu": torch.get_rng_state(),
                    **({"cuda": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {})},
            "config": self.spec.config,
        }
        # Snapshot now (training changes the weights in place), write on the writer's thread.
        self.writer.submit(checkpoint.HostSnapshot(state), checkpoint.checkpoint_dir(self.run_dir) / checkpoint.LAST)

    def _evaluates_after(self, epoch: int) -> bool:
        every = self.cfg.recipe.eval_every
        return epoch + 1 == self.cfg.epochs or (every > 0 and (epoch + 1) % every == 0)

    def fit(self) -> dict[str, Any] | None:
        t_start = time.perf_counter()
        splits = self._load_data()
        self.timeline.mark("data_loaded")
        self._build(splits)
        start_epoch, history, resumed_from = self._resume()
        self.timeline.mark("model_built")
        self.writer = checkpoint.BackgroundWriter()
        self.preemption = preemption.PreemptionWatch(preemption.enabled())
        self.tensorboard = reporting.TensorBoardLog(self.run_dir, self.is_main and self.cfg.tensorboard)
        self.bar = progress.EpochBar(progress.wanted(self.cfg.progress, self.is_main), self.device, self.cfg.epochs)
        try:
            return self._fit(splits, start_epoch, history, resumed_from, t_start)
        finally:
            self.tensorboard.close()
            self.preemption.close()
            self.writer.close()  # the last checkpoint is on disk before the run reports itself done

    def _fit(self, splits: Splits, start_epoch: int, history: list[dict[str, Any]], resumed_from: str | None,
             t_start: float) -> dict[str, Any] | None:
        cfg = self.cfg
        aug_gen = torch.Generator(device=self.device)
        warmup_s = self._warm_up(aug_gen) if self.compiled or self.captures else None
        if warmup_s is not None:
            self.timeline.mark("warmed_up")
            if self.is_main:
                done = ["compiled"] * self.compiled + ["captured the step as one CUDA graph"] * self.captures
                log.info("%s in %.1fs (not counted in the timings)", " and ".join(done), warmup_s)
        metrics_log = MetricsLog(self.run_dir)
        if self.is_main:
            metrics_log.rewrite(history)
            if resumed_from:
                log.info("resumed from %s after epoch %d", resumed_from, start_epoch)
        timed = {"train_s": 0.0, "eval_s": 0.0}
        advised = False
        for epoch in range(start_epoch, cfg.epochs):
            epoch_start = time.perf_counter()
            row: dict[str, Any] = {"epoch": epoch + 1, "started_unix": round(time.time(), 3)}
            # Seeded per (seed, epoch, rank), so a resumed run augments exactly as an uninterrupted one.
            aug_gen.manual_seed((cfg.seed * 100_003 + epoch) * 1_009 + self.rank)
            if cfg.profile and epoch == min(start_epoch + 1, cfg.epochs - 1) and self.is_main:
                with profiled(self.run_dir):
                    row.update(self._train_epoch(epoch, aug_gen))
            else:
                row.update(self._train_epoch(epoch, aug_gen))
            if self.bad_step is not None:
                self._stop_for_non_finite_loss(epoch, row["loss"])
            self._average_buffers()
            if self._evaluates_after(epoch):
                row.update(self._evaluate())
                timed["eval_s"] += row["eval_s"]
            timed["train_s"] += row["train_s"]
            row["lr"] = self.steppers[0].scheduler.get_last_lr()[0]
            row["max_mem_allocated_mb"], row["max_mem_reserved_mb"] = self._memory_mb()
            row["epoch_s"] = time.perf_counter() - epoch_start
            history.append(row)
            self._save(epoch + 1, history)
            if self.is_main:
                metrics_log.append(row)
                self.tensorboard.epoch(row)
                self.bar.epoch_done(row)
                self._log_epoch(row)
                advised = advised or self._advise(row, epoch)
            more_to_do = epoch + 1 < cfg.epochs and cfg.checkpoint
            if self.stop_requested and more_to_do and preemption.may_requeue(warn=self.is_main):
                self._stop_for_requeue(epoch + 1)
        digests, devices = self._gather_rank_facts()
        if not self.is_main:
            return None
        reporting.plot_curves(history, self.run_dir / reporting.CURVES)
        timed["train_eval_s"] = timed["train_s"] + timed["eval_s"]
        timed["clock"] = "cuda events" if self.device.type == "cuda" else "host clock"
        timed["compile_warmup_s"] = warmup_s
        return self._results(history, digests, devices, resumed_from, timed, time.perf_counter() - t_start,
                             splits)

    def _stop_for_non_finite_loss(self, epoch: int, loss: float) -> None:
        """Every rank gets here at the same epoch (the step came through an all-reduce) and stops;
        this epoch is not saved, so the last checkpoint is the last good state."""
        self.writer.wait()
        steps = self.steps_per_epoch
        last = checkpoint.checkpoint_dir(self.run_dir) / checkpoint.LAST
        if epoch > 0 and last.exists() and self.cfg.checkpoint:
            good = (f"the last good checkpoint is {last} (after epoch {epoch}); resume from it with "
                    f"resume={self.run_dir} and a lower lr (now {self.cfg.lr})")
        else:
            good = f"no checkpoint precedes it; try a lower lr (now {self.cfg.lr})"
        raise NonFiniteLoss(f"the training loss became {loss} at step {self.bad_step} (epoch {epoch + 1}, step "
                            f"{self.bad_step - epoch * steps + 1} of {steps}); training stopped on every rank and "
                            f"epoch {epoch + 1} was not saved; {good}")

    def _stop_for_requeue(self, epochs_done: int) -> None:
        """SIGUSR2 reached a rank during this epoch: checkpoint, requeue the job, and leave on every rank."""
        self.writer.wait()  # this epoch's checkpoint is on disk
        if self.is_main:
            log.warning("SIGUSR2 (preemption or time limit): stopping after epoch %d, checkpoint written; the "
                        "job is requeued and resumes from it in this run dir", epochs_done)
            preemption.requeue(self.run_dir)
        if self.ddp:
            dist.barrier()  # nobody leaves (and ends the others) before rank 0 has requeued the job
        raise preemption.Preempted()

    def _log_epoch(self, row: dict[str, Any]) -> None:
        cfg = self.cfg
        test = f"{100 * row['test_acc']:.2f}%" if "test_acc" in row else "-"
        log.info("epoch %*d/%d  loss %.4f  train %.2f%%  test %s  %s img/s  input wait %.1f%%  %.2fs",
                 len(str(cfg.epochs)), row["epoch"], cfg.epochs, row["loss"], 100 * row["train_acc"], test,
                 f"{row['img_per_s']:,.0f}", 100 * row["input_stall"], row["epoch_s"])

    def _advise(self, row: dict[str, Any], epoch: int) -> bool:
        """Say once per run when training was input-bound (not judged on a first epoch that has more)."""
        if self.device.type != "cuda" or (epoch == 0 and self.cfg.epochs > 1):
            return False
        advice = input_advice(row["input_stall"], self.placement, self.data_mb, self.compiled)
        if advice:
            log.warning(advice)
        return advice is not None

    def _gather_rank_facts(self) -> tuple[list[str], list[str]]:
        """Every rank's weights digest and device name, in rank order (one entry for single and dp)."""
        mine = (weights_digest(self.model), self._device_names())
        if not self.ddp:
            return [mine[0]], mine[1]
        everyone: list[tuple[str, list[str]]] = [("", [])] * self.world_size
        dist.all_gather_object(everyone, mine)
        digests = [d for d, _ in everyone]
        if len(set(digests)) > 1 and self.is_main:
            log.warning("ranks ended with DIFFERENT weights (digests %s): the replicas diverged", digests)
        return digests, [name for _, names in everyone for name in names]

    def _device_names(self) -> list[str]:
        if self.device.type != "cuda":
            return []
        indices = range(self.layout.num_devices) if self.layout.strategy == "dp" else [self.device.index]
        return [torch.cuda.get_device_name(i) for i in indices]

    def _results(self, history, digests, devices, resumed_from, timed, total_s, splits) -> dict[str, Any]:
        cfg = self.cfg
        final = history[-1] if history else {}
        scored = [r["test_acc"] for r in history if "test_acc" in r]
        stalls = [r["input_stall"] for r in history]
        results = {
            "recipe": cfg.recipe.name,
            "model": cfg.recipe.model,
            "strategy": self.layout.strategy,
            "world_size": self.world_size,
            "device_type": self.device.type,
            "devices": devices,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "epochs": cfg.epochs,
            "batch_size": cfg.batch_size,
            "batch_per_process": self.layout.batch_per_process,
            "synthetic_data": splits.synthetic,
            "data_placement": self.placement,
            "compiled": self.compiled,
            "cuda_graph": self.captured is not None,
            "gradient_sync": ("flat all-reduce" if self.own_grad_sync else "DDP") if self.ddp else None,
            "final": final,
            "test_acc": final.get("test_acc"),
            "best_test_acc": max(scored, default=None),
            "train_s": timed["train_s"],
            "timed": timed,
            "input_stall": round(sum(stalls) / len(stalls), 4) if stalls else None,
            "worker_s": total_s,
            "first_step_s": self.first_step_s,
            "started_unix": self.spec.started_at,  # when `launch` began: first_step_s counts from it
            "startup": self.timeline.as_dict(),
            "resumed_from": resumed_from,
            "restarts": self.world.restart_count,
            "weights_sha256": digests,
            "ranks_agree": len(set(digests)) == 1,
            "torch": torch.__version__,
        }
        write_results(self.run_dir, results)
        return results


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer, to show that all ranks ended with the same model."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float64 if tensor.is_floating_point() else torch.int64)
                 .contiguous().numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def profiled(run_dir: Path):
    """torch.profiler over one epoch: profile.txt (ops by device time) and trace.json (chrome://tracing)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (run_dir / "profile.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
    prof.export_chrome_trace(str(run_dir / "trace.json"))
    log.info("profile of this epoch: %s (and trace.json for chrome://tracing or Perfetto)", run_dir / "profile.txt")


def _mode(name: str) -> str | None:
    return None if name == "default" else name
