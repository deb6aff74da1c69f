"""recipe=imagefolder end to end: a small ImageNet-layout folder (tests/imagefolders.py) trained by `launch` on the
CPU, on one rank and on two gloo ranks, through the launcher's Dataset path (DataLoader workers, collate,
on_after_batch_transfer). Skipped until that path (launcher/data/loader.py) lands."""

import shutil

import pytest

pytest.importorskip("torchvision", reason="recipe=imagefolder needs torchvision (pip install torchvision)")

from tests.imagefolders import write_image_folder

pytestmark = [pytest.mark.distributed]

TINY = ("recipe=imagefolder", "recipe.model=resnet18", "recipe.image_size=32", "gpus=[]", "epochs=2", "batch_size=8",
        "data.workers=1")


@pytest.fixture
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("imagenet"))


def test_it_trains_on_one_rank_and_counts_images(launch, folder):
    result = launch(*TINY, f"data.root={folder}")
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["recipe"] == "imagefolder" and r["model"] == "resnet18"
    assert "model: resnet18, 11.18M parameters" in result.output  # (said before the first epoch, as nanoGPT does)
    assert 0.0 <= r["test_acc"] <= 1.0 and "images_per_s" in result.run_dir().joinpath("metrics.jsonl").read_text()
    # launch eval names the classes by their folders
    evaluated = launch("eval", str(result.run_dir()), "gpus=[]")
    assert evaluated.returncode == 0, evaluated.output
    import json

    report = json.loads(next(result.cwd.glob("outputs/**/eval.json")).read_text())
    assert report["classes"] == ["ant", "bee", "cat"] and set(report["per_class_acc"]) == {"ant", "bee", "cat"}
    assert "ant" in evaluated.output

    # A folder of as many classes, named otherwise (its sorted order moves every label): the network's outputs
    # are the checkpoint's classes, so evaluating or resuming on it is refused before any worker starts (it
    # scored and trained in silence, its "accuracy" nonsense)
    other = folder.parent / "other"
    shutil.copytree(folder, other)
    for split in ("train", "val"):
        (other / split / "ant").rename(other / split / "zebra")
    for command in (("eval", str(result.run_dir()), "gpus=[]", f"data.root={other}"),
                    (*TINY, f"data.root={other}", f"resume={result.run_dir()}", "epochs=3")):
        refused = launch(*command)
        assert refused.returncode == 2, refused.output
        assert "missing here: ant" in refused.output and "not in the checkpoint: zebra" in refused.output
        assert "start-up" not in refused.output and len(list(result.cwd.glob("outputs/**/eval.json"))) == 1


def test_it_trains_on_two_gloo_ranks_that_agree(launch, folder):
    result = launch(*TINY, f"data.root={folder}", "strategy=ddp", "nprocs=2")
    assert result.returncode == 0, result.output
    assert result.results()["ranks_agree"]


def test_decode_gpu_on_the_cpu_says_so_and_trains(launch, folder):
    result = launch(*TINY, f"data.root={folder}", "data.decode=gpu", "epochs=1")
    assert result.returncode == 0, result.output
    assert "data.decode=gpu: no CUDA device here" in result.output


def test_a_bad_file_is_one_line_or_skipped_and_counted(launch, folder):
    bad = folder / "train" / "ant" / "ant_003.JPEG"
    bad.write_bytes(bad.read_bytes()[:200])
    # (batch_size=10: every one of the 30 training images is in the epoch, none in a dropped tail)
    stopped = launch(*TINY, f"data.root={folder}", "epochs=1", "batch_size=10")
    assert stopped.returncode == 2 and "ant_003.JPEG cannot be decoded" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    log = stopped.run_dir().joinpath("train.log").read_text()  # the run's log says why it stopped, too
    assert "ant_003.JPEG cannot be decoded" in log and "Traceback" not in log
    assert stopped.stderr.count("ant_003.JPEG cannot be decoded") == 1  # (said once on the console)
    bad_val = folder / "val" / "bee" / "bee_001.JPEG"
    bad_val.write_bytes(b"not a jpeg")
    skipped = launch(*TINY, f"data.root={folder}", "epochs=1", "batch_size=10", "data.on_bad_file=skip")
    assert skipped.returncode == 0, skipped.output
    assert skipped.results().get("skipped_samples") == 1 and skipped.results().get("skipped_eval_samples") == 1
    assert "skipped 1  skipped in evaluation 1" in skipped.output
    assert "data.on_bad_file=skip: left out" in skipped.output and "bee_001.JPEG" in skipped.output
    # launch eval leaves out what the run left out (its data.on_bad_file), and counts it
    evaluated = launch("eval", str(skipped.run_dir()), "gpus=[]")
    assert evaluated.returncode == 0, evaluated.output
    import json

    assert json.loads(next(skipped.cwd.glob("outputs/**/eval.json")).read_text())["eval_skipped"] == 1
    assert "images (1 unreadable, left out)" in evaluated.output


def test_a_folder_without_val_is_refused_before_any_worker(launch, tmp_path):
    root = write_image_folder(tmp_path / "data", 2, 1, odd_files=False)
    import shutil

    shutil.rmtree(root / "val")
    result = launch(*TINY, f"data.root={root}", timeout=60)
    assert result.returncode == 2 and "has no val/ folder" in result.stderr
    assert not list((tmp_path).glob("outputs/**/train.log"))


def test_a_checkpoint_inside_an_epoch_on_two_ranks_resumes_on_one_in_the_same_order(launch, folder, tmp_path,
                                                                                    tmp_path_factory):
    from tests.imagefolders import check_two_ranks_resumed_on_one

    check_two_ranks_resumed_on_one(launch, tmp_path, tmp_path_factory.mktemp("whole"), folder,
                                   two=("gpus=[]", "strategy=ddp", "nprocs=2"), one=("gpus=[]",),
                                   common=("recipe.model=resnet18", "recipe.image_size=32", "data.workers=1"))
