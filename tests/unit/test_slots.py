"""launcher/data/slots.py: DataLoader workers write batches into shared slots the training process copies from."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from launcher.data.slots import PinnedSlots


class Filler(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index


class IntoSlots:
    """A collate that writes each batch (its indices repeated, as bytes) into a slot where it can."""

    def __init__(self, slots: PinnedSlots, nbytes: int):
        self.slots, self.nbytes = slots, nbytes

    def __call__(self, indices: list[int]):
        data = torch.tensor(indices, dtype=torch.uint8).repeat_interleave(self.nbytes // len(indices))
        slot = self.slots.claim(data.numel())
        if slot is None:
            return data, -1
        self.slots.view(slot, data.numel()).copy_(data)
        return torch.empty(0, dtype=torch.uint8), slot


def test_workers_write_batches_into_their_own_slots_and_the_reader_frees_them():
    slots = PinnedSlots(workers=2, per_worker=3, nbytes=64)
    loader = torch.utils.data.DataLoader(Filler(), batch_size=4, num_workers=2, collate_fn=IntoSlots(slots, 40),
                                         multiprocessing_context="fork", prefetch_factor=1)
    seen = []
    for data, slot in loader:
        assert slot >= 0 and data.numel() == 0  # (each worker had a slot free)
        got = slots.to_device(slot, 40, torch.device("cpu"))
        seen += got.unique().tolist()
        # (freed once copied; its worker may already have claimed it again for its next batch)
    assert sorted(seen) == list(range(12))
    assert int(slots.busy.sum()) == 0  # every batch read: every slot free
    assert slots.owner.tolist() != [0, 0]  # (each worker id's process recorded)


def test_a_batch_too_large_or_without_a_free_slot_falls_back():
    slots = PinnedSlots(workers=1, per_worker=1, nbytes=16, wait=0.01)
    loader = torch.utils.data.DataLoader(Filler(), batch_size=4, num_workers=1, collate_fn=IntoSlots(slots, 40),
                                         multiprocessing_context="fork")
    for data, slot in loader:  # 40 bytes do not fit 16
        assert slot == -1 and data.numel() == 40
    small = torch.utils.data.DataLoader(Filler(), batch_size=4, num_workers=1, collate_fn=IntoSlots(slots, 8),
                                        multiprocessing_context="fork", prefetch_factor=3)
    kinds = [slot for _, slot in small]  # never read back: the one slot stays busy after the first batch
    assert kinds[0] == 0 and kinds[1:] == [-1, -1]
    assert slots.claim(8) is None  # (outside a worker: never)


def as_worker(monkeypatch, worker_id: int, workers: int) -> None:
    """This process as DataLoader worker `worker_id` (what get_worker_info says in a worker)."""
    info = SimpleNamespace(id=worker_id, num_workers=workers)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: info)


def test_each_worker_has_its_own_slots_and_a_batch_its_own_bytes(monkeypatch):
    slots = PinnedSlots(workers=2, per_worker=2, nbytes=16, wait=0.01)
    written = {}
    # worker 1 fills its slots first: worker 0 still gets two of its own
    for worker, sizes in ((1, (16, 5)), (0, (16, 8))):
        as_worker(monkeypatch, worker, 2)
        for size in sizes:
            slot = slots.claim(size)
            assert slot is not None, f"worker {worker} found no free slot of its own"
            data = torch.full((size,), len(written) + 1, dtype=torch.uint8)
            slots.view(slot, size).copy_(data)
            written[slot] = data
    assert len(written) == 4  # four slots: none shared
    for slot, data in written.items():  # batches of different sizes never overlap one another
        assert torch.equal(slots.to_device(slot, data.numel(), torch.device("cpu")), data)
    assert int(slots.busy.sum()) == 0
