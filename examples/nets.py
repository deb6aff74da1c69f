"""A network a config names: `model._target_=nets.TinyNet +model.hidden=8` (num_classes is passed by launch)."""

from torch import nn


class TinyNet(nn.Sequential):
    def __init__(self, num_classes: int, hidden: int = 16):
        super().__init__(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


class LazyNet(nn.Sequential):
    """Its layers' input sizes found from the first batch (`model._target_=nets.LazyNet`)."""

    def __init__(self, num_classes: int, hidden: int = 16):
        super().__init__(nn.Flatten(), nn.LazyLinear(hidden), nn.LazyBatchNorm1d(), nn.ReLU(),
                         nn.LazyLinear(num_classes))
