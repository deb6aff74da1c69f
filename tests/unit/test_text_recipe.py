"""recipe=text's parts: the corpus and its streams, the windows a step trains on, the models, the config."""

import math

import numpy as np
import pytest
import torch

from launcher.config import DataConfig, Placement
from launcher.data.corpus import Corpus, byte_streams, stdlib_files, stdlib_root, unigram_loss
from launcher.data.placement import Data, rank_order
from launcher.errors import ConfigError, LaunchError
from launcher.recipes import TokenSplits
from launcher.recipes.text import Text
from launcher.recipes.text_models import GPT, Llama, Recurrent, generate, llama_ffn, rotary, rotate
from tests.conftest import config_of


def test_stdlib_corpus_is_this_pythons_sources_without_test_suites():
    files = stdlib_files(stdlib_root())
    assert len(files) > 200 and all(f.suffix == ".py" for f in files)
    rel = [str(f.relative_to(stdlib_root())) for f in files]
    assert "os.py" in rel and not any(r.startswith(("test/", "site-packages/")) or "/test/" in r for r in rel)


def test_streams_are_built_once_and_the_held_out_files_are_fixed(tmp_path):
    corpus = Corpus("stdlib", tmp_path, synthetic=False)
    folder = corpus.ensure()
    train, val = (folder / "train.bin").read_bytes(), (folder / "val.bin").read_bytes()
    assert len(train) > 5_000_000 and 0.02 < len(val) / (len(train) + len(val)) < 0.1
    assert b"def " in val[:100_000] and val[:2000] not in train  # whole files held out
    stamp = (folder / "train.bin").stat().st_mtime_ns
    again = Corpus("stdlib", tmp_path, synthetic=False)
    assert again.folder == folder and again.ensure() == folder
    assert (folder / "train.bin").stat().st_mtime_ns == stamp  # not rebuilt
    assert not list(folder.glob(".*tmp"))


def test_a_users_text_file_holds_out_its_end_and_a_missing_one_is_one_line(tmp_path):
    text = tmp_path / "book.txt"
    text.write_bytes(bytes(range(32, 127)) * 100)
    folder = Corpus(str(text), tmp_path / "data", synthetic=False).ensure()
    train, val = (folder / "train.bin").read_bytes(), (folder / "val.bin").read_bytes()
    assert train + val == text.read_bytes() and len(val) == len(text.read_bytes()) // 20
    with pytest.raises(LaunchError, match=r"recipe.corpus=.*nope does not exist.*recipe.corpus=stdlib"):
        Corpus(str(tmp_path / "nope"), tmp_path, synthetic=False)


def test_a_folder_streams_its_regular_files_in_chunks_and_skips_what_is_not_text(tmp_path, monkeypatch):
    import os

    from launcher.data import corpus as corpus_module

    monkeypatch.setattr(corpus_module, "CHUNK", 7)  # many chunks per file: nothing is read whole
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / ".git").mkdir()
    files = {src / "a.txt": b"alpha " * 50, src / "sub" / "b.txt": b"beta " * 40, src / "c.txt": b"gamma " * 30}
    for path, data in files.items():
        path.write_bytes(data)
    (src / ".git" / "HEAD").write_bytes(b"ref: hidden")
    (src / ".hidden.txt").write_bytes(b"hidden")
    os.mkfifo(src / "pipe")  # would block a reader forever
    (src / "kcore").symlink_to("/proc/self/status")  # a link into a kernel filesystem
    (src / "linked").symlink_to("/proc", target_is_directory=True)
    corpus = Corpus(str(src), tmp_path / "data", synthetic=False)
    assert sorted(corpus.files) == sorted(files)
    folder = corpus.ensure()
    train, val = (folder / "train.bin").read_bytes(), (folder / "val.bin").read_bytes()
    assert sorted(train.split(b"\n\n")[:-1] + val.split(b"\n\n")[:-1]) == sorted(files.values())
    assert val and train  # few files: one is held out, the others train
    assert not list(folder.glob(".*tmp"))


def _corpus_with_second_paths(tmp_path):
    """A folder of 3 text files, plus a link to one of them, a hard link to another, a linked folder onto
    its own parent and one onto a sibling folder (linked folders are not followed)."""
    import os

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {src / "a.txt": b"alpha " * 50, src / "sub" / "b.txt": b"beta " * 40, src / "c.txt": b"gamma " * 30}
    for path, data in files.items():
        path.write_bytes(data)
    (src / "sub" / "again.txt").symlink_to(src / "a.txt")
    os.link(src / "c.txt", src / "sub" / "c-hard.txt")
    (src / "sub" / "up").symlink_to(src, target_is_directory=True)
    (src / "down").symlink_to(src / "sub", target_is_directory=True)
    return src, files


def test_a_folder_reads_each_file_once_and_says_what_second_paths_it_left_out(tmp_path, capsys):
    src, files = _corpus_with_second_paths(tmp_path)
    corpus = Corpus(str(src), tmp_path / "data", synthetic=False)
    assert corpus.files == sorted(files)
    assert corpus.left_out == [(src / "sub" / "again.txt", src / "a.txt"), (src / "sub" / "c-hard.txt", src / "c.txt")]
    capsys.readouterr()
    Text(config_of("recipe=text", f"recipe.corpus={src}", f"data.root={tmp_path / 'data'}", "recipe.context=8",
                   "batch_size=2", "gpus=[]")).prepare()
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "left out" in line]
    assert said == [f"launch: warning: recipe.corpus={src}: left out 2 second paths to files read already, so "
                    f"each is read once (e.g. {src / 'sub' / 'again.txt'}, which is {src / 'a.txt'})"], err


def test_a_glob_reads_each_file_once_and_never_follows_a_linked_folder(tmp_path):
    """glob.glob's ** followed linked folders: one loop read the files once per level (40 levels), two never
    ended. A glob now walks the real folders and reads each file once."""
    src, files = _corpus_with_second_paths(tmp_path)
    (src / "sub" / "up2").symlink_to(src, target_is_directory=True)  # (two loops: glob.glob never ended)
    corpus = Corpus(f"{src}/**/*.txt", tmp_path / "data", synthetic=False)
    assert corpus.files == sorted(files)
    assert [p for p, _ in corpus.left_out] == [src / "sub" / "again.txt", src / "sub" / "c-hard.txt"]


def test_an_interrupted_build_leaves_no_stream_that_looks_complete(tmp_path, monkeypatch):
    from launcher.data import corpus as corpus_module

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_bytes(b"x" * 1000)
    calls = []

    def interrupted(path, out, start=0, length=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        out.write(path.read_bytes())

    monkeypatch.setattr(corpus_module, "_append", interrupted)
    corpus = Corpus(str(src), tmp_path / "data", synthetic=False)
    with pytest.raises(KeyboardInterrupt):
        corpus.ensure()
    assert list(corpus.folder.iterdir()) == []  # no streams, no meta.json, no temporary files
    monkeypatch.undo()
    assert (corpus.ensure() / "meta.json").is_file()  # the next run builds it


def test_a_file_that_cannot_be_read_is_named(tmp_path, monkeypatch):
    from launcher.data import corpus as corpus_module

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a" * 100)
    (src / "b.txt").write_bytes(b"b" * 100)
    corpus = Corpus(str(src), tmp_path / "data", synthetic=False)
    real_open = open

    def failing_open(path, *args, **kwargs):
        if str(path).endswith("b.txt"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(corpus_module, "open", failing_open, raising=False)
    with pytest.raises(LaunchError, match=r"cannot read .*b\.txt \(Permission denied\).*recipe.corpus=stdlib"):
        corpus.ensure()
    assert not (corpus.folder / "meta.json").exists() and not list(corpus.folder.glob("*.bin"))


def test_unigram_baseline_is_the_held_out_cross_entropy_of_byte_frequencies():
    train = np.array([65] * 300 + [66] * 100, dtype=np.uint8)
    val = np.array([65, 66], dtype=np.uint8)
    p_a, p_b = 301 / (400 + 256), 101 / (400 + 256)  # add-one smoothed over 256 bytes
    assert unigram_loss(train, val) == pytest.approx(-(math.log(p_a) + math.log(p_b)) / 2)


def _data(n_train=1000, n_test=200, context=8) -> Data:
    stream = np.arange(n_train, dtype=np.int64) % 251
    splits = TokenSplits(stream.astype(np.uint8), (np.arange(n_test) % 251).astype(np.uint8), 256, context)
    return Data.place_tokens(splits, DataConfig(placement=Placement.auto), torch.device("cpu"))


def test_a_window_predicts_the_next_byte_and_stays_inside_the_stream():
    data = _data()
    assert len(data.train) == 1000 - 8  # every start whose targets fit
    (x, y), idx = next(data.train.batches([torch.tensor([0, 991, 500])]))
    assert x.dtype == torch.long and x.shape == y.shape == (3, 8)
    assert torch.equal(x[:, 1:], y[:, :-1]) and y[1, -1].item() == 999 % 251
    assert data.targets_per_sample == 8 and data.unit == "tokens" and data.drawn_per_epoch == 999 // 8


def test_held_out_windows_tile_the_stream_without_overlap():
    data = _data(n_test=200)
    windows = len(data.test)
    (x, y), _ = next(data.test.batches([torch.arange(windows)]))
    starts = x[:, 0].tolist()
    assert starts == [8 * i for i in range(windows)] and windows == (200 - 1) // 8


def test_an_epoch_draws_random_windows_per_seed_and_epoch_and_ranks_share_them():
    one = rank_order(992, 16, seed=1, epoch=0, drawn=124)
    assert one.shape == (7, 16) and one.max() < 992
    assert torch.equal(one, rank_order(992, 16, seed=1, epoch=0, drawn=124))
    assert not torch.equal(one, rank_order(992, 16, seed=1, epoch=1, drawn=124))
    halves = [rank_order(992, 16, seed=1, epoch=0, world_size=2, rank=r, drawn=124) for r in (0, 1)]
    assert torch.equal(torch.cat(halves, 1), one)


def test_gpt_is_causal_and_ties_its_output_to_the_embedding():
    torch.manual_seed(0)
    model = GPT(256, context=16, layers=2, width=32, heads=4, dropout=0.0).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    assert torch.allclose(model(a)[0, :10], model(b)[0, :10], atol=1e-6)
    assert not torch.allclose(model(a)[0, 10:], model(b)[0, 10:])
    assert model.head.weight is model.tokens.weight
    n = sum(p.numel() for p in model.parameters()) - 16 * 32
    assert model.flops_per_token() == 6 * n + 12 * 2 * 16 * 32


@pytest.mark.parametrize("tie", [True, False])
def test_llama_is_causal_and_counts_its_flops_tied_or_not(tie):
    torch.manual_seed(0)
    model = Llama(256, context=16, layers=2, width=64, heads=4, kv_heads=2, tie_embeddings=tie).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    assert torch.allclose(model(a)[0, :10], model(b)[0, :10], atol=1e-5)
    assert not torch.allclose(model(a)[0, 10:], model(b)[0, 10:])
    assert (model.head.weight is model.tokens.weight) == tie
    n = sum(p.numel() for p in model.parameters()) - (0 if tie else 256 * 64)  # (an untied table multiplies nothing)
    assert model.flops_per_token() == 6 * n + 12 * 2 * 16 * 64
    loss, hits = model(a, b)
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(model(a)[0], b[0]).item(), rel=1e-5)


def test_llama_31_8b_has_its_published_parameter_count_and_llama_2s_mlp_rule():
    with torch.device("meta"):
        model = Llama(128256, context=8192, layers=32, width=4096, heads=32, kv_heads=8, ffn=14336,
                      tie_embeddings=False)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama 3.1 8B's
    assert llama_ffn(4096) == 11008 and llama_ffn(64) == 256  # (Llama 2 7B's MLP; a small width's rounding)


def test_grouped_query_attention_is_attention_with_each_key_value_head_repeated_for_its_group():
    """kv_heads=2 of 4 heads: query heads 0-1 share key/value head 0, heads 2-3 head 1 (as Llama's repeat_kv);
    the same as 4 key/value heads holding those copies."""
    torch.manual_seed(0)
    grouped = Llama(256, context=8, layers=1, width=32, heads=4, kv_heads=2).eval()
    full = Llama(256, context=8, layers=1, width=32, heads=4, kv_heads=4).eval()
    state = dict(grouped.state_dict())
    kv = state["blocks.0.kv.weight"].view(2, 2, 8, 32)  # (k or v, kv head, its width, model width)
    state["blocks.0.kv.weight"] = kv.repeat_interleave(2, dim=1).reshape(2 * 4 * 8, 32)
    full.load_state_dict(state)
    x = torch.randint(0, 256, (2, 8))
    assert torch.allclose(grouped(x), full(x), atol=1e-5)


def test_rotary_positions_turn_each_pair_by_its_angle_and_scores_depend_on_distance_only():
    cos, sin = rotary(12, 8, 10000.0, torch.device("cpu"))
    x = torch.randn(1, 1, 12, 8)
    # against the complex form: pair (2i, 2i+1) times exp(1j * position * theta^(-2i/8))
    angles = torch.outer(torch.arange(12.0), 10000.0 ** -(torch.arange(0, 8, 2) / 8))
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * torch.polar(
        torch.ones_like(angles), angles)).flatten(-2)
    assert torch.allclose(rotate(x, cos, sin), expected, atol=1e-5)
    q, k = torch.randn(8), torch.randn(8)
    turned = [rotate(v.expand(1, 1, 12, 8), cos, sin)[0, 0] for v in (q, k)]
    assert (turned[0][7] @ turned[1][4]).item() == pytest.approx((turned[0][5] @ turned[1][2]).item(), rel=1e-4)


def test_llama_built_on_the_meta_device_and_materialized_holds_its_initialization_in_every_parameter():
    """strategy.meta_init=true: the model is built on the meta device, moved to its device empty (garbage) and
    given init_weights(). Drawn from the same random state, every parameter must equal the plain build's: one
    that init_weights left out would keep to_empty's garbage."""
    from launcher.strategies.fsdp import initialize

    def build():
        return Llama(256, context=8, layers=2, width=32, heads=4, kv_heads=2, tie_embeddings=False)

    plain = build()
    torch.manual_seed(3)
    plain.init_weights()
    with torch.device("meta"):
        meta = build()
    meta.to_empty(device="cpu")
    for tensor in meta.state_dict().values():
        tensor.fill_(float("nan"))
    torch.manual_seed(3)
    initialize(meta)
    for (name, a), (_, b) in zip(plain.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_models_predict_every_position(kind):
    model = Recurrent(kind, 256, layers=2, width=16, dropout=0.0)
    assert model(torch.randint(0, 256, (3, 7))).shape == (3, 7, 256)
    assert model.flops_per_token() == 6 * sum(p.numel() for p in model.parameters())


def test_generation_continues_the_prompt_with_bytes():
    model = GPT(256, context=8, layers=1, width=16, heads=2, dropout=0.0)
    out = generate(model, b"def ", 20, 8, 1.0, torch.device("cpu"))
    assert out.startswith(b"def ") and len(out) == 24


def test_text_config_names_the_key_and_the_fix():
    cfg = config_of("recipe=text")
    assert cfg.recipe.model.value == "gpt" and cfg.optim.name == "adamw" and cfg.recipe.corpus == "stdlib"
    with pytest.raises(ConfigError, match=r"recipe.heads=5.*recipe.heads=4"):
        config_of("recipe=text", "recipe.width=64", "recipe.heads=5")
    with pytest.raises(ConfigError, match=r"recipe.context"):
        config_of("recipe=text", "recipe.context=1")
    with pytest.raises(ConfigError, match=r"recipe.kv_heads=3.*recipe.kv_heads=2"):
        config_of("recipe=text", "recipe.model=llama", "recipe.width=64", "recipe.heads=4", "recipe.kv_heads=3")
    with pytest.raises(ConfigError, match=r"recipe.heads=4 .*must be even.*recipe.heads=3"):
        config_of("recipe=text", "recipe.model=llama", "recipe.width=12", "recipe.heads=4")



def test_a_named_llama_size_sets_its_shape_and_every_key_given_beside_it_wins():
    eight = config_of("recipe=text", "recipe.size=8b").recipe
    assert (eight.model.value, eight.layers, eight.width, eight.heads, eight.kv_heads, eight.ffn,
            eight.tie_embeddings) == ("llama", 32, 4096, 32, 8, 14336, False)
    assert config_of("recipe=text", "recipe.size=1b").recipe.tie_embeddings  # (Llama 3.2 1B ties its output)
    mine = config_of("recipe=text", "recipe.size=8b", "recipe.layers=2", "recipe.kv_heads=4").recipe
    assert (mine.layers, mine.kv_heads, mine.width) == (2, 4, 4096)
    assert config_of("recipe=text").recipe.model.value == "gpt"  # (no size: nothing set)
    with pytest.raises(ConfigError, match=r"recipe.size=1b is not valid: names a Llama 3 shape.*recipe.model=llama"):
        config_of("recipe=text", "recipe.size=1b", "recipe.model=gpt")


def test_a_resumed_run_keeps_the_shape_it_trained_with_where_a_size_and_its_own_keys_were_given(tmp_path):
    """`recipe.size=debug recipe.layers=2` trains 2 layers; `launch resume=RUN` carried layers=2 from the
    checkpoint, then applied size=debug's preset over it (4 layers, "changed here: recipe.layers 2 -> 4") and
    the worker refused the checkpoint as not fitting. The preset applies on a resume only where the command
    line names one; what is typed there still wins."""
    from launcher.config import to_plain
    from launcher.train import checkpoint

    first = config_of("recipe=text", "recipe.size=debug", "recipe.layers=2", "recipe.context=64")
    run = tmp_path / "run"
    checkpoint.save_atomic({"net_state_dict": {}, "epoch": 1, "history": [{"epoch": 1, "test_loss": 2.0}],
                            "config": to_plain(first)},
                           run / "checkpoints" / "last.pt")
    resumed = config_of(f"resume={run}").recipe
    assert (resumed.size.value, resumed.layers, resumed.width, resumed.context) == ("debug", 2, 256, 64)
    assert config_of(f"resume={run}", "recipe.layers=3").recipe.layers == 3  # (typed wins)
    again = config_of(f"resume={run}", "recipe.size=1b").recipe  # (a size typed here sets its shape)
    assert (again.layers, again.width, again.context) == (16, 2048, 64)


def test_a_resume_that_types_another_model_is_refused_for_that_model_not_for_a_carried_key(tmp_path):
    """`launch resume=RUN recipe.model=gpt` after a llama run said "recipe.size=debug is not valid: names a
    Llama 3 shape" (the size carried from the checkpoint, blamed for the model typed): the model is named."""
    import pytest

    from launcher.config import to_plain
    from launcher.errors import ConfigError, LaunchError
    from launcher.train import checkpoint

    first = config_of("recipe=text", "recipe.model=llama", "recipe.size=debug")
    run = tmp_path / "run"
    checkpoint.save_atomic({"net_state_dict": {}, "epoch": 1, "history": [{"epoch": 1, "test_loss": 2.0}],
                            "config": to_plain(first)},
                           run / "checkpoints" / "last.pt")
    with pytest.raises((LaunchError, ConfigError)) as refused:
        config_of(f"resume={run}", "recipe.model=gpt")
    said = str(refused.value)
    assert said.startswith(f"recipe.model=gpt is not valid with resume={run}: the checkpoint was trained with "
                           "recipe.model=llama") and "recipe.size" not in said, said
    assert config_of(f"resume={run}", "recipe.model=llama").recipe.size.value == "debug"  # (its own model: fine)


def test_a_corpus_file_edited_in_place_builds_its_streams_again(tmp_path):
    """The streams' folder is keyed by every file's name, size and time: an edit that keeps the size (a word
    replaced by another as long) is built again, never trained on from the old streams."""
    import os

    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (src / name).write_bytes(b"the old words " * 40)
    first = Corpus(str(src), tmp_path / "data", synthetic=False)
    old = first.ensure()
    (src / "a.txt").write_bytes(b"the new words " * 40)
    os.utime(src / "a.txt", ns=(1, 1))  # (another time, whatever the clock's resolution)
    again = Corpus(str(src), tmp_path / "data", synthetic=False)
    assert again.folder != old
    built = again.ensure()
    assert b"new words" in (built / "train.bin").read_bytes() + (built / "val.bin").read_bytes()


def _text(tmp_path, *overrides):
    from launcher.recipes.text import Text

    return Text(config_of("recipe=text", f"data.root={tmp_path / 'data'}", *overrides))


def test_max_bytes_is_the_whole_budget_of_both_streams(tmp_path):
    """recipe.max_bytes=N: the first N - N/20 bytes of the training stream and N/20 of the held-out one."""
    folder = tmp_path / "streams"
    folder.mkdir()
    (folder / "train.bin").write_bytes(bytes(range(256)) * 40)
    (folder / "val.bin").write_bytes(bytes(range(256)) * 4)
    train, val = byte_streams(folder, _text(tmp_path, "recipe.max_bytes=2000").hp.max_bytes)
    assert (len(train), len(val)) == (1900, 100) and len(train) + len(val) == 2000


def test_a_batch_of_more_windows_than_the_stream_holds_is_refused_before_any_worker(tmp_path):
    """A window is context + 1 bytes: a training stream of 1900 bytes holds (1900 - 1) // 19 = 99 windows of 19,
    so batch_size=100 is one line and exit 2, and 99 goes through."""
    book = tmp_path / "book.txt"
    book.write_bytes(bytes(range(32, 127)) * 20 + b"x" * 100)  # 2000 bytes: 1900 train, 100 held out
    corpus = f"recipe.corpus={book}"
    with pytest.raises(ConfigError, match=r"batch_size=100 is not valid: larger than the 99 windows of 19 bytes"):
        _text(tmp_path, corpus, "recipe.context=19", "batch_size=100").prepare()
    _text(tmp_path, corpus, "recipe.context=19", "batch_size=99").prepare()


def test_the_epoch_row_reports_bits_per_byte_and_mfu_over_every_gpu(tmp_path, monkeypatch):
    """Bits per byte are the loss in nats over ln 2; MFU is the tokens/s of all the ranks against all their peaks."""
    from launcher.recipes import text

    recipe = _text(tmp_path, "perf.precision=bf16")
    recipe.flops_per_token = 6e6
    monkeypatch.setattr(text, "peak_flops", lambda device: 1e12)
    row = {"loss": 1.5, "test_loss": 2.0, "tokens_per_s": 1000.0}
    recipe.report(row, torch.device("cpu"), world_size=4)
    assert row["bpb"] == pytest.approx(1.5 / math.log(2)) and row["test_bpb"] == pytest.approx(2.0 / math.log(2))
    assert row["mfu"] == pytest.approx(1000.0 * 6e6 / (4 * 1e12))
    shards = {"loss": 1.5}
    recipe.tokens = True
    recipe.report(shards, torch.device("cpu"), world_size=1)
    assert shards["ppl"] == pytest.approx(math.exp(1.5)) and "bpb" not in shards


def test_a_sample_of_token_ids_never_holds_the_padding_beyond_the_vocabulary():
    """The model's vocabulary is padded to a multiple of 64: those outputs are never tokens, however likely."""
    from launcher.recipes.text_models import generate_ids

    class PaddingLover(torch.nn.Module):
        def forward(self, ids):
            logits = torch.zeros(*ids.shape, 64)
            logits[..., 50:] = 10.0  # the padding (ids 50-63) far likelier than any token
            return logits

    ids = generate_ids(PaddingLover(), [1, 2, 3], 40, 8, 1.0, torch.device("cpu"), vocab=50)
    assert ids[:3] == [1, 2, 3] and len(ids) == 43 and max(ids[3:]) < 50


def test_an_evaluation_forward_takes_no_more_windows_than_their_logits_allow():
    """recipe=text evaluates in the training batch (eval.batch_size=${batch_size}): a batch of 64 windows reached
    through accumulate=16 over 2 ranks would evaluate 32 windows a rank at once, ~190 GiB of logits at Llama 3's
    8,192 x 128,256 (an out-of-memory error after the first epoch); each forward takes one window there, 27 at
    GPT-2's 1,024 x 50,304, and the whole share on bytes."""
    import types

    from launcher.train.evaluation import Evaluation
    from tests.conftest import config_of

    def chunk(*overrides):
        cfg = config_of("recipe=text", *overrides)
        strategy = types.SimpleNamespace(world_size=2)
        return Evaluation(cfg, Text(cfg), strategy, torch.device("cpu"), None, None)._chunk()

    shards = ("recipe.corpus=/shards/*.npy",)
    assert chunk("recipe.size=8b", "recipe.vocab_size=128256", "recipe.context=8192", *shards) == 1
    assert chunk("recipe.vocab_size=50257", "recipe.context=1024", *shards) == 27
    assert chunk() == 32 and chunk("eval.batch_size=1024") == 512
