"""strategy=single: one process on one device (a GPU, or the CPU)."""

from __future__ import annotations

from launcher.strategies.base import Strategy


class Single(Strategy):
    """Everything the base class does: one process, one device, nothing shared."""

    name = "single"
    one_device = True
