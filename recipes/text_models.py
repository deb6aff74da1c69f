"""recipe=text's networks (recipes/text.py), sized by recipe.layers / width / heads / context, and what is
read from them: FLOPs per token (for MFU, against the GPUs' bf16 peaks) and sampled text.

- gpt: a decoder-only Transformer: learned positions, pre-norm blocks (LayerNorm, causal
  `scaled_dot_product_attention`, a 4x GELU MLP), a final LayerNorm, the output layer tied to the
  token embedding; GPT-2's initialization (residual projections scaled by 1/sqrt(2 x layers)).
- lstm, gru: an embedding, torch's multi-layer LSTM or GRU, the output layer tied to the embedding.

`launch export` writes a GPT's weights for `GPT(vocab, context, layers, width, heads, dropout)` (docs/runs.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launcher.data.corpus import VOCAB

# Dense bf16 peak FLOP/s per GPU, for MFU (vendor data sheets; SXM parts).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


class Block(nn.Module):
    """Pre-norm Transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, layers: int, width: int, heads: int, dropout: float):
        super().__init__()
        self.context, self.layers, self.width = context, layers, width
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialization (also what strategy=fsdp strategy.meta_init=true runs on the shards)."""
        self.apply(self._init)
        for block in self.blocks:  # residual projections: 1/sqrt(2 x layers)
            for proj in (block.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.layers))
        for norm in [self.norm, *(n for b in self.blocks for n in (b.norm1, b.norm2))]:
            norm.reset_parameters()

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """The logits (B, T, V); with `targets` (B, T), instead the mean cross-entropy and the fraction of
        arg-max hits, as nanoGPT's model returns its loss: computed inside the forward, so that compiled,
        inductor fuses the float32 upcast, the log-sum-exp and the arg-max into the head's output."""
        t = idx.shape[1]
        x = self.drop(self.tokens(idx) + self.positions(torch.arange(t, device=idx.device)))
        x = self.norm(self.trunk(x))
        if targets is None:
            return self.head(x)
        logits = self.head(x).flatten(0, 1).float()
        targets = targets.flatten()
        return F.cross_entropy(logits, targets), (logits.argmax(-1) == targets).float().mean()

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks, in order. A method of its own so that under strategy=fsdp, where each block's
        FSDP2 hooks stop torch.compile's graph, the compiled forward resumes after the blocks: the
        head and the loss are compiled too (a graph stopped inside a loop of the forward itself would
        leave the rest of the forward eager)."""
        for block in self.blocks:
            x = block(x)
        return x

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward and backward), PaLM's convention (Chowdhery et al. 2022,
        appendix B): 6 x the parameters that multiply (all but the position table; the tied output
        layer counted once) + 12 x layers x context x width for the attention scores and values."""
        n = sum(p.numel() for p in self.parameters()) - self.positions.weight.numel()
        return 6.0 * n + 12.0 * self.layers * self.context * self.width


class Recurrent(nn.Module):
    def __init__(self, kind: str, vocab: int, layers: int, width: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        rnn = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = rnn(width, width, layers, batch_first=True, dropout=dropout if layers > 1 else 0.0)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(idx))
        return self.head(hidden)

    def flops_per_token(self) -> float:
        """6 x the parameters: every weight of the recurrent layers and the (tied) output layer is one
        multiply-add per token forward, two more backward; the embedding lookup is not a matmul but its
        weight is the output layer's, counted once."""
        return 6.0 * sum(p.numel() for p in self.parameters())


class NextTokenLoss(nn.Module):
    """Cross-entropy over every position of every window: logits (B, T, V), targets (B, T)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def generate_ids(model: nn.Module, prompt: list[int], n: int, context: int, temperature: float,
                 device: torch.device, seed: int = 0, vocab: int | None = None) -> list[int]:
    """`prompt` and `n` token ids sampled after it, each from the model's distribution at `temperature`
    over the first `vocab` outputs (the padding beyond the vocabulary is never a token)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor(prompt, dtype=torch.long, device=device)[None]
    for _ in range(n):
        logits = model(ids[:, -context:])[:, -1, :vocab].float() / temperature
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], dim=1)
    model.train(was_training)
    return ids[0].tolist()


def generate(model: nn.Module, prompt: bytes, n: int, context: int, temperature: float, device: torch.device,
             seed: int = 0) -> bytes:
    """`n` bytes sampled after `prompt`, each from the model's distribution at `temperature`."""
    return bytes(generate_ids(model, list(prompt), n, context, temperature, device, seed, vocab=VOCAB))


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)
