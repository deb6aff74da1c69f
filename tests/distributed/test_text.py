"""recipe=text end to end on CPU: a byte-level language model learns past the unigram baseline in seconds,
what a user reads (bits per byte, tokens/s, a sample) is there, and launch eval scores it. (2 ranks
against 1, under ddp and fsdp: tests/distributed/test_fsdp.py.)"""

import json

import pytest

pytestmark = pytest.mark.distributed

TOY = ("recipe=text", "gpus=[]", "recipe.layers=2", "recipe.width=64", "recipe.heads=2", "recipe.context=64",
       "recipe.max_bytes=300000", "batch_size=32", "lr=3e-3", "progress=lines")


@pytest.fixture(scope="module")
def text_root(tmp_path_factory):
    return tmp_path_factory.mktemp("text-data")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_small_gpt_beats_the_unigram_baseline_and_leaves_a_sample(launch, text_root):
    result = launch(*TOY, "epochs=2", f"data.root={text_root}")
    assert result.returncode == 0, result.output
    results, run_dir = result.results(), result.run_dir()
    final = results["final"]
    # clearly below what byte frequencies alone give (~4.6 bits/byte on the stdlib's sources)
    assert final["test_bpb"] < 0.9 * results["unigram_test_bpb"], (final, results["unigram_test_bpb"])
    assert final["test_loss"] < results["unigram_test_loss"]
    assert final["tokens_per_s"] > 0 and "img_per_s" not in final and final["bpb"] > 0
    assert results["parameters"] > 0 and results["flops_per_token"] > 6 * results["parameters"]
    sample = (run_dir / "sample.txt").read_text()
    assert sample.startswith("def ") and len(sample) > 100 and results["sample"].startswith("def ")
    assert "bits/byte (unigram baseline" in result.output and "tokens/s" in result.output
    assert [r["epoch"] for r in _rows(run_dir)] == [1, 2]
    for row in _rows(run_dir):  # tokens, not windows of 64: an epoch's steps cover most of the 300 KB read
        assert 100_000 < row["tokens_per_s"] * row["train_s"] <= 300_000, row
    meta = json.loads(next((text_root / "text").glob("stdlib-*/meta.json")).read_text())
    assert "PSF" in meta["licence"]


def test_gru_trains_and_launch_eval_reports_the_held_out_loss(launch, text_root):
    result = launch(*TOY, "epochs=1", "recipe.model=gru", f"data.root={text_root}", "recipe.sample_bytes=0",
                    "recipe.max_bytes=100000")
    assert result.returncode == 0, result.output
    run_dir, trained = result.run_dir(), result.results()
    assert not (run_dir / "sample.txt").exists()
    evaluated = launch("eval", str(run_dir))
    assert evaluated.returncode == 0, evaluated.output
    report = json.loads(next(evaluated.cwd.glob("outputs/**/eval.json")).read_text())
    assert report["test_loss"] == pytest.approx(trained["final"]["test_loss"], rel=1e-5)
    assert "confusion" not in report and "bits/byte" in evaluated.output


def test_a_corpus_too_short_for_one_batch_is_one_line_before_any_worker(launch, text_root):
    result = launch("recipe=text", "gpus=[]", "recipe.max_bytes=3000", "recipe.context=64", f"data.root={text_root}")
    assert result.returncode == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("launch: batch_size=64 is not valid: larger than the 44 windows of 64 bytes")
    assert "rank 0" not in result.output and "Traceback" not in result.output
    shorter = launch("recipe=text", "gpus=[]", "recipe.max_bytes=40", "recipe.context=64", f"data.root={text_root}")
    assert shorter.returncode == 2, shorter.output
    line = shorter.stderr.strip().splitlines()[-1]
    assert line.startswith("launch: recipe.context=64 is not valid: longer than the training stream (38 bytes")
    assert line.endswith("(e.g. launch recipe.max_bytes=4340)") and "Traceback" not in shorter.output


def test_a_corpus_too_short_for_any_context_suggests_a_longer_corpus_not_the_refused_value(launch, tmp_path):
    """A held-out stream of a byte or two holds no window at all: the example asks for a longer corpus
    (it suggested recipe.context=2 to a run refused for recipe.context=2)."""
    (tmp_path / "tiny.txt").write_text("hello world, this is tiny text\n")
    result = launch("recipe=text", "gpus=[]", f"recipe.corpus={tmp_path / 'tiny.txt'}", "recipe.context=2",
                    "batch_size=2", "epochs=1", f"data.root={tmp_path / 'data'}")  # (its byte copy: not in ~/.cache)
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and line.startswith("launch: recipe.context=2 is not valid: longer than the "
                                                      "held-out stream"), result.output
    assert "recipe.context=2)" not in line and "(e.g. launch recipe.corpus=" in line, line
