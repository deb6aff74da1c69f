"""Four GPUs of one host (marked `four_gpus`, skipped with fewer): every rank has a GPU of its own, and a
checkpoint written by four ranks inside an epoch resumes on two and on one in the same global order.

    python -m pytest -m four_gpus tests/gpu -v
"""

import json

import pytest

from tests.distributed.test_own_data import EXAMPLES, OWN, stopped_and_resumed_elsewhere

four_gpus = pytest.mark.four_gpus


@pytest.fixture
def project(tmp_path):
    import shutil

    for f in [*EXAMPLES.glob("*.py"), *OWN.glob("*.py")]:
        shutil.copy(f, tmp_path / f.name)  # the user's project dir: recipe files beside them
    return tmp_path


@four_gpus
def test_ddp_on_four_gpus_gives_each_rank_a_gpu_of_its_own(launch):
    result = launch("recipe=cifar10", "data.synthetic=true", "epochs=2", "gpus=[0,1,2,3]", timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["strategy"] == "ddp" and r["world_size"] == 4 and r["cuda_visible_devices"] == "0,1,2,3", r
    assert len(r["devices"]) == 4 and r["ranks_agree"] and len(r["weights_sha256"]) == 4, r
    rows = [json.loads(x) for x in (result.run_dir() / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[-1]["img_per_s"] > 0


@four_gpus
def test_fsdp_on_four_gpus_shards_over_all_of_them(launch, tmp_path):
    result = launch("recipe=text", "recipe.model=llama", "recipe.layers=4", "recipe.width=256", "recipe.heads=4",
                    "recipe.kv_heads=2", "recipe.context=128", "recipe.max_bytes=400000", "epochs=1",
                    "gpus=[0,1,2,3]", "strategy=fsdp", "strategy.min_unit_params=0", f"data.root={tmp_path / 'data'}",
                    timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["strategy"] == "fsdp" and r["world_size"] == 4 and len(r["devices"]) == 4, r
    assert "fsdp: 5 units, 4 of 1 block" in r["sharding"], r["sharding"]
    assert r["final"]["test_bpb"] < r["unigram_test_bpb"], r["final"]


@four_gpus
def test_a_checkpoint_of_four_gpus_inside_an_epoch_resumes_on_two_and_on_one_in_the_same_order(
        launch, project, tmp_path_factory):
    stopped_and_resumed_elsewhere(launch, project, tmp_path_factory.mktemp("whole"), ("gpus=[0,1,2,3]",), 4,
                                  [(("gpus=[0,1]",), 2), (("gpus=[0]",), 1)], ("gpus=[0]",))
