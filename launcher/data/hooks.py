"""What the data path takes from a recipe: what its `load` returns (`Splits`: images in memory,
`TokenSplits`: token streams, or (train, eval) Datasets), and, as Lightning's DataHooks, how a batch is made
from a Dataset's samples (`collate`) and what runs on it once it is on the device (`on_after_batch_transfer`).

launcher.recipes.Recipe inherits the hooks, and a recipe overrides them; the loader (loader.py) asks for
these two only, so the data wing needs nothing else of a recipe. No torch at import time: the launcher
imports the recipes' base before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Splits:
    """A dataset held in memory: images (N, C, H, W) uint8 and labels (N,) int64, with per-channel stats."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]  # per channel, in the stored pixel units
    std: tuple[float, ...]
    synthetic: bool = False


@dataclass
class TokenSplits:
    """A token stream for next-token prediction: 1-D integer arrays (memory-mapped files, say, so a corpus
    larger than host memory is read only where sampled), or a list of them (shards: token files read in
    place; no window crosses from one into the next). A training sample is a window of `context`
    tokens starting anywhere in `train`, its targets the same window one token on; the held-out windows
    of `test` do not overlap."""

    train: Any  # numpy array (or np.memmap) of token ids, or a list of them (shards)
    test: Any
    vocab_size: int
    context: int
    synthetic: bool = False


class DataHooks:
    def collate(self, samples: list[Any]) -> Any:
        """A batch of a Dataset's samples (torch's default_collate unless overridden). A sample that
        is None (the Dataset skipped it: a bad file, say) never gets here: the launcher leaves it out
        and counts it."""
        from torch.utils.data import default_collate

        return default_collate(samples)

    def on_after_batch_transfer(self, batch: Any, training: bool) -> Any:
        """A Dataset's batch once it is on the device, before the step: GPU work on the batch (decoding,
        cropping, normalizing) that should run off the compute stream. It runs on the side stream that
        copied the batch, a few batches ahead of the step that uses it. `training`: a training batch,
        else an evaluation one."""
        return batch


def transfers(hooks: Any) -> bool:
    """Whether `hooks` (a recipe) has GPU work of its own after a batch's copy: an on_after_batch_transfer
    other than DataHooks' (the loader then runs it on the prefetch thread)."""
    return type(hooks).on_after_batch_transfer is not DataHooks.on_after_batch_transfer
