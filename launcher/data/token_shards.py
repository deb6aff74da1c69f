"""Token shards for recipe=text: files of token ids as nanoGPT and llm.c write them, read in place.

Three formats, told apart by the suffix and the first 1,024 bytes:
- llm.c's `.bin`: a header of 256 int32 (magic 20240520, version 1 for uint16 tokens or 2 for uint32,
  the token count), the tokens from byte 1024 (llm.c's dev/data/*.py, e.g. fineweb_train_000001.bin);
- nanoGPT's `.bin`: uint16 tokens with no header (its data/*/prepare.py: train.bin, val.bin);
- `.npy`: a 1-D uint16 or uint32 array (numpy's own header), e.g. modded-nanogpt-style dumps.

Every shard is memory-mapped read-only (`Shard.open`): nothing is copied or concatenated on the host
and nothing beside the shards is ever written, so a corpus of many gigabytes costs only the pages the
sampled windows touch. Which shards are held out: those whose names say `val` (nanoGPT's val.bin,
llm.c's *_val_*.bin); if none does, the last 1/20 of the last shard, as for a single text file.

numpy only (no torch): the launcher reads headers and checks token ids before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.errors import ConfigError, LaunchError

LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 1024  # 256 int32
LLMC_DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32)}  # header[1], the version
NPY_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32))
TOKEN_SUFFIXES = (".bin", ".npy")
HELD_OUT = 20  # without a val shard: the last 1/HELD_OUT of the last shard is held out
SCAN_TOKENS = 1 << 24  # tokens read at a time while looking for the largest token id
PAD_VOCAB = 64  # the model's vocabulary is padded to a multiple of this (nanoGPT: 50257 -> 50304)
# A name that says held-out: `val` (or validation) as a word of its own: val.bin, fineweb_val_000000.bin,
# shard-validation-3.npy; not interval.bin or valley.bin.
VAL_NAME = re.compile(r"(?:^|[^a-z])val(?:id|idation)?(?:$|[^a-z])", re.IGNORECASE)


class ShardError(LaunchError):
    """A token file cannot be used; the message names it and says what to do."""


def padded_vocab(vocab: int) -> int:
    """The model's vocabulary: `vocab` rounded up to a multiple of 64, so the embedding and the output
    layer's matmul have GPU-friendly shapes (the extra rows are never targets and learn to stay unlikely)."""
    return -(-vocab // PAD_VOCAB) * PAD_VOCAB


def is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def is_token_file(path: Path) -> bool:
    return path.suffix.lower() in TOKEN_SUFFIXES


def names_tokens(files: Sequence[Path], spec: str) -> bool:
    """Whether `files` (what recipe.corpus named) are token shards (all .bin/.npy) or text (none is);
    a mixture is one line that says how to name only the token files."""
    tokens = [p for p in files if is_token_file(p)]
    if not tokens:
        return False
    if len(tokens) < len(files):
        other = next(p for p in files if not is_token_file(p))
        folder = Path(spec).expanduser() if Path(spec).expanduser().is_dir() else tokens[0].parent
        raise ConfigError("recipe.corpus", spec, f"mixes {len(tokens)} token files (.bin/.npy) with "
                          f"{len(files) - len(tokens)} other files (e.g. {other.name}); name the token files only, "
                          "or a folder of text only", f"recipe.corpus='{folder}/*{tokens[0].suffix}'")
    return True


@dataclass(frozen=True)
class Shard:
    """One token file: where its tokens start, their type and count, as read from its header."""

    path: Path
    kind: str  # llm.c | nanoGPT | npy
    dtype: np.dtype
    offset: int  # bytes before the first token
    tokens: int

    def open(self) -> np.ndarray:
        """The tokens, memory-mapped read-only (nothing is read until indexed, nothing ever written)."""
        if self.tokens == 0:
            return np.empty(0, self.dtype)
        if self.kind == "npy":
            return np.load(self.path, mmap_mode="r")
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.tokens,))


def _head(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as exc:
        raise ShardError(f"cannot read the token file {path} ({exc.strerror or exc}); leave it out of "
                         "recipe.corpus or make it readable") from None


def read_llmc_header(path: Path) -> Shard:
    """An llm.c shard's header, checked against the file: the magic, a known version, and a token count
    that the bytes after the header hold exactly (a truncated copy or a foreign file is named)."""
    size = path.stat().st_size
    head = _head(path, LLMC_HEADER_BYTES)
    if len(head) < LLMC_HEADER_BYTES:
        raise ShardError(f"{path} is not an llm.c token file: {size} bytes, shorter than its 1024-byte header "
                         "(truncated?); copy it again or leave it out of recipe.corpus")
    header = np.frombuffer(head, dtype="<i4")
    magic, version, count = (int(v) for v in header[:3])
    if magic != LLMC_MAGIC:
        raise ShardError(f"{path} has an llm.c-style header with magic {magic}, not {LLMC_MAGIC}; write it with "
                         "llm.c's dev/data scripts, or leave it out of recipe.corpus")
    if version not in LLMC_DTYPES:
        raise ShardError(f"{path} is llm.c version {version}; versions 1 (uint16 tokens) and 2 (uint32) are read: "
                         "write it with llm.c's dev/data scripts, or leave it out of recipe.corpus")
    dtype = LLMC_DTYPES[version]
    held = size - LLMC_HEADER_BYTES
    if count < 0 or held != count * dtype.itemsize:
        what = "truncated?" if held < count * dtype.itemsize else "trailing bytes"
        raise ShardError(f"{path}: its llm.c header says {count} tokens ({count * dtype.itemsize} bytes) but "
                         f"{held} bytes follow the header ({what}); copy it again or leave it out of recipe.corpus")
    return Shard(path, "llm.c", dtype, LLMC_HEADER_BYTES, count)


def _looks_like_llmc(head: bytes, size: int) -> bool:
    """A header llm.c would write but for the magic: a version and count that fit the size, the rest zero.
    (A raw uint16 file matching this by chance would need 506 zero tokens from its 7th on.)"""
    if len(head) < LLMC_HEADER_BYTES:
        return False
    header = np.frombuffer(head, dtype="<i4")
    version, count = int(header[1]), int(header[2])
    dtype = LLMC_DTYPES.get(version)
    return (dtype is not None and count > 0 and size == LLMC_HEADER_BYTES + count * dtype.itemsize
            and not header[3:].any())


def read_shard(path: Path) -> Shard:
    """A token file's layout (no tokens read): llm.c or nanoGPT by the first bytes of a .bin, numpy's
    header for a .npy. Raises ShardError naming the file when its layout does not hold."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ShardError(f"cannot read the token file {path} ({exc.strerror or exc}); leave it out of "
                         "recipe.corpus") from None
    if path.suffix.lower() == ".npy":
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise ShardError(f"{path} is not a readable .npy array ({exc}); write it with np.save, or leave it "
                             "out of recipe.corpus") from None
        if array.ndim != 1 or array.dtype not in NPY_DTYPES:
            raise ShardError(f"{path} holds a {array.dtype} array of shape {tuple(array.shape)}; token shards are "
                             "1-D uint16 or uint32 (np.save(path, tokens.astype(np.uint16)))")
        return Shard(path, "npy", array.dtype, 0, int(array.shape[0]))
    head = _head(path, LLMC_HEADER_BYTES)
    if len(head) >= 4 and int(np.frombuffer(head[:4], dtype="<i4")[0]) == LLMC_MAGIC:
        return read_llmc_header(path)
    if _looks_like_llmc(head, size):
        return read_llmc_header(path)  # names the bad magic
    if size % 2:
        raise ShardError(f"{path} has an odd size ({size} bytes): not uint16 tokens (nanoGPT's raw .bin) nor an "
                         "llm.c shard; copy it again or leave it out of recipe.corpus")
    wider = _raw_uint32(_head(path, RAW_SAMPLE_BYTES))
    if wider:
        raise ShardError(f"{path} reads as uint32 tokens written without a header (every second uint16 of it is "
                         f"{wider}: the high halves of uint32 ids); a raw .bin is read as uint16 (nanoGPT's). For ids "
                         "above 65535 save a .npy (np.save(path, tokens.astype(np.uint32))) or an llm.c shard "
                         "(version 2); below it, tokens.astype(np.uint16).tofile(path)")
    return Shard(path, "nanoGPT", np.dtype(np.uint16), 0, size // 2)


RAW_SAMPLE_BYTES = 1 << 16  # the start of a raw .bin looked at for uint32 tokens (32,768 uint16 values)


def _raw_uint32(head: bytes) -> str | None:
    """Where the start of a raw .bin is uint32 tokens (np.uint32 ids written with tofile), which read as
    uint16 give every real id followed by its high half, 0 for ids below 65536: those few values (said as
    "0" or "0 or 1"), else None. Real uint16 text varies at odd places as at even ones."""
    values = np.frombuffer(head[:len(head) // 4 * 4], dtype="<u2")
    if len(values) < 64:
        return None
    high, low = np.unique(values[1::2]), np.unique(values[0::2])
    if len(high) > 4 or int(high.max()) > 3 or len(low) <= 16:
        return None
    return " or ".join(str(int(v)) for v in high)


def is_held_out(path: Path) -> bool:
    return bool(VAL_NAME.search(path.stem))


@dataclass(frozen=True)
class Piece:
    """Tokens [start, stop) of a shard: a whole shard, or the train part or held-out tail of one."""

    shard: Shard
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start

    def open(self) -> np.ndarray:
        tokens = self.shard.open()
        return tokens if (self.start, self.stop) == (0, len(tokens)) else tokens[self.start:self.stop]

    def __str__(self) -> str:
        whole = (self.start, self.stop) == (0, self.shard.tokens)
        return str(self.shard.path) if whole else f"{self.shard.path}[{self.start}:{self.stop}]"


@dataclass
class TokenCorpus:
    """recipe.corpus's token shards split into training and held-out pieces, those shorter than a window
    (context + 1 tokens) set aside."""

    spec: str
    train: list[Piece]
    val: list[Piece]
    skipped: list[Piece]  # shorter than context + 1 tokens
    dtype: np.dtype

    @classmethod
    def read(cls, spec: str, files: Sequence[Path], context: int) -> TokenCorpus:
        shards = [read_shard(p) for p in files]
        dtype = shards[0].dtype
        odd = next((s for s in shards if s.dtype != dtype), None)
        if odd is not None:
            raise ShardError(f"recipe.corpus={spec} mixes {dtype} tokens ({shards[0].path.name}) with {odd.dtype} "
                             f"({odd.path}); name shards of one token type (a glob: recipe.corpus='/data/*.bin')")
        val = [Piece(s, 0, s.tokens) for s in shards if is_held_out(s.path)]
        train = [Piece(s, 0, s.tokens) for s in shards if not is_held_out(s.path)]
        if not train:
            raise ConfigError("recipe.corpus", spec, f"every one of its {len(shards)} token files is held out (its "
                              "name says val); name the training shards too",
                              f"recipe.corpus='{shards[0].path.parent}/*{shards[0].path.suffix}'")
        if not val:  # the tail of the last shard, like a single text file's
            last = train[-1]
            cut = last.stop - max(1, last.tokens // HELD_OUT)
            train[-1], val = Piece(last.shard, 0, cut), [Piece(last.shard, cut, last.stop)]
        skipped = [p for p in train + val if p.tokens <= context]
        corpus = cls(spec, [p for p in train if p.tokens > context], [p for p in val if p.tokens > context],
                     skipped, dtype)
        for pieces, what in ((train, "training"), (val, "held-out")):
            if not any(p.tokens > context for p in pieces):
                longest = max(p.tokens for p in pieces)
                raise ConfigError("recipe.context", context, f"longer than every {what} shard of recipe.corpus="
                                  f"{spec} (the longest holds {longest} tokens; a window needs context + 1)",
                                  f"recipe.context={max(2, longest // 4)}")
        return corpus

    def describe(self) -> str:
        """The split in one line (the launcher says it before any worker): the training shards and what is held
        out, the shards named val or the tail of the last shard."""
        def count(pieces: list[Piece]) -> str:
            return f"{sum(p.tokens for p in pieces):,} tokens"

        names = sorted({p.shard.path.name for p in self.val})
        if all((p.start, p.stop) == (0, p.shard.tokens) for p in self.val):
            held = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        else:
            held = f"the last 1/{HELD_OUT} of {names[0]} (no shard's name says val)"
        shards = len({p.shard.path for p in self.train})
        return (f"recipe.corpus={self.spec}: {shards} training shard{'s' if shards != 1 else ''} "
                f"({count(self.train)}); held out: {held} ({count(self.val)})")

    def opened(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The training and held-out pieces, memory-mapped."""
        return [p.open() for p in self.train], [p.open() for p in self.val]


def largest_token(shard: Shard, cache: Path | None) -> int:
    """The largest token id in `shard` (-1 when empty), read in chunks of SCAN_TOKENS (a shard larger than
    memory is never loaded whole). Remembered in `cache` (a folder under data.root, never beside the
    shard) by path, size and mtime, so a later run does not read the shard again."""
    stat = shard.path.stat()
    entry = _cache_entry(shard, cache) if cache is not None else None
    if entry is not None:
        try:
            return int(json.loads(entry.read_text())["largest"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    tokens, largest = shard.open(), -1
    for start in range(0, len(tokens), SCAN_TOKENS):
        largest = max(largest, int(tokens[start:start + SCAN_TOKENS].max()))
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"path": str(shard.path.resolve()), "size": stat.st_size,
                                       "mtime_ns": stat.st_mtime_ns, "largest": largest}))
            os.replace(tmp, entry)
        except OSError:  # an unwritable data.root: the check still ran, the next run reads again
            pass
    return largest


def check_token_ids(corpus: TokenCorpus, vocab: int, cache: Path | None) -> None:
    """Every token id below `vocab` (recipe.vocab_size), else one line naming the shard and its largest id."""
    shards = list({p.shard.path: p.shard for p in corpus.train + corpus.val + corpus.skipped}.values())
    unchecked = sum(s.tokens * s.dtype.itemsize for s in shards)
    if cache is None or not all(_cache_entry(s, cache).is_file() for s in shards):
        print(f"launch: checking the token ids of recipe.corpus={corpus.spec} ({len(shards)} shards, "
              f"{unchecked / 2**20:,.1f} MB) against recipe.vocab_size={vocab} (once; later runs remember)",
              file=sys.stderr, flush=True)
    for shard in shards:
        largest = largest_token(shard, cache)
        if largest >= vocab:
            raise ConfigError("recipe.vocab_size", vocab, f"{shard.path} holds token id {largest}; every id must be "
                              "below the vocabulary size (the tokenizer's: GPT-2's is 50257)",
                              f"recipe.vocab_size={largest + 1}")


def _cache_entry(shard: Shard, cache: Path) -> Path:
    """Where a shard's largest token id is remembered: keyed by its path, size and mtime (a shard
    rewritten in place is read again)."""
    stat = shard.path.stat()
    key = f"{shard.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return cache / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def token_unigram_loss(train: Sequence[np.ndarray], val: Sequence[np.ndarray], vocab: int, budget: int) -> float:
    """Cross-entropy (nats per token) of the held-out tokens under the training tokens' frequencies (add-one
    smoothed over `vocab`), counted on at most `budget` tokens of each side, in chunks."""

    def counts(pieces: Sequence[np.ndarray]) -> np.ndarray:
        total, left = np.zeros(vocab, np.float64), budget
        for tokens in pieces:
            for start in range(0, min(len(tokens), left), SCAN_TOKENS):
                chunk = np.asarray(tokens[start:min(start + SCAN_TOKENS, left)])
                total += np.bincount(chunk, minlength=vocab)[:vocab]
            left -= min(len(tokens), left)
            if left <= 0:
                break
        return total

    train_counts = counts(train) + 1.0
    logp = np.log(train_counts / train_counts.sum())
    val_counts = counts(val)
    return float(-(val_counts * logp).sum() / max(1.0, val_counts.sum()))
