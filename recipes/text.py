"""text: next-token prediction: a byte-level language model on a text corpus that is on every machine
offline (the default), or a GPT on token shards that nanoGPT or llm.c wrote.

The corpus (`recipe.corpus`):
- `stdlib` (the default): the Python standard library's own source files, `*.py` under this
  interpreter's `sysconfig` stdlib path, test suites and site-packages left out (~10 MB on Python 3.11).
  They ship with every Python; licence: the PSF License Agreement (Python Software Foundation License
  Version 2), which allows copying and derived works. Which files exist depends on the Python version,
  so the version is part of the corpus's name.
- the path of a text file (its last 5% held out) or of a folder (every file under it, sorted; the held-out
  files chosen by a hash of their relative paths, ~5%).
- a glob of text files (quoted: recipe.corpus='/data/books/*.txt'), as a folder's.
- token shards, told by their suffixes (.bin, .npy; a mixture with other files is one line): one file, a
  folder or a glob of nanoGPT's raw uint16 .bin, llm.c's .bin (a 256-int32 header: magic 20240520,
  version 1 uint16 or 2 uint32, the count, checked against the file's size) or 1-D uint16/uint32 .npy
  (launcher/data/token_shards.py). They are memory-mapped read-only and never copied or concatenated on the
  host; nothing is written beside them. Held out: the shards whose names say `val` (val.bin,
  *_val_*.bin), else the last 1/20 of the last shard. A shard shorter than context + 1 tokens is left
  out with a warning; windows never cross from one shard into the next. `recipe.vocab_size` must be
  given (GPT-2: 50257); `prepare` reads every shard once, in chunks, for its largest token id (one line
  naming the shard if it is >= vocab_size) and remembers it under <data.root>/text/token-ids by path,
  size and mtime. The model's embedding and output layer are padded to a multiple of 64 (50304).
For text, bytes are the tokens (vocabulary 256): no tokenizer, nothing to download. The streams are built once
into `<data.root>/text/<corpus key>/{train,val}.bin` (uint8, written under a temporary name and renamed)
and then memory-mapped, so a corpus larger than host memory is read only where windows are sampled
(launcher/data/placement.py `TokenWindows`). `data.synthetic=true` generates a stream from a fixed random
Markov chain instead (timing only).

Models (`recipe.model`), sized by recipe.layers / width / heads / context:
- gpt: a decoder-only Transformer: learned positions, pre-norm blocks (LayerNorm, causal
  `scaled_dot_product_attention`, a 4x GELU MLP), a final LayerNorm, the output layer tied to the
  token embedding; GPT-2's initialization (residual projections scaled by 1/sqrt(2 x layers)).
- lstm, gru: an embedding, torch's multi-layer LSTM or GRU, the output layer tied to the embedding.

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

import hashlib
import json
import logging
import math
import os
import stat as stat_module
import sys
import sysconfig
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from launcher.config import TextConfig
from launcher.data.token_shards import (
    TokenCorpus,
    check_token_ids,
    is_glob,
    names_tokens,
    padded_vocab,
    token_unigram_loss,
)
from launcher.errors import ConfigError, LaunchError
from launcher.figures import LauncherFigures
from launcher.files import write_text_atomic
from launcher.recipes import Recipe, TokenSplits

log = logging.getLogger("launcher.train")

VOCAB = 256  # bytes
HELD_OUT = 20  # one file in this many (by a hash of its path), or the last 1/HELD_OUT of a single file
SAMPLE_FILE = "sample.txt"
SAMPLE_PROMPT_TOKENS = 8  # token shards: the sample continues the held-out stream's first tokens
LICENCES = {"stdlib": "PSF License Agreement (Python Software Foundation License Version 2)"}
# Dense bf16 peak FLOP/s per GPU, for MFU (vendor data sheets; SXM parts).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}
SYNTHETIC_BYTES = (4_000_000, 200_000)
BASELINE_BYTES = 2**26  # the unigram baseline counts at most this much of each stream (a start-up cost)


class TextDataError(LaunchError):
    """The corpus cannot be read; the message says what to give instead."""


# ---- the corpus ------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's own sources: *.py outside test suites and installed packages, sorted."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if p.is_file() and not skip.intersection(p.relative_to(root).parts))


def held_out(relative: str) -> bool:
    return hashlib.sha1(relative.encode()).digest()[0] % HELD_OUT == 0


class Corpus:
    """Where a corpus's bytes come from (files, and which are held out), and the folder its streams go to."""

    def __init__(self, spec: str, data_root: Path, synthetic: bool):
        self.spec = spec
        self.synthetic = synthetic
        self.tokens = False  # token shards (.bin, .npy: read in place by TokenCorpus), not text
        self.checked = data_root / "text" / "token-ids"  # what a token scan found, per shard
        self.left_out: list[tuple[Path, Path]] = []  # (a second path to a file, the path it is read under)
        if synthetic:
            self.name, self.files, self.root = "synthetic", [], None
        elif spec == "stdlib":
            self.root = stdlib_root()
            self.files = stdlib_files(self.root)
            self.name = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
            if not self.files:
                raise TextDataError(f"recipe.corpus=stdlib found no Python sources under {self.root}; give a text "
                                    "file or folder instead: recipe.corpus=/path/to/text")
        else:
            path = Path(os.path.expanduser(spec))
            if is_glob(spec) and not path.exists():
                fixed = next(i for i, part in enumerate(path.parts) if is_glob(part))
                self.root = Path(*path.parts[:fixed]) if fixed else Path(".")
                self.files, self.left_out = read_once(globbed(self.root, path))
                if not self.files:
                    raise TextDataError(f"recipe.corpus={spec} matches no file; give a glob that names files (quote "
                                        "it: recipe.corpus='/data/fineweb10B/fineweb_*.bin'), a file or a folder")
            elif not path.exists():
                raise TextDataError(f"recipe.corpus={spec} does not exist; give stdlib, a text file, a folder or a "
                                    "glob of text or token files: recipe.corpus=stdlib")
            else:
                self.root = path if path.is_dir() else path.parent
                self.files, self.left_out = (read_once(corpus_files(path)) if path.is_dir() else
                                             ([path] if _regular(path) else [], []))
            self.tokens = names_tokens(self.files, spec)
            if not self.tokens and (not self.files or sum(p.stat().st_size for p in self.files) < 2):
                raise TextDataError(f"recipe.corpus={spec} holds no text (no regular file with bytes in it); give "
                                    "a file or folder with some, or recipe.corpus=stdlib")
            self.name = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.name)[:40] or "corpus"
        digest = hashlib.sha256(f"v1 {self.name}".encode())
        for p in self.files:
            stat = p.stat()
            digest.update(f"{p.relative_to(self.root)} {stat.st_size} {stat.st_mtime_ns}".encode())
        self.folder = data_root / "text" / f"{self.name}-{digest.hexdigest()[:12]}"

    def ensure(self) -> Path:
        """The folder with train.bin and val.bin, built if missing: file by file, in chunks (a corpus
        larger than memory is never held whole), into temporary files renamed when complete; meta.json,
        written last, marks the folder complete. Raises TextDataError naming a file that cannot be read,
        OSError where the folder cannot be written."""
        if (self.folder / "meta.json").is_file():
            return self.folder
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.synthetic:
            total = sum(p.stat().st_size for p in self.files)
            print(f"launch: building the token streams of recipe.corpus={self.spec} ({len(self.files)} files, "
                  f"{total / 2**20:,.1f} MB) in {self.folder} (once; later runs map them)", file=sys.stderr,
                  flush=True)
        with _Staged(self.folder / "train.bin") as train, _Staged(self.folder / "val.bin") as val:
            if self.synthetic:
                for out, stream in zip((train, val), _synthetic_streams().values(), strict=True):
                    out.write(stream.tobytes())
            elif len(self.files) == 1 and self.spec != "stdlib":
                size = self.files[0].stat().st_size
                cut = size - max(1, size // HELD_OUT)
                _append(self.files[0], train, 0, cut)
                _append(self.files[0], val, cut)
            else:
                for p, to_val in self._assignment():
                    out = val if to_val else train
                    _append(p, out)
                    out.write(b"\n\n")
        meta = {"corpus": self.spec, "name": self.name, "files": len(self.files), "root": str(self.root),
                "bytes": {"train": train.size, "val": val.size},
                "licence": LICENCES.get(self.spec, "the corpus's own" if not self.synthetic else "generated")}
        _write_atomic(self.folder / "meta.json", json.dumps(meta, indent=1).encode())
        return self.folder

    def _assignment(self) -> list[tuple[Path, bool]]:
        """Each file and whether it is held out (by a hash of its relative path); with few files, the
        last one is held out if none was, and the first one trains if all were."""
        held = [held_out(str(p.relative_to(self.root))) for p in self.files]
        if not any(held):
            held[-1] = True
        if all(held):
            held[0] = False
        return list(zip(self.files, held, strict=True))


# Kernel filesystems: their "files" are not text, and some never end (/proc/kcore, /dev/zero).
VIRTUAL_FILESYSTEMS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                                 "securityfs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs",
                                 "binfmt_misc", "autofs", "efivarfs", "rpc_pipefs", "nsfs"})
CHUNK = 1 << 24  # bytes read and written at a time while building a stream


def _virtual_mounts() -> list[Path]:
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return [Path("/proc"), Path("/sys"), Path("/dev")]
    return [Path(f[1].replace("\\040", " ")) for f in map(str.split, lines)
            if len(f) >= 3 and f[2] in VIRTUAL_FILESYSTEMS]


def _regular(p: Path) -> bool:
    try:
        return stat_module.S_ISREG(p.stat().st_mode)
    except OSError:  # a dangling link, a file gone meanwhile
        return False


def corpus_files(top: Path) -> list[Path]:
    """Every regular file under `top`, sorted. Names starting with a dot are skipped, linked folders
    are not followed, and kernel filesystems (/proc, /sys, /dev, ...) are not entered, nor linked to.
    (A file under two paths is in the list twice: `read_once` keeps one.)"""
    virtual = _virtual_mounts()

    def in_virtual(p: Path) -> bool:
        return any(p == v or v in p.parents for v in virtual)

    files = []
    for folder, dirs, names in os.walk(top):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not d.startswith(".") and not in_virtual(here / d)]
        for name in names:
            p = here / name
            if name.startswith(".") or not _regular(p):
                continue
            if p.is_symlink() and in_virtual(Path(os.path.realpath(p))):
                continue
            files.append(p)
    return sorted(files)


def globbed(root: Path, pattern: Path) -> list[Path]:
    """The files a glob names, hidden names left out as glob.glob leaves them. pathlib's `**` does not follow
    linked folders, where glob.glob's does: one link to a folder above it read every file once per level (40
    levels), two never ended."""
    rest = pattern.relative_to(root) if pattern.is_absolute() or root != Path(".") else pattern
    named = set(rest.parts)  # (a hidden name the pattern spells out is meant)

    def shown(p: Path) -> bool:
        return not any(part.startswith(".") and part not in named for part in p.parts[len(root.parts):])

    return sorted(p for p in root.glob(str(rest)) if shown(p) and _regular(p))


def read_once(files: list[Path]) -> tuple[list[Path], list[tuple[Path, Path]]]:
    """`files` (sorted), each file (by device and inode) once: a link to a file listed under another path, or a
    hard link, would read its bytes twice. The path that is not a link is kept, else the first by name.
    Returns (the files, [(each path left out, the path kept)])."""
    kept: dict[tuple[int, int], Path] = {}
    left_out: list[tuple[Path, Path]] = []
    for p in sorted(files, key=lambda p: (p.is_symlink(), p)):
        st = p.stat()
        key = (st.st_dev, st.st_ino)
        if key in kept:
            left_out.append((p, kept[key]))
        else:
            kept[key] = p
    return sorted(kept.values()), sorted(left_out)


class _Staged:
    """A stream being written: to a temporary name beside `path`, renamed to it when the block ends
    without an error, removed otherwise (an interrupted build leaves nothing that looks complete)."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        self.size = 0

    def __enter__(self) -> _Staged:
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed in __exit__)
        return self

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.size += len(data)

    def __exit__(self, kind, value, tb) -> None:
        try:
            self.file.close()
            if kind is None:
                os.replace(self.tmp, self.path)
        finally:
            self.tmp.unlink(missing_ok=True)


def _append(src: Path, out: _Staged, start: int = 0, length: int | None = None) -> None:
    """Copy `length` bytes of `src` from `start` (to its end when None) into `out`, in chunks. A file
    that cannot be read is named (TextDataError); an error writing `out` propagates as it is."""
    try:
        f = open(src, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise _unreadable(src, exc) from None
    with f:
        left = length
        while left is None or left > 0:
            try:
                if start:
                    f.seek(start)
                    start = 0
                chunk = f.read(CHUNK if left is None else min(CHUNK, left))
            except OSError as exc:
                raise _unreadable(src, exc) from None
            if not chunk:
                break
            out.write(chunk)
            left = None if left is None else left - len(chunk)


def _unreadable(src: Path, exc: OSError) -> TextDataError:
    return TextDataError(f"cannot read {src} ({exc.strerror or exc}) while building the corpus's streams; leave "
                         "it out (give a folder without it) or give recipe.corpus=stdlib")


def _write_atomic(path: Path, data: bytes) -> None:
    with _Staged(path) as out:
        out.write(data)


def _synthetic_streams() -> dict[str, np.ndarray]:
    """Words of a fixed random vocabulary (2,000 lowercase words), drawn by a Zipf law and separated by
    spaces: learnable, and nothing like a real corpus."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    words = [np.append(rng.choice(letters, rng.integers(2, 9)), np.uint8(32)) for _ in range(2000)]
    out = {}
    for split, n in zip(("train", "val"), SYNTHETIC_BYTES, strict=True):
        drawn = np.minimum(rng.zipf(1.2, size=n // 4), len(words)) - 1
        out[split] = np.concatenate([words[i] for i in drawn])[:n]
    return out


def unigram_loss(train: np.ndarray, val: np.ndarray) -> float:
    """Cross-entropy (nats per byte) of the held-out stream under the training stream's byte frequencies
    (add-one smoothed): the loss of a model that learned nothing but how often each byte occurs. Counted
    on the first BASELINE_BYTES of each, so a corpus larger than memory is not read whole at every start."""
    train, val = train[:BASELINE_BYTES], val[:BASELINE_BYTES]
    counts = np.bincount(np.asarray(train), minlength=VOCAB).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    val_counts = np.bincount(np.asarray(val), minlength=VOCAB).astype(np.float64)
    return float(-(val_counts * logp).sum() / max(1.0, val_counts.sum()))


# ---- the models -----------------------------------------------------------------------------------


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


def _shorter_context(stream_bytes: int, corpus: str) -> str:
    """The example for a context longer than a stream: a context the stream holds (a window is context + 1
    bytes, the smallest context 2), or, where none fits, a longer corpus (never the refused value again)."""
    if stream_bytes >= 3:
        return f"recipe.context={max(2, stream_bytes // 4)}"
    return f"recipe.corpus=/path/to/a/longer/text.txt (recipe.corpus={corpus} is too short)"


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


# ---- the recipe -----------------------------------------------------------------------------------


class Text(Recipe):
    Config = TextConfig
    hp: TextConfig
    classifies = False
    # (bits per byte for bytes, perplexity for token shards: `report`)
    figures = ("loss", "train_acc", "bpb", "ppl", "test_loss", "test_acc", "test_bpb", "test_ppl")
    tokens = False  # set by load: token shards (loss and perplexity), not bytes (bits per byte)
    loss_in_forward = False  # set by build_model: the GPT returns its own loss (training_step)

    def _corpus(self) -> Corpus:
        root = Path(os.path.expanduser(str(self.cfg.data.root)))
        return Corpus(str(self.hp.corpus), root, self.cfg.data.synthetic)

    def prepare(self) -> None:
        """In the launcher, once: build the corpus's streams (workers then only map them), and check that
        they hold a batch of windows, before any worker starts. Token shards are not built: their headers,
        lengths and token ids are checked instead (the ids once per shard, remembered under data.root)."""
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
        train, val = self._streams(folder)
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

    def _prepare_shards(self, corpus: Corpus) -> None:
        """Token shards, checked in the launcher: a vocabulary given, every header and length sound, every
        token id inside the vocabulary, a batch of windows in the training shards and one held out."""
        hp, spec = self.hp, self.hp.corpus
        if not hp.vocab_size:
            raise ConfigError("recipe.vocab_size", 0, f"recipe.corpus={spec} holds token ids, so give their "
                              "tokenizer's vocabulary size (0 means 256, for bytes; GPT-2's is 50257)",
                              "recipe.vocab_size=50257")
        if hp.max_bytes:
            raise ConfigError("recipe.max_bytes", hp.max_bytes, "applies to text (bytes) only; with token shards "
                              "name fewer of them instead", "recipe.max_bytes=0")
        shards = TokenCorpus.read(spec, corpus.files, hp.context)
        for piece in shards.skipped:
            print(f"launch: warning: {piece} holds {piece.tokens} tokens, fewer than a window of recipe.context="
                  f"{hp.context} + 1; it is left out", file=sys.stderr, flush=True)
        check_token_ids(shards, hp.vocab_size, corpus.checked)
        windows = sum(p.tokens - 1 for p in shards.train) // hp.context
        if self.cfg.batch_size > windows:
            raise ConfigError("batch_size", self.cfg.batch_size, f"larger than the {windows} windows of {hp.context} "
                              f"tokens in the training shards of recipe.corpus={spec}",
                              f"batch_size={max(1, windows // 4)}")

    def _streams(self, folder: Path) -> tuple[np.ndarray, np.ndarray]:
        # copy-on-write maps: nothing is read until sampled, and nothing is ever written back
        train = np.memmap(folder / "train.bin", dtype=np.uint8, mode="c")
        val = np.memmap(folder / "val.bin", dtype=np.uint8, mode="c")
        if self.hp.max_bytes:
            train = train[: max(2, self.hp.max_bytes - self.hp.max_bytes // HELD_OUT)]
            val = val[: max(2, self.hp.max_bytes // HELD_OUT)]
        return train, val

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
        train, val = self._streams(folder)
        self.vocab = VOCAB
        self.baseline = unigram_loss(train, val)
        return TokenSplits(train, val, padded_vocab(VOCAB), self.hp.context, synthetic=self.cfg.data.synthetic)

    def build_model(self, num_classes: int) -> nn.Module:
        hp = self.hp
        if hp.model.value == "gpt":
            model: nn.Module = GPT(num_classes, hp.context, hp.layers, hp.width, hp.heads, hp.dropout)
        else:
            model = Recurrent(hp.model.value, num_classes, hp.layers, hp.width, hp.dropout)
        self.parameter_count = sum(p.numel() for p in model.parameters())
        self.flops_per_token = model.flops_per_token()
        self.loss_in_forward = isinstance(model, GPT)
        return model

    def training_step(self, model: nn.Module, batch: Any) -> Any:
        """The GPT computes its own loss inside its (compiled) forward. At GPT-2's vocabulary the logits and
        the loss are a quarter of the step: returning logits and taking an eager float32 loss after them ran
        at 0.78x (BENCHMARKS.md)."""
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
        if peak and "tokens_per_s" in row and self.cfg.perf.precision.value != "fp32":
            row["mfu"] = row["tokens_per_s"] * self.flops_per_token / (peak * world_size)

    def finish(self, model: nn.Module, run_dir: Path, device: torch.device, main: bool) -> dict[str, Any]:
        """Facts for results.json, and a sample: text after recipe.sample_prompt for bytes; for token shards
        (no tokenizer offline) recipe.sample_bytes token ids after the held-out stream's first ones, written
        to sample.txt as space-separated ids (decode them with the shards' tokenizer)."""
        facts: dict[str, Any] = {"parameters": self.parameter_count, "flops_per_token": self.flops_per_token,
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
