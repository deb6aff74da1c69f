"""launcher/train/nested.py: a nested state's tensors, a tensor under two names once where it is copied, and
counted per name where torch.distributed's host copy of a sharded state holds each name apart."""

import torch

from launcher.train import nested


def test_a_tensor_under_two_names_is_one_tensor_but_its_bytes_count_per_name():
    embedding = torch.zeros(10, 4)  # a tied embedding and output layer
    state = {"model": {"tokens.weight": embedding, "head.weight": embedding, "bias": torch.zeros(3)},
             "optim": [{"step": torch.tensor(1.0)}], "epoch": 3}
    assert len(nested.tensors_in(state)) == 3
    assert len(list(nested.every_tensor(state))) == 4
    assert nested.local_nbytes(state) == (40 + 40 + 3 + 1) * 4
    copied = nested.mapped(state, torch.clone)
    assert copied["model"]["tokens.weight"] is copied["model"]["head.weight"] and copied["epoch"] == 3
