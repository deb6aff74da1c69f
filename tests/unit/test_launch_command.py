"""The `launch` command's own parts, in this process (no worker starts): its exit code over several runs,
what reaches a user's script, which backend runs a config, and `launch doctor`'s figures."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from launcher.errors import LaunchError
from launcher.host.outcome import LaunchContext
from tests.conftest import composed, config_of


def test_the_exit_code_is_the_worst_of_the_commands_runs():
    from launcher.host.cli import Invocation

    runs = Invocation(started=0.0)
    assert runs.exit_code() == 0
    for code in (1, 130, 0):
        runs.record(code)
    assert runs.exit_code() == 130  # (a sweep whose last run went well still failed)


def test_words_after_the_double_dash_reach_the_script_exactly_as_typed():
    from launcher.host.cli import _script_args_as_override
    from launcher.host.compose import typed

    words = ["--name", "${oc.env:HOME}", "it's", "a,b", "C:\\dir\\"]
    argv = _script_args_as_override(["script=train.py", "gpus=[]", "--", *words])
    assert typed(composed(*argv)).script_args == words


def test_backend_slurm_under_another_hydra_launcher_is_refused():
    from launcher.host.cli import _refuse_impossible_sweeps

    with pytest.raises(LaunchError, match="backend=slurm is not valid with hydra/launcher=joblib"):
        _refuse_impossible_sweeps(["-m", "hydra/launcher=joblib", "backend=slurm", "lr=0.1,0.2"])
    _refuse_impossible_sweeps(["-m", "hydra/launcher=joblib", "lr=0.1,0.2"])  # backend=local there: fine


def test_bad_input_a_backend_finds_is_exit_2_with_its_line(tmp_path):
    from launcher.host.launch import launch

    outcome = launch(config_of("backend=slurm", "gpus=[]", "script=no_such_script.py"), tmp_path,
                     LaunchContext(started=0.0))
    assert outcome.exit_code == 2 and outcome.error.startswith("script=no_such_script.py is not valid: no such file")


def test_each_backend_option_runs_its_own_way(tmp_path, capsys):
    from launcher.host.launch import launch

    assert launch(config_of("backend=slurm", "gpus=[]", "dry_run=true"), tmp_path / "a",
                  LaunchContext(started=0.0)).exit_code == 0
    assert "dry run: nothing submitted. The batch script" in capsys.readouterr().out
    assert launch(config_of("gpus=[]", "dry_run=true"), tmp_path / "b", LaunchContext(started=0.0)).exit_code == 0
    assert "dry run: nothing started." in capsys.readouterr().out


def test_a_local_sweep_checks_each_runs_script_or_recipe_before_any_run_starts():
    from launcher.host.backends.local import LocalBackend

    cfg = config_of("gpus=[]", "script=no_such_script.py")
    with pytest.raises(LaunchError, match="script=no_such_script.py is not valid"):
        LocalBackend(cfg.backend).check(cfg)


def test_a_local_sweep_runs_as_many_at_once_as_sweep_parallel_says(tmp_path, monkeypatch):
    from launcher.host.backends import local
    from launcher.host.sweep import SweepContext, SweepJob

    asked = []

    class Recorder:
        def __init__(self, hydra_context, task_function, parallel):
            asked.append(parallel)

        def run(self, jobs):
            pass

    monkeypatch.setattr(local, "SideBySide", Recorder)
    cfg = config_of("gpus=[]", "sweep.parallel=3")
    local.LocalBackend(cfg.backend).sweep([SweepJob(0, [], None, cfg, tmp_path)], SweepContext(None, None, tmp_path))
    assert asked == [3]


# ---- script=: what a user's script is given, and how its end is said ---------------------------------

def test_a_scripts_args_become_its_flags():
    from launcher.host.script import script_argv

    cfg = config_of("script=train.py", "gpus=[]", "+args.lr=0.1", "+args.verbose=true", "+args.quiet=false",
                    "+args.sizes=[1,2]", "script_args=[--seed,3]")
    assert script_argv(cfg) == ["--lr", "0.1", "--verbose", "--sizes", "1,2", "--seed", "3"]


def test_a_script_run_in_place_that_exits_with_a_message_fails(tmp_path):
    from launcher.host.script import run_in_this_process

    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit('no data')\n")
    outcome = run_in_this_process(script, [], {}, rank=1)
    assert outcome.exit_code == 1 and outcome.error == "rank 1: train.py exited with code 1"
    script.write_text("import sys\nsys.exit(0)\n")
    assert run_in_this_process(script, [], {}, rank=1).exit_code == 0


def test_a_script_rank_killed_by_a_signal_fails_the_launch_and_says_so(tmp_path):
    from launcher.host.script import _describe

    def failed(exitcode):
        failure = types.SimpleNamespace(exitcode=exitcode, message={"message": "Signal 9 (SIGKILL) received by PID 7"})
        return types.SimpleNamespace(get_first_failure=lambda: (1, failure))

    killed = _describe(failed(-9), Path("train.py"), tmp_path)
    assert killed.exit_code == 1 and "rank 1 of train.py was killed by signal 9" in killed.error
    assert _describe(failed(3), Path("train.py"), tmp_path).exit_code == 3


# ---- launch doctor -----------------------------------------------------------------------------------

def test_doctor_reports_each_caches_size_in_mib(tmp_path, monkeypatch):
    from launcher.host import doctor

    monkeypatch.setenv("LAUNCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LAUNCH_PYCACHE_DIR", str(tmp_path / "pycache"))
    (tmp_path / "decoded" / "digits-1").mkdir(parents=True)
    (tmp_path / "decoded" / "digits-1" / "x.npy").write_bytes(b"\0" * (3 * 2**20))
    (tmp_path / "decoded" / "cifar-2").mkdir()
    monkeypatch.setenv("LAUNCH_DATA_ROOT", str(tmp_path / "data"))
    (tmp_path / "data" / "text" / "corpus.txt-0123").mkdir(parents=True)  # (recipe=text's byte copy of a corpus)
    (tmp_path / "data" / "text" / "corpus.txt-0123" / "train.bin").write_bytes(b"\0" * 2**20)
    found = {c["what"]: c for c in doctor.caches()}
    assert (found["decoded datasets"]["mib"], found["decoded datasets"]["entries"]) == (3.0, 2)
    text = found["text corpora"]
    assert (text["path"], text["mib"], text["entries"]) == (str(tmp_path / "data" / "text"), 1.0, 1)
    monkeypatch.delenv("LAUNCH_DATA_ROOT")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # (the config's default, ~ as that user's home)
    assert {c["what"]: c for c in doctor.caches()}["text corpora"][
        "path"] == str(tmp_path / "home" / ".cache" / "launcher" / "data" / "text")


def test_doctor_lists_each_gpus_free_and_total_memory_from_nvml(monkeypatch):
    from launcher.host import doctor

    class Err(Exception):
        pass

    fake = types.SimpleNamespace(
        NVMLError=Err, nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetUUID=lambda h: "GPU-a", nvmlDeviceGetName=lambda h: "H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(free=10 * 2**30, total=140 * 2**30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=7),
        nvmlSystemGetDriverVersion=lambda: "580.0")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    devices, driver = doctor._nvml_devices()
    assert driver == "driver 580.0"
    assert devices == [{"physical_index": 0, "name": "H200", "total_mib": 140 * 1024, "free_mib": 10 * 1024,
                        "utilization_pct": 7}]


def test_every_unit_named_heaviest_first_exists():
    """tests/conftest.py hands the xdist units out in HEAVY_FIRST's order: a renamed or removed file would
    silently drop to the end of the queue and could put the suite's tail back on one core."""
    from tests.conftest import HEAVY_FIRST, REPO, xdist_group_of

    assert [unit for unit in HEAVY_FIRST if unit != "waiting" and not (REPO / unit).exists()] == []
    files = [unit for unit in HEAVY_FIRST if unit.endswith(".py")]
    assert [xdist_group_of(f"{unit}::test_x") for unit in files] == files
    assert xdist_group_of("tests/unit/test_config.py::test_x") == "tests/unit"
    assert {xdist_group_of(f"tests/{d}/test_x.py::test_x") for d in ("slurm", "multinode")} == {"waiting"}


_CTRL_C_AS_A_FOREIGN_PROCESS_STARTS_A_RUN = """
import os, signal, sys, traceback, types

import hydra.core.hydra_config
import launcher.host.resume
from launcher.host.cli import Invocation
from tests.conftest import composed

cfg = composed("gpus=[]", "dry_run=true")
hydra.core.hydra_config.HydraConfig.get = staticmethod(lambda: types.SimpleNamespace(
    runtime=types.SimpleNamespace(output_dir=sys.argv[1]), overrides=types.SimpleNamespace(task=[])))


def carry_settings(config, overrides):  # the run's first step: a terminal's Ctrl-C lands here
    os.kill(os.getpid(), signal.SIGINT)
    return config


launcher.host.resume.carry_settings = carry_settings
run = Invocation(started=0.0)
run.pid = -1  # (the process that composed: another one, as under joblib)
try:
    run.run_job(cfg)
except KeyboardInterrupt as ctrl_c:
    print("raised in", traceback.extract_tb(ctrl_c.__traceback__)[-1].name, "torch imported:", "torch" in sys.modules)
"""


def test_a_run_in_another_hydra_launchers_process_holds_ctrl_c_until_torch_is_imported(tmp_path):
    """CI's timed joblib test saw a loky worker print "Exception ignored in: ... _get_module_lock ...
    KeyboardInterrupt": launch held Ctrl-C in its own process only, and a run in joblib's worker took it
    inside its imports (torch's takes seconds; a KeyboardInterrupt inside torch's import of numpy is
    swallowed, leaving a torch without numpy). Such a run holds it too, and raises it once torch is in."""
    import subprocess

    from tests.conftest import clean_env

    proc = subprocess.run([sys.executable, "-c", _CTRL_C_AS_A_FOREIGN_PROCESS_STARTS_A_RUN, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, env=clean_env(),
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.strip() == "raised in let_through torch imported: True", proc.stdout + proc.stderr[-3000:]
