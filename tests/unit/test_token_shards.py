"""recipe=text on token shards: the files nanoGPT and llm.c write, read in place; which are held out; the
windows a step trains on never crossing from one shard into the next; the vocabulary checks."""

import json
import os

import numpy as np
import pytest
import torch

from launcher.config import DataConfig, Placement
from launcher.data.corpus import Corpus
from launcher.data.placement import Data, TokenWindows
from launcher.data.token_shards import (
    LLMC_MAGIC,
    TokenCorpus,
    check_token_ids,
    largest_token,
    padded_vocab,
    read_llmc_header,
    read_shard,
    token_unigram_loss,
)
from launcher.errors import ConfigError, LaunchError
from launcher.recipes import TokenSplits
from launcher.recipes.text import Text
from tests.conftest import config_of


def write_llmc(path, tokens, version=1, magic=LLMC_MAGIC, count=None):
    """A shard as llm.c's dev/data/data_common.py writes it: 256 int32 of header, then the tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    dtype = np.uint16 if version == 1 else np.uint32
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes())
    return path


def test_an_llmc_shard_is_read_in_place_after_its_header(tmp_path):
    tokens = np.arange(5000) % 50257
    shard = read_shard(write_llmc(tmp_path / "fineweb_train_000001.bin", tokens))
    assert (shard.kind, shard.dtype, shard.offset, shard.tokens) == ("llm.c", np.uint16, 1024, 5000)
    mapped = shard.open()
    assert isinstance(mapped, np.memmap) and not mapped.flags.writeable
    assert np.array_equal(mapped, tokens)
    wide = read_shard(write_llmc(tmp_path / "llama_train_000001.bin", [0, 128000, 7], version=2))
    assert wide.dtype == np.uint32 and list(wide.open()) == [0, 128000, 7]


def test_an_llmc_header_with_a_bad_magic_or_version_is_one_line_naming_the_file(tmp_path):
    bad = write_llmc(tmp_path / "a.bin", np.arange(100), magic=20240326)
    with pytest.raises(LaunchError, match=r"a\.bin has an llm.c-style header with magic 20240326, not 20240520"):
        read_shard(bad)  # (a header llm.c would write, but for the magic: not taken for raw tokens)
    with pytest.raises(LaunchError, match=r"b\.bin is llm.c version 7; versions 1 \(uint16 tokens\) and 2"):
        read_llmc_header(write_llmc(tmp_path / "b.bin", np.arange(10), version=7))


def test_a_truncated_llmc_shard_is_one_line_naming_the_file_and_the_counts(tmp_path):
    path = write_llmc(tmp_path / "fineweb_train_000002.bin", np.arange(1000))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(LaunchError, match=r"fineweb_train_000002\.bin: its llm.c header says 1000 tokens \(2000 "
                                          r"bytes\) but 1990 bytes follow the header \(truncated\?\)") as info:
        read_shard(path)
    assert "\n" not in str(info.value)
    longer = write_llmc(tmp_path / "fineweb_train_000003.bin", np.arange(1000), count=990)  # 20 bytes too many
    with pytest.raises(LaunchError, match=r"fineweb_train_000003\.bin: its llm.c header says 990 tokens \(1980 "
                                          r"bytes\) but 2000 bytes follow the header \(trailing bytes\)"):
        read_shard(longer)
    short = tmp_path / "c.bin"
    short.write_bytes(np.array([LLMC_MAGIC, 1, 5], dtype="<i4").tobytes())
    with pytest.raises(LaunchError, match=r"c\.bin is not an llm.c token file: 12 bytes, shorter than its 1024"):
        read_shard(short)


def test_a_nanogpt_bin_is_raw_uint16_and_an_odd_size_is_named(tmp_path):
    tokens = np.array([50256, 15496, 11, 995, 0, 1], dtype=np.uint16)
    (tmp_path / "train.bin").write_bytes(tokens.tobytes())
    shard = read_shard(tmp_path / "train.bin")
    assert (shard.kind, shard.offset, shard.tokens) == ("nanoGPT", 0, 6)
    assert list(shard.open()) == list(tokens)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(LaunchError, match=r"odd\.bin has an odd size \(3 bytes\)"):
        read_shard(tmp_path / "odd.bin")


def test_uint32_tokens_written_raw_into_a_bin_are_one_line_not_read_as_uint16(tmp_path):
    """Ids 66000-69999 written with tofile as uint32 read as uint16 gave every id's low half followed by 1:
    the id check passed (largest 4463 < 70000) and the run trained on them. Ids below 65536 so: followed by 0."""
    rng = np.random.default_rng(0)
    for name, low, high, halves in (("wide.bin", 66000, 70000, "1"), ("gpt2.bin", 0, 50257, "0"),
                                    ("both.bin", 60000, 70000, "0 or 1")):
        rng.integers(low, high, 100_000).astype(np.uint32).tofile(tmp_path / name)
        with pytest.raises(LaunchError, match=rf"{name} reads as uint32 tokens written without a header \(every "
                                              rf"second uint16 of it is {halves}: .*np\.uint32"):
            read_shard(tmp_path / name)
    # real uint16 text, however repetitive, and a short file, are read as before
    text = np.tile(np.array([464, 3290, 318, 257, 1332, 13, 198, 0], dtype=np.uint16), 5000)
    for name, tokens in (("text.bin", text), ("short.bin", np.array([5, 0, 7, 0, 9, 1], dtype=np.uint16)),
                         ("tokens.bin", rng.integers(0, 50257, 100_000).astype(np.uint16))):
        tokens.tofile(tmp_path / name)
        assert read_shard(tmp_path / name).tokens == len(tokens)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_npy_shards_of_uint16_or_uint32_are_memory_mapped(tmp_path, dtype):
    tokens = (np.arange(300) * 7).astype(dtype)
    np.save(tmp_path / "shard_000.npy", tokens)
    shard = read_shard(tmp_path / "shard_000.npy")
    assert shard.dtype == dtype and shard.tokens == 300
    mapped = shard.open()
    assert isinstance(mapped, np.memmap) and np.array_equal(mapped, tokens)
    np.save(tmp_path / "floats.npy", np.zeros(4, np.float32))
    with pytest.raises(LaunchError, match=r"floats\.npy holds a float32 array of shape \(4,\); token shards are 1-D"):
        read_shard(tmp_path / "floats.npy")


def test_shards_named_val_are_held_out(tmp_path):
    files = [write_llmc(tmp_path / f"fineweb_{split}_{i:06d}.bin", np.arange(100 + i))
             for split, i in (("val", 0), ("train", 1), ("train", 2))]
    (tmp_path / "interval_3.bin").write_bytes(np.arange(50, dtype=np.uint16).tobytes())  # not `val`
    corpus = TokenCorpus.read("x", sorted([*files, tmp_path / "interval_3.bin"]), context=8)
    assert [p.shard.path.name for p in corpus.val] == ["fineweb_val_000000.bin"]
    assert [p.shard.path.name for p in corpus.train] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin",
                                                         "interval_3.bin"]
    assert all((p.start, p.stop) == (0, p.shard.tokens) for p in corpus.train + corpus.val)  # whole shards
    assert corpus.describe() == ("recipe.corpus=x: 3 training shards (253 tokens); held out: fineweb_val_000000.bin "
                                 "(100 tokens)")  # (said before any worker)
    with pytest.raises(ConfigError, match=r"recipe.corpus=x is not valid: every one of its 1 token files is held "
                                          r"out .*recipe.corpus="):
        TokenCorpus.read("x", files[:1], context=8)


def test_without_a_val_shard_the_tail_of_the_last_one_is_held_out(tmp_path):
    files = [write_llmc(tmp_path / f"s{i}.bin", np.arange(1000) + i) for i in range(2)]
    corpus = TokenCorpus.read("x", files, context=8)
    (first, last), (val,) = corpus.train, corpus.val
    assert (first.start, first.stop) == (0, 1000)
    assert last.shard is val.shard and (last.start, last.stop, val.start, val.stop) == (0, 950, 950, 1000)
    train, held = corpus.opened()
    assert np.array_equal(np.concatenate([train[1], held[0]]), np.arange(1000) + 1)
    assert corpus.describe() == ("recipe.corpus=x: 2 training shards (1,950 tokens); held out: the last 1/20 of "
                                 "s1.bin (no shard's name says val) (50 tokens)")


def test_shards_shorter_than_a_window_are_left_out_and_if_none_fits_one_line(tmp_path):
    files = [write_llmc(tmp_path / "a_train.bin", np.arange(500)), write_llmc(tmp_path / "b_train.bin", np.arange(8)),
             write_llmc(tmp_path / "val.bin", np.arange(100))]
    corpus = TokenCorpus.read("x", files, context=8)
    assert [p.shard.path.name for p in corpus.skipped] == ["b_train.bin"]
    assert [p.shard.path.name for p in corpus.train] == ["a_train.bin"]
    with pytest.raises(ConfigError, match=r"recipe.context=600 is not valid: longer than every training shard .*"
                                          r"the longest holds 500 tokens.*recipe.context=125"):
        TokenCorpus.read("x", files, context=600)


def test_a_token_id_outside_the_vocabulary_names_the_shard_and_the_largest_id(tmp_path, monkeypatch):
    from launcher.data import token_shards

    monkeypatch.setattr(token_shards, "SCAN_TOKENS", 100)  # many chunks: a shard is never read whole
    tokens = np.arange(1000) % 300
    tokens[777] = 50300
    files = [write_llmc(tmp_path / "train_1.bin", np.arange(1000) % 50257),
             write_llmc(tmp_path / "train_2.bin", tokens), write_llmc(tmp_path / "val_1.bin", np.arange(200))]
    corpus = TokenCorpus.read("x", files, context=8)
    cache = tmp_path / "root" / "text" / "token-ids"
    with pytest.raises(ConfigError, match=r"recipe.vocab_size=50257 is not valid: .*train_2\.bin holds token id "
                                          r"50300; .*recipe.vocab_size=50301"):
        check_token_ids(corpus, 50257, cache)
    with pytest.raises(ConfigError, match=r"recipe.vocab_size=50300 is not valid: .*holds token id 50300"):
        check_token_ids(corpus, 50300, cache)  # (ids run from 0 to vocab_size - 1)
    check_token_ids(corpus, 50301, cache)
    assert sorted(json.loads(p.read_text())["largest"] for p in cache.glob("*.json")) == [199, 999, 50300]
    # a second run reads the remembered answer, not the shard; a rewritten shard is read again
    monkeypatch.setattr(token_shards.Shard, "open", lambda self: pytest.fail("read again"))
    assert largest_token(corpus.train[1].shard, cache) == 50300
    monkeypatch.undo()
    write_llmc(tmp_path / "train_2.bin", np.arange(1000) % 300)
    os.utime(tmp_path / "train_2.bin", ns=(1, 1))
    assert largest_token(read_shard(tmp_path / "train_2.bin"), cache) == 299
    assert not list(tmp_path.glob(".*"))  # nothing written beside the shards


def test_the_vocabulary_is_padded_to_a_multiple_of_64():
    assert [padded_vocab(v) for v in (256, 50257, 50304, 65, 2)] == [256, 50304, 50304, 128, 64]


def test_the_vocabulary_size_is_checked_when_composed():
    assert config_of("recipe=text").recipe.vocab_size == 0
    assert config_of("recipe=text", "recipe.vocab_size=50257").recipe.vocab_size == 50257
    with pytest.raises(ConfigError, match=r"recipe.vocab_size=1 is not valid: a vocabulary needs at least 2"):
        config_of("recipe=text", "recipe.vocab_size=1")
    with pytest.raises(ConfigError, match=r"recipe.vocab_size=100000000 is not valid: must be an integer from 0 to"):
        config_of("recipe=text", "recipe.vocab_size=100000000")


def test_the_corpus_is_told_by_suffix_and_a_mixture_is_one_line(tmp_path):
    folder = tmp_path / "owt"
    folder.mkdir()
    write_llmc(folder / "train.bin", np.arange(100))
    (folder / "prepare.py").write_text("print()")
    with pytest.raises(ConfigError, match=r"recipe.corpus=.*owt is not valid: mixes 1 token files \(.bin/.npy\) with "
                                          r"1 other files \(e.g. prepare.py\).*recipe.corpus='.*owt/\*.bin'"):
        Corpus(str(folder), tmp_path / "root", synthetic=False)
    assert Corpus(str(folder / "*.bin"), tmp_path / "root", synthetic=False).tokens
    text = Corpus(str(folder / "*.py"), tmp_path / "root", synthetic=False)  # a glob of text: bytes, as before
    assert not text.tokens and text.files == [folder / "prepare.py"]
    with pytest.raises(LaunchError, match=r"matches no file"):
        Corpus(str(folder / "*.npy"), tmp_path / "root", synthetic=False)


def test_token_shards_need_their_vocabulary_size(tmp_path):
    write_llmc(tmp_path / "train.bin", np.arange(1000))
    cfg = config_of("recipe=text", f"recipe.corpus={tmp_path}", f"data.root={tmp_path / 'root'}", "batch_size=4",
                    "recipe.context=8")
    with pytest.raises(ConfigError, match=r"recipe.vocab_size=0 is not valid: .*holds token ids.*"
                                          r"\(e.g. launch recipe.vocab_size=50257\)"):
        Text(cfg).prepare()


def test_a_corpus_that_names_token_files_needs_its_vocabulary_size_in_the_config_a_dry_run_checks_too():
    """`recipe.corpus='DIR/*.bin'` (or a .npy) without recipe.vocab_size: the schema says it, so a dry run does,
    where only a real run's prepare did (a dry run showed a plan at the byte vocabulary)."""
    for corpus in ("/data/fineweb/fineweb_*.bin", "/data/tokens.NPY"):
        with pytest.raises(ConfigError, match=r"recipe.vocab_size=0 is not valid: recipe.corpus=.* holds token ids.*"
                                              r"\(e.g. launch recipe.vocab_size=50257\)"):
            config_of("recipe=text", f"recipe.corpus={corpus}", "dry_run=true")
    assert config_of("recipe=text", "recipe.corpus=/data/owt/*.bin", "recipe.vocab_size=50257").recipe.vocab_size


@pytest.mark.parametrize("layout", ["llm.c-uint16", "llm.c-uint32", "nanoGPT-uint16", "npy-uint16", "npy-uint32"])
@pytest.mark.parametrize("largest_in", ["train", "val"])
def test_a_token_id_equal_to_the_vocabulary_size_is_refused_and_one_below_is_not(tmp_path, monkeypatch, layout,
                                                                                 largest_in):
    """The boundary, in every layout and token type: ids 0..vocab-1 fit the embedding, id == vocab does not
    (on the GPU an out-of-range index is a device-side assert, or with the padded vocabulary a silent row)."""
    from launcher.data import token_shards

    monkeypatch.setattr(token_shards, "SCAN_TOKENS", 300)  # the largest id sits in a last, partial chunk
    kind, dtype = layout.split("-")
    vocab = 65535 if dtype == "uint16" else 70000  # (uint16: the type's own largest value is the refused id)

    def write(folder, name, tokens):
        tokens = np.asarray(tokens, dtype=dtype)
        if kind == "npy":
            np.save(folder / f"{name}.npy", tokens)
            return folder / f"{name}.npy"
        if kind == "llm.c":
            return write_llmc(folder / f"{name}.bin", tokens, version=1 if dtype == "uint16" else 2)
        (folder / f"{name}.bin").write_bytes(tokens.tobytes())
        return folder / f"{name}.bin"

    for largest, refused in ((vocab - 1, False), (vocab, True)):
        folder = tmp_path / f"{largest}"
        folder.mkdir()
        train, val = np.arange(1000) % 500, np.arange(400) % 300
        (train if largest_in == "train" else val)[-1] = largest
        shards = {"train": write(folder, "train", train), "val": write(folder, "val", val)}
        cfg = config_of("recipe=text", f"recipe.corpus={folder}", f"data.root={tmp_path / 'root'}", "batch_size=4",
                        "recipe.context=8", f"recipe.vocab_size={vocab}")
        if not refused:
            Text(cfg).prepare()
            continue
        with pytest.raises(ConfigError) as err:
            Text(cfg).prepare()
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"recipe.vocab_size={vocab} is not valid: ")
        assert f"{shards[largest_in]} holds token id {vocab}" in text and f"recipe.vocab_size={vocab + 1}" in text


def test_the_unigram_baseline_counts_token_frequencies_over_the_vocabulary():
    train, val = [np.array([5] * 30 + [7] * 10, np.uint16)], [np.array([5, 7], np.uint16)]
    p5, p7 = 31 / (40 + 100), 11 / (40 + 100)
    assert token_unigram_loss(train, val, 100, 1000) == pytest.approx(-(np.log(p5) + np.log(p7)) / 2)


def _shards(lengths, dtype=torch.int32):
    """Shards whose tokens say where they are: shard k's token j is k * 10_000 + j."""
    return [torch.arange(n, dtype=dtype) + k * 10_000 for k, n in enumerate(lengths)]


@pytest.mark.parametrize("stride", [1, 4])
def test_windows_of_several_shards_never_cross_a_shard_boundary(stride):
    lengths, context = [50, 9, 3, 31, 8, 64], 8  # 3 and 8 tokens: shorter than a window, none from them
    windows = TokenWindows(_shards(lengths), context, stride, torch.device("cpu"), "host")
    expected = [(k, j) for k, n in enumerate(lengths) for j in range(0, n - context, stride)]
    assert len(windows) == len(expected)
    x, y = windows.take(torch.arange(len(windows)))
    assert [(int(w[0]) // 10_000, int(w[0]) % 10_000) for w in x] == expected
    whole = torch.cat([x, y[:, -1:]], 1)
    assert torch.equal(whole[:, 1:] - whole[:, :-1], torch.ones(len(expected), context, dtype=torch.long))
    assert torch.equal(x[:, 1:], y[:, :-1])
    # any order, repeats too (an epoch draws windows at random): each window is the same wherever it comes
    order = torch.tensor([len(expected) - 1, 0, 5, 5, len(expected) // 2])
    xo, _ = windows.take(order)
    assert torch.equal(xo, x[order])


def test_token_splits_of_shards_place_as_windows_per_shard():
    train = [np.arange(40, dtype=np.uint16), np.arange(1000, 1100, dtype=np.uint16)]
    test = [np.arange(2000, 2033, dtype=np.uint16)]
    data = Data.place_tokens(TokenSplits(train, test, 64, 8), DataConfig(placement=Placement.auto),
                             torch.device("cpu"))
    assert len(data.train) == 32 + 92 and len(data.test) == 4  # held-out windows tile without overlap
    assert data.drawn_per_epoch == (39 + 99) // 8 and data.megabytes == pytest.approx(173 * 2 / 2**20)
    (x, y), _ = next(data.train.batches([torch.tensor([31, 32, 123])]))
    assert x[:, 0].tolist() == [31, 1000, 1091] and y[2, -1].item() == 1099
    (x, _), _ = next(data.test.batches([torch.arange(4)]))
    assert x[:, 0].tolist() == [2000, 2008, 2016, 2024]


def test_one_stream_still_takes_its_windows_as_before():
    stream = torch.arange(100, dtype=torch.uint8)
    windows = TokenWindows(stream, 8, 1, torch.device("cpu"), "host")
    assert windows.shards is None and windows.bases is None and len(windows) == 92
    x, y = windows.take(torch.tensor([0, 91]))
    assert x[1].tolist() == list(range(91, 99)) and y[1, -1].item() == 99


def test_unsigned_ids_held_signed_for_cuda_are_masked_back():
    """CUDA cannot index uint16/uint32, so on the GPU a stream is held as int16/int32 and `take` masks the
    ids back (checked on an H100 against the host path; here the same view and mask on the CPU)."""
    ids = torch.tensor([0, 1, 40000, 50256, 65535] * 4, dtype=torch.uint16)
    windows = TokenWindows([ids], 4, 1, torch.device("cpu"), "host")
    signed = windows._signed(ids)
    assert signed.dtype == torch.int16 and windows.mask == 0xFFFF and int(signed[2]) < 0
    one = TokenWindows(signed, 4, 1, torch.device("cpu"), "host")
    one.mask = windows.mask
    x, y = one.take(torch.tensor([0, 2]))
    assert x[1].tolist() == [40000, 50256, 65535, 0] and y[0].tolist() == [1, 40000, 50256, 65535]
