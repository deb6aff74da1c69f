"""recipe=text's networks (recipes/text.py), sized by recipe.layers / width / heads / context, and what is
read from them: FLOPs per token (for MFU, against the GPUs' bf16 peaks) and sampled text.

- gpt: a decoder-only Transformer: learned positions, pre-norm blocks (LayerNorm, causal
  `scaled_dot_product_attention`, a 4x GELU MLP), a final LayerNorm, the output layer tied to the
  token embedding; GPT-2's initialization (residual projections scaled by 1/sqrt(2 x layers)).
- llama: Llama 3's decoder (Llama below): RMSNorm, rotary positions, SwiGLU, grouped-query attention.
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
from launcher.recipes import logits_of

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


class Llama(nn.Module):
    """Llama 3's decoder: token embedding, pre-norm blocks (RMSNorm; causal attention with rotary positions
    and `kv_heads` key/value heads, each shared by heads / kv_heads query heads; a SwiGLU MLP), a final
    RMSNorm, the output layer (tied to the embedding, or not). No biases, no dropout. Sized like Llama 3.1 8B
    by layers=32 width=4096 heads=32 kv_heads=8 ffn=14336 vocab 128256, untied."""

    def __init__(self, vocab: int, context: int, layers: int, width: int, heads: int, kv_heads: int = 0,
                 ffn: int = 0, rope_theta: float = 500000.0, tie_embeddings: bool = True):
        super().__init__()
        self.context, self.layers, self.width, self.heads = context, layers, width, heads
        self.rope_theta = rope_theta
        self.tokens = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads, kv_heads or heads, ffn or llama_ffn(width))
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab, bias=False)
        if tie_embeddings:
            self.head.weight = self.tokens.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every matrix normal(0, 0.02), the projections back into the residual stream (attention's output,
        the MLP's down) at 0.02 / sqrt(2 x layers), an untied output layer at width^-1/2, norms at 1 (also what
        strategy=fsdp strategy.meta_init=true runs on the shards)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        for block in self.blocks:
            for out in (block.out, block.down):
                nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * self.layers))
        if self.head.weight is not self.tokens.weight:
            nn.init.normal_(self.head.weight, std=self.width ** -0.5)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """As GPT.forward: the logits, or with `targets` the mean cross-entropy and the arg-max hits."""
        rope = rotary(idx.shape[1], self.width // self.heads, self.rope_theta, idx.device)
        x = self.norm(self.trunk(self.tokens(idx), rope))
        if targets is None:
            return self.head(x)
        logits = self.head(x).flatten(0, 1).float()
        targets = targets.flatten()
        return F.cross_entropy(logits, targets), (logits.argmax(-1) == targets).float().mean()

    def trunk(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The blocks, in order (a method of its own: see GPT.trunk)."""
        for block in self.blocks:
            x = block(x, *rope)
        return x

    def flops_per_token(self) -> float:
        """As GPT's: 6 x the parameters that multiply (all but the embedding table where the output layer is
        not it) + 12 x layers x context x width for the attention scores and values."""
        n = sum(p.numel() for p in self.parameters())
        if self.head.weight is not self.tokens.weight:
            n -= self.tokens.weight.numel()
        attention = 12.0 * self.layers * self.context * self.width
        return 6.0 * n + attention


class LlamaBlock(nn.Module):
    """x + attention(norm(x)), then x + down(silu(gate(norm(x))) * up(norm(x)))."""

    def __init__(self, width: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_width = heads, kv_heads, width // heads
        self.attention_norm, self.mlp_norm = nn.RMSNorm(width, eps=1e-5), nn.RMSNorm(width, eps=1e-5)
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * kv_heads * self.head_width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.attention_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_width).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.head_width).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, c))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def llama_ffn(width: int, multiple: int = 256) -> int:
    """Llama's MLP width for `width`: two thirds of 4 x width (the SwiGLU's three matrices cost what a 4x
    MLP's two do), rounded up to a multiple of `multiple`."""
    return multiple * -(-int(8 * width / 3) // multiple)


def rotary(length: int, head_width: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary angles' cosines and sines (length, head_width / 2), in float32: position p turns the pair
    (2i, 2i+1) of a query or key by p x theta^(-2i / head_width) (Su et al. 2021, RoFormer)."""
    frequencies = theta ** -(torch.arange(0, head_width, 2, device=device, dtype=torch.float32) / head_width)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, length, head_width) with each pair of its last dimension turned by its angle."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2).type_as(x)


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
        logits = logits_of(model(ids[:, -context:]))[:, -1, :vocab].float() / temperature
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
