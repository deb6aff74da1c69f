"""Sharded checkpoints (strategy=fsdp) written by a process beside each rank, not by a thread of it.

Writing a checkpoint with torch.distributed.checkpoint is mostly Python (planning, serializing each
tensor, its collectives), and on a thread of the training process it takes the GIL from the thread that
issues the steps. Measured on 2 H200s (GPT-2 124M under fsdp, a checkpoint after each epoch): staging
into a kept page-locked copy was faster than dcp.async_save as is, and the writer a process, not a thread,
was as fast as no checkpoints at all in the same calls (measured: BENCHMARKS.md section 5).

    ShardWriter.make_host_copy(state) on a thread while the first epoch trains (Saves.warm_pinned_memory):
                                      the host copy kept for the run (page-locked shared memory)
    ShardWriter.save(state, folder)   on the training thread: the state's tensors copied into that copy by
                                      copies queued behind the last step: nothing waits. Returns a future,
                                      done when every rank's shards are on disk.
    (the writer thread)               waits for those copies, hands the copy to the process (its shared
                                      memory: nothing is copied again) and waits for its answer
    (the process, `_serve`)           dcp.save over a gloo group of the writer processes of every rank,
                                      met on the workers' own store under a prefix of this attempt
                                      (nothing new listens anywhere); forked at the rank's start
                                      (`start_early`), shown by ps as launch-shards; it dies with its rank
                                      (parent-death signal), and ends when the writer closes

One save at a time: the next waits for the last (checkpoint.BackgroundWriter.wait_sharded), so the
host copy is never overwritten while it is read. Where /dev/shm cannot hold the host copy (a container's
default is 64 MB), it is kept in ordinary page-locked memory and each save is pickled through the pipe,
said once with what to give the container.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.world import WorldInfo

if TYPE_CHECKING:
    import torch

# No torch here at import time: the writer process imports this module before `_serve` runs, and a rank
# killed while it imported torch (seconds) left its writer, and multiprocessing's resource tracker whose
# pipe the writer holds, running that long. `_serve` arms its parent-death signal first, then imports.

log = logging.getLogger("launcher.train")

READY = "ready"
PROCESS_NAME = "launch-shards"  # what ps and top show for a writer process


class ShardWriter:
    def __init__(self, world: WorldInfo, device: torch.device, timeout_s: float) -> None:
        self.world, self.device, self.timeout_s = world, device, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher-shards")
        self._host: tuple[tuple, dict[str, Any]] | None = None  # (the layout it was made for, the copy)
        self._process: Any = None
        self._conn: Any = None
        self._started: Future | None = None  # the process has met the others' (its gloo group is up)
        self._piped = False  # /dev/shm could not hold the host copy: each save is sent through the pipe, pickled

    def make_host_copy(self, state: dict[str, Any]) -> None:
        """The host copy that each save copies this rank's shards into, made for `state`'s tensors (as
        torch.distributed.checkpoint.get_state_dict gives them): page-locked shared memory on a GPU (the
        copies into it are queued, not waited for; the writer process reads it where it is). Making it is
        the slow part of a save (~12 bytes a parameter / ranks with AdamW, each page of it allocated, then
        locked), so Saves.warm_pinned_memory has it made on a thread while the first epoch trains: made at
        the first save's call, every step after the epoch waited for it (measured: BENCHMARKS.md section
        5). Nothing is copied into it here: each save writes its own values (`host_copy_of`)."""
        try:
            host, self._piped = host_copy_of(state, pin=self.device.type == "cuda", shared=True), False
        except RuntimeError as exc:
            if "shared memory" not in str(exc):
                raise
            if not self._piped:  # (said once, not again for a copy made again)
                log.warning(_short_of_shared_memory(state),  # (the console hears it once: from rank 0)
                            extra={"file_only": True} if self.world.rank else {})
            self._piped = True
            host = host_copy_of(state, pin=self.device.type == "cuda", shared=False)
        self._host = (_layout(state), host)

    def save(self, state: dict[str, Any], folder: Path) -> Future:
        """Write `state` (as torch.distributed.checkpoint.get_state_dict gives it: this rank's shards) to
        `folder`; the future is done when every rank's writer has written its part, or has the error."""
        import torch
        from torch.distributed._state_dict_utils import _copy_state_dict

        gpu = self.device.type == "cuda"
        if self._host is None or self._host[0] != _layout(state):  # (none made ahead, or not for this state)
            if self._host is not None:  # (an optimizer's state for a parameter that had no gradient before)
                log.info("checkpoint: this rank's state changed its tensors since the first step, so its host "
                         "copy is made again here, on the training thread", extra={"file_only": bool(self.world.rank)})
            self._host = None  # (an old copy let go before the new one is made)
            self.make_host_copy(state)
        assert self._host is not None
        staged = _copy_state_dict(state, self._host[1], non_blocking=gpu)
        copied = torch.cuda.current_stream(self.device).record_event() if gpu else None
        if self._process is None:
            self._start()  # (here, on the training thread, which lives as long as the rank: the process's
            # parent-death signal follows the thread that started it; start_early's was the same thread)
        return self._pool.submit(self._write, staged, copied, folder)

    def _start(self) -> None:
        """The process: the one start_early forked for this rank, else one spawned now (a fresh interpreter:
        a fork of a rank that has threads and may have touched CUDA is not safe)."""
        global _early
        args = _serve_args(self.world, self.timeout_s)
        if _early is not None and _early[2] == args:
            self._process, self._conn, _ = _early
            _early = None
        else:
            self._process, self._conn = _start_process("spawn", args)
        self._started = self._pool.submit(self._answer)

    def _answer(self) -> None:
        """The process's answer to the last request (READY or None: done); its error raised here."""
        try:
            reply = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(f"the checkpoint writer process of rank {self.world.rank} ended "
                               f"(exit code {self._process.exitcode})") from None
        if isinstance(reply, BaseException):
            raise reply

    def _write(self, staged: dict[str, Any], copied: Any, folder: Path) -> None:
        if copied is not None:
            copied.synchronize()
        assert self._started is not None
        self._started.result()
        if self._piped:  # (plain pickling: tensors by value, where the pipe's own would move them to /dev/shm)
            import pickle

            self._conn.send_bytes(pickle.dumps((str(folder), staged), protocol=pickle.HIGHEST_PROTOCOL))
        else:
            self._conn.send((str(folder), staged))
        self._answer()

    def close(self) -> None:
        """The last save waited for (by the caller), the process told to end and joined; killed if it
        does not end within 30 s."""
        self._pool.shutdown(wait=True)
        if self._process is None:
            return
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._process = None


_early: tuple[Any, Any, tuple] | None = None  # (process, its pipe, its arguments): start_early's, not yet taken


def start_early(world: WorldInfo, timeout_s: float) -> None:
    """Fork this rank's writer process now, at the worker's start, where the worker has no other thread and
    has not touched CUDA (train/loop.py calls this first): a fork shares the modules the worker already
    imported, where a process spawned at the first save imported torch anew, seconds of CPU beside the
    training steps. The first save takes it (ShardWriter._start); a run that never saves leaves it waiting,
    and it ends with the rank."""
    global _early
    args = _serve_args(world, timeout_s)
    process, conn = _start_process("fork", args)
    _early = (process, conn, args)


def _serve_args(world: WorldInfo, timeout_s: float) -> tuple:
    """`_serve`'s arguments after the pipe and the parent: the rank's place and its attempt's store prefix."""
    return (world.rank, world.world_size, world.master_addr, world.master_port,
            f"launcher/attempt{world.restart_count}/shard-writer", timeout_s)


def _start_process(method: str, args: tuple) -> tuple[Any, Any]:
    """A writer process started by `method` (fork or spawn) with `_serve`'s `args`, and the rank's end of its pipe."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(method)
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_serve, name=f"launcher-shard-writer-{args[0]}", daemon=True,
                          args=(theirs, os.getpid(), *args))
    # Started with SIGINT ignored, which it keeps: a Ctrl-C at a terminal reaches its whole process group,
    # and the rank's own ending ends the writer (the parent-death signal), without a traceback from it
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        process.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, before)
    theirs.close()  # (the process's end: a recv here then fails when the process dies)
    return process, ours


def host_copy_of(state: Any, pin: bool, shared: bool) -> Any:
    """`state` (as get_state_dict gives it: dicts and lists of tensors, DTensors and plain values) with each
    tensor replaced by an uninitialised one of its shape and dtype in host memory, where a save copies its
    values: shared memory (`shared`: the writer process maps it, nothing is sent) and page-locked (`pin`:
    the copies into it are queued on the GPU, not waited for). A DTensor's copy keeps its spec (mesh,
    placements, global shape) and holds this rank's local shard.

    torch's `_create_cpu_state_dict` makes the same layout, but first copies each shard from the GPU into
    ordinary memory and then each new tensor into shared memory: two passes over the whole state whose
    values are thrown away, two thirds of its time for an 8B model's shards (bench/host_copy.py;
    BENCHMARKS.md section 5). Here the shared memory is made at its size and only locked."""
    import weakref

    import torch
    from torch.cuda import _pin_memory_utils as pins
    from torch.distributed.tensor import DTensor

    def tensor(like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if not shared or nbytes == 0 or like.dim() == 0:  # (a step count, or nothing: no pages to lock)
            made = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin and nbytes > 0 and not shared)
            return made.share_memory_() if shared else made
        storage = torch.UntypedStorage._new_shared(nbytes)  # (its pages allocated, nothing written into them)
        made = torch.empty(0, dtype=like.dtype).set_(storage, 0, like.shape)
        if pin:
            pins.pin_memory(made.data_ptr(), nbytes)
            weakref.finalize(made, pins.unpin_memory, made.data_ptr())
        return made

    def copy(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {key: copy(value) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            made = [copy(value) for value in obj]
            return tuple(made) if isinstance(obj, tuple) else made
        if isinstance(obj, DTensor):
            return DTensor(tensor(obj._local_tensor), obj._spec, requires_grad=False)
        return tensor(obj) if isinstance(obj, torch.Tensor) else obj

    return copy(state)


def _layout(obj: Any) -> tuple:
    """What a host copy made for `obj` must match to take its values: its keys, nesting, and each tensor's
    shape and dtype as this rank holds it."""
    if isinstance(obj, dict):
        return ("dict", tuple((k, _layout(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("seq", tuple(_layout(v) for v in obj))
    local = obj.to_local() if hasattr(obj, "to_local") else obj
    if hasattr(local, "shape") and hasattr(local, "dtype"):
        return (tuple(local.shape), local.dtype)
    return ()


def _short_of_shared_memory(state: dict[str, Any]) -> str:
    """What is said once where /dev/shm cannot hold this rank's host copy (a container's default is 64 MB)."""
    import shutil

    from launcher.train.nested import local_nbytes

    held = local_nbytes(state)

    try:
        free = f"{shutil.disk_usage('/dev/shm').free / 2**20:.1f} MB free"
    except OSError:
        free = "its free space unknown"
    return (f"strategy=fsdp's checkpoints: /dev/shm cannot hold this rank's shards ({held / 2**20:.1f} "
            f"MB; {free}), so each save is sent to its writer process through a pipe, pickled, which costs this "
            "rank more host time; give the machine or container more (e.g. docker run --shm-size=16g, or --ipc=host)")


def _serve(conn: Any, parent: int, rank: int, world_size: int, addr: str, port: int, prefix: str,
           timeout_s: float) -> None:
    """The writer process: meet the other ranks' writers, then write each state it is sent."""
    from launcher.lifetime import die_with_parent, name_this_process

    die_with_parent(signal.SIGKILL, parent)
    name_this_process(PROCESS_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (as it was started, where that was the training thread)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # (a DeviceMesh unpickled here warns
    # that its process groups are not in this process: they are not needed to write its shards)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    timeout = timedelta(seconds=timeout_s)
    try:
        store = (dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout) if world_size > 1
                 else dist.HashStore())  # (alone: no other writer to meet)
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
                                timeout=timeout)
        conn.send(READY)
    except BaseException as exc:  # noqa: BLE001 - said to the rank, which raises it
        _send_error(conn, exc)
        os._exit(1)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the rank is gone
            break
        if request is None:
            break
        folder, state = request
        try:
            dcp.save(state, checkpoint_id=folder)
            conn.send(None)
        except BaseException as exc:  # noqa: BLE001 - said to the rank, which raises it
            _send_error(conn, exc)
        del request, state
    os._exit(0)  # (a process group torn down politely can block on peers that are already gone)


def _send_error(conn: Any, exc: BaseException) -> None:
    """`exc` to the rank (`send` pickles it whole before writing anything); its text where it does not pickle."""
    try:
        conn.send(exc)
    except (OSError, ValueError):  # the rank is gone
        pass
    except Exception:  # noqa: BLE001 - not picklable (a traceback inside it, say)
        try:
            conn.send(RuntimeError(f"{type(exc).__name__}: {exc}"))
        except (OSError, ValueError):
            pass
