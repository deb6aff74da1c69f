"""`launch runs`: the recent runs here, newest first, with their state, as a table or JSON."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

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
    wide = {k: v for k, v in clean_env().items() if k != "COLUMNS"}  # (not a terminal: every column, whatever width)
    shown = subprocess.run([sys.executable, "-m", "launcher", "runs"], cwd=tmp_path, capture_output=True, text=True,
                           env=wide, timeout=60)
    lines = shown.stdout.splitlines()
    assert lines[0].split()[:3] == ["started", "recipe", "strategy"] and len(lines) == 6
    assert lines[-1].startswith(f"resume=latest and launch eval latest: {finished.run_dir()} (its checkpoint")
    assert "is the newest under outputs/; sweep runs are named by their dir)" in lines[-1]  # (not multirun/'s)
    assert "running" in lines[2] and "c-running" in lines[2]


def test_a_run_stopped_by_a_signal_reads_stopped_and_a_script_that_ended_well_finished(launch, tmp_path):
    """outcome.json: how each launch ended, which `launch runs` shows (before, both read `failed`)."""
    import signal
    import time

    from tests.conftest import launch_command

    proc = subprocess.Popen(launch_command("gpus=[]", "epochs=300", "hydra.run.dir=outputs/x/stopped"), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env())
    metrics = tmp_path / "outputs" / "x" / "stopped" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    (tmp_path / "hi.py").write_text("print('hello')\n")
    ran = launch("script=hi.py", "gpus=[]", "hydra.run.dir=outputs/y/script")
    assert ran.returncode == 0, ran.output
    listed = subprocess.run([sys.executable, "-m", "launcher", "runs", "--json"], cwd=tmp_path, capture_output=True,
                            text=True, env=clean_env(), timeout=60)
    runs = {Path(r["dir"]).name: r for r in json.loads(listed.stdout)}
    assert runs["stopped"]["state"] == "stopped (SIGTERM)" and runs["stopped"]["exit_code"] == 143
    assert "stopped by SIGTERM" in runs["stopped"]["error"]
    assert runs["script"]["state"] == "finished" and runs["script"]["epochs"] is None


def test_runs_with_a_wrong_argument_is_one_line(launch):
    result = launch("runs", "--everything", timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("launch: runs does not take '--everything'")


def test_runs_shows_damaged_runs_as_unreadable_escapes_names_and_fits_the_terminal(tmp_path):
    """One bad run never stops the listing: a metrics line that is not an object, metrics.jsonl a folder,
    results.json a FIFO (reading it would block forever), a hand-edited plan with wrong types; a name
    holding a terminal escape sequence is printed escaped; rows fit COLUMNS."""
    dead = subprocess.Popen(["true"])
    dead.wait()

    def run(name: str) -> Path:
        return _fake_run(tmp_path, name, dead.pid, "2026-11-01 09:00:00", {})

    (run("a-lines") / "metrics.jsonl").write_text('[1, 2]\n"text"\n{"epoch": 1, "test_acc": 0.25}\n')
    folder = run("b-folder")
    (folder / "metrics.jsonl").unlink()
    (folder / "metrics.jsonl").mkdir()
    os.mkfifo(run("c-fifo") / "results.json")
    (run("d-plan") / "plan.json").write_text(json.dumps({"strategy": ["x"], "gpu_ids": 5, "nprocs": "two"}))
    run("e-\x1b[31mred")
    env = {**clean_env(), "COLUMNS": "60"}
    proc = subprocess.run([sys.executable, "-m", "launcher", "runs", "--all"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 6 and all(len(line) <= 60 for line in lines), proc.stdout
    assert "\x1b" not in proc.stdout and "\\x1b[31mred" in proc.stdout
    assert "25.00%" in proc.stdout  # the one good metrics line of a-lines
    listed = json.loads(subprocess.run([sys.executable, "-m", "launcher", "runs", "--all", "--json"], cwd=tmp_path,
                                       capture_output=True, text=True, timeout=60, env=env).stdout)
    assert {Path(r["dir"]).name[:1] for r in listed} == {"a", "b", "c", "d", "e"}
    assert next(r for r in listed if Path(r["dir"]).name == "d-plan")["state"] == "unreadable"


def test_each_runs_state_best_figure_and_order_read_from_its_files_in_process(tmp_path, capsys):
    """runs.main, in this process: newest first, a sweep's own dir (Hydra's basic sweeper's, Optuna's) not
    listed, the best epoch's accuracy, a launch that ended well without results (a script) finished, --limit."""
    from launcher.host import rundir, runs

    dead = subprocess.Popen(["true"])
    dead.wait()
    best = _fake_run(tmp_path, "a-best", dead.pid, "2026-11-01 10:00:00",
                     {"outcome.json": json.dumps({"exit_code": 1, "error": "boom"})})
    (best / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e, "test_acc": a}) + "\n"
                                                for e, a in ((1, 0.5), (2, 0.75), (3, 0.625))))
    _fake_run(tmp_path, "b-script", dead.pid, "2026-11-01 11:00:00", {"outcome.json": json.dumps({"exit_code": 0})})
    sweep = tmp_path / "multirun" / "2026-11-01" / "12-00-00"
    sweep.mkdir(parents=True)
    claim = {"pid": dead.pid, "host": "x", "started": "2026-11-01 12:00:00"}
    (sweep / ".launch-claim.json").write_text(json.dumps(claim))
    (sweep / "multirun.yaml").write_text("{}\n")
    # an Optuna sweep's own dir holds no multirun.yaml: launch's claim there says it is a sweep's
    optuna = tmp_path / "multirun" / "2026-11-01" / "12-30-00"
    rundir.claim(optuna, "hydra.sweep.dir")  # (as RunDirClaim.on_multirun_start claims it)
    rundir._claims.pop(optuna.absolute())
    (optuna / "optimization_results.yaml").write_text("name: optuna\n")
    assert runs.main(["--json"], root=tmp_path) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [Path(r["dir"]).name for r in listed] == ["b-script", "a-best"]  # newest first; the sweep's dir is none
    assert [r["state"] for r in listed] == ["finished", "failed"]
    assert listed[1]["best_test_acc"] == 0.75 and listed[1]["epochs"] == "3/4"
    assert runs.main(["--json", "--limit", "1"], root=tmp_path) == 0
    assert [Path(r["dir"]).name for r in json.loads(capsys.readouterr().out)] == ["b-script"]


def test_a_language_model_is_judged_by_its_held_out_loss_in_the_runs_table_and_its_kept_checkpoints(launch, tmp_path,
                                                                                                     capsys):
    """recipe=text's sweep.objective is test_loss (a language model's figure, not next-token accuracy): `launch
    runs` shows its best held-out loss where results.json has an accuracy too, and checkpoint.keep_best ranks by
    it where no metric is named (the saving code reads the same objective)."""
    from launcher.host import runs
    from tests.conftest import config_of

    assert config_of("recipe=text").sweep.objective == "test_loss"
    assert config_of("recipe=digits").sweep.objective == "test_acc"
    dead = subprocess.Popen(["true"])
    dead.wait()
    results = {"recipe": "text", "test_acc": 0.49, "best_test_acc": 0.49, "objective": "test_loss",
               "best_test_loss": 2.0290}
    _fake_run(tmp_path, "lm", dead.pid, "2026-11-01 10:00:00", {"results.json": json.dumps(results)})
    assert runs.main(["--limit", "1"], root=tmp_path) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.rstrip().endswith("lm")]
    assert "test_loss 2.029" in row and "49.00%" not in row
    # its `launch eval` is judged so too (eval.json names no objective: the run's config does)
    evaluated = _fake_run(tmp_path, "lm-eval", dead.pid, "2026-11-01 11:00:00",
                          {"eval.json": json.dumps({"recipe": "text", "test_acc": 0.48, "test_loss": 2.0415})})
    (evaluated / "config.yaml").write_text("recipe:\n  name: text\n  model: gpt\nepochs: 2\nsweep:\n  objective: "
                                           "test_loss\n")
    assert runs.main(["--limit", "1"], root=tmp_path) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.rstrip().endswith("lm-eval")]
    assert "test_loss 2.042" in row and "48.00%" not in row and "text (eval)" in row
    # and one stopped before its results (Ctrl-C): its logged epochs' best held-out loss, not their accuracy
    stopped = _fake_run(tmp_path, "lm-stopped", dead.pid, "2026-11-01 12:00:00",
                        {"outcome.json": json.dumps({"exit_code": 130, "stopped_by": "SIGINT"})})
    (stopped / "config.yaml").write_text((evaluated / "config.yaml").read_text())
    (stopped / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e, "test_acc": a, "test_loss": v,
                                                               "test_bpb": v / math.log(2)}) + "\n"
                                                   for e, a, v in ((1, 0.3, 2.9), (2, 0.34, 2.561), (3, 0.33, 2.7))))
    assert runs.main(["--limit", "1"], root=tmp_path) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.rstrip().endswith("lm-stopped")]
    assert "test_loss 2.561" in row and "34.00%" not in row and "stopped (SIGINT)" in row
    assert "test_loss 2.561 (3.695 bpb)" in row, row  # (bytes: the loss in nats, and in bits as its epochs said it)
    # on token shards the epochs said perplexity
    (stopped / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "test_loss": 2.0, "test_ppl": math.exp(2.0)}) + "\n")
    assert runs.main(["--limit", "1"], root=tmp_path) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.rstrip().endswith("lm-stopped")]
    assert "test_loss 2 (ppl 7.389)" in row, row
    # a diverged run's huge loss is listed, not an OverflowError that takes the listing down
    (stopped / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "test_loss": 1000.0, "test_ppl": 1e300}) + "\n")
    assert runs.main(["--limit", "1"], root=tmp_path) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.rstrip().endswith("lm-stopped")]
    assert "test_loss 1000 (ppl 1.014e+304)" in row, row
    (tmp_path / "kept").mkdir()
    kept = launch("recipe=text", "gpus=[]", "recipe.layers=1", "recipe.width=32", "recipe.heads=2", "recipe.context=32",
                  "recipe.max_bytes=20000", "recipe.sample_bytes=0", "batch_size=32", "epochs=2",
                  "checkpoint.keep_best=1", cwd=tmp_path / "kept")
    assert kept.returncode == 0, kept.output
    assert kept.results()["best_checkpoint"]["metric"] == "test_loss", kept.results()["best_checkpoint"]



def test_a_sweeps_runs_show_what_each_was_given_that_the_others_were_not(tmp_path, capsys):
    """Two runs of one sweep read alike (same recipe, devices, epochs) but for their figures: each row names
    its swept values (`lr=0.2 batch_size=64`), not the keys every run had alike; a run of no sweep has none."""
    from launcher.host import runs

    dead = subprocess.Popen(["true"])
    dead.wait()
    sweep = tmp_path / "multirun" / "2026-11-01" / "12-00-00"
    for job, (lr, batch) in enumerate((("0.05", "64"), ("0.2", "64"), ("0.2", "128"))):
        run = sweep / str(job)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(f"- recipe=digits\n- lr={lr}\n- batch_size={batch}\n")
        (run / "plan.json").write_text(json.dumps({"strategy": "single", "nprocs": 1}))
        (run / ".launch-claim.json").write_text(json.dumps({"pid": dead.pid, "host": "x",
                                                            "started": f"2026-11-01 12:00:0{job}"}))
    (sweep / "multirun.yaml").write_text("{}\n")
    _fake_run(tmp_path, "alone", dead.pid, "2026-11-01 09:00:00", {})
    assert runs.main(["--json"], root=tmp_path) == 0
    listed = {Path(r["dir"]).name: r.get("swept") for r in json.loads(capsys.readouterr().out)}
    assert listed == {"0": {"lr": "0.05", "batch_size": "64"}, "1": {"lr": "0.2", "batch_size": "64"},
                      "2": {"lr": "0.2", "batch_size": "128"}, "alone": None}
    os.environ["COLUMNS"] = "200"
    try:
        assert runs.main([], root=tmp_path) == 0
    finally:
        del os.environ["COLUMNS"]
    table = capsys.readouterr().out.splitlines()
    assert "swept" in table[0] and "lr=0.2 batch_size=128" in table[1] and "recipe=digits" not in "".join(table)


def test_each_command_answers_help_with_its_usage_and_exit_0(launch):
    """`launch runs --help` (and export's, eval's) said "runs does not take '--help'" and exited 2."""
    for command, words in (("runs", "--limit N"), ("export", "OUT.safetensors"), ("eval", "RUN_DIR_OR_CHECKPOINT")):
        result = launch(command, "--help", timeout=60)
        assert result.returncode == 0 and result.stdout.startswith(f"usage: launch {command} "), result.output
        assert words in result.stdout and "docs/runs.md#" in result.stdout and result.stderr == ""
