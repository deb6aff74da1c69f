"""`launch eval RUN_DIR`: a saved model evaluated on any strategy, into a new run dir, with accuracy per
class and the confusion matrix; a file that is not a launch checkpoint is one line."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.distributed


def test_eval_on_two_ranks_gives_the_trained_accuracy_per_class_and_a_confusion_matrix(launch, tmp_path):
    trained = launch("gpus=[]", "epochs=2", "hydra.run.dir=trained")
    assert trained.returncode == 0, trained.output
    training_acc = json.loads((tmp_path / "trained" / "results.json").read_text())["test_acc"]
    result = launch("eval", "trained", "gpus=[]", "strategy=ddp", "nprocs=2")
    assert result.returncode == 0, result.output
    [run_dir] = [p.parent for p in tmp_path.glob("outputs/*/*/eval.json")]
    assert run_dir.name.split("-")[-3:-1] == ["digits", "eval"]  # a run dir of its own, named as an eval
    report = json.loads((run_dir / "eval.json").read_text())
    assert report["world_size"] == 2 and report["trained_epochs"] == 2
    assert report["test_acc"] == pytest.approx(training_acc)  # the saved weights, the same test split
    confusion = report["confusion"]
    assert len(confusion) == 10 and sum(map(sum, confusion)) == report["test_images"] == 359
    assert sum(confusion[i][i] for i in range(10)) / 359 == pytest.approx(report["test_acc"])
    for i, name in enumerate(report["classes"]):
        assert report["per_class_acc"][name] == pytest.approx(confusion[i][i] / sum(confusion[i]))
    # a row is a true class (its images, however predicted): row sums are the test split's class counts
    from launcher.recipes.digits import TEST_FRACTION
    labels = np.load(Path(__file__).parents[2] / "recipes" / "data" / "digits.npz")["labels"]
    assert [sum(row) for row in confusion] == [round((labels == c).sum() * TEST_FRACTION) for c in range(10)]
    assert (run_dir / "confusion.png").stat().st_size > 1000
    assert f"test accuracy {100 * training_acc:.2f}%" in result.stdout
    assert not (tmp_path / "trained" / "eval.json").exists()  # the trained run is left as it was


def test_eval_takes_the_recipe_values_the_checkpoint_was_trained_with(launch, tmp_path):
    shutil.copytree(Path(__file__).parents[2] / "examples" / "my_pkg", tmp_path / "my_pkg")
    trained = launch("recipe=my_pkg.my_recipe", "recipe.hidden=16", "gpus=[]", "epochs=1", "batch_size=32",
                     "hydra.run.dir=narrow")
    assert trained.returncode == 0, trained.output
    result = launch("eval", "narrow/checkpoints/last.pt", "gpus=[]")  # no recipe.hidden given: the checkpoint's
    assert result.returncode == 0, result.output
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/eval.json")]
    assert report["recipe"] == "my_pkg.my_recipe" and report["classes"] == ["0", "1"]
    # another recipe named: that, in one line (it used to be refused for a recipe.* key of the checkpoint's)
    other = launch("eval", "narrow", "recipe=digits", "gpus=[]", timeout=120)
    lines = [x for x in other.stderr.splitlines() if x.strip()]
    assert other.returncode == 2 and len(lines) == 1, other.output
    assert "recipe=digits is not valid with launch eval narrow: the checkpoint was trained with " \
           "recipe=my_pkg.my_recipe" in lines[0]


@pytest.mark.parametrize(("args", "expected"), [
    (("eval",), "launch eval needs the run dir or checkpoint to evaluate"),
    (("eval", "nowhere"), "launch eval nowhere is not valid: nowhere/checkpoints/last.pt does not exist"),
    (("eval", "junk.pt"), "launch eval junk.pt is not valid: "),
])
def test_eval_of_something_that_is_not_a_checkpoint_is_one_line(launch, tmp_path, args, expected):
    (tmp_path / "nowhere").mkdir()
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    result = launch(*args, timeout=120)
    assert result.returncode == 2, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    said = "launch: " + expected[len("launch "):]  # (not "launch: launch eval ...")
    assert len(lines) == 1 and lines[0].startswith(said), result.stderr
    assert not (tmp_path / "outputs").exists()
