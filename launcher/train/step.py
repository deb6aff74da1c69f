"""One training step (TrainStep), and with `perf.cuda_graph=true` its device work replayed as one CUDA graph.

At CIFAR sizes a step is a few hundred small kernels, and issuing them from Python takes about as
long as running them: the GPU waits for the host. Under DDP it gets worse, because the reducer's
per-parameter autograd hooks add host work to every backward pass. Capturing the step once and
replaying it costs one launch per step instead.

What is in the graph: zeroing the gradients, augmentation, normalization, forward, loss, backward
with the gradient all-reduce (ranks > 1), and the epoch's running loss/accuracy sums. DDP's reducer
cannot run inside a replayed graph (its host-side bookkeeping would not replay), so the gradients
live in flat buffers (`FlatGradients`) whose buckets are all-reduced from autograd hooks; captured
once, those all-reduces replay with the backward pass. NCCL's watchdog does not see collectives
inside a graph, so the loop bounds its epoch-end wait by `strategy.timeout_s` (stall.wait_for). The
strategy decides who averages (launcher/strategies: CapturedDDP under ddp, nobody on one device).

The optimizers' steps are in the graph too when every optimizer can be captured (fused SGD and AdamW,
the launcher's Muon: launcher/train/optim.py `capturable`): the graph reads each parameter group's
learning rate from a device tensor, filled from the schedule's value before each replay, and the
schedules step on the host after it. Otherwise the optimizers run eagerly after each replay. Keeping
them in the graph matters where the host is slow: recipe=cifar10_fast's Muon issues ~140 kernels a
step, and on an H100 host whose CPU took longer to issue them than the GPU to run them the eager
optimizer left the GPU idle half the time (BENCHMARKS.md, issue 15).

The gradients stay in place between steps (`FlatGradients`), so nothing may set them to None, and
the inputs are copied into static buffers before each replay.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from launcher.config import Precision
from launcher.data.prefetch import batch_len
from launcher.figures import check_step_names
from launcher.train.optim import capturable

if TYPE_CHECKING:
    from launcher.strategies import Nets
    from launcher.train.optim import Stepper


class CapturedStep:
    """A step body captured once, replayed per batch.

    `body(batch, idx)` must do only device work with static shapes (no .item(), no host sync); `batch`
    is any nesting of tensors (a recipe's batch). `capture` is called once, after eager warm-up steps on
    the same shapes (cuDNN has picked its algorithms, lazily created state such as optimizer buffers
    exists); `run` copies a batch into the static inputs and replays. `fits` says whether a batch has
    the captured shapes (a batch that lost samples, or a last short one, runs eagerly instead).
    """

    def __init__(self, body: Callable[[Any, torch.Tensor], None], generators: Iterable[torch.Generator] = ()):
        self.body = body
        self.generators = list(generators)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: Any = None
        self.layout: list[tuple] | None = None

    @staticmethod
    def _layout(batch: Any, idx: torch.Tensor) -> list[tuple]:
        leaves, spec = tree_flatten((batch, idx))
        return [spec, *((t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in leaves)]

    def capture(self, batch: Any, idx: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """Capture on `stream` (the side stream the warm-up ran on), with (batch, idx) as the example."""
        self.static = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (batch, idx))
        self.layout = self._layout(batch, idx)
        pairs = zip(tree_leaves(self.static), tree_leaves((batch, idx)), strict=True)
        if any(isinstance(s, torch.Tensor) and s.stride() != t.stride() for s, t in pairs):
            # The warm-up's batches were views with gaps (recipe=text's windows[:, :-1]); the static
            # copies are dense. Compiled code guards on strides and would recompile inside the capture,
            # where compiling cannot run (it reads values to the host): run once on the static layout first.
            self.body(*self.static)
        graph = torch.cuda.CUDAGraph()
        for generator in self.generators:
            # Random ops on this generator read its seed and offset at each replay, so reseeding it
            # between replays (every epoch) takes effect and each replay draws fresh numbers.
            graph.register_generator_state(generator)
        # thread_local: a data thread (data.placement=host) may pin memory while this thread captures.
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            self.body(*self.static)
        self.graph = graph

    def fits(self, batch: Any, idx: torch.Tensor) -> bool:
        return self.layout == self._layout(batch, idx)

    def run(self, batch: Any, idx: torch.Tensor) -> None:
        assert self.graph is not None and self.static is not None, "capture() first"
        for static, new in zip(tree_leaves(self.static), tree_leaves((batch, idx)), strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(new, non_blocking=True)
        self.graph.replay()


class Figures:
    """Named figures summed on the device, each with its count: read once per epoch (no host sync per
    step), reduced over the ranks as sums and counts, so each mean is exact over every sample of every
    rank (a short last batch or an uneven shard weighs what it holds).

    A value is a 0-dim tensor (a batch mean, weighing the batch's `n` samples) or a tensor of one value
    per sample or element (each weighing one). Sums are float64: an epoch of tokens overflows float32's
    exact integers."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, name: str, value: torch.Tensor, n: int) -> None:
        value = value.detach()
        pair = self.sums.get(name)
        if pair is None:
            pair = self.sums[name] = (torch.zeros((), dtype=torch.float64, device=self.device),
                                      torch.zeros((), dtype=torch.float64, device=self.device))
        if value.dim() == 0:
            pair[0].add_(value.double() * n)
            pair[1].add_(n)
        else:
            pair[0].add_(value.double().sum())
            pair[1].add_(value.numel())

    def zero(self) -> None:
        for total, count in self.sums.values():
            total.zero_()
            count.zero_()

    @property
    def names(self) -> list[str]:
        return list(self.sums)

    def tensors(self) -> list[torch.Tensor]:
        """Every figure's sum and count, in `names` order: what the epoch's end reads back."""
        return [t for pair in self.sums.values() for t in pair]

    @staticmethod
    def means(names: list[str], values: list[float]) -> dict[str, float]:
        """Each figure's mean from `tensors()`' values (reduced over the ranks)."""
        return {name: values[2 * i] / values[2 * i + 1] if values[2 * i + 1] else float("nan")
                for i, name in enumerate(names)}


class EpochSums:
    """The epoch's training figures (the loss, and what training_step names) and finite steps, summed
    on the device, read once per epoch.

    A non-finite loss poisons the weights, so every later step is non-finite too: the count of finite
    steps is the index of the first bad step within the epoch (found without a per-step host sync).
    """

    def __init__(self, device: torch.device):
        self.figures = Figures(device)
        self.finite_steps = torch.zeros((), dtype=torch.long, device=device)
        self.overflowed = torch.zeros((), dtype=torch.long, device=device)  # fp16: steps the scaler skipped
        self.named: set[str] = set()  # the training_step's figure names checked so far (once each)

    def add(self, loss: torch.Tensor, figures: dict[str, torch.Tensor], n: int) -> None:
        if not self.named.issuperset(figures):
            check_step_names("training_step", figures)
            self.named.update(figures)
        self.figures.add("loss", loss, n)
        for name, value in figures.items():
            self.figures.add(name, value, n)

    def zero(self) -> None:
        self.figures.zero()
        self.finite_steps.zero_()
        self.overflowed.zero_()


def loss_and_figures(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A training_step's result as (loss, figures): a loss tensor, `(loss, {name: tensor})`, or a dict with
    `loss` (Lightning's form)."""
    if isinstance(out, torch.Tensor):
        loss, figures = out, {}
    elif isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict):
        loss, figures = out
    elif isinstance(out, dict) and "loss" in out:
        loss, figures = out["loss"], {k: v for k, v in out.items() if k != "loss"}
    else:
        raise TypeError(f"training_step returned {type(out).__name__}; return the loss (a 0-dim tensor), "
                        "(loss, {name: tensor}) or {'loss': loss, name: tensor}")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"training_step's loss must be a 0-dim tensor (a mean over the batch), not {shape}")
    for name, value in figures.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"training_step's figure {name!r} is a {type(value).__name__}; figures are tensors "
                            "(a 0-dim batch mean, or one value per sample), kept on the device")
    return loss, figures


def eval_figures(out: Any) -> dict[str, torch.Tensor]:
    """An eval_step's result, checked: named tensors (0-dim batch means, or one value per sample)."""
    if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) for v in out.values()):
        raise TypeError(f"eval_step returned {type(out).__name__}; return {{name: tensor}}: each a 0-dim batch "
                        "mean or one value per sample, kept on the device (e.g. {'mse': ((pred - y) ** 2).mean(1)})")
    return out


def autocast_for(precision: Precision, device_type: str) -> Callable[[], torch.autocast]:
    """What a step runs under (perf.precision): float16 autocast with fp16, bf16 with bf16 (and auto on GPUs),
    else none. A function that holds no reference to the trainer, so that nothing the trainer holds refers
    back to it: `trainer = None` in loop.train() frees its captured graph at once, before teardown."""
    bf16 = precision in (Precision.bf16, Precision.fp8) or (precision is Precision.auto and device_type == "cuda")
    return functools.partial(_autocast, device_type, bf16, precision is Precision.fp16)


def _autocast(device_type: str, bf16: bool, fp16: bool) -> torch.autocast:
    if fp16:
        return torch.autocast(device_type, dtype=torch.float16)
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)


def micro_batches(batch: Any, parts: int) -> list[Any]:
    """`batch` cut into `parts` along its samples (every tensor with the batch's leading size), the rest
    of it shared."""
    if parts == 1:
        return [batch]
    n = batch_len(batch)
    leaves, spec = tree_flatten(batch)
    cut = [list(t.chunk(parts)) if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n else [t] * parts
           for t in leaves]
    return [tree_unflatten([c[i] for c in cut], spec) for i in range(parts)]


class TrainStep:
    """A training step: its device work up to the gradients (`body`, what a CUDA graph captures) and
    the optimizers after it. Built once per run; `capture` turns the body into a replayed graph."""

    def __init__(self, nets: Nets, steppers: list[Stepper], training_step: Callable[[Any, Any], Any],
                 normalize: Callable[[torch.Tensor], torch.Tensor] | None, augment: Callable | None,
                 autocast: Callable, device: torch.device, poison: torch.Tensor | None = None, accumulate: int = 1,
                 no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 clip_grad_norm: float = 0.0, scaler: torch.amp.GradScaler | None = None):
        self.nets = nets
        self.scaler = scaler  # perf.precision=fp16: losses scaled up, steps that overflow skipped
        self.clip_grad_norm = clip_grad_norm  # optim.clip_grad_norm: 0 never
        self.steppers = steppers
        self.training_step = training_step  # the recipe's: (model, batch) -> loss, or (loss, figures)
        self.normalize = normalize  # in-memory images and tokens: batch[0] as the network takes it; else None
        self.augment = augment
        self.autocast = autocast
        self.poison = poison  # fault.kind=nan: added to the loss (a tensor, so a graph sees it change)
        self.accumulate = accumulate  # micro-batches per step; gradients synchronized after the last only
        self.no_sync = no_sync
        self.sums = EpochSums(device)
        self.epoch = torch.zeros((), dtype=torch.long, device=device)  # the epoch, as a graph reads it
        self.captured: CapturedStep | None = None
        self.compiled_inputs: Callable | None = None  # augmentation + normalization, compiled (`compile_captured`)
        self.optimizers_in_graph = False  # the captured graph also steps the optimizers (`capture`)
        self.lr_slots: list[list[torch.Tensor]] = []  # each param group's learning rate, as the graph reads it
        self.eager_steps = 0  # steps whose batch did not fit the captured graph's shapes (run eagerly)

    def inputs(self, batch: Any, idx: torch.Tensor, epoch: int | torch.Tensor, generator: torch.Generator) -> Any:
        """The batch as training_step takes it: for in-memory images, its images augmented and normalized
        (one compiled function where `compile_captured` made one, the random numbers drawn before it);
        a Dataset's batch as the recipe made it."""
        if self.normalize is None:
            return batch
        x = batch[0]
        if self.compiled_inputs is not None:
            x = self.compiled_inputs(x, self.augment.draw(x, generator), idx, epoch)
        else:
            if self.augment is not None:  # (the whole batch at once: augmented as without accumulation)
                x = self.augment(x, generator, indices=idx, epoch=epoch)
            x = self.normalize(x)
        return (x, *batch[1:])

    def compile_captured(self, mode: str | None) -> None:
        """For a captured step: compile the network's training forward as one graph
        (launcher/train/compiling.py; the CUDA graph already removed the launch costs, this fuses
        kernels), and the image augmentation with the normalization as another (a dozen passes over
        the batch become one or two: airbench94's step at batch 2000 took less GPU time on an H100;
        measured: BENCHMARKS.md section 1). Eval mode runs the eager forward: evaluation would otherwise
        compile again for eval-mode BatchNorm and each batch shape."""
        from launcher.data.augment import ImageAugmentation
        from launcher.train.compiling import compile_for_training, compiled

        compile_for_training(self.nets.module, mode)
        if isinstance(self.augment, ImageAugmentation) and self.normalize is not None:
            augment, normalize = self.augment, self.normalize

            def prepare(x: torch.Tensor, draws: tuple, idx: torch.Tensor, epoch: torch.Tensor) -> torch.Tensor:
                return normalize(augment.apply(x, draws, idx, epoch))

            self.compiled_inputs = compiled(prepare, mode)

    def body(self, batch: Any, idx: torch.Tensor, epoch: int | torch.Tensor, generator: torch.Generator) -> None:
        """The step's device work up to the gradients, and the epoch's sums. No host sync."""
        grads = self.nets.grads
        if grads is not None:
            grads.zero()
            grads.start_backward()
        else:
            self.nets.module.zero_grad(set_to_none=True)
        batch = self.inputs(batch, idx, epoch, generator)
        parts = self.accumulate
        finite = None
        for i, micro in enumerate(micro_batches(batch, parts)):
            with self.no_sync() if i < parts - 1 else contextlib.nullcontext():
                with self.autocast():
                    out = self.training_step(self.nets.train, micro)
                loss, figures = loss_and_figures(out)
                if self.poison is not None:
                    loss = loss + self.poison
                scaled = loss / parts if parts > 1 else loss
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            self.sums.add(loss.detach().float(), figures, batch_len(micro))
            ok = torch.isfinite(loss.detach())
            finite = ok if finite is None else finite & ok
        if grads is not None:
            grads.finish_backward()  # ddp: every bucket's all-reduce issued and waited for
        if self.clip_grad_norm > 0:
            if self.scaler is not None:  # (the norm of the true gradients)
                for stepper in self.steppers:
                    self.scaler.unscale_(stepper.optimizer)
            clip_gradients(self.nets.module, self.clip_grad_norm)
        self.sums.finite_steps += finite

    def __call__(self, batch: Any, idx: torch.Tensor, epoch: int, generator: torch.Generator) -> None:
        if self.captured is not None and self.captured.fits(batch, idx):
            if self.optimizers_in_graph:
                self._fill_lr_slots()
                self.captured.run(batch, idx)
                for stepper in self.steppers:
                    stepper.scheduler.step()
                return
            self.captured.run(batch, idx)
        else:  # with flat gradients the epoch is the tensor a graph would read, so both paths agree
            self.eager_steps += self.captured is not None
            self.body(batch, idx, self.epoch if self.nets.grads is not None else epoch, generator)
        if self.scaler is not None:
            self._scaled_step()
            return
        for stepper in self.steppers:
            stepper.step()

    def _scaled_step(self) -> None:
        """fp16: each optimizer steps unless its gradients overflowed (the scaler then lowers the scale);
        the schedules step either way. Skipped steps are counted on the device: the scale went down."""
        before = self.scaler._scale.clone()  # (made by scale() in the body; a device tensor: no sync)
        for stepper in self.steppers:
            self.scaler.step(stepper.optimizer)
            stepper.scheduler.step()
        self.scaler.update()
        self.sums.overflowed += (self.scaler._scale < before).long()

    def capture(self, batch: Any, idx: torch.Tensor, generator: torch.Generator, stream: torch.cuda.Stream) -> None:
        """Capture the body, and the optimizers' steps after it where all of them can be captured. Called
        after eager warm-up steps (the optimizers' state exists: nothing is created during capture)."""
        with_optimizers = all(capturable(s.optimizer) for s in self.steppers)
        device = self.epoch.device
        if with_optimizers and not self.lr_slots:
            self.lr_slots = [[torch.tensor(float(g["lr"]), device=device) for g in s.optimizer.param_groups]
                             for s in self.steppers]

        def body(batch: Any, idx: torch.Tensor) -> None:
            self.body(batch, idx, self.epoch, generator)
            if with_optimizers:
                self._step_optimizers_on_slots()

        step = CapturedStep(body, generators=[generator])
        step.capture(batch, idx, stream=stream)
        self.captured = step
        self.optimizers_in_graph = with_optimizers

    def _step_optimizers_on_slots(self) -> None:
        """The optimizers' steps reading each group's learning rate from its device tensor (while being
        captured); the groups keep their Python floats otherwise, for the schedules and checkpoints."""
        for stepper, slots in zip(self.steppers, self.lr_slots, strict=True):
            groups = stepper.optimizer.param_groups
            floats = [g["lr"] for g in groups]
            try:
                for group, slot in zip(groups, slots, strict=True):
                    group["lr"] = slot
                stepper.optimizer.step()
            finally:
                for group, value in zip(groups, floats, strict=True):
                    group["lr"] = value

    def _fill_lr_slots(self) -> None:
        for stepper, slots in zip(self.steppers, self.lr_slots, strict=True):
            for group, slot in zip(stepper.optimizer.param_groups, slots, strict=True):
                slot.fill_(group["lr"])

    def zero_grads(self) -> None:
        if self.nets.grads is not None:
            self.nets.grads.zero()
        else:
            self.nets.module.zero_grad(set_to_none=True)


def clip_gradients(module: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradients down to a global L2 norm of `max_norm` where theirs is larger (torch's rule:
    times max_norm / (norm + 1e-6), at most 1); returns their norm before. Every rank's gradients are
    whole after ddp's all-reduce. Under fsdp each rank holds shards of them (DTensors, Shard(0) on one
    mesh dimension): the norm is taken over each rank's own shards as plain tensors, their squares
    summed over the ranks in one all-reduce, and the shards scaled in place: less host time a step for
    GPT-2 124M on 2 H200s than DTensor's dispatch took (bench/probe/fsdp_step.py; the fsdp step there is
    bound by the host; measured: BENCHMARKS.md section 5). No host sync: a captured step holds it."""
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    with torch.no_grad():
        grads = [p.grad for p in params]
        group = _sharded_group(grads)
        if group is None:
            total = torch.nn.utils.get_total_norm(grads, foreach=True)
            if hasattr(total, "full_tensor"):  # (a DTensor: every rank's shards' norms, already combined)
                total = total.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
            return total
        import torch.distributed as dist

        shards = [g.to_local() for g in grads]  # (under no_grad: the DTensors' own local tensors)
        squares = torch.nn.utils.get_total_norm(shards, foreach=True).float() ** 2
        dist.all_reduce(squares, group=group)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for same in _by_dtype(shards):
            torch._foreach_mul_(same, coef.to(same[0].dtype))
        return total


def _sharded_group(grads: list[torch.Tensor]):
    """The process group over which `grads` are sharded, where every one is a DTensor sharded along one
    dimension of the same one-dimensional mesh (FSDP2's fully_shard on strategy=fsdp's mesh); else None."""
    from torch.distributed.tensor import DTensor, Shard

    first = grads[0]
    if not isinstance(first, DTensor) or first.device_mesh.ndim != 1:
        return None
    mesh = first.device_mesh
    for g in grads:
        if not isinstance(g, DTensor) or g.device_mesh != mesh or not isinstance(g.placements[0], Shard):
            return None
    return mesh.get_group()


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())
