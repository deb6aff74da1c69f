"""perf.activation_checkpointing (launcher/strategies/recompute.py): what the backward pass runs again under each
mode, on a tiny Llama in this process; the gradients never change."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.config import Recompute
from launcher.recipes.text_models import Llama
from launcher.strategies import recompute

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class Counting(TorchDispatchMode):
    """How many times each aten op ran."""

    def __init__(self):
        super().__init__()
        self.ran: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ran[func] = self.ran.get(func, 0) + 1
        return func(*args, **(kwargs or {}))

    def count(self, ops) -> int:
        return sum(self.ran.get(op, 0) for op in ops)


def _backward_of(mode: Recompute) -> tuple[Counting, Counting, list[torch.Tensor], str | None]:
    torch.manual_seed(0)
    model = Llama(vocab=64, context=16, layers=2, width=32, heads=4, kv_heads=2, ffn=48)
    said = recompute.apply(model, mode)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    with Counting() as forward:
        loss, _ = model(x, y)
    with Counting() as backward:
        loss.backward()
    return forward, backward, [p.grad.clone() for p in model.parameters()], said


@pytest.fixture(scope="module")
def modes():
    return {mode: _backward_of(mode) for mode in Recompute}


def test_full_runs_each_block_again_in_the_backward_and_selective_only_its_cheap_ops(modes):
    silu = {torch.ops.aten.silu.default}
    _, kept, _, _ = modes[Recompute.none]
    forward, full, _, _ = modes[Recompute.full]
    _, selective, _, _ = modes[Recompute.selective]
    assert kept.count(silu) == 0  # (none: the backward runs no forward op again)
    # full: every block's forward again, its matmuls included (the output layer's, outside the blocks, not)
    assert full.count(silu) == 2 and full.count(MATMULS) > kept.count(MATMULS)
    # (q, kv, out, gate, up of each block; its last projection's output is needed by nothing in the backward:
    # the recomputation stops before it)
    block_matmuls = full.count(MATMULS) - kept.count(MATMULS)
    assert block_matmuls >= 2 * 4, block_matmuls
    # selective: the activations are recomputed, the matmuls' outputs are kept
    assert selective.count(silu) == 2 and selective.count(MATMULS) == kept.count(MATMULS)
    assert forward.count(MATMULS) >= block_matmuls


def test_every_mode_gives_the_same_gradients_and_says_what_it_did(modes):
    _, _, plain, said = modes[Recompute.none]
    assert said is None
    for mode in (Recompute.full, Recompute.selective):
        _, _, grads, said = modes[mode]
        assert said.startswith(f"activation checkpointing: {mode.value}, 2 blocks ("), said
        for a, b in zip(grads, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fsdps_older_key_still_asks_for_full(tmp_path):
    from tests.conftest import config_of

    assert recompute.mode_of(config_of("gpus=[]")) is Recompute.none
    assert recompute.mode_of(config_of("gpus=[]", "perf.activation_checkpointing=selective")) is Recompute.selective
    older = config_of("gpus=[]", "strategy=fsdp", "nprocs=2", "strategy.activation_checkpointing=true")
    assert recompute.mode_of(older) is Recompute.full


def test_a_hugging_face_style_model_is_cut_at_the_outermost_modules_its_no_split_modules_name():
    """`_no_split_modules` (what a transformers model says must stay whole) wins over the ModuleList rule, and a
    named class inside another named one is not a unit of its own (it would be sharded and recomputed twice)."""
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = Attention(), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    class Model(nn.Module):
        _no_split_modules = {"Layer", "Attention"}

        def __init__(self):
            super().__init__()
            self.embed, self.first, self.second, self.head = nn.Embedding(8, 4), Layer(), Layer(), nn.Linear(4, 8)

    model = Model()
    assert recompute.shard_units(model) == [model.first, model.second]
    del Model._no_split_modules
    assert len(recompute.shard_units(model)) == 4  # (the ModuleLists' members)


def test_the_activation_estimate_grows_with_the_batch_and_the_sequence_not_its_square_and_orders_the_modes():
    """Measured on the meta device: twice the windows or twice the context keep twice the bytes (attention counted
    as a fused kernel keeps it, not as the meta device's math, whose sequence x sequence matrix grows 4x); full keeps
    less than selective, which keeps less than none; the same model in bf16 keeps a little more than half."""
    def measure(batch: int, context: int, dtype=torch.float32) -> recompute.Activations:
        with torch.device("meta"):
            model = Llama(256, context=context, layers=6, width=64, heads=4, kv_heads=2, tie_embeddings=False)
            x = torch.zeros(batch, context, dtype=torch.long)
        model = model.to(dtype)
        return recompute.activation_bytes(model, lambda: model(x, x))

    base = measure(4, 256)
    assert base.full < base.selective < base.none
    # selective keeps, beyond full, each block's matmul outputs: its q, k, v and output projections and its SwiGLU's
    # three (more than 4 widths a token), not only attention's output
    assert base.selective - base.full > 6 * 4 * 64 * 4 * 4 * 256
    for other in (measure(8, 256), measure(4, 512)):
        for mode in (Recompute.none, Recompute.full, Recompute.selective):
            assert other.under(mode) == pytest.approx(2 * base.under(mode), rel=0.05), (mode, other, base)
    assert 0.5 * base.none < measure(4, 256, torch.bfloat16).none < 0.65 * base.none  # (the loss's logits: fp32)
    # none: what the backward keeps of each of the 6 blocks (its norms, projections, attention, SwiGLU: ~20 values
    # of the width a token) and the logits, in fp32 (4 bytes)
    assert 6 * 15 * 64 * 4 * 4 * 256 < base.none < 6 * 30 * 64 * 4 * 4 * 256 + 3 * 4 * 256 * 256 * 4

