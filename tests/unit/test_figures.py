"""A figure appears under its own name or not at all: a step's or a report's figure under a name the launcher
gives a meaning of its own is one line (exit 2), never filed under a doubled prefix, summed into the loss or
shown as an accuracy; and a setting that names a figure the run cannot have is refused before any worker
where the recipe's figures are known up front, else at the first epoch that can have it, on every rank."""

import contextlib
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from launcher.errors import ConfigError, LaunchError
from launcher.figures import NamedFigures
from launcher.recipes import Recipe
from launcher.train.epoch_end import EpochEnds
from launcher.train.evaluation import Evaluation
from launcher.train.step import TrainStep
from tests.conftest import config_of

EXAMPLES = Path(__file__).parents[2] / "examples"


def _train_once(training_step):
    """One step of a TrainStep (the loop's own) taking `training_step`; its epoch sums."""
    model = nn.Linear(3, 2)

    class Nets:
        module = train = eval = model
        grads = None

    step = TrainStep(Nets(), [], training_step, lambda x: x, None, contextlib.nullcontext, torch.device("cpu"))
    step.body((torch.randn(4, 3), torch.randint(0, 2, (4,))), torch.arange(4), 0, torch.Generator())
    return step.sums


def _evaluate_once(eval_step):
    """One evaluation (the loop's own Evaluation) of a recipe whose eval_step is `eval_step`; its sums."""
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))

    class Split:
        def __len__(self):
            return 8

        def batches(self, chunks):
            for rows in chunks:
                yield (x[rows], y[rows]), rows

    recipe = SimpleNamespace(eval_step=eval_step, eval_chunk_limit=lambda: None)
    strategy = SimpleNamespace(world_size=1, rank=0, lockstep_eval=False)
    cfg = SimpleNamespace(eval=SimpleNamespace(batch_size=4))
    evaluation = Evaluation(cfg, recipe, strategy, torch.device("cpu"), contextlib.nullcontext,
                            SimpleNamespace(warmup_s=None))
    data = SimpleNamespace(test=Split(), in_memory=False, num_classes=2)
    model = nn.Linear(3, 2)
    return evaluation.queue(SimpleNamespace(eval=model), data, warmed=False).figures


def _mse(model, batch):
    return ((model(batch[0]) - 0.5) ** 2).mean(1)


@pytest.mark.parametrize("figures, said", [
    ({"train_mae": 1}, "training_step's figure 'train_mae' is not valid: training_step's figures appear as "
                       "train_NAME, so this one would be train_train_mae; return it as 'mae'"),
    ({"loss": 1}, "training_step's figure 'loss' is not valid: the loss is the step's first value"),
    ({"s": 1}, "training_step's figure 's' is not valid: train_s is one of the launcher's own keys"),
    ({"acc": 1}, "training_step's figure 'acc' is not valid: train_acc is the launcher's accuracy"),
])
def test_a_training_figure_under_a_name_the_launcher_keeps_is_one_line(figures, said):
    def training_step(model, batch):
        out = model(batch[0])
        return nn.functional.cross_entropy(out, batch[1]), {k: out.abs().mean(1) for k in figures}

    with pytest.raises(LaunchError) as caught:
        _train_once(training_step)
    assert str(caught.value).startswith(said) and "\n" not in str(caught.value)


def test_the_default_steps_accuracy_and_a_recipes_own_figures_are_summed_under_their_names():
    recipe = Recipe.__new__(Recipe)
    assert _train_once(lambda m, b: Recipe.training_step(recipe, m, b)).figures.names == ["loss", "acc"]
    assert _train_once(lambda m, b: {"loss": m(b[0]).pow(2).mean(), "mae": m(b[0]).abs().mean(1)}).figures.names \
        == ["loss", "mae"]


@pytest.mark.parametrize("name, said", [
    ("test_mse", "eval_step's figure 'test_mse' is not valid: eval_step's figures appear as test_NAME, so this one "
                 "would be test_test_mse; return it as 'mse' (it appears as test_mse)"),
    ("val_loss", "eval_step's figure 'val_loss' is not valid: eval_step's figures appear as test_NAME, so this one "
                 "would be test_val_loss; return it as 'loss'"),
    ("acc", "eval_step's figure 'acc' is not valid: test_acc is the launcher's accuracy (shown as a percentage, and "
            "as the test accuracy)"),
])
def test_an_evaluation_figure_under_a_name_the_launcher_keeps_is_one_line(name, said):
    with pytest.raises(LaunchError) as caught:
        _evaluate_once(lambda model, batch: {name: _mse(model, batch)})
    assert str(caught.value).startswith(said) and "\n" not in str(caught.value)


def test_the_launchers_accuracy_reaches_a_recipe_through_its_default_eval_step():
    recipe = Recipe.__new__(Recipe)

    def added_to(model, batch):  # a recipe's own figure beside the default ones
        figures = Recipe.eval_step(recipe, model, batch)
        figures["mse"] = _mse(model, batch)
        return figures

    assert _evaluate_once(lambda m, b: Recipe.eval_step(recipe, m, b)).names == ["loss", "acc"]
    assert _evaluate_once(added_to).names == ["loss", "acc", "mse"]
    assert _evaluate_once(lambda m, b: {"loss": _mse(m, b), "top1": _mse(m, b) < 1}).names == ["loss", "top1"]


def _reporting(report, cfg=None, evaluated=("mse",)):
    """An epoch end's row reporting (EpochEnds._report) with a recipe whose report is `report`."""
    return SimpleNamespace(recipe=SimpleNamespace(report=report), device=torch.device("cpu"),
                           strategy=SimpleNamespace(world_size=2),
                           step=SimpleNamespace(sums=SimpleNamespace(named=set())),
                           evaluation=SimpleNamespace(named=set(evaluated)),
                           named_figures=NamedFigures(cfg or config_of("gpus=[]")))


def _row(**more):
    return {"epoch": 1, "loss": 0.5, "train_s": 1.0, "samples_per_s": 100.0, "input_stall": 0.0, "epoch_s": 1.2, **more}


@pytest.mark.parametrize("report, said", [
    (lambda row, d, w: row.update(loss=math.sqrt(row["loss"])), "report's figure 'loss' is not valid: loss is a "
                                                                 "figure the launcher computed"),
    (lambda row, d, w: row.pop("test_mse"), "report's figure 'test_mse' is not valid"),
    (lambda row, d, w: row.update(test_acc=0.9), "report's figure 'test_acc' is not valid: test_acc is the launcher's "
                                                 "own name"),
    (lambda row, d, w: row.update(checkpoint_wait_s=0.0), "report's figure 'checkpoint_wait_s' is not valid"),
])
def test_a_report_that_changes_the_launchers_figures_or_takes_its_names_is_one_line(report, said):
    with pytest.raises(LaunchError) as caught:
        EpochEnds._report(_reporting(report), _row(test_mse=0.25))
    assert str(caught.value).startswith(said) and "\n" not in str(caught.value)


def test_a_report_may_not_file_a_figure_under_an_evaluated_name_on_an_epoch_without_evaluation():
    with pytest.raises(LaunchError, match="report's figure 'test_mse' is not valid"):
        EpochEnds._report(_reporting(lambda row, d, w: row.update(test_mse=0.0)), _row())


def test_a_derived_figure_is_added_and_a_setting_naming_it_is_checked_at_the_first_evaluation():
    def rmse(row, device, world_size):
        if "test_mse" in row:
            row["test_rmse"] = math.sqrt(row["test_mse"])

    trainer = _reporting(rmse, config_of("gpus=[]", "early_stop.metric=test_rmse"))
    row = _row()
    EpochEnds._report(trainer, row)  # (not evaluated: nothing to check yet)
    row = _row(test_mse=0.25)
    EpochEnds._report(trainer, row)
    assert row["test_rmse"] == 0.5
    typo = _reporting(rmse, config_of("gpus=[]", "early_stop.metric=test_rmsee"))
    EpochEnds._report(typo, _row())
    with pytest.raises(ConfigError, match=r"early_stop.metric=test_rmsee is not valid: names no figure of this "
                                          r"run's epochs; they are loss, test_mse, test_rmse .*\(e.g. launch "
                                          r"early_stop.metric=test_rmse\)"):
        EpochEnds._report(typo, _row(test_mse=0.25))


@pytest.fixture
def examples(tmp_path, monkeypatch):
    """examples/ copied to a project dir launch runs in (its regression.py is recipe=regression)."""
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    monkeypatch.chdir(tmp_path / "examples")
    monkeypatch.syspath_prepend(str(tmp_path / "examples"))
    return tmp_path / "examples"


@pytest.mark.parametrize("setting, typed, said", [
    ("early_stop.metric", "test_rmsee", "early_stop.metric=test_rmsee is not valid: names no figure of this run's "
                                        "epochs; they are loss, test_mse, test_rmse"),
    ("early_stop.metric", "val/accuracy", "early_stop.metric=val/accuracy is not valid"),
    ("checkpoint.metric", "test_acc", "checkpoint.metric=test_acc is not valid"),
    ("sweep.objective", "test_rmsee", "sweep.objective=test_rmsee is not valid: names no figure of this run's epochs"),
])
def test_a_setting_naming_a_figure_the_recipe_does_not_have_is_refused_before_any_worker(examples, setting, typed,
                                                                                          said):
    from launcher.host.run_here import check_runnable

    more = ("checkpoint.keep_best=2",) if setting == "checkpoint.metric" else ()
    with pytest.raises(ConfigError) as caught:
        check_runnable(config_of("recipe=regression", "gpus=[]", f"{setting}={typed}", *more))
    assert str(caught.value).startswith(said) and "(e.g. launch " in str(caught.value)


def test_the_built_in_recipes_figures_are_known_up_front_and_an_unknown_one_waits_for_its_epoch(examples):
    from launcher.host.run_here import check_runnable

    with pytest.raises(ConfigError, match=r"early_stop.metric=test_mse is not valid: names no figure of this run's "
                                          r"epochs; they are loss, train_acc, test_acc, test_loss"):
        check_runnable(config_of("recipe=digits", "gpus=[]", "early_stop.metric=test_mse"))
    check_runnable(config_of("recipe=digits", "gpus=[]", "early_stop.metric=val/accuracy", "sweep.objective=worker_s"))
    # a recipe that says nothing of its figures and has its own eval_step: known at its first evaluation
    (examples / "quiet.py").write_text((examples / "regression.py").read_text().replace(
        "    figures = (", "    unsaid = ("))
    check_runnable(config_of("recipe=quiet", "gpus=[]", "early_stop.metric=test_rmsee"))


def test_a_recipe_whose_declared_figures_leave_one_out_is_one_line_at_its_first_evaluation():
    named = NamedFigures(config_of("gpus=[]"), ("loss", "test_mse"), "regression")
    named.check(_row())
    with pytest.raises(LaunchError, match=r"recipe=regression is not valid: its `figures` \(loss, test_mse\) leave "
                                          r"out test_rmse, which its epochs have"):
        named.check(_row(test_mse=0.25, test_rmse=0.5))


def test_a_sweep_objective_that_is_no_figure_is_checked_against_results_json():
    named = NamedFigures(config_of("gpus=[]", "sweep.objective=worker_s"))
    named.check_results({"worker_s": 3.0, "final": {}})
    typo = NamedFigures(config_of("gpus=[]", "sweep.objective=worker_ss"))
    with pytest.raises(ConfigError, match=r"sweep.objective=worker_ss is not valid: .* \(e.g. launch "
                                          r"sweep.objective=worker_s\)"):
        typo.check_results({"worker_s": 3.0, "final": {"loss": 0.1}})


@pytest.mark.parametrize("every, evaluated", [(2, [False, True, True]), (0, [False, False, True]),
                                              (1, [True, True, True])])
def test_a_run_evaluates_every_nth_epoch_and_always_after_its_last(every, evaluated):
    """eval.every=2 over 3 epochs: after epoch 2, and after the last (3) though 3 is no multiple of 2."""
    cfg = SimpleNamespace(epochs=3, eval=SimpleNamespace(every=every, batch_size=4))
    evaluation = Evaluation(cfg, SimpleNamespace(), SimpleNamespace(), torch.device("cpu"), contextlib.nullcontext,
                            SimpleNamespace(warmup_s=None))
    assert [evaluation.after(epoch) for epoch in range(3)] == evaluated


def test_launch_eval_counts_the_samples_every_rank_skipped():
    """`launch eval` on two ranks (data.on_bad_file=skip): eval_skipped is the sum over the ranks, not rank 0's."""
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))

    class Split:
        skipped = 0

        def __len__(self):
            return 8

        def batches(self, chunks):
            self.skipped += 1  # (this rank left one bad file out)
            for rows in chunks:
                yield (x[rows], y[rows]), rows

    other_rank_skipped = 2
    strategy = SimpleNamespace(world_size=2, rank=0, lockstep_eval=False, all_reduce=lambda t: 2 * t,
                               reduce_host=lambda values: [v + other_rank_skipped for v in values])
    cfg = SimpleNamespace(eval=SimpleNamespace(batch_size=4))
    evaluation = Evaluation(cfg, SimpleNamespace(eval_step=lambda model, batch: {"mse": _mse(model, batch)},
                                                  eval_chunk_limit=lambda: None),
                            strategy, torch.device("cpu"), contextlib.nullcontext, SimpleNamespace(warmup_s=None))
    data = SimpleNamespace(test=Split(), in_memory=False, num_classes=2)
    row = evaluation.read_now(SimpleNamespace(eval=nn.Linear(3, 2)), data, warmed=True)
    assert row["eval_skipped"] == 1 + other_rank_skipped
