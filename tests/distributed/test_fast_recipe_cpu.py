"""The record-speed configuration end to end on CPU (small official-format data, compile off for speed)."""

import json

import pytest

pytestmark = pytest.mark.distributed

SMALL_FAST = ("recipe=cifar10_fast", "batch_size=100", "eval.batch_size=100", "perf.compile=false",
              "gpus=[]")


@pytest.fixture(scope="module")
def tiny_cifar_root(tmp_path_factory):
    """200 training images: 2 steps per epoch at batch 100 (on 2 CPU cores airbench94's forward and
    backward dominate a step; Muon's Newton-Schulz runs in float32 on the CPU: optim.ns_dtype)."""
    from launcher.recipes.cifar10 import FOLDER, synthetic_splits, write_official_format

    root = tmp_path_factory.mktemp("tiny-cifar")
    write_official_format(root / FOLDER, synthetic_splits(200, 50, seed=3))
    return root


def test_fast_recipe_with_two_gloo_ranks(launch, tiny_cifar_root):
    # (1 step per epoch: 100 images per rank)
    result = launch(*SMALL_FAST, f"data.root={tiny_cifar_root}", "eval.batch_size=50", "epochs=2", "strategy=ddp",
                    "nprocs=2", "batch_size=200")
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["model"] == "airbench94" and r["strategy"] == "ddp" and r["ranks_agree"]
    assert r["timed"]["clock"] == "host clock" and r["timed"]["train_eval_s"] > 0
    rows = [json.loads(x) for x in (result.run_dir() / "metrics.jsonl").read_text().splitlines()]
    # eval_every=0: scored once, after the last epoch; every epoch reports its input wait
    assert "test_acc" not in rows[0] and "test_acc" in rows[1]
    assert all(0 <= row["input_stall"] <= 1 and row["host_issue_s"] > 0 for row in rows)
    assert "input wait" in result.stdout


def test_a_restart_resumes_both_optimizers_exactly(launch, tiny_cifar_root):
    # 1 step per epoch (the 200 images at once): a failure at step 1 (0-based, epoch 2) restarts from the
    # epoch-1 checkpoint (Muon and SGD state).
    tiny = (*SMALL_FAST, f"data.root={tiny_cifar_root}", "eval.batch_size=50", "epochs=2", "batch_size=200")
    plain = launch(*tiny)
    assert plain.returncode == 0, plain.output
    digest = plain.results()["weights_sha256"]
    for d in plain.run_dirs():
        d.rename(d.with_name(d.name + "-plain"))
        (d.with_name(d.name + "-plain") / ".hydra").rename(d.with_name(d.name + "-plain") / "hydra-config")
    restarted = launch(*tiny, "fault.rank=0", "fault.step=1", "max_restarts=1")
    assert restarted.returncode == 0, restarted.output
    r = restarted.results()
    assert r["restarts"] == 1 and r["resumed_from"].endswith("last.pt")  # resumed, not started over
    assert r["weights_sha256"] == digest


def test_muon_with_a_model_that_has_no_matrices_is_refused_in_one_line(launch):
    result = launch("optim=muon", "epochs=1", "gpus=[]")
    assert result.returncode == 2, result.output
    assert "parameter_roles" in result.stderr and "Traceback" not in result.output
