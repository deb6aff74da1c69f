"""Generated token shards in llm.c's format, for benchmarking recipe=text on shards (and bench/gpt_script.py
--shards) without downloading FineWeb:

    python bench/make_token_shards.py /tmp/shards --shards 8 --tokens-per-shard 100000000
    launch recipe=text gpus=[0] recipe.corpus='/tmp/shards/gen_*.bin' recipe.vocab_size=50257 ...

Writes `gen_train_000001.bin` .. `gen_train_<N>.bin` and `gen_val_000000.bin` (llm.c's names: the val
shard is held out by its name), each a header of 256 int32 (magic 20240520, version 1, the token count)
and uint16 tokens, as llm.c's dev/data/data_common.py writes them; a vocabulary over 65,536 (Llama 3's
128,256) is written as version 2, uint32 tokens, which recipe=text also reads. The tokens: a Zipf law over the
vocabulary (rank 1 the most frequent, as real text roughly is), each token then repeated with a fixed
random successor half of the time, so a model has something to learn; nothing like a real corpus, so
loss figures say nothing, only speed does. Written in chunks (a shard is never held whole) under a
temporary name renamed when complete. numpy only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
CHUNK = 1 << 24  # tokens generated and written at a time


def write_shard(path: Path, tokens: int, vocab: int, rng: np.random.Generator, successor: np.ndarray) -> None:
    wide = vocab > 65536
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, 2 if wide else VERSION, tokens
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        left = tokens
        while left:
            n = min(CHUNK, left)
            drawn = np.minimum(rng.zipf(1.1, size=n), vocab) - 1
            follow = rng.random(n) < 0.5
            drawn[1:][follow[1:]] = successor[drawn[:-1][follow[1:]]]
            f.write(drawn.astype("<u4" if wide else "<u2").tobytes())
            left -= n
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shards", type=int, default=4, help="training shards (a val shard is added)")
    parser.add_argument("--tokens-per-shard", type=int, default=10_000_000)
    parser.add_argument("--val-tokens", type=int, default=0, help="tokens of the val shard (0: as a training shard)")
    parser.add_argument("--vocab-size", type=int, default=50257, help="over 65536: uint32 tokens (version 2)")
    parser.add_argument("--prefix", default="gen")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 2 <= args.vocab_size <= 1 << 32:
        parser.error(f"--vocab-size {args.vocab_size}: 2 to 65536 (uint16 tokens) or up to 2**32 (uint32)")
    if args.shards < 1 or args.tokens_per_shard < 1:
        parser.error("--shards and --tokens-per-shard must be at least 1")
    args.folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    successor = rng.integers(0, args.vocab_size, size=args.vocab_size)
    names = [(f"{args.prefix}_val_000000.bin", args.val_tokens or args.tokens_per_shard)]
    names += [(f"{args.prefix}_train_{i:06d}.bin", args.tokens_per_shard) for i in range(1, args.shards + 1)]
    for name, tokens in names:
        write_shard(args.folder / name, tokens, args.vocab_size, rng, successor)
        print(f"{args.folder / name}: {tokens:,} tokens", flush=True)


if __name__ == "__main__":
    main()
