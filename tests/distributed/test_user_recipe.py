"""`recipe=my_pkg.my_recipe`: a user's own module with the recipe interface, found from where launch runs."""

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


def test_a_users_recipe_module_trains_on_two_ranks(launch, tmp_path):
    shutil.copytree(Path(__file__).parent / "data" / "my_pkg", tmp_path / "my_pkg")  # the user's project dir
    result = launch("recipe=my_pkg.my_recipe", "gpus=[]", "strategy=ddp", "nprocs=2", "epochs=3", "batch_size=32")
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["recipe"] == "my_pkg.my_recipe" and r["model"] == "mlp" and r["ranks_agree"]
    assert r["test_acc"] > 0.6
