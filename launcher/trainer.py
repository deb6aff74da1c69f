"""The training loop every recipe shares, run inside each worker process.

Batch semantics, the same for every strategy: `batch_size` is GLOBAL, the number of samples in one
optimizer step summed over all devices. Each epoch draws one permutation from (seed, epoch), the same
on every rank; step s takes rows s*B .. (s+1)*B of it, and under ddp rank r takes its contiguous
B/world slice of those rows. So one step sees the same images whether it runs on 1 GPU, on 2 with
DDP, or on 2 with DataParallel, and a run is reproducible from its seed.

The dataset sits on the training device as uint8 (GPU-resident when on GPU), augmentation and
normalization run there, and nothing syncs the host inside an epoch: losses and accuracies are summed
on the device and read once per epoch.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from launcher import checkpoint
from launcher.config import ConfigError
from launcher.distenv import WorldInfo
from launcher.metrics import MetricsLog, write_results
from launcher.recipes import Splits, get_recipe
from launcher.strategy import Layout, wrap_model

log = logging.getLogger("launcher.train")


@dataclass
class WorkerSpec:
    """Everything a worker needs, as plain picklable data (workers never compose Hydra configs)."""

    config: dict[str, Any]  # the resolved config
    run_dir: str
    layout: Layout
    env: dict[str, str]  # applied in the worker before CUDA starts
    resume_from: str | None = None
    started_at: float = 0.0  # the launcher's time.time() when it started, for time-to-first-step


def pick_device(layout: Layout, world: WorldInfo) -> torch.device:
    if layout.device_type == "cpu":
        return torch.device("cpu")
    # A joined world may give each process a one-GPU mask (srun --gpus-per-task): then it is device 0.
    default = world.local_rank if layout.strategy == "ddp" else 0
    index = int(os.environ.get("LAUNCH_DEVICE_INDEX", default))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def train(spec: WorkerSpec, world: WorldInfo) -> dict[str, Any] | None:
    """Train one worker's part of the run. Returns the results on rank 0, None elsewhere."""
    cfg = OmegaConf.create(spec.config)
    layout = spec.layout
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # torch may have been imported before the worker env was applied (a joined world): apply it now.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = pick_device(layout, world)
    if device.type == "cuda":
        # DataParallel runs each replica in a new thread every step, and cuDNN's autotuning results do not
        # carry over between those threads, so with benchmark on it re-tunes every step: on 2x H200 the
        # fast net ran at 2.5k img/s under dp with it on, 63.7k with it off (BENCHMARKS.md).
        torch.backends.cudnn.benchmark = layout.strategy != "dp"
        torch.set_float32_matmul_precision("high")
    distributed = layout.strategy == "ddp"
    if distributed:
        init_process_group(layout.dist_backend, world, timedelta(seconds=cfg.strategy.timeout_s), device)
    run = _Run(cfg, spec, world, device)
    # On failure the process group is left alone: destroying an NCCL communicator while peers are
    # still inside a collective blocks forever (seen on 2x H200). The worker exits at once instead.
    results = run.fit()
    if distributed:
        # DDP's reducer holds the process group and sits in reference cycles; free it while the
        # interpreter is whole, or gloo's threads may be torn down at exit ("terminate called").
        del run
        gc.collect()
        dist.destroy_process_group()
    return results


def init_process_group(backend: str, world: WorldInfo, timeout: timedelta, device: torch.device) -> None:
    """init_process_group on a store namespaced by restart attempt.

    Under torchelastic the workers share the agent's TCPStore, which outlives a restart; without a
    per-attempt prefix, restarted ranks can read the dead ranks' addresses and fail to connect
    (pytorch/pytorch#167288). Outside elastic (srun), rank 0 hosts the store itself.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(world.master_addr, world.master_port, world.world_size,
                          is_master=not agent_hosts_store and world.rank == 0, timeout=timeout)
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(f"launcher/attempt{world.restart_count}", store),
        rank=world.rank, world_size=world.world_size, timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def triangular_schedule(total_steps: int, warmup_steps: int):
    """LR multiplier: linear warm-up from ~0 to 1 over warmup_steps, then linear decay to 0 at the end."""
    warmup_steps = min(max(warmup_steps, 0), total_steps - 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer, to show that all ranks ended with the same model."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float64 if tensor.is_floating_point() else torch.int64)
                 .contiguous().numpy().tobytes())
    return h.hexdigest()


class _Run:
    def __init__(self, cfg: DictConfig, spec: WorkerSpec, world: WorldInfo, device: torch.device):
        self.cfg, self.spec, self.world, self.device = cfg, spec, world, device
        self.layout = spec.layout
        self.run_dir = Path(spec.run_dir)
        self.rank = world.rank if self.layout.strategy == "ddp" else 0
        self.world_size = self.layout.world_size
        self.is_main = self.rank == 0
        self.recipe = get_recipe(cfg.recipe.name)

    # ---- set-up -------------------------------------------------------------------------------
    def _load_data(self) -> Splits:
        splits = self.recipe.load(self.cfg)
        n = len(splits.train_y)
        if self.cfg.batch_size > n:
            raise ConfigError("batch_size", self.cfg.batch_size,
                              f"larger than the {n} training images of {self.cfg.recipe.name}", f"batch_size={n // 4}")
        if splits.synthetic and self.is_main:
            log.warning("SYNTHETIC data (data.synthetic=true): for timing only, accuracy says nothing about "
                        "the real dataset")
        on = self.device
        self.train_x, self.train_y = splits.train_x.to(on), splits.train_y.to(on)
        self.test_x, self.test_y = splits.test_x.to(on), splits.test_y.to(on)
        self.mean = torch.tensor(splits.mean, device=on).view(1, -1, 1, 1)
        self.std = torch.tensor(splits.std, device=on).view(1, -1, 1, 1)
        return splits

    def _build(self, splits: Splits) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts them)
        model = self.recipe.build_model(cfg, splits.num_classes).to(self.device)
        self.channels_last = self.device.type == "cuda" and cfg.recipe.channels_last and splits.train_x.dim() == 4
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        self.net = wrap_model(model, self.layout, self.device, cfg.strategy)
        r = cfg.recipe
        if r.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=r.momentum,
                                             nesterov=r.nesterov and r.momentum > 0, weight_decay=r.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=r.weight_decay)
        self.steps_per_epoch = len(self.train_y) // cfg.batch_size
        total = self.steps_per_epoch * cfg.epochs
        warmup = round(r.warmup_epochs * self.steps_per_epoch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, triangular_schedule(total, warmup))
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=r.label_smoothing)
        self.fault_step = cfg.fault.step if cfg.fault.rank is not None else -1
        use_bf16 = r.precision == "bf16" or (r.precision == "auto" and self.device.type == "cuda")
        self.autocast = lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)

    def _resume(self) -> tuple[int, list[dict[str, Any]], str | None]:
        """Where to start: after a restart, this run's own last checkpoint; else `resume`, if given."""
        own = checkpoint.checkpoint_dir(self.run_dir) / checkpoint.LAST
        source = None
        if self.world.restart_count > 0 and own.exists():
            source = str(own)
        elif self.spec.resume_from:
            source = self.spec.resume_from
        if source is None:
            return 0, [], None
        state = checkpoint.load(source, map_location=self.device)
        saved = state.get("config", {}).get("recipe", {})
        for key in ("name", "model"):
            if saved.get(key) not in (None, self.cfg.recipe[key]):
                raise ConfigError(f"recipe.{key}", self.cfg.recipe[key],
                                  f"the checkpoint {source} was trained with recipe.{key}={saved[key]}",
                                  f"recipe.{key}={saved[key]} resume={self.spec.resume_from or source}")
        self.model.load_state_dict(state["net_state_dict"])
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        self.scheduler.load_state_dict(state["scheduler_state_dict"])
        rng = state.get("rng", {})
        if "cpu" in rng:  # dropout and other global randomness continue where they stopped
            torch.set_rng_state(rng["cpu"].cpu())
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"].cpu(), self.device)
        return int(state["epoch"]), list(state.get("history", [])), source

    # ---- the loop -----------------------------------------------------------------------------
    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() - self.mean) / self.std
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for each step of `epoch`: (steps, batch_per_rank)."""
        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
        perm = torch.randperm(len(self.train_y), generator=g)
        b = self.cfg.batch_size
        order = perm[: self.steps_per_epoch * b].view(self.steps_per_epoch, b)
        if self.layout.strategy == "ddp":
            per_rank = b // self.world_size
            order = order[:, self.rank * per_rank:(self.rank + 1) * per_rank]
        return order.to(self.device)

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
        if fault.kind == "hang":
            while True:
                time.sleep(60)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _train_epoch(self, epoch: int, aug_gen: torch.Generator) -> dict[str, float]:
        self.net.train()
        order = self._epoch_order(epoch)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        augment = getattr(self.recipe, "augment", None) if self.cfg.recipe.augment else None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._sync()
        start = time.perf_counter()
        for step in range(self.steps_per_epoch):
            global_step = epoch * self.steps_per_epoch + step
            self._maybe_fail(global_step)
            idx = order[step]
            x, y = self.train_x[idx], self.train_y[idx]
            if augment is not None:
                x = augment(x, aug_gen)
            with self.autocast():
                logits = self.net(self._normalize(x))
                loss = self.loss_fn(logits, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            loss_sum += loss.detach().float() * len(y)
            correct += (logits.argmax(1) == y).sum()
            if self.first_step_s is None:
                self._sync()
                self.first_step_s = time.time() - self.spec.started_at
        self._sync()
        train_s = time.perf_counter() - start
        totals = self._all_reduce(torch.stack([loss_sum, correct.float(), torch.tensor(
            float(order.numel()), device=self.device)]))
        return {"loss": (totals[0] / totals[2]).item(), "train_acc": (totals[1] / totals[2]).item(),
                "train_s": train_s, "img_per_s": self.steps_per_epoch * self.cfg.batch_size / train_s}

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        # Under ddp every rank holds the same weights (buffers are averaged first), so each scores a
        # disjoint shard and the counts are summed. DataParallel scores the whole set across its GPUs.
        net = self.net if self.layout.strategy == "dp" else self.model
        net.eval()
        shard = torch.arange(self.rank, len(self.test_y), self.world_size, device=self.device)
        chunk = max(1, self.cfg.recipe.eval_batch_size // self.world_size)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)
        for i in range(0, len(shard), chunk):
            idx = shard[i:i + chunk]
            with self.autocast():
                logits = net(self._normalize(self.test_x[idx]))
            y = self.test_y[idx]
            loss_sum += torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum")
            correct += (logits.argmax(1) == y).sum()
        totals = self._all_reduce(torch.stack([loss_sum, correct, torch.tensor(float(len(shard)), device=self.device)]))
        return {"test_loss": (totals[0] / totals[2]).item(), "test_acc": (totals[1] / totals[2]).item()}

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.layout.strategy == "ddp":
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def _average_buffers(self) -> None:
        """BatchNorm running stats drift apart across ranks (each sees its own batches): average them."""
        if self.layout.strategy != "ddp":
            return
        for buf in self.model.buffers():
            if buf.is_floating_point():
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
                buf.div_(self.world_size)

    def _memory_mb(self) -> tuple[float | None, float | None]:
        if self.device.type != "cuda":
            return None, None
        devices = range(self.layout.num_devices) if self.layout.strategy == "dp" else [self.device.index]
        alloc = max(torch.cuda.max_memory_allocated(d) for d in devices) / 2**20
        reserved = max(torch.cuda.max_memory_reserved(d) for d in devices) / 2**20
        both = self._all_reduce(torch.tensor([alloc, reserved], device=self.device),
                                op=dist.ReduceOp.MAX if self.layout.strategy == "ddp" else None)
        return round(both[0].item(), 1), round(both[1].item(), 1)

    def _save(self, epoch: int, history: list[dict[str, Any]]) -> None:
        if not (self.is_main and self.cfg.checkpoint):
            return
        state = {
            "net_state_dict": self.model.state_dict(),
            "optimizer_state_dict": self.optimizer.state_dict(),
            "scheduler_state_dict": self.scheduler.state_dict(),
            "epoch": epoch,
            "history": history,
            "rng": {"cpu": torch.get_rng_state(),
                    **({"cuda": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {})},
            "config": self.spec.config,
        }
        checkpoint.save_atomic(state, checkpoint.checkpoint_dir(self.run_dir) / checkpoint.LAST)

    def fit(self) -> dict[str, Any] | None:
        cfg = self.cfg
        t_start = time.perf_counter()
        splits = self._load_data()
        self._build(splits)
        start_epoch, history, resumed_from = self._resume()
        metrics_log = MetricsLog(self.run_dir)
        if self.is_main:
            metrics_log.rewrite(history)
            if resumed_from:
                log.info("resumed from %s after epoch %d", resumed_from, start_epoch)
        self.first_step_s: float | None = None
        aug_gen = torch.Generator(device=self.device)
        train_time = 0.0
        for epoch in range(start_epoch, cfg.epochs):
            epoch_start = time.perf_counter()
            row: dict[str, Any] = {"epoch": epoch + 1}
            # Seeded per (seed, epoch, rank), so a resumed run augments exactly as an uninterrupted one.
            aug_gen.manual_seed((cfg.seed * 100_003 + epoch) * 1_009 + self.rank)
            row.update(self._train_epoch(epoch, aug_gen))
            self._average_buffers()
            row.update(self._evaluate())
            row["lr"] = self.scheduler.get_last_lr()[0]
            row["max_mem_allocated_mb"], row["max_mem_reserved_mb"] = self._memory_mb()
            row["epoch_s"] = time.perf_counter() - epoch_start
            train_time += row["train_s"]
            history.append(row)
            self._save(epoch + 1, history)
            if self.is_main:
                metrics_log.append(row)
                log.info("epoch %*d/%d  loss %.4f  train %.2f%%  test %.2f%%  %s img/s  %.2fs",
                         len(str(cfg.epochs)), epoch + 1, cfg.epochs, row["loss"], 100 * row["train_acc"],
                         100 * row["test_acc"], f"{row['img_per_s']:,.0f}", row["epoch_s"])
                if not math.isfinite(row["loss"]):
                    log.warning("loss is %s at epoch %d", row["loss"], epoch + 1)
        digests, devices = self._gather_rank_facts()
        if not self.is_main:
            return None
        return self._results(history, digests, devices, resumed_from, train_time, time.perf_counter() - t_start,
                             splits)

    def _gather_rank_facts(self) -> tuple[list[str], list[str]]:
        """Every rank's weights digest and device name, in rank order (one entry for single and dp)."""
        mine = (weights_digest(self.model), self._device_names())
        if self.layout.strategy != "ddp":
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

    def _results(self, history, digests, devices, resumed_from, train_time, total_s, splits) -> dict[str, Any]:
        cfg = self.cfg
        final = history[-1] if history else {}
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
            "final": final,
            "test_acc": final.get("test_acc"),
            "best_test_acc": max((r["test_acc"] for r in history), default=None),
            "train_s": train_time,
            "worker_s": total_s,
            "first_step_s": self.first_step_s,
            "resumed_from": resumed_from,
            "restarts": self.world.restart_count,
            "weights_sha256": digests,
            "ranks_agree": len(set(digests)) == 1,
            "torch": torch.__version__,
        }
        write_results(self.run_dir, results)
        return results
