"""`recipe=my_pkg.my_recipe`: a user's own Recipe class, found from where launch runs, with hyper-parameters of
its own that are typed, shown by --cfg job, set from the command line and reach its code."""

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


@pytest.fixture
def users_project(tmp_path):
    shutil.copytree(Path(__file__).parents[2] / "examples" / "my_pkg", tmp_path / "my_pkg")  # the user's project dir


def test_a_users_recipe_trains_on_two_ranks_with_its_own_hyper_parameter(launch, users_project):
    result = launch("recipe=my_pkg.my_recipe", "recipe.hidden=48", "gpus=[]", "strategy=ddp", "nprocs=2", "epochs=3",
                    "batch_size=32")
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["recipe"] == "my_pkg.my_recipe" and r["model"] == "mlp" and r["ranks_agree"]
    assert r["test_acc"] > 0.6
    assert "hidden: 48" in (result.run_dir() / "config.yaml").read_text()
    # the hidden layer really is 48 wide: the checkpoint's first weight matrix says so
    import torch

    state = torch.load(result.run_dir() / "checkpoints" / "last.pt", weights_only=True)
    assert tuple(state["net_state_dict"]["1.weight"].shape) == (48, 16)


def test_its_hyper_parameters_are_typed_and_shown(launch, users_project):
    shown = launch("recipe=my_pkg.my_recipe", "--cfg", "job", timeout=60)
    assert shown.returncode == 0 and "name: my_pkg.my_recipe" in shown.stdout and "hidden: 32" in shown.stdout
    wrong = launch("recipe=my_pkg.my_recipe", "recipe.hidden=wide", timeout=60)
    assert wrong.returncode == 2 and "recipe.hidden=wide is not valid: must be an integer" in wrong.stderr
    typo = launch("recipe=my_pkg.my_recipe", "recipe.hiden=3", timeout=60)
    assert typo.returncode == 2 and "did you mean recipe.hidden?" in typo.stderr
    model = launch("recipe=my_pkg.my_recipe", "recipe.model=cnn", "gpus=[]", timeout=60)
    assert model.returncode == 2 and "recipe.model=cnn is not valid: my_pkg.my_recipe has: mlp" in model.stderr


def test_a_module_without_a_recipe_class_is_one_line(launch, tmp_path):
    (tmp_path / "not_a_recipe.py").write_text("X = 1\n")
    result = launch("recipe=not_a_recipe.x", timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.output
    (tmp_path / "plain.py").write_text("X = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "plain.py").write_text("X = 1\n")
    result = launch("recipe=pkg.plain", timeout=60)
    assert result.returncode == 2 and "pkg.plain defines no subclass of launcher.recipes.Recipe" in result.stderr


def test_a_recipe_module_that_fails_to_import_is_one_line(launch, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "mine" / "needs.py").write_text("import not_installed_anywhere\n")
    (tmp_path / "mine" / "typo.py").write_text("def f(:\n")
    for module, words in (("mine.needs", "importing mine.needs failed (line 1): ModuleNotFoundError: No module "
                                         "named 'not_installed_anywhere'"),
                          ("mine.typo", "importing mine.typo failed: SyntaxError")):
        result = launch(f"recipe={module}", timeout=60)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and words in lines[0], result.output
