"""`launch runs`: the recent runs here, newest first, with their state, as a table or JSON."""

import json
import os
import subprocess
import sys

from tests.conftest import clean_env


def _fake_run(root, name, claim_pid, started, files):
    run = root / "outputs" / "2026-11-01" / name
    (run / "failures").mkdir(parents=True)
    (run / ".launch-claim.json").write_text(json.dumps({"pid": claim_pid, "host": os.uname().nodename,
                                                        "started": started, "argv": []}))
    (run / "config.yaml").write_text("recipe:\n  name: digits\n  model: cnn\nepochs: 4\n")
    (run / "plan.json").write_text(json.dumps({"strategy": "ddp", "gpu_ids": [0, 1], "nprocs": 2}))
    (run / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "test_acc": 0.5}) + "\n")
    for rel, text in files.items():
        (run / rel).write_text(text)
    return run


def test_runs_lists_every_state_newest_first(launch, tmp_path):
    finished = launch("gpus=[]", "epochs=1")
    assert finished.returncode == 0, finished.output
    dead = subprocess.Popen(["true"])
    dead.wait()
    _fake_run(tmp_path, "a-failed", dead.pid, "2026-11-01 10:00:00", {"failures/attempt0-rank1.json": "{}"})
    _fake_run(tmp_path, "b-preempted", dead.pid, "2026-11-01 11:00:00", {"preempted": "0"})
    _fake_run(tmp_path, "c-running", os.getpid(), "2026-11-01 12:00:00", {})
    listed = subprocess.run([sys.executable, "-m", "launcher", "runs", "--json"], cwd=tmp_path, capture_output=True,
                            text=True, env=clean_env(), timeout=60)
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout)
    assert [r["state"] for r in runs] == ["finished", "running", "preempted", "failed"]  # newest first
    assert runs[0]["recipe"] == "digits" and runs[0]["epochs"] == "1/1" and runs[0]["best_test_acc"] > 0.3
    assert runs[1]["devices"] == "GPU 0,1" and runs[1]["epochs"] == "1/4" and runs[1]["strategy"] == "ddp"
    assert runs[3]["failed_ranks"] == ["attempt0-rank1.json"]
    shown = subprocess.run([sys.executable, "-m", "launcher", "runs"], cwd=tmp_path, capture_output=True, text=True,
                           env=clean_env(), timeout=60)
    lines = shown.stdout.splitlines()
    assert lines[0].split()[:3] == ["started", "recipe", "strategy"] and len(lines) == 5
    assert "running" in lines[2] and "c-running" in lines[2]


def test_runs_with_a_wrong_argument_is_one_line(launch):
    result = launch("runs", "--everything", timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("launch: runs does not take '--everything'")
