"""A recipe's Datasets through the launcher's DataLoader (launcher/data/loader.py): one pass runs through the
epochs, so the workers read the next epoch's first batches before the loop asks for them, each batch read with
its own epoch told to the Dataset; rows other than the planned ones start a pass of their own."""

import json
import os
import time

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from launcher.config import DataConfig
from launcher.data.loader import DatasetSplit, check_datasets
from launcher.data.placement import rank_order
from launcher.errors import ConfigError
from launcher.recipes import Recipe

CPU = torch.device("cpu")


class Journal(Dataset):
    """Sample i of epoch e is (i, e as this process was told); every read is written to a journal file."""

    def __init__(self, n: int, journal: str):
        self.n, self.journal, self.epoch = n, journal, -1

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, i):
        with open(self.journal, "a") as f:
            f.write(json.dumps([os.getpid(), self.epoch, i, time.monotonic()]) + "\n")
        return torch.tensor([i, self.epoch])


class Plain(Recipe):
    def __init__(self):  # (no config: the loader asks only for collate and on_after_batch_transfer)
        pass


def reads(journal) -> list[list]:
    return [json.loads(line) for line in open(journal).read().splitlines()] if os.path.exists(journal) else []


def make(tmp_path, workers: int, epochs: int = 3, n: int = 40, batch: int = 4):
    def order(epoch):
        return rank_order(n, batch, seed=7, epoch=epoch)

    split = DatasetSplit(Journal(n, str(tmp_path / "journal.jsonl")), Plain(), DataConfig(workers=workers,
                         worker_prefetch=2), CPU, True, 1, 0, 1, batch,
                         upcoming=lambda e: order(e) if e < epochs else None)
    return split, order, str(tmp_path / "journal.jsonl")


def epoch_of(split, rows, epoch):
    got = [(b, idx) for b, idx in split.batches(rows, epoch)]
    for (b, idx), row in zip(got, rows, strict=True):
        assert b[:, 0].tolist() == row.tolist() == idx.tolist()  # the rows asked, in their order
        assert b[:, 1].tolist() == [epoch] * len(row)  # each sample read with its own epoch
    return got


def test_workers_read_the_next_epochs_first_batches_before_the_loop_asks(tmp_path):
    split, order, journal = make(tmp_path, workers=2)
    loader_iter = None
    for epoch in range(3):
        epoch_of(split, order(epoch), epoch)
        if epoch == 0:
            loader_iter = split._pass.batches
        assert split._pass.batches is loader_iter  # one pass, not one per epoch
        if epoch < 2:  # the loop's epoch end: the workers go on meanwhile, into the next epoch's first row
            first_row = set(order(epoch + 1)[0].tolist())
            deadline = time.monotonic() + 20
            while not first_row <= {r[2] for r in reads(journal) if r[1] == epoch + 1}:
                assert time.monotonic() < deadline, "the next epoch's first row was not read before it was asked for"
                time.sleep(0.05)
    # every sample of every epoch read once, with its epoch, and nothing past the last epoch
    done = reads(journal)
    assert sorted((r[1], r[2]) for r in done) == sorted((e, i) for e in range(3) for i in range(40))


def test_a_warm_up_or_a_resumed_epochs_rest_starts_a_pass_of_its_own(tmp_path):
    split, order, journal = make(tmp_path, workers=2)
    got = [idx.tolist() for _, idx in split.batches(order(0)[:2])]  # a warm-up: rows outside the epochs
    assert got == order(0)[:2].tolist()
    epoch_of(split, order(1)[3:], 1)  # a resumed epoch's remainder
    epoch_of(split, order(2), 2)  # goes on from it
    rows = order(0)
    epoch_of(split, torch.flip(rows, [0]), 0)  # rows that are not the planned ones: read as asked
    # a pass left early is not continued
    batches = split.batches(order(1), 1)
    next(batches)
    batches.close()
    epoch_of(split, order(2), 2)


def test_an_epoch_asked_for_with_other_rows_than_planned_reads_the_rows_asked(tmp_path):
    split, order, journal = make(tmp_path, workers=2)
    epoch_of(split, order(0), 0)  # its pass reads on into epoch 1's planned rows
    epoch_of(split, torch.flip(order(1), [0]), 1)  # the same epoch in another order: a pass of its own

def test_without_workers_the_epoch_is_told_in_the_training_process(tmp_path):
    split, order, journal = make(tmp_path, workers=0)
    for epoch in range(2):
        epoch_of(split, order(epoch), epoch)
    assert {r[0] for r in reads(journal)} == {os.getpid()}


class Gappy(Dataset):
    """Samples 3, 5 and 6 are None: files the Dataset could not read and chose to skip."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return None if i in (3, 5, 6) else torch.tensor([i])


def test_samples_the_dataset_skips_are_left_out_of_their_batches_and_all_counted():
    split = DatasetSplit(Gappy(), Plain(), DataConfig(workers=0), CPU, True, 1, 0, 1, 4)
    got = [b.view(-1).tolist() for b, _ in split.batches(torch.arange(12).view(3, 4), 0)]
    assert got == [[0, 1, 2], [4, 7], [8, 9, 10, 11]]
    assert split.skipped == 3


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(8).view(8, 1))


def test_a_training_stream_without_a_length_is_one_line_and_an_evaluation_stream_needs_none(tmp_path):
    mapped = Journal(8, str(tmp_path / "journal.jsonl"))
    with pytest.raises(ConfigError, match=r"training IterableDataset has no __len__.*\(e\.g\. launch recipe=mine\)"):
        check_datasets(Stream(), mapped, "mine")
    check_datasets(mapped, Stream(), "mine")  # (an evaluation reads a stream to its end)
