"""recipe=text on token shards end to end on CPU: llm.c-format shards of a GPT-2-sized vocabulary (50257,
padded to 50304) train a tiny GPT on 1 rank and on 2 gloo ranks; the loss falls below what token
frequencies alone give, perplexity is reported, the sample is token ids, nothing is written beside the
shards, and a bad corpus is one line before any worker starts."""

import json
import re

import numpy as np
import pytest

pytestmark = pytest.mark.distributed

VOCAB = 50257
STATES = 16
TINY = ("recipe=text", "gpus=[]", "recipe.layers=1", "recipe.width=32", "recipe.heads=2", "recipe.context=32",
        f"recipe.vocab_size={VOCAB}", "batch_size=8", "lr=1e-2", "optim.warmup_epochs=0", "epochs=3",
        "recipe.sample_bytes=12", "progress=lines")


def markov_tokens(n: int, seed: int) -> np.ndarray:
    """A small Markov chain over STATES states (each followed by one of 2 others), spread over ids up to
    50256 (the first token): learnable in a few dozen steps, unlike token frequencies (16 ids, about as
    likely: ln 16 = 2.77 nats; knowing the transitions, ln 2)."""
    rng = np.random.default_rng(seed)
    ids = np.linspace(0, VOCAB - 1, STATES).astype(np.int64)
    successors = np.random.default_rng(0).integers(0, STATES, size=(STATES, 2))
    state, out = STATES - 1, np.empty(n, np.int64)
    for i, pick in enumerate(rng.integers(0, 2, size=n)):
        out[i] = ids[state]
        state = successors[state, pick]
    return out


def write_llmc(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, len(tokens)
    path.write_bytes(header.tobytes() + tokens.astype(np.uint16).tobytes())


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fineweb-like")
    for i in range(3):
        write_llmc(folder / f"toy_train_{i:06d}.bin", markov_tokens(1000, seed=i + 1))
    write_llmc(folder / "toy_val_000000.bin", markov_tokens(400, seed=99))
    write_llmc(folder / "toy_train_000009.bin", markov_tokens(20, seed=7))  # shorter than a window: left out
    return folder


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_trained(result, shards):
    assert result.returncode == 0, result.output
    results, run_dir = result.results(), result.run_dir()
    rows = _rows(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert rows[-1]["loss"] < rows[0]["loss"] < np.log(VOCAB)
    final = results["final"]
    # well below knowing only which 16 ids occur (and what token frequencies give): transitions were learned
    assert final["test_loss"] < min(0.8 * np.log(STATES), results["unigram_test_loss"]), final
    assert final["test_ppl"] == pytest.approx(np.exp(final["test_loss"]), rel=1e-6) and "test_bpb" not in final
    assert results["vocab_size"] == VOCAB and results["padded_vocab_size"] == 50304
    assert final["tokens_per_s"] > 0
    ids = [int(t) for t in (run_dir / "sample.txt").read_text().split()]
    assert len(ids) == 8 + 12 and ids == results["sample_ids"] and max(ids) < VOCAB
    assert "toy_train_000009.bin holds 20 tokens, fewer than a window" in result.stderr
    assert sorted(p.name for p in shards.iterdir()) == [  # nothing written beside the shards
        "toy_train_000000.bin", "toy_train_000001.bin", "toy_train_000002.bin", "toy_train_000009.bin",
        "toy_val_000000.bin"]
    return results


def test_a_tiny_gpt_learns_llmc_shards_on_one_rank(launch, shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    result = launch(*TINY, f"recipe.corpus={shards}", f"data.root={root}")
    results = _check_trained(result, shards)
    assert "perplexity" in result.output
    assert len(list((root / "text" / "token-ids").glob("*.json"))) == 5  # each shard's check, remembered
    assert "checking the token ids" in result.stderr
    assert re.search(r"launch: recipe.corpus=\S+: 3 training shards \([\d,]+ tokens\); held out: toy_val_000000.bin",
                     result.stderr), result.stderr  # (the split, said: toy_train_000009.bin is too short)
    assert results["parameters"] < 2_000_000
    # `launch eval` says a token model's figures as a byte-level one's: its loss, perplexity for bits per byte
    evaluated = launch("eval", str(result.run_dir()), "gpus=[]", f"data.root={root}")
    assert evaluated.returncode == 0, evaluated.output
    assert re.search(r"evaluated \S+ in \S+s: test loss \d+\.\d{4} \(perplexity \d+\.\d\), next-token accuracy "
                     r"\d+\.\d\d%", evaluated.output), evaluated.output


def test_two_gloo_ranks_train_the_same_shards(launch, shards, tmp_path_factory):
    result = launch(*TINY, f"recipe.corpus={shards}/toy_*.bin", f"data.root={tmp_path_factory.mktemp('root')}",
                    "strategy=ddp", "nprocs=2")
    results = _check_trained(result, shards)
    assert results["world_size"] == 2


def test_token_shards_without_a_vocabulary_size_or_with_ids_beyond_it_are_one_line(launch, shards, tmp_path):
    plain = [a for a in TINY if not a.startswith("recipe.vocab_size")]
    result = launch(*plain, f"recipe.corpus={shards}", f"data.root={tmp_path}")
    assert result.returncode == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("launch: recipe.vocab_size=0 is not valid: recipe.corpus=") and "Traceback" not in line
    assert line.endswith("(e.g. launch recipe.vocab_size=50257)") and "rank 0" not in result.output
    small = launch(*plain, "recipe.vocab_size=50000", f"recipe.corpus={shards}", f"data.root={tmp_path}")
    assert small.returncode == 2, small.output
    line = small.stderr.strip().splitlines()[-1]
    assert "toy_train_000000.bin holds token id 50256" in line and line.endswith("recipe.vocab_size=50257)")
