"""Where the time of making fsdp's host copy goes (the page-locked shared memory each sharded save copies a
rank's shards into), on one GPU, for one rank's shards of a Llama-shaped model: each step of how torch's
`_create_cpu_state_dict(pin_memory=True, share_memory=True)` makes it, against shared memory made at its size
with nothing copied into it, then pinned. A thread beside it wakes every millisecond and records its longest
wait: how long each step kept a training thread's Python from running.

    python bench/host_copy.py --layers 32 --ranks 2   # Llama 3.1 8B's shape, one rank's half: 16 GB of fp32

One JSON line per way: {"way", "gb", "seconds": {step: s}, "longest_gil_wait_s": {step: s}}.
"""

from __future__ import annotations

import argparse
import json
import threading
import time


class Ticker:
    """A thread that sleeps a millisecond at a time and records its longest wake-up delay."""

    def __init__(self) -> None:
        self.worst, self._stop = 0.0, False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            time.sleep(0.001)
            now = time.perf_counter()
            self.worst, last = max(self.worst, now - last), now

    def take(self) -> float:
        worst, self.worst = self.worst, 0.0
        return round(worst, 3)

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


def shards(layers: int, ranks: int, device: str) -> list:
    import torch

    dim, kv, hidden, vocab = 4096, 1024, 14336, 128256
    shapes = [(vocab, dim), (vocab, dim)]
    for _ in range(layers):
        shapes += [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (hidden, dim), (dim, hidden), (hidden, dim),
                   (dim,), (dim,)]
    return [torch.empty((s[0] // ranks, *s[1:]), device=device).normal_() for s in shapes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()

    import torch
    from torch.cuda import _pin_memory_utils as pins

    state = shards(args.layers, args.ranks, "cuda")
    torch.cuda.synchronize()
    gb = round(sum(t.numel() * t.element_size() for t in state) / 1e9, 2)
    ticker = Ticker()

    def timed(seconds: dict, waits: dict, step: str, fn):
        ticker.take()
        started = time.perf_counter()
        out = fn()
        seconds[step] = round(time.perf_counter() - started, 2)
        waits[step] = ticker.take()
        return out

    def stage(seconds: dict, waits: dict, host: list) -> None:
        def copy():
            for h, t in zip(host, state, strict=True):
                h.copy_(t, non_blocking=True)
            torch.cuda.synchronize()
        timed(seconds, waits, "staged_copy", copy)

    def release(host: list) -> None:
        for h in host:
            pins.unpin_memory(h.data_ptr())
        host.clear()

    def pinned_and_said(way: str, seconds: dict, waits: dict, host: list) -> None:
        """`host` pinned (timed), the step totals, a save's copies into it timed, freed, one JSON line."""
        timed(seconds, waits, "pin", lambda: [pins.pin_memory(h.data_ptr(), h.numel() * h.element_size())
                                              for h in host])
        seconds["total"] = round(sum(seconds.values()), 2)
        stage(seconds, waits, host)
        release(host)
        print(json.dumps({"way": way, "gb": gb, "seconds": seconds, "longest_gil_wait_s": waits}), flush=True)

    def new_shared():
        out = []
        for t in state:
            storage = torch.UntypedStorage._new_shared(t.numel() * t.element_size())
            out.append(torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape))
        return out

    with torch.cuda.stream(torch.cuda.Stream()):
        # torch's way: a copy of each shard in ordinary memory (DTensor.to("cpu")), a new shared tensor, pinned
        seconds, waits = {}, {}
        timed(seconds, waits, "to_cpu", lambda: [t.to("cpu") for t in state])
        host = timed(seconds, waits, "share_memory", lambda: [torch.empty(t.shape).share_memory_() for t in state])
        pinned_and_said("torch _create_cpu_state_dict", seconds, waits, host)
        # shared memory of each shard's size, nothing copied into it, then pinned (shard_writer.host_copy_of)
        seconds, waits = {}, {}
        host = timed(seconds, waits, "new_shared", new_shared)
        pinned_and_said("new shared, pinned", seconds, waits, host)
    ticker.stop()


if __name__ == "__main__":
    main()
