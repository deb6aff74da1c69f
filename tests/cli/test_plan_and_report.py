"""Commands that start nothing: the dry-run plan, the composed config, the environment report."""

import json

from tests.conftest import clean_env


def test_dry_run_prints_the_plan_and_leaves_nothing(launch):
    result = launch("gpus=[]", "strategy=ddp", "nprocs=2", "dry_run=true", timeout=60)
    assert result.returncode == 0, result.output
    out = result.stdout
    assert "dry run: nothing started. digits (cnn): ddp, gloo on CPU, 2 processes" in out
    assert "batch 64 global = 32 x 2 ranks" in out and "CUDA_VISIBLE_DEVICES=''" in out
    assert not (result.cwd / "outputs").exists()


def test_dry_run_warns_about_dataparallel_only_where_it_applies(launch):
    result = launch("dry_run=true", timeout=60)
    assert result.returncode == 0 and "DataParallel" not in result.stdout


def test_cfg_job_prints_the_composed_config(launch):
    result = launch("recipe=cifar10", "strategy=ddp", "--cfg", "job", timeout=60)
    assert result.returncode == 0, result.output
    assert "name: cifar10" in result.stdout and "model: airbench" in result.stdout and "name: ddp" in result.stdout
    assert not (result.cwd / "outputs").exists()


def test_doctor_reports_versions_devices_and_caches_as_json(launch, tmp_path):
    cache = tmp_path / "cache"
    decoded = cache / "decoded" / "cifar10-0123456789abcdef"
    decoded.mkdir(parents=True)
    (decoded / "train_x.npy").write_bytes(b"\0" * 3 * 2**20)
    env = {**clean_env(), "LAUNCH_CACHE_DIR": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    result = launch("doctor", "--json", timeout=60, env=env)
    assert result.returncode == 0, result.output
    report = json.loads(result.stdout)
    assert report["packages"]["torch"] and report["packages"]["hydra-core"]
    assert report["cuda_device_count"] == len(report["cuda_devices"])
    assert "slurm" in report and "cuda_visible_devices" in report
    by_what = {c["what"]: c for c in report["caches"]}
    assert by_what["decoded datasets"] == {"what": "decoded datasets", "path": str(cache / "decoded"),
                                           "mib": 3.0, "entries": 1, "unusable": None}
    assert by_what["inductor kernels"]["path"] == str(cache / "inductor")
    assert by_what["inductor kernels"]["mib"] == 0 and "bytecode" in by_what


def test_doctor_in_words(launch):
    result = launch("doctor", timeout=60)
    assert result.returncode == 0
    assert "torch CUDA" in result.stdout and "CUDA_VISIBLE_DEVICES" in result.stdout and "SLURM" in result.stdout
    assert "caches" in result.stdout and "decoded datasets" in result.stdout
