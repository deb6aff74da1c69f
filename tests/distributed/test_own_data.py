"""A user's own work: a Dataset recipe in a plain file, its own loss and figures, a network from config, and
the launcher's global order kept by a resume in the middle of an epoch, on another number of ranks too."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

OWN = Path(__file__).parent / "data" / "own"  # the tests' own recipes
EXAMPLES = Path(__file__).parents[2] / "examples"  # docs/own-code.md's (regression.py, nets.py)


def _run_dir(result) -> Path:
    return Path(re.search(r"run dir: (\S+)", result.output).group(1))


def _results(result) -> dict:
    return json.loads((_run_dir(result) / "results.json").read_text())


@pytest.fixture
def project(tmp_path):
    for f in [*EXAMPLES.glob("*.py"), *OWN.glob("*.py")]:
        shutil.copy(f, tmp_path / f.name)  # the user's project dir: recipe files beside them
    return tmp_path


def test_a_regression_dataset_in_a_plain_file_trains_and_its_rmse_falls(launch, project):
    result = launch("recipe=regression", "gpus=[]", "epochs=3", "batch_size=128", "optim=adamw", "lr=0.01",
                    "sweep.objective=test_rmse", "data.workers=1")
    assert result.returncode == 0, result.output
    rows = [json.loads(line) for line in (result.run_dir() / "metrics.jsonl").read_text().splitlines()]
    rmse = [r["test_rmse"] for r in rows]
    assert rmse[-1] < rmse[0] and all(math.isclose(r["test_rmse"], math.sqrt(r["test_mse"])) for r in rows)
    r = result.results()
    assert r["test_rmse"] == rmse[-1] and r["best_test_rmse"] == min(rmse)  # minimized: an error
    assert "samples_per_s" in rows[0] and "train_acc" not in rows[0]
    assert re.search(r"epoch 3/3  loss \S+  test_mse \S+  test_rmse \S+", result.output)
    assert "done in" in result.output and "test_rmse" in result.output.splitlines()[-1]
    assert (result.run_dir() / "curves.png").is_file()
    # launch eval reports the same figures
    trained = result.run_dir()
    evaluated = launch("eval", str(trained), "gpus=[]")
    assert evaluated.returncode == 0, evaluated.output
    eval_json = json.loads(next(project.glob("outputs/**/eval.json")).read_text())
    assert math.isclose(eval_json["test_rmse"], rmse[-1], rel_tol=1e-5)
    assert re.search(r"evaluated \S+ in \S+s: mse \S+, rmse \S+\.", evaluated.output)  # (its own figures named)
    assert "next-token" not in evaluated.output


def test_evaluation_figures_are_exact_over_uneven_shards_on_two_ranks_and_stop_them_alike(launch, project):
    """819 evaluation samples: an uneven last shard. One rank and two score the same set the same way, and
    (the same global batch, the same order) train the same: the figures agree, not a mean of rank means.
    Early stopping on the figure the recipe's report derives (test_rmse) stops both after the same epoch:
    every rank has it (derived on rank 0 alone, the other rank found no such figure and the run failed)."""
    common = ("recipe=regression", "gpus=[]", "epochs=3", "batch_size=64", "eval.batch_size=100", "optim=adamw",
              "lr=0.01", "data.workers=0", "early_stop.metric=test_rmse", "early_stop.patience=1",
              "early_stop.min_delta=10")  # (epoch 2 cannot improve by 10: stopped after it)
    one = launch(*common)
    two = launch(*common, "strategy=ddp", "nprocs=2")
    assert one.returncode == 0 and two.returncode == 0, two.output
    assert _results(two)["ranks_agree"]
    assert math.isclose(_results(one)["test_mse"], _results(two)["test_mse"], rel_tol=1e-4)
    stopped = [_results(r)["stopped_early"] for r in (one, two)]
    assert [(s["epoch"], s["metric"]) for s in stopped] == [(2, "test_rmse")] * 2, stopped
    # no accuracy and no sweep.objective typed: the run is ranked by its own first held-out figure
    r = _results(one)
    assert r["objective"] == "test_mse" and r["best_test_mse"] == min(
        json.loads(line)["test_mse"] for line in (_run_dir(one) / "metrics.jsonl").read_text().splitlines())
    listed = launch("runs")
    assert "test_mse" in listed.output, listed.output


def test_two_ranks_with_dataloader_workers_end_without_waiting_for_them(launch, project):
    """The workers are stopped when the run's data is done: left to the DataLoader's __del__ at the process
    group's teardown, each one was waited for 5 s (2 workers x 2 loaders a rank: 20 s after the last epoch)."""
    result = launch("recipe=indexed", "gpus=[]", "epochs=1", "batch_size=8", "strategy=ddp", "nprocs=2",
                    "data.workers=2")
    assert result.returncode == 0, result.output
    last = json.loads((result.run_dir() / "metrics.jsonl").read_text().splitlines()[-1])
    assert result.finished_at - (last["started_unix"] + last["epoch_s"]) < 10


def _steps(run_cwd: Path, ranks: int, whole: bool = True) -> list[list[int]]:
    """Each global step's samples, every rank's share together, in the order trained (`whole=False`: up to the
    step every rank logged, where a failure stopped them at different ones)."""
    per_rank = [[json.loads(line) for line in (run_cwd / f"indices-{r}.jsonl").read_text().splitlines()]
                for r in range(ranks)]
    return [sorted(i for share in step for i in share) for step in zip(*per_rank, strict=whole)]


def test_a_restart_inside_an_epoch_continues_the_global_order(launch, project, tmp_path_factory):
    common = ("recipe=indexed", "gpus=[]", "epochs=2", "batch_size=8", "optim=adamw", "data.workers=1",
              "strategy=ddp", "nprocs=2")
    whole = launch(*common)
    assert whole.returncode == 0, whole.output
    uninterrupted = _steps(project, 2)
    assert len(uninterrupted) == 24 and sorted(sum(uninterrupted[:12], [])) == list(range(96))
    assert whole.results()["final"]["train_abs_err"] >= 0 and "test_count" in whole.results()["final"]
    # the same run failing at step 18 (epoch 2, step 7), saved every 4 steps, restarted once. Rank 0 has
    # submitted step 16's checkpoint before it can take step 17 with rank 1; elastic's SIGTERM then stops it
    # while the write may still be under way (lost before lifetime.finish_on_sigterm: the restart went back
    # to the epoch's start, CI, under load)
    elsewhere = tmp_path_factory.mktemp("restarted")
    for f in [*EXAMPLES.glob("*.py"), *OWN.glob("*.py")]:
        shutil.copy(f, elsewhere / f.name)
    restarted = launch(*common, "checkpoint_every_steps=4", "fault.rank=1", "fault.step=18", "max_restarts=1",
                       cwd=elsewhere)
    assert restarted.returncode == 0, restarted.output
    assert "resuming epoch 2 at step 5 of 12" in restarted.output
    # each rank's shares: before the failure steps 0-17 as in the uninterrupted run (rank 1 failed at step 18
    # before training it; rank 0 may have begun it), then after the restart steps 16-23 (the checkpoint was
    # 4 steps into epoch 2), again as in the uninterrupted run
    for rank in range(2):
        mine = [json.loads(x) for x in (elsewhere / f"indices-{rank}.jsonl").read_text().splitlines()]
        whole_rank = [json.loads(x) for x in (project / f"indices-{rank}.jsonl").read_text().splitlines()]
        assert mine[:18] == whole_rank[:18] and mine[-8:] == whole_rank[16:]


def stopped_and_resumed_elsewhere(launch, project: Path, elsewhere: Path, first: tuple[str, ...], ranks: int,
                                  resumes: list[tuple[tuple[str, ...], int]], alone: tuple[str, ...]) -> None:
    """recipe=indexed on `ranks` ranks (`first`'s placement), saved every 3 steps of its first epoch and stopped
    at step 8, then resumed from its checkpoint on each of `resumes` (placement, ranks): every resume trains the
    samples that one rank (`alone`, in `elsewhere`) trains uninterrupted from the checkpoint's step on, step by
    step, in its order. (tests/gpu runs it on GPUs.) The checkpoint is step 6's, or step 3's where the stop
    came while step 6's was still being written (4 ranks on 2 busy cores: CI)."""
    import torch

    common = ("recipe=indexed", "epochs=2", "batch_size=8", "data.workers=0")
    stopped = launch(*common, *first, "checkpoint_every_steps=3", f"fault.rank={ranks - 1}", "fault.step=8")
    assert stopped.returncode == 1, stopped.output
    state = torch.load(_run_dir(stopped) / "checkpoints" / "last.pt", weights_only=True)
    assert state["epoch"] == 0 and state["step_in_epoch"] in (3, 6), state["step_in_epoch"]
    saved = state["step_in_epoch"]
    before = _steps(project, ranks, whole=False)
    for f in [*EXAMPLES.glob("*.py"), *OWN.glob("*.py")]:
        shutil.copy(f, elsewhere / f.name)
    whole = launch(*common, *alone, cwd=elsewhere)
    assert whole.returncode == 0, whole.output
    uninterrupted = _steps(elsewhere, 1)
    assert len(uninterrupted) == 24 and before[:saved] == uninterrupted[:saved]
    for placement, count in resumes:
        for f in project.glob("indices-*.jsonl"):
            f.unlink()
        again = launch("recipe=indexed", f"resume={_run_dir(stopped)}", *placement, "data.workers=0")
        assert again.returncode == 0, again.output
        assert _steps(project, count) == uninterrupted[saved:], placement


def test_a_checkpoint_inside_an_epoch_of_four_ranks_resumes_on_two_and_on_one_in_the_same_order(launch, project,
                                                                                                 tmp_path_factory):
    stopped_and_resumed_elsewhere(launch, project, tmp_path_factory.mktemp("whole"),
                                  ("gpus=[]", "strategy=ddp", "nprocs=4"), 4,
                                  [(("gpus=[]", "strategy=ddp", "nprocs=2"), 2), (("gpus=[]",), 1)], ("gpus=[]",))


def test_a_network_from_config_with_its_arguments(launch, project):
    result = launch("model._target_=nets.TinyNet", "+model.hidden=8", "gpus=[]", "epochs=3")
    assert result.returncode == 0, result.output
    assert _results(result)["model"] == "nets.TinyNet" and _results(result)["test_acc"] > 0.25
    import torch

    state = torch.load(_run_dir(result) / "checkpoints" / "last.pt", weights_only=True)
    assert tuple(state["net_state_dict"]["3.weight"].shape) == (10, 8)  # num_classes passed by launch
    bad = launch("model._target_=torchvision.models.no_such_net", "gpus=[]", timeout=60)
    assert bad.returncode == 2 and "model._target_=torchvision.models.no_such_net is not valid" in bad.stderr
    assert "Traceback" not in bad.output and not list(project.glob("outputs/**/train.log"))[1:]
    stray = launch("+model.hidden=8", "gpus=[]", timeout=60)
    assert stray.returncode == 2 and "model._target_ names none" in stray.stderr
    # launch eval builds the network that was saved (its _target_ and arguments), not the recipe's own
    evaluated = launch("eval", str(_run_dir(result)), "gpus=[]")
    assert evaluated.returncode == 0, evaluated.output
    eval_json = json.loads(next(project.glob("outputs/**/eval.json")).read_text())
    assert eval_json["model"] == "nets.TinyNet" and eval_json["test_acc"] == _results(result)["test_acc"]
    # and a resume, with no override: its own run's checkpoint (this user's seal), its arguments carried too
    # (+model.hidden=8 was left behind: the checkpoint's weights did not fit TinyNet's default width)
    resumed = launch(f"resume={_run_dir(result)}", "epochs=4", "gpus=[]")
    assert resumed.returncode == 0, resumed.output
    assert _results(resumed)["model"] == "nets.TinyNet"
    assert "hidden: 8" in (_run_dir(resumed) / "config.yaml").read_text()


def test_a_network_that_does_not_take_the_batches_is_one_line_naming_its_key(launch, project):
    """torchvision's resnet18 (3 input channels) on digits (1 channel): torch's own sentence, the batch's
    shapes and the key that chose the network, in one line, exit 2; on 2 gloo ranks too. The recipe's own
    network and a user recipe's own step keep their behaviour (the test after this one)."""
    for extra in ([], ["strategy=ddp", "nprocs=2"]):
        result = launch("recipe=digits", "+model._target_=torchvision.models.resnet18", "gpus=[]", "epochs=1",
                        *extra, timeout=240)
        assert result.returncode == 2, result.output
        line = [t for t in result.stderr.splitlines() if "is not valid" in t]
        assert len(line) == 1 and "Traceback" not in result.output
        assert line[0].startswith("launch: model._target_=torchvision.models.resnet18 is not valid: the network does "
                                  "not take recipe=digits's batches (")
        assert "1x8x8" in line[0] and "expected input[" in line[0] and "to have 3 channels" in line[0]
    flat = launch("recipe=digits", "model._target_=torch.nn.Flatten", "gpus=[]", "epochs=1", timeout=240)
    assert flat.returncode == 2 and "Traceback" not in flat.output, flat.output
    assert "model._target_=torch.nn.Flatten is not valid: the network has no parameters to train" in flat.stderr


CLASSIFIER = """
import torch
from torch import nn
from torch.utils.data import Dataset, random_split

from launcher.recipes import Recipe


class Points(Dataset):
    classes = ["a", "b", "c"]

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(600, 2, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0.5).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Classifier(Recipe):
    def load(self):
        return random_split(Points(), [0.8, 0.2], generator=torch.Generator().manual_seed(0))

    def build_model(self, num_classes):
        return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, num_classes))
"""


def test_a_classifier_finds_its_classes_through_random_split_or_names_what_to_give(launch, project):
    """The default num_classes looks through random_split's Subsets to the Dataset's `classes`; a Dataset with
    none gave build_model 0 classes, and the first step failed in the loss with a traceback ("Target 2 is out of
    bounds"): now one line naming what to give, exit 2, before any step."""
    (project / "points.py").write_text(CLASSIFIER)
    result = launch("recipe=points", "gpus=[]", "epochs=1", "data.workers=0")
    assert result.returncode == 0, result.output
    assert result.results()["test_acc"] > 0.34  # (three classes: above chance)
    assert "never a target" not in result.output  # (its network has the 3 outputs it was asked for)
    evaluated = launch("eval", str(result.run_dir()), "gpus=[]", "data.workers=0")
    assert evaluated.returncode == 0, evaluated.output
    assert re.search(r"test accuracy \S+% on 120 samples \(loss", evaluated.output), evaluated.output  # (not images)
    (project / "bare.py").write_text(CLASSIFIER.replace('    classes = ["a", "b", "c"]\n', ""))
    bare = launch("recipe=bare", "gpus=[]", "epochs=1", "data.workers=0")
    assert bare.returncode == 2 and "Traceback" not in bare.output, bare.output
    assert ("launch: recipe=bare is not valid: its network has a layer with no outputs (2.weight, of shape [0, 16]): "
            "build_model was given num_classes=0, since its training Dataset (Subset) names no `classes`: give that "
            "Dataset a `classes` list, or define num_classes(self, train) in the recipe") in bare.stderr
    assert "epoch 1/1" not in bare.output


def test_a_recipes_own_network_with_more_outputs_than_classes_is_said(launch, project):
    """A build_model that ignores the num_classes it is given (5 outputs for 3 classes) trains, the 2 outputs
    beyond the classes never a target: a warning says so, as for a network from config (a user's trial)."""
    (project / "wide.py").write_text(CLASSIFIER.replace("nn.Linear(16, num_classes)", "nn.Linear(16, 5)"))
    result = launch("recipe=wide", "gpus=[]", "epochs=1", "data.workers=0")
    assert result.returncode == 0, result.output
    assert ("recipe=wide's network: its last layer (2) gives 5 outputs for the 3 classes of recipe=wide; the 2 "
            "beyond them are never a target") in result.output, result.output
    assert "its build_model(num_classes) is given 3" in result.output, result.output


def test_a_users_step_that_raises_shows_the_users_frame(launch, project):
    (project / "broken.py").write_text((EXAMPLES / "regression.py").read_text().replace(
        "        x, y = batch\n        return nn.functional.mse_loss(model(x).float(), y)",
        "        x, y = batch\n        return undefined_name(model(x), y)"))
    result = launch("recipe=broken", "gpus=[]", "epochs=1", "data.workers=0")
    assert result.returncode == 1
    assert "NameError" in result.output and "broken.py" in result.output


def test_a_sweep_minimizes_the_recipes_own_figure(launch, project):
    result = launch("-m", "recipe=regression", "recipe.hidden=8,64", "gpus=[]", "epochs=2", "batch_size=128",
                    "optim=adamw", "lr=0.01", "sweep.objective=test_rmse", "data.workers=0", timeout=300)
    assert result.returncode == 0, result.output
    summary = next(project.glob("multirun/**/summary.md")).read_text()
    assert "| test_rmse |" in summary and "samples_per_s" in summary
    values = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^\| (\d) \|.*?\| 0 \| ([\d.]+) \|", summary,
                                                                       re.M)}
    best = min(values, key=values.get)
    assert f"best: job {best} " in summary
    runs = launch("runs", timeout=60)
    assert runs.returncode == 0 and "test_rmse" in runs.stdout


def test_a_network_with_lazy_layers_trains_on_two_ranks_alike(launch, project):
    """nets.LazyNet (nn.LazyLinear, nn.LazyBatchNorm1d) takes its shapes from a first batch before ddp or fsdp
    wraps it (it died in the gradient buckets' sizing): every rank starts from the same weights, so fsdp
    (each rank keeps its own part of them) trains as ddp (rank 0's, broadcast) does."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        result = launch("model._target_=nets.LazyNet", "gpus=[]", "epochs=1", f"strategy={strategy}", "nprocs=2")
        assert result.returncode == 0, result.output
        runs[strategy] = _results(result)
        assert runs[strategy]["ranks_agree"] is (True if strategy == "ddp" else None)  # (fsdp: nothing compared)
        assert runs[strategy]["world_size"] == 2
    # (the training loss: evaluation reads the BatchNorm statistics, rank 0's under ddp, averaged under fsdp)
    assert runs["ddp"]["final"]["loss"] == pytest.approx(runs["fsdp"]["final"]["loss"], rel=1e-4)


def test_a_stream_trains_each_ranks_share_once_per_epoch_and_batch_means_are_weighed_by_their_samples(launch,
                                                                                                    project):
    """2 ranks x 2 DataLoader workers on an IterableDataset of 48 ids (a global batch of 8: 6 steps): each
    rank's steps are its every-other sample of the stream, in the order drawn from the epoch its workers were
    told, full batches, the ranks' shares disjoint and together the whole epoch. The evaluation set (37
    samples, eval.batch_size=10: rank 0 scores 5+5+5+4, rank 1 5+5+5+3) reports a 0-dim batch mean as the
    exact mean over its samples, not a mean of the batches' means."""
    import torch

    result = launch("recipe=streamed", "gpus=[]", "epochs=2", "batch_size=8", "eval.batch_size=10", "strategy=ddp",
                    "nprocs=2", "data.workers=2", "optim=sgd")
    assert result.returncode == 0, result.output
    steps = [[json.loads(line) for line in (project / f"streamed-{r}.jsonl").read_text().splitlines()]
             for r in range(2)]
    assert [len(s) for s in steps] == [12, 12]
    for epoch in range(2):
        stream = torch.randperm(48, generator=torch.Generator().manual_seed(epoch)).tolist()
        trained = []
        for rank in range(2):
            mine = steps[rank][6 * epoch:6 * (epoch + 1)]
            assert [s["ids"] for s in mine] == [stream[rank::2][4 * k:4 * (k + 1)] for k in range(6)], (rank, epoch)
            assert all(e == epoch for s in mine for e in s["epochs"])  # (the workers were told the epoch)
            assert {w for s in mine for w in s["workers"]} == {0, 1}
            trained += [i for s in mine for i in s["ids"]]
        assert sorted(trained) == list(range(48))
    exact = sum(i * i for i in range(37)) / 37
    assert math.isclose(result.results()["test_value"], exact, rel_tol=1e-6), (result.results()["test_value"], exact)
