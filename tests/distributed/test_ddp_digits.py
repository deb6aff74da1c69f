"""End to end on CPU with 2 gloo ranks: what a user sees after `launch recipe=digits gpus=[] strategy=ddp nprocs=2`."""

import json
import re

import pytest
import torch

pytestmark = pytest.mark.distributed

DDP_CPU = ("recipe=digits", "gpus=[]", "strategy=ddp", "nprocs=2")


def test_two_rank_ddp_reaches_95_percent_with_identical_weights(launch):
    result = launch(*DDP_CPU)
    assert result.returncode == 0, result.output
    run_dir = result.run_dir()  # exactly one run dir although two workers ran
    results = result.results()
    assert results["strategy"] == "ddp" and results["world_size"] == 2 and results["batch_per_process"] == 32
    assert results["test_acc"] >= 0.95, results
    digests = results["weights_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1] and results["ranks_agree"]
    assert "test accuracy" in result.stdout
    # where the start-up went, itemized and in order
    startup = results["startup"]
    assert list(startup)[:2] == ["spawn", "worker_process"] and list(startup)[-1] == "first_step"
    assert list(startup.values()) == sorted(startup.values()) and "process_group" in startup
    assert "start-up, seconds since launch" in result.stdout
    # the first step's time counts from the command (not from some other clock's zero): within the launch's own
    assert 0 < results["first_step_s"] < result.seconds, (results["first_step_s"], result.seconds)

    # metrics.jsonl: one line per epoch with the promised fields
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, results["epochs"] + 1))
    for key in ("loss", "train_acc", "test_acc", "img_per_s", "epoch_s", "max_mem_allocated_mb", "max_mem_reserved_mb"):
        assert key in rows[0]
    # the resolved config, the rank-prefixed log from both ranks and the launcher, the checkpoint
    assert "strategy:\n  name: ddp" in (run_dir / "config.yaml").read_text()
    log = (run_dir / "train.log").read_text()
    assert re.search(r"\[launcher\]", log) and re.search(r"\[rank 0\]", log)
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["epoch"] == results["epochs"] and "net_state_dict" in state
    assert not any(k.startswith("module.") for k in state["net_state_dict"])


def test_single_process_cpu_default_run(launch):
    result = launch("epochs=3")
    assert result.returncode == 0, result.output
    results = result.results()
    assert results["strategy"] == "single" and results["device_type"] == "cpu" and results["test_acc"] > 0.9


def test_cifar10_recipe_on_official_format_data(launch, cifar_root):
    result = launch("recipe=cifar10", f"data.root={cifar_root}", "epochs=1", "batch_size=100", *DDP_CPU[1:])
    assert result.returncode == 0, result.output
    results = result.results()
    assert results["recipe"] == "cifar10" and results["model"] == "airbench" and not results["synthetic_data"]
    assert results["ranks_agree"]
