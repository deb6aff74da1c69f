"""A launch writes only into a run dir it claimed, never into a user's files or another launch's run,
and removes only what it created."""

import json
import socket
import subprocess

from tests.conftest import clean_env, launch_command

QUICK = ("gpus=[]", "epochs=1")


def one_launch_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("launch:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and "Warning" not in stderr, stderr
    return lines[0]


def test_a_folder_with_the_users_files_is_refused_and_left_as_it_was(launch, tmp_path):
    mine = tmp_path / "experiment"
    mine.mkdir()
    (mine / "config.yaml").write_text("my notes\n")
    (mine / "metrics.jsonl").write_text('{"mine": 1}\n')
    result = launch(*QUICK, "hydra.run.dir=experiment")
    assert result.returncode == 2, result.output
    line = one_launch_line(result.stderr)
    assert "holds files launch did not write (config.yaml, metrics.jsonl)" in line
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert (mine / "config.yaml").read_text() == "my notes\n"


def test_a_finished_run_is_never_written_over(launch, tmp_path):
    first = launch(*QUICK, "hydra.run.dir=run")
    assert first.returncode == 0, first.output
    before = (tmp_path / "run" / "results.json").read_bytes()
    again = launch(*QUICK, "hydra.run.dir=run", "lr=0.01")
    assert again.returncode == 2
    assert "already holds a run: continue it with resume=" in one_launch_line(again.stderr)
    assert (tmp_path / "run" / "results.json").read_bytes() == before
    claim = json.loads((tmp_path / "run" / ".launch-claim.json").read_text())  # who wrote it, and when
    assert {"pid", "host", "started", "argv"} <= set(claim) and "hydra.run.dir=run" in claim["argv"]


def test_two_launches_started_together_on_one_dir_never_share_it(launch, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # (two forks of the warm launcher: they start within milliseconds)
        both = list(pool.map(lambda _: launch("gpus=[]", "epochs=2", "hydra.run.dir=shared"), range(2)))
    codes = sorted(r.returncode for r in both)
    assert codes == [0, 2], [r.output for r in both]
    refused = next(r for r in both if r.returncode == 2).stderr
    line = one_launch_line(refused)
    assert "being written by another launch" in line or "already holds a run" in line, line
    rows = [json.loads(x) for x in (tmp_path / "shared" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]  # one run's epochs, not two interleaved


def test_torchrun_variables_left_in_the_shell_are_refused_in_one_line(launch, tmp_path):
    """RANK=0 WORLD_SIZE=2 ... without torchrun: joining would wait for a rank 1 nobody starts (it hung
    until killed, leaving a run dir without outcome.json). Refused before any run dir, naming them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stale = clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    refused = launch(*QUICK, env=stale, timeout=120)
    assert refused.returncode == 2, refused.output
    line = one_launch_line(refused.stderr)
    assert "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT" in line and "LAUNCH_JOIN=1" in line, line
    assert not (tmp_path / "outputs").exists()


def test_a_refused_launch_removes_only_what_it_created(launch, tmp_path):
    (tmp_path / "sub").mkdir()
    dry = launch("dry_run=true", "hydra.run.dir=sub")
    assert dry.returncode == 0, dry.output
    assert (tmp_path / "sub").is_dir() and not any((tmp_path / "sub").iterdir())  # the user's empty dir stays
    bad = launch("epochs=-1", "hydra.run.dir=deep/new/dir")
    assert bad.returncode == 2
    assert not (tmp_path / "deep").exists()  # made by the launch: taken back, parents included


def test_a_dry_run_sweep_leaves_no_run_folders(launch, tmp_path):
    """Each run of a sweep says what it would do; none of their folders stays (Hydra makes them)."""
    dry = launch("-m", "dry_run=true", "gpus=[]", "lr=0.01,0.02", "hydra.sweep.dir=sw")
    assert dry.returncode == 0, dry.output
    assert dry.stdout.count("(not created)") == 2, dry.output
    assert not (tmp_path / "sw" / "0").exists() and not (tmp_path / "sw" / "1").exists()


def test_a_refused_launch_into_the_current_folder_keeps_it(tmp_path):
    here = tmp_path / "project"
    here.mkdir()
    proc = subprocess.run(launch_command("epochs=-1", "hydra.run.dir=."), cwd=here, capture_output=True,
                          text=True, env=clean_env(), timeout=120)
    assert proc.returncode == 2
    expected = "launch: epochs=-1 is not valid: must be an integer >= 1 (e.g. launch epochs=10)"
    assert one_launch_line(proc.stderr) == expected
    assert here.is_dir() and not any(here.iterdir())


def test_a_sweep_into_a_folder_with_the_users_files_is_refused_before_hydra_writes(launch, tmp_path):
    mine = tmp_path / "sweeps"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep\n")
    result = launch("-m", *QUICK, "lr=0.01,0.02", "hydra.sweep.dir=sweeps")
    assert result.returncode == 2, result.output
    assert "hydra.sweep.dir=" in one_launch_line(result.stderr)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]  # no multirun.yaml, no run dirs
