"""Batch semantics: `batch_size` is global, and DDP ranks split each step's batch, not the epoch."""

import math

import pytest
import torch

from launcher.config import Decay
from launcher.data.placement import eval_chunks, rank_order, warm_up_chunks
from launcher.train.optim import linear_decay, warmup_then_decay


def test_ddp_ranks_together_see_exactly_the_single_process_batches():
    single = rank_order(1000, 64, seed=5, epoch=2)
    ranks = [rank_order(1000, 64, seed=5, epoch=2, world_size=4, rank=r) for r in range(4)]
    assert single.shape == (15, 64) and ranks[0].shape == (15, 16)
    assert torch.equal(torch.cat(ranks, dim=1), single)
    flat = torch.cat([r.flatten() for r in ranks])
    assert len(set(flat.tolist())) == flat.numel()  # disjoint: no image twice in an epoch


def test_rank_shards_are_disjoint_and_cover_the_epoch():
    n, batch, world = 10_000, 2000, 2
    shards = [rank_order(n, batch, seed=3, epoch=1, world_size=world, rank=r) for r in range(world)]
    seen = [set(s.flatten().tolist()) for s in shards]
    assert not (seen[0] & seen[1])
    assert seen[0] | seen[1] == set(range(n))  # n is a multiple of the batch: every image, once


def test_epochs_differ_and_seed_reproduces():
    a = rank_order(500, 50, seed=1, epoch=0)
    assert torch.equal(a, rank_order(500, 50, seed=1, epoch=0))
    assert not torch.equal(a, rank_order(500, 50, seed=1, epoch=1))
    assert not torch.equal(a, rank_order(500, 50, seed=2, epoch=0))


def test_eval_chunks_split_the_test_set_between_ranks():
    chunks = [eval_chunks(1001, 100, world_size=2, rank=r) for r in range(2)]
    flat = sorted(torch.cat(chunks[0] + chunks[1]).tolist())
    assert flat == list(range(1001)) and max(len(c) for c in chunks[0]) == 100


def test_under_fsdp_every_rank_warms_evaluation_up_with_the_same_forwards():
    # GPT-2 on 2x H200 hung at its last epoch: 63 held-out windows in chunks of 16 a rank are [16, 16] on
    # rank 0 and [16, 15] on rank 1, and the warm-up ran one forward per size of each rank's own chunks
    for n, chunk, world in ((63, 16, 2), (1001, 100, 4), (10, 3, 3), (64, 16, 2)):
        mine = [eval_chunks(n, chunk, world, r, equal_counts=True) for r in range(world)]
        warmed = [[len(c) for c in warm_up_chunks(mine[r], n, chunk, world, lockstep=True)] for r in range(world)]
        assert all(w == warmed[0] for w in warmed)  # the same forwards, in the same order, on every rank
        assert set(warmed[0]) == {len(c) for chunks in mine for c in chunks}  # each size any rank evaluates
    assert [len(c) for c in warm_up_chunks(eval_chunks(63, 16, 2, 1, True), 63, 16, 2, lockstep=False)] == [16, 15]


def test_the_schedule_rises_then_falls_to_zero_or_its_floor_in_a_line_or_a_cosine():
    f = warmup_then_decay(total_steps=100, warmup_steps=10)
    assert f(0) == 0.1 and f(9) == 1.0
    assert f(10) == 1.0 and f(55) == 0.5 and f(100) == 0.0
    cosine = warmup_then_decay(100, 10, Decay.cosine, floor=0.1)  # (nanoGPT's: down to a tenth of lr)
    assert cosine(0) == 0.1 and cosine(10) == 1.0 and cosine(100) == pytest.approx(0.1) == cosine(150)
    assert cosine(55) == pytest.approx(0.55)  # (half-way: the floor plus half of what is above it)
    quarter = warmup_then_decay(100, 0, Decay.cosine, floor=0.1)(25)  # a quarter in: above the line's 0.775
    assert quarter == pytest.approx(0.1 + 0.9 * (0.5 + 0.5 * math.cos(math.pi / 4))) and quarter > 0.8
    assert warmup_then_decay(100, 10, Decay.linear, floor=0.2)(55) == pytest.approx(0.6)


def test_linear_decay_ends_at_zero_and_stays():
    f = linear_decay(75)
    assert f(0) == 1.0 and f(75) == 0.0 and f(200) == 0.0
