"""Batch semantics: `batch_size` is global, and DDP ranks split each step's batch, not the epoch."""

import torch

from launcher.strategy import choose
from launcher.trainer import triangular_schedule


def epoch_order(n, batch, seed, epoch, world, rank):
    """The trainer's rule, restated: one permutation per (seed, epoch); rank r takes its slice of each row."""
    from types import SimpleNamespace

    from launcher.trainer import _Run

    run = object.__new__(_Run)
    run.cfg = SimpleNamespace(seed=seed, batch_size=batch)
    run.train_y = torch.zeros(n)
    run.steps_per_epoch = n // batch
    run.layout = choose("ddp" if world > 1 else "single", 0, world, batch)
    run.world_size, run.rank, run.device = world, rank, torch.device("cpu")
    return run._epoch_order(epoch)


def test_ddp_ranks_together_see_exactly_the_single_process_batches():
    single = epoch_order(1000, 64, seed=5, epoch=2, world=1, rank=0)
    ranks = [epoch_order(1000, 64, seed=5, epoch=2, world=4, rank=r) for r in range(4)]
    assert single.shape == (15, 64) and ranks[0].shape == (15, 16)
    assert torch.equal(torch.cat(ranks, dim=1), single)
    flat = torch.cat([r.flatten() for r in ranks])
    assert len(set(flat.tolist())) == flat.numel()  # disjoint: no image twice in an epoch


def test_epochs_differ_and_seed_reproduces():
    a = epoch_order(500, 50, seed=1, epoch=0, world=1, rank=0)
    assert torch.equal(a, epoch_order(500, 50, seed=1, epoch=0, world=1, rank=0))
    assert not torch.equal(a, epoch_order(500, 50, seed=1, epoch=1, world=1, rank=0))


def test_triangular_schedule_rises_then_falls_to_zero():
    f = triangular_schedule(total_steps=100, warmup_steps=10)
    assert f(0) == 0.1 and f(9) == 1.0
    assert f(10) == 1.0 and 0 < f(50) < 1 and f(100) == 0.0
