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


_COMPOSES = """
import sys

from hydra._internal.config_loader_impl import ConfigLoaderImpl

composed = []
load = ConfigLoaderImpl.load_configuration
ConfigLoaderImpl.load_configuration = lambda self, *a, **k: composed.append(1) or load(self, *a, **k)
sys.argv = ["launch", *sys.argv[1:]]
from launcher.host.cli import main

try:
    main()
finally:
    print("composed", len(composed), file=sys.stderr)
"""


def test_a_launch_composes_its_config_once_unless_a_config_of_the_users_may_set_hydra_mode(tmp_path):
    """Hydra composed every command's config twice, the first time only to read hydra.mode, which none of
    launch's configs set (~0.2 CPU-s of a launch); a config from the user's own search path still may."""
    import subprocess
    import sys

    def composes(*overrides: str) -> int:
        proc = subprocess.run([sys.executable, "-c", _COMPOSES, "gpus=[]", "dry_run=true", *overrides],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, env=clean_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stderr.split("composed ")[-1])

    assert composes() == 1
    assert composes("recipe=cifar10", "strategy=ddp", "nprocs=2") == 1
    assert composes(f"hydra.searchpath=[file://{tmp_path}]") == 2


def test_a_users_config_that_sets_hydra_mode_still_makes_a_sweep(launch, tmp_path):
    """lightning-hydra-template's hparams_search configs set `hydra.mode: MULTIRUN`: selected from the user's
    search path, `launch` sweeps without -m."""
    (tmp_path / "mine" / "experiment").mkdir(parents=True)
    (tmp_path / "mine" / "experiment" / "sweep.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      seed: 1,2\n")
    result = launch("gpus=[]", "dry_run=true", f"hydra.searchpath=[file://{tmp_path / 'mine'}]", "+experiment=sweep",
                    timeout=60)
    assert result.returncode == 0, result.output
    assert result.stdout.count("dry run: nothing started.") == 2 and "/multirun/" in result.stdout, result.stdout


def test_none_of_launchs_configs_sets_hydra_mode():
    """What lets a launch compose once (launcher.host.compose.one_compose_per_run): no YAML launch ships
    sets hydra.mode, at the top of the primary config or from a group option's global package."""
    from pathlib import Path

    import yaml

    import launcher

    conf = Path(launcher.__file__).parent / "conf"
    if not conf.is_dir():  # (an editable install: conf/ at the top of the repository)
        conf = Path(launcher.__file__).parents[1] / "conf"
    files = sorted(conf.rglob("*.yaml"))
    assert len(files) > 10
    for path in files:
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        group = path.parent.relative_to(conf).as_posix()
        package = next((line.split()[2] for line in text.splitlines() if line.startswith("# @package ")),
                       "_global_" if group == "." else group.replace("/", "."))
        if package == "_global_":
            assert "mode" not in (data.get("hydra") or {}), path
        else:
            assert not package.startswith("hydra") or "mode" not in data, path
