"""Page-locked buffers shared with the DataLoader workers, for batches too large to pin one by one.

    slots = PinnedSlots(workers=15, per_worker=6, nbytes=80 << 20)   # in the training process, before the
    ...                                                               # DataLoader's workers fork
    slot = slots.claim(nbytes)            # in a worker's collate: None when none is free or it is too small
    slots.view(slot, nbytes).copy_(...)   # the worker writes its batch there
    ...                                   # the batch carries (slot, nbytes), not the bytes
    x = slots.to_device(slot, nbytes, device)   # in the training process: one DMA straight from the slot

Why: a DataLoader hands a worker's batch over in a new shared-memory file each time; the training process's
pin-memory thread then maps it (a page fault every 4 KB), copies it into page-locked memory, and frees it.
For recipe=imagefolder's crops handed over unresized (about 67 MB a batch of 256) that one thread kept a
core busy on each of two H200s' ranks and fed them far less than the workers made (measured: BENCHMARKS.md
section 6; bench/results/regions-why-stacks-d0035ae.txt). Here the memory is shared once, before the workers
fork, and registered with CUDA once (cudaHostRegister): a worker writes its batch into one of its own slots
(each worker has `per_worker` of them, so no two processes ever claim the same one), the training process
copies it to the GPU by DMA without touching it, and frees the slot once that copy has run (an event).

Where no slot is free within `wait` seconds (the training process is behind) or the batch does not fit, the
caller falls back to a tensor of its own: slots only ever make a batch cheaper, never hold one up for long.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import numpy as np
import torch

from launcher.lifetime import process_alive

log = logging.getLogger("launcher.train")


class PinnedSlots:
    def __init__(self, workers: int, per_worker: int, nbytes: int, wait: float = 0.05):
        if workers < 1 or per_worker < 1 or nbytes < 1:
            raise ValueError(f"PinnedSlots needs workers, per_worker and nbytes >= 1, got {workers}, {per_worker}, "
                             f"{nbytes}")
        self.workers, self.per_worker, self.nbytes, self.wait = workers, per_worker, nbytes, wait
        count = workers * per_worker
        # (made in shared memory directly: its pages are taken only as slots are first written, and the
        # slots are claimed lowest first, so a run that needs few of them touches few)
        storage = torch.UntypedStorage._new_shared(count * nbytes)
        self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (count * nbytes,), (1,))
        self.busy = torch.zeros(count, dtype=torch.int8).share_memory_()  # 1: a worker wrote it, not yet copied
        self.owner = torch.zeros(workers, dtype=torch.int64).share_memory_()  # each worker id's process
        self._busy: np.ndarray | None = None  # (this process's numpy view of `busy`: cheap to read and write)
        self._pinned = np.zeros(count, dtype=bool)  # slots page-locked for CUDA (in the training process)
        self._failed = False
        self._creator = os.getpid()  # (the training process: the only one that page-locks slots)
        self._held: deque[tuple[torch.cuda.Event, int]] = deque()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_busy": None, "_held": deque(), "_pinned": np.zeros_like(self._pinned)}

    def _flags(self) -> np.ndarray:
        if self._busy is None:
            self._busy = self.busy.numpy()
        return self._busy

    def claim(self, nbytes: int) -> int | None:
        """A free slot of this DataLoader worker's for a batch of `nbytes`, marked busy; None outside a worker,
        for a batch larger than a slot, or when none of the worker's slots comes free within `wait`."""
        info = torch.utils.data.get_worker_info()
        if info is None or info.id >= self.workers or nbytes > self.nbytes:
            return None
        owner = int(self.owner[info.id])
        if owner != os.getpid():
            if owner != 0 and process_alive(owner):  # (another DataLoader's worker of the same id has these slots)
                return None
            self.owner[info.id] = os.getpid()
        flags, first = self._flags(), info.id * self.per_worker
        deadline = None
        while True:
            for slot in range(first, first + self.per_worker):
                if flags[slot] == 0:
                    flags[slot] = 1
                    return slot
            now = time.monotonic()
            deadline = deadline or now + self.wait
            if now >= deadline:
                return None
            time.sleep(0.001)

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * self.nbytes
        return self.buffer[start:start + nbytes]

    def to_device(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """The slot's first `nbytes` copied to `device` on the current stream (asynchronously where the
        slots are registered with CUDA); the slot is freed for its worker once that copy has run."""
        if device.type != "cuda":
            out = self.view(slot, nbytes).clone()
            self._flags()[slot] = 0
            return out
        self.release_done()
        pinned = self._register(slot)
        out = self.view(slot, nbytes).to(device, non_blocking=pinned)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self._held.append((done, slot))
        return out

    def release_done(self) -> None:
        """Free the slots whose copies have run."""
        flags = self._flags()
        while self._held and self._held[0][0].query():
            flags[self._held.popleft()[1]] = 0

    def _register(self, slot: int) -> bool:
        """Page-lock the slot for CUDA the first time it is copied from (in the training process, never in a
        worker): only the slots a run uses are locked. Whether it is."""
        if self._pinned[slot] or self._failed:
            return bool(self._pinned[slot])
        code = torch.cuda.cudart().cudaHostRegister(self.view(slot, self.nbytes).data_ptr(), self.nbytes, 0)
        if int(code) != 0:  # (copies from the slots are then synchronous, still without the pin thread's copy)
            log.warning("data: a shared batch slot could not be page-locked (cudaHostRegister: %s); batches are "
                        "copied from the slots without it", code)
            self._failed = True
            return False
        self._pinned[slot] = True
        return True

    def __del__(self) -> None:
        if getattr(self, "_creator", None) != os.getpid():
            return
        for slot in np.flatnonzero(self._pinned):
            try:
                torch.cuda.cudart().cudaHostUnregister(self.view(int(slot), self.nbytes).data_ptr())
            except Exception:  # noqa: BLE001 - at exit, CUDA may be gone already
                return



SLOT_MEMORY = 0.25  # of the host's memory, at most, for the ranks' PinnedSlots together


def batch_slots(workers: int, worker_prefetch: int, nbytes: int) -> PinnedSlots | None:
    """Shared, page-locked buffers for a rank's training batches of `nbytes` at most: each of its `workers`
    gets its prefetch's worth plus two, within SLOT_MEMORY of the host's memory and half of /dev/shm's free
    space, shared by the ranks on this machine (LOCAL_WORLD_SIZE); None without workers, or where that
    memory cannot be had."""
    if workers < 1:
        return None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    room = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * SLOT_MEMORY) // ranks
    try:  # (and half of what /dev/shm has free, shared with the batches that find no slot: a container's
        shm = os.statvfs("/dev/shm")  # /dev/shm may be small, and a write past it kills the worker)
        room = min(room, shm.f_bavail * shm.f_frsize // 2 // ranks)
    except OSError:
        pass
    per_worker = min(int(worker_prefetch) + 2, room // (workers * nbytes))
    if per_worker < 1:
        log.info("data: no shared batch slots (%d workers x %d MB do not fit in %d MB); batches of crops go "
                 "through the DataLoader's pinning", workers, nbytes >> 20, room >> 20)
        return None
    try:
        return PinnedSlots(workers, per_worker, nbytes)
    except RuntimeError as exc:  # (shared memory too small: a container's /dev/shm)
        log.warning("data: no shared batch slots (%s); batches of crops go through the DataLoader's pinning", exc)
        return None
