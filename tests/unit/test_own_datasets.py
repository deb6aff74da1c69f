"""A recipe's own Datasets. An IterableDataset through the launcher's DataLoader (launcher/data/loader.py):
each rank takes every world_size-th sample of the stream, split again among its DataLoader workers. Both
ranks' shares are built here in one process (the split needs no process group), with real DataLoader
workers: every step's batch is the one expected, full, the ranks' and the workers' shares disjoint and
together the whole epoch; an evaluation reads the whole stream, its last partial batches too. An
evaluation's 0-dim batch means are weighed by their batches' samples (launcher/train/evaluation.py)."""

import contextlib
import math
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from launcher.config import DataConfig
from launcher.data.loader import DatasetSplit
from launcher.data.placement import Data, rank_order
from launcher.recipes import Recipe
from launcher.strategies.base import Nets
from launcher.train.evaluation import Evaluation
from tests.conftest import config_of

CPU = torch.device("cpu")
WORLD, WORKERS = 2, 2


class Stream(IterableDataset):
    """Sample ids 0..n-1 in an order drawn from the epoch it was told; each sample is (id, the epoch this
    process was told, the DataLoader worker that read it: -1 in the rank itself)."""

    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(epoch)).tolist()

    def __iter__(self):
        info = get_worker_info()
        for i in self.order(self.epoch):
            yield torch.tensor([i, self.epoch, -1 if info is None else info.id])


class Plain(Recipe):
    def __init__(self):  # (no config: the loader asks only for collate and on_after_batch_transfer)
        pass


def splits(n: int, per_rank: int, training: bool, workers: int = WORKERS) -> list[DatasetSplit]:
    options = DataConfig(workers=workers, worker_prefetch=2)
    return [DatasetSplit(Stream(n), Plain(), options, CPU, training, WORLD, rank, WORLD, per_rank)
            for rank in range(WORLD)]


def epoch(split: DatasetSplit, rows: torch.Tensor | list, number: int | None) -> list[torch.Tensor]:
    return [batch for batch, _ in split.batches(rows, number)]


def test_each_training_step_takes_a_full_batch_of_its_ranks_share_and_the_epoch_is_whole():
    n, per_rank = 40, 4  # a global batch of 8: 5 steps, every sample once
    ranks = splits(n, per_rank, training=True)
    try:
        for e in range(2):
            stream = ranks[0].dataset.order(e)
            trained = []
            for rank, split in enumerate(ranks):
                rows = rank_order(n, WORLD * per_rank, 0, e, WORLD, rank)
                got = epoch(split, rows, e)
                share = stream[rank::WORLD]  # every world_size-th sample of the stream
                assert [b[:, 0].tolist() for b in got] == [share[s * per_rank:(s + 1) * per_rank]
                                                           for s in range(len(rows))], f"rank {rank}, epoch {e}"
                assert all(b[:, 1].eq(e).all() for b in got), f"the workers were not told epoch {e}"
                assert {w for b in got for w in b[:, 2].tolist()} == set(range(WORKERS))  # both workers read
                trained += [i for b in got for i in b[:, 0].tolist()]
            assert sorted(trained) == list(range(n))  # disjoint, and together the whole epoch
    finally:
        for split in ranks:
            split.close()


def test_a_resumed_epochs_rest_goes_on_from_its_step_not_from_the_streams_start():
    n, per_rank = 48, 4  # 6 steps
    ranks = splits(n, per_rank, training=True, workers=WORKERS)
    try:
        stream = ranks[0].dataset.order(1)
        for rank, split in enumerate(ranks):
            rows = rank_order(n, WORLD * per_rank, 0, 1, WORLD, rank)[4:]  # resumed at step 5 of 6
            got = epoch(split, rows, 1)
            share = stream[rank::WORLD]
            assert [b[:, 0].tolist() for b in got] == [share[s * per_rank:(s + 1) * per_rank] for s in (4, 5)]
    finally:
        for split in ranks:
            split.close()


def test_an_evaluation_reads_every_sample_of_the_stream_once_over_uneven_shares():
    n, per_rank = 43, 3  # rank 0: 22 samples, rank 1: 21; each ends in a partial batch
    for workers in (0, WORKERS):
        ranks = splits(n, per_rank, training=False, workers=workers)
        try:
            stream = ranks[0].dataset.order(0)
            seen = []
            for rank, split in enumerate(ranks):
                got = epoch(split, [], None)
                share = stream[rank::WORLD]
                batches = [share[s:s + per_rank] for s in range(0, len(share), per_rank)]
                assert [b[:, 0].tolist() for b in got] == batches, f"rank {rank}, {workers} workers"
                seen += [i for b in got for i in b[:, 0].tolist()]
            assert sorted(seen) == list(range(n))
        finally:
            for split in ranks:
                split.close()


class Squares(Dataset):
    def __len__(self):
        return 37

    def __getitem__(self, i):
        return {"x": torch.zeros(4), "value": torch.tensor(float(i * i))}


class MeanOfBatch(Plain):
    def eval_step(self, model, batch):
        return {"value": batch["value"].mean(), "per_sample": batch["value"]}


def test_an_evaluations_batch_means_are_weighed_by_their_samples_over_an_uneven_last_chunk():
    """37 samples in chunks of 10 (the last one 7): the reported figure is the exact mean over the samples
    (438), not the mean of the chunks' means (487.1), a 0-dim mean and a per-sample figure alike."""
    cfg = config_of("gpus=[]", "eval.batch_size=10")
    single = SimpleNamespace(world_size=1, rank=0, lockstep_eval=False, all_reduce=lambda t, op="sum": t,
                             reduce_host=lambda values, op="sum": values)
    recipe = MeanOfBatch()
    test = DatasetSplit(Squares(), recipe, DataConfig(workers=0), CPU, False, 1, 0, 1, 10)
    data = Data(test, test, "workers", "", 0.0, 0, False, None, None, False, None, in_memory=False)
    evaluation = Evaluation(cfg, recipe, single, CPU, contextlib.nullcontext, SimpleNamespace(warmup_s=None))
    model = nn.Linear(4, 1)
    row = evaluation.read_now(Nets(model, model, model), data, warmed=False)
    exact = sum(i * i for i in range(37)) / 37
    assert math.isclose(row["test_value"], exact, rel_tol=1e-6), row
    assert math.isclose(row["test_per_sample"], exact, rel_tol=1e-6), row
