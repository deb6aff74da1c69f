"""text: next-token prediction: a byte-level language model on a text corpus that is on every machine
offline (the default), or a GPT on token shards that nanoGPT or llm.c wrote.

What is trained (`recipe.model`, recipes/text_models.py): gpt, a decoder-only Transformer (GPT-2's
initialization, the output layer tied to the token embedding), llama (Llama 3's decoder: recipe.kv_heads,
ffn, rope_theta, tie_embeddings besides), or lstm / gru; sized by recipe.layers / width / heads / context.
Each window of `recipe.context` tokens predicts its next tokens (cross-entropy over every position).

On what data (`recipe.corpus`, launcher/data/corpus.py): `stdlib` (the default: the Python standard
library's own sources), a text file, a folder or a glob of them, built once into two byte streams (bytes are
the tokens: vocabulary 256, nothing to download) and memory-mapped; or token shards (.bin, .npy:
launcher/data/token_shards.py), read in place, for which `recipe.vocab_size` must be given (GPT-2: 50257):
`prepare` checks every shard's header, length and largest token id once (one line naming a shard whose id
is >= vocab_size). The model's embedding and output layer are padded to a multiple of 64 (50304).
`data.synthetic=true` generates a stream from a fixed random Markov chain instead (timing only).

Reported per epoch (besides loss and next-token accuracy): bits per byte for text (train and held-out:
the loss in nats / ln 2), perplexity for token shards (`ppl`, `test_ppl`: bits per byte would need the
bytes per token, which only the tokenizer knows), tokens/s, and on GPUs with a known bf16 peak, MFU from
the model FLOPs per token stated in `flops_per_token`. results.json adds the parameter count, the FLOPs
per token, `vocab_size` and `padded_vocab_size`, the unigram baseline (the held-out loss of the training
split's token frequencies, counted on a bounded prefix: a model must beat it to have learned anything
beyond them) and the sample rank 0 generates after training (also in sample.txt): text after
recipe.sample_prompt, or for token shards (no tokenizer offline) recipe.sample_bytes token ids after the
held-out stream's first 8, space-separated (`sample_ids` in results.json; decode with the tokenizer).
Hyper-parameters: TextConfig in launcher/config.py; values: conf/recipe/text.yaml.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launcher.config import TextConfig, tokens_without_vocabulary
from launcher.data.corpus import BASELINE_BYTES, HELD_OUT, VOCAB, Corpus, TextDataError, byte_streams, unigram_loss
from launcher.data.token_shards import TokenCorpus, check_token_ids, padded_vocab, token_unigram_loss
from launcher.errors import ConfigError
from launcher.figures import LauncherFigures
from launcher.files import write_text_atomic
from launcher.recipes import Recipe, TokenSplits
from launcher.recipes.text_models import GPT, Llama, NextTokenLoss, Recurrent, generate, generate_ids, peak_flops

log = logging.getLogger("launcher.train")

SAMPLE_FILE = "sample.txt"
SAMPLE_PROMPT_TOKENS = 8  # token shards: the sample continues the held-out stream's first tokens
EVAL_LOGITS_BYTES = 8 * 2**30  # an evaluation forward's logits a rank at most (Text.eval_chunk_limit)


def _shorter_context(stream_bytes: int, corpus: str) -> str:
    """The example for a context longer than a stream: a context the stream holds (a window is context + 1
    bytes, the smallest context 2), or, where none fits, a longer corpus (never the refused value again)."""
    if stream_bytes >= 3:
        return f"recipe.context={max(2, stream_bytes // 4)}"
    return f"recipe.corpus=/path/to/a/longer/text.txt (recipe.corpus={corpus} is too short)"



class Text(Recipe):
    Config = TextConfig
    hp: TextConfig
    classifies = False
    # (bits per byte for bytes, perplexity for token shards: `report`)
    figures = ("loss", "train_acc", "bpb", "ppl", "test_loss", "test_acc", "test_bpb", "test_ppl")
    tokens = False  # set by load: token shards (loss and perplexity), not bytes (bits per byte)
    loss_in_forward = False  # set by build_model: the GPT returns its own loss (training_step)
    # set by build_model; a network from config (model._target_: a Hugging Face causal LM, say) is counted in
    # `finish`, and has no MFU (its FLOPs per token are its own)
    parameter_count: int | None = None
    flops_per_token: float | None = None

    def _corpus(self) -> Corpus:
        root = Path(os.path.expanduser(str(self.cfg.data.root)))
        return Corpus(str(self.hp.corpus), root, self.cfg.data.synthetic)

    def prepare(self) -> None:
        """In the launcher, once: build the corpus's streams (workers then only map them), and check that
        they hold a batch of windows, before any worker starts. Token shards are not built: their headers,
        lengths and token ids are checked instead (the ids once per shard, remembered under data.root)."""
        self._check_config_vocabulary()
        corpus = self._corpus()
        if corpus.left_out:
            (first, kept), n = corpus.left_out[0], len(corpus.left_out)
            print(f"launch: warning: recipe.corpus={corpus.spec}: left out {n} second path{'s' if n != 1 else ''} to "
                  f"files read already, so each is read once (e.g. {first}, which is {kept})", file=sys.stderr,
                  flush=True)
        if corpus.tokens:
            self._prepare_shards(corpus)
            return
        vocab = self.hp.vocab_size
        if vocab and vocab < VOCAB:
            raise ConfigError("recipe.vocab_size", vocab, f"a byte corpus (recipe.corpus={self.hp.corpus}) has 256 "
                              "tokens; 0 takes that", "recipe.vocab_size=0")
        try:
            folder = corpus.ensure()
        except OSError as exc:
            raise TextDataError(f"cannot write the corpus's token streams to {corpus.folder} ({exc.strerror}); "
                                "set data.root to a writable folder: data.root=/tmp/data") from None
        train, val = byte_streams(folder, self.hp.max_bytes)
        context, batch = self.hp.context, self.cfg.batch_size
        windows = (len(train) - 1) // context
        if windows < 1:
            more = HELD_OUT * max(batch * context // (HELD_OUT - 1) + 2, context + 1)
            raise ConfigError("recipe.context", context, f"longer than the training stream ({len(train)} bytes; "
                              "recipe.max_bytes or the corpus is too short)",
                              f"recipe.max_bytes={more}" if self.hp.max_bytes and more > self.hp.max_bytes
                              else _shorter_context(len(train), self.hp.corpus))
        if batch > windows:
            raise ConfigError("batch_size", batch, f"larger than the {windows} windows of {context} bytes in the "
                              "training stream (recipe.max_bytes or the corpus is too short)",
                              f"batch_size={max(1, windows // 4)}")
        if len(val) < context + 1:
            raise ConfigError("recipe.context", context, f"longer than the held-out stream ({len(val)} bytes)",
                              _shorter_context(len(val), self.hp.corpus))

    def _check_config_vocabulary(self) -> None:
        """A network from config whose own config section gives a vocab_size below the data's (a Hugging Face
        config with +model.config.vocab_size=100 on bytes): its first step would index past its embedding.
        Refused here, in the launcher before any worker; the worker checks the network it built too (a
        vocabulary set elsewhere than in the config: launcher/train/misfit.py short_vocabulary)."""
        from launcher.models import configured
        from launcher.train.misfit import vocabulary_refusal

        inner = self.cfg.model.get("config") if configured(self.cfg.model) else None
        given = inner.get("vocab_size") if isinstance(inner, dict) else None
        vocab = self.hp.vocab_size or VOCAB
        if isinstance(given, int) and not isinstance(given, bool) and given < vocab:
            raise vocabulary_refusal(given, vocab, self.cfg.model["_target_"])

    def _prepare_shards(self, corpus: Corpus) -> None:
        """Token shards, checked in the launcher: a vocabulary given, every header and length sound, every
        token id inside the vocabulary, a batch of windows in the training shards and one held out."""
        hp, spec = self.hp, self.hp.corpus
        if not hp.vocab_size:
            raise tokens_without_vocabulary("recipe", spec)
        if hp.max_bytes:
            raise ConfigError("recipe.max_bytes", hp.max_bytes, "applies to text (bytes) only; with token shards "
                              "name fewer of them instead", "recipe.max_bytes=0")
        shards = TokenCorpus.read(spec, corpus.files, hp.context)
        for piece in shards.skipped:
            print(f"launch: warning: {piece} holds {piece.tokens} tokens, fewer than a window of recipe.context="
                  f"{hp.context} + 1; it is left out", file=sys.stderr, flush=True)
        check_token_ids(shards, hp.vocab_size, corpus.checked)
        print(f"launch: {shards.describe()}", file=sys.stderr, flush=True)
        windows = sum(p.tokens - 1 for p in shards.train) // hp.context
        if self.cfg.batch_size > windows:
            raise ConfigError("batch_size", self.cfg.batch_size, f"larger than the {windows} windows of {hp.context} "
                              f"tokens in the training shards of recipe.corpus={spec}",
                              f"batch_size={max(1, windows // 4)}")

    def load(self) -> TokenSplits:
        corpus = self._corpus()
        if corpus.tokens:  # (checked by prepare; read in place, one memory map per shard)
            self.tokens, self.vocab = True, self.hp.vocab_size
            shards = TokenCorpus.read(corpus.spec, corpus.files, self.hp.context)
            train, val = shards.opened()
            self.prompt = [int(t) for t in val[0][:SAMPLE_PROMPT_TOKENS]]
            self.baseline = token_unigram_loss(train, val, self.vocab, BASELINE_BYTES)
            return TokenSplits(train, val, padded_vocab(self.vocab), self.hp.context)
        folder = corpus.ensure()  # (built by prepare; a worker on another node builds its own)
        train, val = byte_streams(folder, self.hp.max_bytes)
        self.vocab = VOCAB
        self.baseline = unigram_loss(train, val)
        return TokenSplits(train, val, padded_vocab(VOCAB), self.hp.context, synthetic=self.cfg.data.synthetic)

    def model_to_size(self) -> nn.Module:
        """The model at its vocabulary (recipe.vocab_size, or bytes), padded as the run pads it, on the meta device."""
        with torch.device("meta"):
            return self.build_model(padded_vocab(self.hp.vocab_size or VOCAB))

    def batch_to_size(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): `size` windows of recipe.context token ids, on the meta device."""
        shape = (size, self.hp.context)
        inputs = torch.zeros(shape, dtype=torch.long, device="meta")
        return inputs, torch.zeros_like(inputs)

    def eval_chunk_limit(self) -> int:
        """Windows whose logits (context x padded vocabulary, in bf16 and their float32 copy for the loss: 6 bytes
        each) come to at most EVAL_LOGITS_BYTES. eval.batch_size is the training batch, which accumulate reaches in
        micro-batches: at batch_size=64 accumulate=16 on 2 ranks, 32 windows a rank in one forward would ask
        ~190 GiB of logits at Llama 3's 8,192 x 128,256; one window is ~6 GiB."""
        per_window = self.hp.context * padded_vocab(self.hp.vocab_size or VOCAB) * 6
        return max(1, EVAL_LOGITS_BYTES // per_window)

    def build_model(self, num_classes: int) -> nn.Module:
        hp = self.hp
        if hp.model.value == "gpt":
            model: nn.Module = GPT(num_classes, hp.context, hp.layers, hp.width, hp.heads, hp.dropout)
        elif hp.model.value == "llama":
            model = Llama(num_classes, hp.context, hp.layers, hp.width, hp.heads, hp.kv_heads, hp.ffn, hp.rope_theta,
                          hp.tie_embeddings)
        else:
            model = Recurrent(hp.model.value, num_classes, hp.layers, hp.width, hp.dropout)
        self.parameter_count = sum(p.numel() for p in model.parameters())
        self.flops_per_token = model.flops_per_token()
        self.loss_in_forward = isinstance(model, (GPT, Llama))
        return model

    def training_step(self, model: nn.Module, batch: Any) -> Any:
        """The GPT computes its own loss inside its (compiled) forward. At GPT-2's vocabulary the logits and
        the loss are a quarter of the step: returning logits and taking an eager float32 loss after them ran
        slower (measured: BENCHMARKS.md sections 5 and 12)."""
        if not self.loss_in_forward:
            return super().training_step(model, batch)
        x, y = batch[0], batch[1]
        loss, hits = model(x, y)
        return loss, LauncherFigures(acc=hits)  # (the launcher's accuracy, computed in the forward)

    def loss(self) -> nn.Module:
        return NextTokenLoss()

    def report(self, row: dict[str, Any], device: torch.device, world_size: int) -> None:
        """Bits per byte for bytes; perplexity for token shards (bits per byte would need the bytes each
        token stands for, which only the tokenizer knows)."""
        for key, bpb, ppl in (("loss", "bpb", "ppl"), ("test_loss", "test_bpb", "test_ppl")):
            if key in row and self.tokens:
                row[ppl] = math.exp(min(row[key], 700.0))
            elif key in row:
                row[bpb] = row[key] / math.log(2)
        peak = peak_flops(device)
        if peak and self.flops_per_token and "tokens_per_s" in row and self.cfg.perf.precision.value != "fp32":
            row["mfu"] = row["tokens_per_s"] * self.flops_per_token / (peak * world_size)

    def finish(self, model: nn.Module, run_dir: Path, device: torch.device, main: bool) -> dict[str, Any]:
        """Facts for results.json, and a sample: text after recipe.sample_prompt for bytes; for token shards
        (no tokenizer offline) recipe.sample_bytes token ids after the held-out stream's first ones, written
        to sample.txt as space-separated ids (decode them with the shards' tokenizer)."""
        count = self.parameter_count or sum(p.numel() for p in model.parameters())  # (a sharded one's too)
        facts: dict[str, Any] = {"parameters": count, "flops_per_token": self.flops_per_token,
                                 "vocab_size": self.vocab, "padded_vocab_size": padded_vocab(self.vocab),
                                 "unigram_test_loss": self.baseline}
        if self.tokens:
            facts["unigram_test_ppl"] = math.exp(min(self.baseline, 700.0))
        else:
            facts["unigram_test_bpb"] = self.baseline / math.log(2)
        if not self.hp.sample_bytes:
            return facts
        if self.tokens:
            ids = generate_ids(model, self.prompt, self.hp.sample_bytes, self.hp.context, self.hp.temperature,
                               device, self.cfg.seed, vocab=self.vocab)
            text = " ".join(map(str, ids))
            facts.update(sample_ids=ids, sample_prompt_ids=len(self.prompt))
        else:
            prompt = self.hp.sample_prompt.encode()
            text = generate(model, prompt, self.hp.sample_bytes, self.hp.context, self.hp.temperature, device,
                            self.cfg.seed).decode("utf-8", errors="replace")
            facts["sample"] = text
        if main:
            write_text_atomic(run_dir / SAMPLE_FILE, text + "\n")  # (a full disk leaves no partial file)
            log.info("a sample (%s):\n%s", run_dir / SAMPLE_FILE, text)
        return facts
