"""A text corpus as two byte streams (train, held out) for next-token prediction (recipe=text), built once
and then memory-mapped; or, where the corpus names token shards, their files (read in place: token_shards.py).

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
  folder or a glob of them (token_shards.py).
Each file is read once, under one path: a link to a file listed under another path, or a hard link, is left
out (`read_once`); linked folders are not followed, nor kernel filesystems entered.

For text, bytes are the tokens (vocabulary 256): no tokenizer, nothing to download. The streams are built once
into `<data.root>/text/<corpus key>/{train,val}.bin` (uint8, written under a temporary name and renamed)
and then memory-mapped, so a corpus larger than host memory is read only where windows are sampled
(placement.py `TokenWindows`). `data.synthetic=true` generates a stream from a fixed random Markov chain
instead (timing only).

numpy only (no torch): the launcher builds the streams before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat as stat_module
import sys
import sysconfig
import uuid
from pathlib import Path

import numpy as np

from launcher.data.token_shards import is_glob, names_tokens
from launcher.errors import LaunchError

VOCAB = 256  # bytes
HELD_OUT = 20  # one file in this many (by a hash of its path), or the last 1/HELD_OUT of a single file
LICENCES = {"stdlib": "PSF License Agreement (Python Software Foundation License Version 2)"}
SYNTHETIC_BYTES = (4_000_000, 200_000)
BASELINE_BYTES = 2**26  # the unigram baseline counts at most this much of each stream (a start-up cost)


class TextDataError(LaunchError):
    """The corpus cannot be read; the message says what to give instead."""




def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's own sources: *.py outside test suites and installed packages, sorted."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    found = []
    for folder, dirs, names in os.walk(root):  # (skipped folders are not entered: site-packages can be large)
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(p for p in found if p.is_file())


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
            files = f"{len(self.files)} file{'s' if len(self.files) != 1 else ''}"
            print(f"launch: building the token streams of recipe.corpus={self.spec} ({files}, "
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


def byte_streams(folder: Path, max_bytes: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The folder's (train, held-out) streams as copy-on-write memory maps: nothing is read until sampled,
    and nothing is ever written back. `max_bytes` (recipe.max_bytes), when set, is both streams' budget
    together, the held-out one taking 1/HELD_OUT of it."""
    train = np.memmap(folder / "train.bin", dtype=np.uint8, mode="c")
    val = np.memmap(folder / "val.bin", dtype=np.uint8, mode="c")
    if max_bytes:
        train = train[: max(2, max_bytes - max_bytes // HELD_OUT)]
        val = val[: max(2, max_bytes // HELD_OUT)]
    return train, val
