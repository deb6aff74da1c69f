"""Checkpoints: the training state captured and restored in one place, written atomically every epoch,
read back with weights_only=True.

`capture` and `restore` are the one pair that knows what the training state is (the model's weights
and buffers, through its strategy; every optimizer and schedule; the RNG); saving, resuming and the
compile/capture warm-up (which must leave no trace) all use them. A checkpoint file is that state
plus where the run stands (a plain dict, so `torch.load(..., weights_only=True)` reads it):

    net_state_dict                  the model's weights and buffers (no wrapper prefixes)
    optimizer_state_dicts, scheduler_state_dicts   one per optimizer (two under optim=muon)
    rng            torch CPU and CUDA generator states
    epoch          epochs completed
    history        the per-epoch metrics so far (metrics.jsonl is rewritten from it on resume)
    config         the resolved config of the run that wrote it (plain data)
    classes        the class names of its outputs, in label order, where the data names them
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from launcher import integrity, lifetime
from launcher.errors import LaunchError
from launcher.files import (
    CHECKPOINTS,
    LAST_CHECKPOINT,
    PREVIOUS_CHECKPOINT,
    DiskFull,
    disk_full,
    link_atomic,
    write_atomic,
)
from launcher.train import best, nested

log = logging.getLogger("launcher.train")

if TYPE_CHECKING:
    from collections.abc import Callable

    from launcher.strategies import Nets, Strategy
    from launcher.train.optim import Stepper
    from launcher.train.shard_writer import ShardWriter
    from launcher.train.threads import Asides
    from launcher.world import WorldInfo


def capture(strategy: Strategy, nets: Nets, steppers: list[Stepper], device: torch.device,
            clone: bool = False, local: bool = False, scaler: torch.amp.GradScaler | None = None) -> dict[str, Any]:
    """The training state now. `clone`: copies that later steps cannot change (the tensors are
    otherwise the live ones, as a checkpoint snapshot copies them itself). `local`: the weights as this
    rank holds them (its shards under fsdp, not the whole model gathered), for `restore(local=True)`
    on the same rank of the same run. `scaler`: perf.precision=fp16's gradient scaler, whose scale and
    growth count are kept as device tensors (its state_dict would wait for the device)."""
    state = {
        "net_state_dict": nets.module.state_dict() if local else strategy.state_dict(nets),
        "optimizer_state_dicts": [s.optimizer.state_dict() for s in steppers],
        "scheduler_state_dicts": [s.scheduler.state_dict() for s in steppers],
        "rng": rng_state(device),
    }
    if scaler is not None:  # (before its first step it has no tensors yet: its initial scale, a number)
        state["grad_scaler"] = ({"scale": scaler._scale, "growth_tracker": scaler._growth_tracker}
                                if scaler._scale is not None else {"scale": scaler.get_scale(), "growth_tracker": 0})
    return _cloned(state) if clone else state


def restore(state: dict[str, Any], strategy: Strategy, nets: Nets, steppers: list[Stepper],
            device: torch.device, local: bool = False, scaler: torch.amp.GradScaler | None = None) -> None:
    """Put a captured (or loaded) state back. The weights are copied into the live tensors, which a
    captured step and flat gradients hold by address. `scaler`: fp16's gradient scaler takes the
    checkpoint's scale (a checkpoint without one, from another precision, leaves it as it is)."""
    saved = state.get("grad_scaler")
    if scaler is not None and saved is not None:  # (its own factors and interval, the checkpoint's scale)
        scaler.load_state_dict({**scaler.state_dict(), "scale": float(saved["scale"]),
                                "_growth_tracker": int(saved["growth_tracker"])})
    if local:
        nets.module.load_state_dict(state["net_state_dict"])
    else:
        strategy.load_state_dict(nets, state["net_state_dict"])
    optimizers, schedulers = optimizer_states(state)
    for stepper, opt_state, sched_state in zip(steppers, optimizers, schedulers, strict=True):
        load_optimizer_state(stepper.optimizer, opt_state)
        stepper.scheduler.load_state_dict(sched_state)
    set_rng_state(state.get("rng", {}), device)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """`optimizer.load_state_dict`, keeping the optimizer's live state tensors: a captured step that
    holds the optimizers' steps (launcher/train/step.py) reads and writes them by address.

    Loaded values are copied into the live tensors where they fit (same shape, dtype and device). A
    live tensor the loaded state lacks (the state was saved before the first step, as the warm-up's
    is) is zeroed and kept: zeros are where the optimizers here start (momentum, AdamW's moments and
    step count; SGD without dampening, which is how optim.py builds it).

    A loaded tensor that is not copied into a live one takes its parameter's memory layout. Snapshots
    are written contiguous, so a channels_last filter's momentum comes back contiguous, and the fused
    CUDA optimizers refuse lists whose strides differ ("check_fast_path_restrictions").
    """
    live = {p: dict(s) for p, s in optimizer.state.items()}
    optimizer.load_state_dict(state_dict)
    for p, values in optimizer.state.items():
        for key, value in values.items():
            if _needs_layout_of(value, p):
                values[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)
    for p, before in live.items():
        values = optimizer.state[p]
        for key, old in before.items():
            if not isinstance(old, torch.Tensor):
                continue
            value = values.get(key)
            if value is None:
                values[key] = old.zero_()
            elif (isinstance(value, torch.Tensor) and old is not value
                  and (old.shape, old.dtype, old.device) == (value.shape, value.dtype, value.device)):
                values[key] = old.copy_(value)


def _needs_layout_of(value: Any, param: torch.Tensor) -> bool:
    """`value` has the parameter's shape but not its strides (plain tensors; a sharded parameter's
    state is laid out by FSDP itself)."""
    return (type(value) is torch.Tensor and not hasattr(param, "device_mesh") and value.shape == param.shape
            and value.device == param.device and value.stride() != param.stride())


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The global generators' states (CPU, and the device's on a GPU): dropout and other randomness."""
    return {"cpu": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {})}


def set_rng_state(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put `rng_state`'s generators back: randomness continues where it stopped."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"].cpu())
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), device)


def _cloned(obj: Any) -> Any:
    return nested.mapped(obj, lambda t: t.detach().clone())  # (a tied weight: one clone under both names)


# ---- sharded checkpoints (strategy=fsdp): torch.distributed.checkpoint -----------------------------


def _dcp_state(nets: Nets, steppers: list[Stepper]) -> dict[str, Any]:
    """The model's and optimizers' state keyed by parameter names, as this rank holds it (its shards under
    fsdp, whole tensors otherwise): what torch.distributed.checkpoint saves and loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(nets.module, [s.optimizer for s in steppers])
    return {"model": model, "optim": optim}


def save_sharded(strategy: Strategy, nets: Nets, steppers: list[Stepper], device: torch.device, path: Path,
                 epoch: int, plain: dict[str, Any], writer: BackgroundWriter,
                 then: Callable[[Path, str | None], None] | None = None, previous: bool = True,
                 row: dict[str, Any] | None = None) -> None:
    """Every rank writes its shards to checkpoints/epoch-<epoch>.dcp (torch.distributed.checkpoint); then
    rank 0 writes `path` (last.pt: the schedules, RNG, epoch, history and config, and which folder holds
    the tensors) atomically and removes the folders of earlier epochs but the one previous.pt names (none
    with `previous` false: checkpoint.keep_previous). A crash at any point leaves last.pt naming a complete
    folder.

    The save is asynchronous (launcher/train/shard_writer.py, tracked by `writer`): the shards are copied
    to a host copy kept for the run by copies queued now, and written to disk with dcp.save by a process
    beside each rank (its collectives on a gloo group of those processes, so they never meet the
    training's); rank 0 writes last.pt as soon as every rank's part is on disk (the save's completion),
    and the next save, or `writer.wait()` (the end of the run, a preemption, a NaN stop), waits for that.
    One save at a time. `row` (the epoch's, which last.pt's history holds) gets checkpoint_wait_s: what this
    call held the steps for (the last save waited for, the shards' copies queued), added to what the epoch's
    end waited for the host copy made beside the first epoch (EpochEnds.queue); set before last.pt can be
    written."""
    import time

    started = time.perf_counter()
    folder = path.parent / f"epoch-{epoch}.dcp"
    state = None
    if strategy.is_main:  # (taken now: the RNG and schedules as they are at the end of this epoch)
        state = {"sharded": folder.name, "scheduler_state_dicts": [s.scheduler.state_dict() for s in steppers],
                 "rng": rng_state(device),
                 **plain}

    def finish() -> None:
        if state is None:
            return
        before = _sharded_folder(path) if previous else None  # (the folder last.pt names: previous.pt's next)
        save_atomic(state, path, folder, previous)
        if then is not None:  # (first: a best checkpoint this one displaces lets its folder go now, not later)
            then(path, folder.name)
        keep = {folder.name, before} | best.kept_folders(path.parent)  # (and those the best checkpoints name)
        for old in path.parent.glob("epoch-*.dcp"):
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def failed(exc: BaseException) -> BaseException:
        """What to raise for a save that failed on some rank (every rank hears of it, after every rank's
        writes ended): rank 0 removes the half-written folder, which last.pt does not name, so a full
        disk gets its space back; a full disk is said in one line, like a plain checkpoint's."""
        stop = exc
        if disk_full(folder.parent, exc):  # (before the folder frees its space)
            stop = DiskFull(folder, "the last complete checkpoint is unchanged (this epoch's partial one was removed)")
            stop.__cause__ = exc
        if strategy.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        return stop

    writer.wait_sharded()
    future = writer.shard_writer(strategy, device).save(_dcp_state(nets, steppers), folder)
    if row is not None:
        row["checkpoint_wait_s"] = round(row.get("checkpoint_wait_s", 0.0) + time.perf_counter() - started, 4)
    writer.track_sharded(future, finish, failed)  # (finish, which writes last.pt, runs after this)


def make_shards_host_copy(strategy: Strategy, nets: Nets, steppers: list[Stepper], device: torch.device,
                          writer: BackgroundWriter, asides: Asides) -> None:
    """The host copy that this rank's sharded saves copy into, made on a thread (`asides`, waited for at
    the first epoch's end) for the state as it is now, after the first step (the optimizers' state made)."""
    asides.start(device, writer.shard_writer(strategy, device).make_host_copy, _dcp_state(nets, steppers))


def restore_sharded(state: dict[str, Any], source: Path, nets: Nets, steppers: list[Stepper],
                    device: torch.device) -> None:
    """A sharded checkpoint (`state` read from last.pt at `source`) into this run's model and optimizers,
    however they are sharded now (another number of ranks, or not sharded at all)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    target = _dcp_state(nets, steppers)
    _load_shards(target, Path(source).parent / state["sharded"])
    set_state_dict(nets.module, [s.optimizer for s in steppers], model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    for stepper, sched_state in zip(steppers, state["scheduler_state_dicts"], strict=True):
        stepper.scheduler.load_state_dict(sched_state)
    set_rng_state(state.get("rng", {}), device)


def load_sharded_weights(state: dict[str, Any], source: Path, nets: Nets) -> None:
    """Only the model's weights of a sharded checkpoint (`launch eval`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    target = {"model": get_model_state_dict(nets.module)}
    _load_shards(target, Path(source).parent / state["sharded"])
    set_model_state_dict(nets.module, target["model"])


def _load_shards(target: dict[str, Any], folder: Path) -> None:
    """dcp.load of `folder` into `target`. One process reading a sharded checkpoint (a resume on one rank,
    `launch eval`) is what it is for: torch's warning that it assumes so is not shown."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", "torch.distributed is (disabled|unavailable)", UserWarning)
        dcp.load(target, checkpoint_id=folder)


def misfit(exc: BaseException) -> BaseException | None:
    """Why loading a checkpoint into this run's network failed, where it is the checkpoint's shapes or names
    (what a plain load_state_dict or torch.distributed.checkpoint raise: RuntimeError, ValueError,
    AssertionError, KeyError; DCP wraps each rank's in a CheckpointException, a BaseException); None for
    anything else (an interrupt, running out of memory), which is not the checkpoint's fault."""
    from torch.distributed.checkpoint.api import CheckpointException  # (here only: a failure's path)

    if isinstance(exc, CheckpointException) and exc.failures:
        first = next(iter(exc.failures.values()))
        return first[0] if isinstance(first, tuple) and first else exc
    if isinstance(exc, torch.OutOfMemoryError):
        return None
    return exc if isinstance(exc, (RuntimeError, ValueError, AssertionError, KeyError)) else None


def save_atomic(state: dict[str, Any], path: Path, folder: Path | None = None, previous: bool = True) -> None:
    """torch.save to a temporary file beside `path`, fsync, rename: a crash never leaves half a checkpoint.
    Sealed first (launcher/integrity.py): the digest of its contents (and of `folder`'s files: a sharded
    checkpoint's shards), and, in a run dir's checkpoints/, the run's name. A run's last.pt keeps the one
    it replaces as previous.pt, unless `previous` is false (checkpoint.keep_previous): then previous.pt
    goes, and with it the blocks of the checkpoint before."""
    path.parent.mkdir(parents=True, exist_ok=True)
    run = integrity.run_id(path.parent.parent, create=True) if path.parent.name == CHECKPOINTS else None
    integrity.seal(state, run, folder)
    if run is not None and path.name == LAST_CHECKPOINT:
        if previous:
            keep_previous(path)
        else:
            path.with_name(PREVIOUS_CHECKPOINT).unlink(missing_ok=True)
    write_atomic(path, lambda f: torch.save(state, f), durable=True)


def keep_previous(path: Path) -> None:
    """Before last.pt is replaced: previous.pt becomes a second name of its file (a hard link: no copy, and
    its blocks stay on disk until the next save replaces previous.pt; a sharded checkpoint's previous shard
    folder is kept as long, save_sharded). Where the filesystem has no hard links, nothing is kept."""
    if not path.is_file():
        return
    try:
        link_atomic(path, path.with_name(PREVIOUS_CHECKPOINT))
    except OSError:
        pass


def _sharded_folder(path: Path) -> str | None:
    """The shard folder's name the sharded checkpoint at `path` names (None: none there, or unreadable)."""
    try:
        named = load(path).get("sharded") if path.is_file() else None
    except Exception:  # noqa: BLE001 - unreadable: nothing to keep for it
        return None
    return named if isinstance(named, str) else None


def load_restart(path: Path, map_location: Any = "cpu") -> tuple[Path, dict[str, Any]]:
    """This run's own checkpoint, read for a restart (max_restarts, a requeue) and checked against its seal
    (a sharded checkpoint's shard files too: one rank calls this, restart._own_checkpoint). Damaged or
    unreadable: the one before it (previous.pt), said in the log, where that one is whole; else a
    LaunchError naming the file and what is wrong (exit 2: a restart would find it so again)."""
    state, broken = _read_checked(path, map_location)
    if broken is None:
        return path, state
    previous = path.with_name(PREVIOUS_CHECKPOINT)
    if previous.is_file():
        older, older_broken = _read_checked(previous, map_location)
        if older_broken is None:
            log.warning("this run's checkpoint %s cannot be trusted (%s): going on from the one before it, %s "
                        "(epoch %s)", path, broken, previous, older.get("epoch"))
            return previous, older
        broken += f"; and the one before it, {previous}: {older_broken}"
    raise LaunchError(f"this run's checkpoint {path} cannot be trusted: {broken}; restart it from an earlier "
                      "checkpoint (resume=PATH) or train afresh")


def _read_checked(path: Path, map_location: Any) -> tuple[dict[str, Any], str | None]:
    """(state, what is wrong with it or None); a file torch cannot read is wrong too."""
    try:
        state = load(path, map_location=map_location)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the file's
        reason = str(exc).strip().splitlines()[0].split(". ")[0][:160] if str(exc).strip() else ""
        return {}, f"it cannot be read ({type(exc).__name__}{': ' + reason if reason else ''})"
    if not isinstance(state, dict):
        return {}, "it is not a launch checkpoint"
    return state, integrity.broken_seal(state, path)


def load(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    return torch.load(path, map_location=map_location, weights_only=True)


def optimizer_states(state: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """(optimizer states, scheduler states), also from checkpoints written with one optimizer (launcher 0.1)."""
    if "optimizer_state_dicts" in state:
        return list(state["optimizer_state_dicts"]), list(state["scheduler_state_dicts"])
    return [state["optimizer_state_dict"]], [state["scheduler_state_dict"]]


class HostSnapshot:
    """A copy of a (nested) state with every tensor in host memory, which training can go on changing
    in place while the copy is written.

    The GPU tensors are copied, by non-blocking copies queued behind the work that made them, into one
    page-locked buffer (each tensor a view of it, `_Layout`): the host only queues them. With a `Stager`
    they are first copied on the device into one buffer kept there (one kernel launch or a few), and that
    buffer to the host by one copy on a side stream while training goes on; without one, each on the
    current stream, which the next step then waits for. The host's work at an epoch's end is then a
    handful of calls whatever the model's tensor count: one per tensor (a pinned allocation and a copy
    each, ~500 for ResNet-50's weights and momentum) held rank 0 of 2 H200s at each epoch's end, in which
    every rank waited (measured: BENCHMARKS.md section 6). `state()` waits for the copies and gives each
    tensor memory of its own, names that held one tensor (a tied weight) one copy (launcher/train/nested.py):
    the file stores each tensor by itself and a tied one once, as torch.save of the live state_dict would; the
    writer thread calls it, and the page-locked buffer goes back to torch's caching host allocator, whose
    blocks later epochs reuse.
    """

    def __init__(self, state: dict[str, Any], stager: Stager | None = None) -> None:
        self._gpu: list[torch.Tensor] = []
        self._state = nested.mapped(state, self._place)  # (a tied weight: one copy, under both its names)
        self._filled: dict[str, Any] | None = None
        staged = stager.copy(self._gpu) if stager is not None and stager.takes(self._gpu) else None
        self._host, self._layout, self._copied = staged if staged is not None else _to_host(self._gpu)

    def _place(self, t: torch.Tensor) -> Any:
        """A CPU tensor cloned; a GPU tensor's place in `_gpu`, whose copy `state()` puts there."""
        if t.device.type != "cuda":
            return t.detach().clone()
        self._gpu.append(t.detach())
        return _Slot(len(self._gpu) - 1)

    def _fill(self, obj: Any, hosts: list[torch.Tensor]) -> Any:
        if isinstance(obj, _Slot):
            return hosts[obj.index]
        if isinstance(obj, dict):
            return {k: self._fill(v, hosts) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._fill(v, hosts) for v in obj)
        return obj

    def add(self, **plain: Any) -> None:
        """Add plain entries (the epoch, the history) known only after the copies were queued."""
        (self._filled if self._filled is not None else self._state).update(plain)

    def state(self) -> dict[str, Any]:
        if self._filled is None:
            for event in self._copied:
                event.synchronize()
            # (the views made here, on the writer thread, not at the epoch's end; clone keeps each view's
            # strides: channels_last filters stay so)
            hosts = [view.clone() for view in self._layout.views(self._host)] if self._layout is not None else []
            self._filled = self._fill(self._state, hosts)
            # (the page-locked buffer back to the allocator's cache; the live tensors let go)
            self._host, self._layout, self._copied, self._gpu = None, None, [], []
        return self._filled


class _Layout:
    """Where each of a list of tensors lies in one flat byte buffer: at an offset aligned to ALIGN bytes,
    with its own strides where they lay its elements out densely (contiguous, channels_last, any order of
    dimensions), else contiguous ones (a tensor with gaps between its elements is copied without them)."""

    ALIGN = 256

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.specs: list[tuple[int, int, torch.dtype, tuple[int, ...], tuple[int, ...]]] = []
        offset = 0
        for t in tensors:
            size = t.numel() * t.element_size()
            self.specs.append((offset, size, t.dtype, tuple(t.shape), _dense_strides(t)))
            offset += -(-size // self.ALIGN) * self.ALIGN
        self.nbytes = offset

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The tensors' places in `flat` (uint8, `nbytes` long), as tensors of their dtypes, shapes and strides."""
        return [flat[offset:offset + size].view(dtype).as_strided(shape, strides)
                for offset, size, dtype, shape, strides in self.specs]


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.shape[d] != 1 and t.stride(d) != expected:
            contiguous = [1] * t.dim()
            for i in range(t.dim() - 2, -1, -1):
                contiguous[i] = contiguous[i + 1] * max(1, t.shape[i + 1])
            return tuple(contiguous)
        expected *= t.shape[d]
    return tuple(t.stride())


def warm_pinned_memory(state: dict[str, Any], copies: int, share: float = 0.25) -> int:
    """Have torch's caching host allocator hold pinned blocks for `copies` host copies of `state`'s GPU
    tensors (one block each, as HostSnapshot takes them), so that epochs' snapshots reuse them instead of
    allocating pinned memory on the training thread at the ends of the first epochs (cudaHostAlloc, slow for
    ResNet-18's 90 MB and far slower for GPT-2 124M's 1.5 GB of weights and AdamW moments, on an H200 host,
    where under ddp every rank waited for it: 2 GPUs ran well below the speed they have without checkpoints;
    measured: BENCHMARKS.md sections 7 and 12). The allocator keeps those blocks for the run whatever happens
    here, so this only moves their cost off the training thread. As many copies as fit in `share` of the
    machine's memory; none where pinning fails. Returns the copies warmed."""
    tensors = [t for t in nested.tensors_in(state) if t.device.type == "cuda"]
    nbytes = _Layout(tensors).nbytes
    if not nbytes:
        return 0
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        memory = 0
    block = 1 << (nbytes - 1).bit_length()  # (the allocator rounds a request up to a power of two)
    copies = min(copies, int(share * memory // block)) if memory else 1
    try:
        blocks = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(copies)]
    except RuntimeError as e:  # (pinned memory refused: the snapshots will allocate as they go, or copy unpinned)
        log.info("checkpoint snapshots: pinned host memory not held ahead (%s)", str(e).splitlines()[0])
        return 0
    del blocks  # back to the allocator's cache
    return copies


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index


def _to_host(tensors: list[torch.Tensor]) -> tuple[torch.Tensor | None, _Layout | None, list]:
    """Non-blocking copies into one host buffer on each tensor's device's current stream: (the buffer, where
    each tensor lies in it, the events after the copies)."""
    if not tensors:
        return None, None, []
    layout = _Layout(tensors)
    host = _host_buffer(layout.nbytes)
    for view, t in zip(layout.views(host), tensors, strict=True):
        view.copy_(t, non_blocking=True)
    devices = sorted({t.device for t in tensors}, key=str)
    return host, layout, [torch.cuda.current_stream(d).record_event() for d in devices]


_said_unpinned: list[str] = []


def _host_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked memory from torch's caching host allocator; where that is refused (the host's
    memory short), ordinary memory, said once: the copies into it then hold the training thread until the
    GPU has made them, slower but whole."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        if not _said_unpinned:
            _said_unpinned.append(str(e))
            log.warning("checkpoint snapshots: %d MB of page-locked host memory refused (%s); copying into "
                        "ordinary memory, which holds training at each checkpoint", nbytes >> 20,
                        str(e).splitlines()[0])
        return torch.empty(nbytes, dtype=torch.uint8)


class Stager:
    """Device-side staging for a `HostSnapshot`: the GPU tensors copied into one buffer kept on the same GPU
    (`_foreach_copy_`: a few kernels, far quicker for ResNet-18's 90 MB on an H200 than the copy over PCIe),
    then that buffer to pinned host memory by one copy on a side stream while the next steps run, instead of
    the next step waiting for the copy over PCIe (on rank 0, and so under ddp for every rank; measured:
    BENCHMARKS.md section 12). Costs one more copy of the state on the GPU, kept for the run, so only states
    up to `share` of the GPU's memory are staged, and only while the steps leave room for it: a run whose
    batch was sized to fill the GPU in its first epoch would otherwise run out of memory in its second (GPT-2
    124M's state is 1.5 GB). Where there is no room, or the buffer cannot be had, the state is copied directly
    (the next step waits for that copy) and a buffer kept from before is let go."""

    HEADROOM = 0.9  # of the memory this process can have: what the epoch's peak and the kept buffer may fill

    def __init__(self, device: torch.device, share: float = 0.05):
        self.device = device
        self.limit = share * torch.cuda.get_device_properties(device).total_memory
        self.side = torch.cuda.Stream(device)
        self._key: list | None = None  # the tensors' dtypes, shapes and strides that _flat is laid out for
        self._layout: _Layout | None = None
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._read: torch.cuda.Event | None = None  # the side stream's copy of the buffer is done
        self._said = False

    def takes(self, tensors: list[torch.Tensor]) -> bool:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if not (tensors and nbytes <= self.limit and all(t.device == self.device for t in tensors)):
            return False
        if self._room_for(_Layout(tensors).nbytes):
            return True
        self._let_go("the steps' peak and the kept copy would come within "
                     f"{1 - self.HEADROOM:.0%} of the GPU's memory")
        return False

    def _room_for(self, nbytes: int) -> bool:
        """Whether a buffer of `nbytes`, kept through the next epochs, leaves the steps the memory they
        took in this one: this epoch's peak (the kept buffer taken out: it was held all epoch) and the
        buffer within HEADROOM of what this process can have (the GPU's free memory and its own cache)."""
        held = self._flat.numel() if self._flat is not None else 0
        peak = torch.cuda.max_memory_allocated(self.device) - held
        free, _ = torch.cuda.mem_get_info(self.device)
        return peak + nbytes <= self.HEADROOM * (free + torch.cuda.memory_reserved(self.device))

    def _let_go(self, why: str) -> None:
        if self._flat is not None or not self._said:
            log.info("checkpoint snapshots: copied to the host directly, not staged on the GPU (%s)", why)
            self._said = True
        self._drop()

    def _drop(self) -> None:
        if self._read is not None:
            torch.cuda.current_stream(self.device).wait_event(self._read)  # (the last copy has left it)
        self._key, self._layout, self._flat, self._views, self._read = None, None, None, [], None

    def copy(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, _Layout, list] | None:
        """The tensors queued to one host buffer: (the buffer, where each lies in it, the event after the
        copy); None where the GPU cannot give the buffer (copy them directly)."""
        compute = torch.cuda.current_stream(self.device)
        if self._read is not None:
            compute.wait_event(self._read)  # the last snapshot has left the buffer
        key = [(t.dtype, t.shape, t.stride()) for t in tensors]
        if key != self._key:
            self._drop()  # (before the new one is made: never both at once)
            layout = _Layout(tensors)
            try:
                self._flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError:
                self._let_go(f"{layout.nbytes >> 20} MB more of GPU memory refused")
                return None
            self._key, self._layout, self._views = key, layout, layout.views(self._flat)
        torch._foreach_copy_(self._views, tensors)
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            host = _host_buffer(self._layout.nbytes)
            host.copy_(self._flat, non_blocking=True)
            self._read = self.side.record_event()
        return host, self._layout, [self._read]


def save_snapshot(snapshot: HostSnapshot, path: Path, previous: bool = True) -> None:
    save_atomic(snapshot.state(), path, previous=previous)


class BackgroundWriter:
    """Writes checkpoints on a thread, so that rank 0's disk write does not hold up training (under ddp
    every other rank waits for rank 0 at its first all-reduce: a synchronous write of ResNet-18's state
    cost the 2-GPU run a large share of every epoch on the H200 host; measured: BENCHMARKS.md section 12).
    Writes happen one at a time, in order; one more may wait behind the one being written (a write of
    ResNet-18's 90 MB with fsync can take about an epoch), and a third `submit` waits for the oldest. An
    error in a write is raised at the next `submit` or at `wait`."""

    QUEUED = 2  # writes in flight (writing or waiting to) before `submit` waits

    def __init__(self, world: WorldInfo | None = None) -> None:
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher-checkpoint")
        self._pending: deque = deque()
        self.sharded: tuple[Any, Any, list[BaseException]] | None = None  # an async sharded save in flight
        self.world = world  # (sharded saves: the rank's place, where its writer process meets the others')
        self.shards: ShardWriter | None = None  # sharded saves' writer, made at the first
        self.last_write_s: float | None = None  # how long the last finished write took (the copy from the GPU too)
        lifetime.finish_first_on_sigterm(self.finish_in_flight)  # (a peer's failure must not lose the write)

    def shard_writer(self, strategy: Strategy, device: torch.device) -> ShardWriter:
        """Sharded saves' writer (launcher/train/shard_writer.py), made at the first use."""
        if self.shards is None:
            from launcher.train.shard_writer import ShardWriter
            from launcher.world import WorldInfo

            self.shards = ShardWriter(self.world or WorldInfo.from_env(), device,
                                      getattr(strategy.options, "timeout_s", 600))
        return self.shards

    def make_room(self) -> float:
        """Wait until one more write may be queued; the seconds waited (training's time, on rank 0)."""
        import time

        t = time.perf_counter()
        while self._pending and (self._pending[0].done() or len(self._pending) >= self.QUEUED):
            self._pending.popleft().result()  # (raises a failed write's error)
        return time.perf_counter() - t

    def submit(self, snapshot: HostSnapshot, path: Path, then: Callable[[Path, str | None], None] | None = None,
               previous: bool = True) -> None:
        """Write `snapshot` to `path` (keeping the one it replaces as previous.pt unless `previous` is false:
        checkpoint.keep_previous); then, on the same thread, `then(path, None)` (the best checkpoints)."""
        self.make_room()
        self._pending.append(self._pool.submit(self._write, snapshot, path, then, previous))

    def _write(self, snapshot: HostSnapshot, path: Path, then: Callable[[Path, str | None], None] | None,
               previous: bool) -> None:
        import time

        t = time.perf_counter()
        save_snapshot(snapshot, path, previous)
        self.last_write_s = time.perf_counter() - t
        if then is not None:
            then(path, None)

    def track_sharded(self, future: Any, finish: Callable[[], None],
                      failed: Callable[[BaseException], BaseException]) -> None:
        """An async sharded save: `finish` (rank 0's last.pt) runs when its future completes without error;
        otherwise `failed` cleans up and gives the error that the next wait raises."""
        import threading

        done, errors = threading.Event(), []

        def completed(f: Any) -> None:
            try:
                exc = f.exception()
                if exc is None:
                    finish()
                else:
                    errors.append(failed(exc))
            except BaseException as exc:  # (raised at the next wait)
                errors.append(exc)
            finally:
                done.set()

        self.sharded = (future, done, errors)
        future.add_done_callback(completed)

    def wait_sharded(self) -> None:
        """The async sharded save in flight, if any, complete on every rank, and its last.pt written."""
        if self.sharded is not None:
            future, done, errors = self.sharded
            self.sharded = None
            done.wait()
            if errors:
                raise errors[0]
            future.result()

    def finish_in_flight(self, deadline: float) -> None:
        """On SIGTERM (lifetime.finish_on_sigterm, from its own thread): the writes already submitted, and a
        sharded save in flight, finished by `deadline` (time.monotonic) where they can be. (Nothing logged:
        the main thread may hold the logging lock where the signal stopped it.)"""
        import concurrent.futures
        import time

        concurrent.futures.wait(list(self._pending), timeout=max(0.0, deadline - time.monotonic()))
        sharded = self.sharded
        if sharded is not None:
            sharded[1].wait(max(0.0, deadline - time.monotonic()))

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()
        self.wait_sharded()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            lifetime.forget_on_sigterm(self.finish_in_flight)
            self._pool.shutdown(wait=True)
            if self.shards is not None:
                self.shards.close()
