"""The trackers' config (log=[...]) and their check before any worker, what rank 0's trackers are fed (metrics.csv,
a local MLflow store, a tracker that fails), figure names, early stopping's decision and the best checkpoints'
bookkeeping, without starting a run."""

import functools
import json
import os
import re
import subprocess
import sys

import pytest

from launcher.config import CheckpointConfig, Config, figure_key
from launcher.errors import LaunchError
from launcher.host import trackers as host_trackers
from launcher.host.compose import typed
from launcher.train.best import BestCheckpoints, kept_folders
from launcher.train.early_stop import EarlyStop
from launcher.train.trackers import CsvTracker, MlflowTracker, RunInfo, Tracker, Trackers
from tests.conftest import launch_command


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from launcher.host.compose import register

    register(list(overrides))
    with initialize_config_module("launcher.conf", version_base=None):
        return typed(hydra_compose("config", overrides=list(overrides)))


@pytest.mark.parametrize(("typed_name", "key"), [
    ("val/mse", "test_mse"), ("test/mse", "test_mse"), ("test_mse", "test_mse"), ("eval/acc", "test_acc"),
    ("test/accuracy", "test_acc"), ("train/loss", "loss"), ("loss", "loss"), ("train/acc", "train_acc"),
    ("img_per_s", "img_per_s"),
])
def test_a_figure_is_named_as_users_type_it(typed_name, key):
    assert figure_key(typed_name) == key


def test_log_picks_several_trackers_and_tensorboard_alone_by_default():
    assert compose().log.chosen == ["tensorboard"]
    cfg = compose("log=[tensorboard,mlflow,csv]", "log.mlflow.tracking_uri=http://127.0.0.1:5000",
                  "log.required=false")
    assert cfg.log.chosen == ["tensorboard", "csv", "mlflow"] and not cfg.log.required
    assert cfg.log.mlflow.tracking_uri == "http://127.0.0.1:5000" and cfg.log.csv.file == "metrics.csv"
    assert compose("log=[]").log.chosen == []
    assert str(compose("log=[wandb]").log.wandb.mode) == "offline"  # nothing leaves the machine unless asked


def test_checkpoint_is_a_section_and_true_false_still_stand_for_it():
    assert compose().checkpoint == CheckpointConfig() and compose().saves
    assert not compose("checkpoint=false").saves
    cfg = compose("checkpoint.keep_best=3", "checkpoint.metric=val/mse", "checkpoint.mode=min")
    assert cfg.checkpoint.keep_best == 3 and cfg.checkpoint.metric == "val/mse" and str(cfg.checkpoint.mode) == "min"
    assert Config(checkpoint=False).checkpoint.enabled is False  # (a config built in code takes a bool too)


@pytest.mark.parametrize(("args", "expected"), [
    (("log=[tensorbord]",), "log: tensorbord is not valid: choose any of csv, mlflow, tensorboard, wandb"),
    (("log.mlflow.tracking_uri=http://x",), "log.mlflow.tracking_uri sets the mlflow tracker, which log does not "
                                            "pick: add it, e.g. launch log=[tensorboard,mlflow]"),
    (("checkpoint=false", "checkpoint.keep_best=2"), "checkpoint.keep_best is not valid beside checkpoint=true/false"),
    (("checkpoint.enabled=false", "checkpoint.keep_best=2"), "checkpoint.keep_best=2 is not valid: keeps the best"),
    (("checkpoint.keep_best=-1",), "checkpoint.keep_best=-1 is not valid"),
    (("early_stop.metric=test_loss", "early_stop.patience=0"), "early_stop.patience=0 is not valid"),
    (("early_stop.mode=down",), "early_stop.mode=down is not valid: choose one of auto, min, max"),
    (("early_stop.metric=val/loss", "eval.every=0"), "eval.every=0 evaluates only after the last epoch"),
    (("log=[mlflow]", "log.mlflow.tracking_uri=127.0.0.1:5000"), "a server's address starts with http://"),
    (("log=[mlflow]", "log.mlflow.tracking_uri=htp://127.0.0.1:5000", "log.required=false"),
     "MLflow has no store for htp://"),
    (("log.required=maybe",), "log.required=maybe is not valid: must be true or false"),
    (("early_stop.patience=5",), "early_stop.metric=null is not valid: names no figure to watch"),
])
def test_bad_keeping_settings_are_one_line_and_exit_2(tmp_path, args, expected):
    proc = subprocess.run(launch_command(*args, "gpus=[]", "dry_run=true"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert expected in lines[0]


def test_a_tracker_that_is_not_installed_stops_the_launch_or_is_left_out(monkeypatch):
    real = host_trackers.importlib.util.find_spec
    monkeypatch.setattr(host_trackers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(LaunchError, match=r"log picks wandb, and the wandb package is not installed here \(pip "
                                          r"install wandb\); or drop it from log=\[...\], or log.required=false"):
        host_trackers.check(compose("log=[tensorboard,wandb]"))
    cfg, warnings = host_trackers.check(compose("log=[tensorboard,wandb]", "log.required=false"))
    assert cfg.log.chosen == ["tensorboard"] and "the run goes on without wandb" in warnings[0]


def test_wandb_online_without_a_login_stops_the_launch_before_any_worker(monkeypatch, tmp_path):
    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_CONFIG_DIR", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(host_trackers.importlib.util, "find_spec", lambda name, *a: object())  # (installed)
    offline, _ = host_trackers.check(compose("log=[wandb]"))  # offline, the default: no login needed
    assert offline.log.chosen == ["wandb"]
    with pytest.raises(LaunchError, match=r"log.wandb.mode=online, and W&B has no login here .*: run wandb login "
                                          r"first, or keep log.wandb.mode=offline"):
        host_trackers.check(compose("log=[wandb]", "log.wandb.mode=online"))
    # each place W&B's client finds a login: ~/.netrc for its host, its settings file, the environment
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert host_trackers.wandb_login() == str(tmp_path / ".netrc")
    (tmp_path / ".netrc").unlink()
    (tmp_path / ".config" / "wandb").mkdir(parents=True)
    (tmp_path / ".config" / "wandb" / "settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert host_trackers.wandb_login() == str(tmp_path / ".config" / "wandb" / "settings")
    (tmp_path / ".config" / "wandb" / "settings").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    online, _ = host_trackers.check(compose("log=[wandb]", "log.wandb.mode=online"))
    assert online.log.chosen == ["wandb"]


def test_an_mlflow_store_that_cannot_be_opened_stops_the_launch_before_any_worker(monkeypatch, tmp_path):
    """A SQLite file in a folder that does not exist or takes no files (MLflow retried for two minutes, its
    warnings on the console, and the run waited), or a database without its driver: one line, exit 2."""
    real = host_trackers.importlib.util.find_spec
    monkeypatch.setattr(host_trackers.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "mlflow" else
                        None if name in ("psycopg2", "psycopg", "pg8000") else real(name, *a))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for uri, said in ((f"sqlite:///{tmp_path}/no/such/folder/x.db", f"the folder {tmp_path}/no/such/folder does "
                                                                     "not exist"),
                      ("sqlite:////proc/x.db", "no file can be made in /proc"),
                      ("postgresql://u@127.0.0.1:1/db", "needs a postgresql driver, and none is installed here")):
        with pytest.raises(LaunchError, match=f"the MLflow store {re.escape(uri)} .*{re.escape(said)}"):
            host_trackers.check(compose("log=[mlflow]", f"log.mlflow.tracking_uri={uri}"))
    fine, _ = host_trackers.check(compose("log=[mlflow]", f"log.mlflow.tracking_uri=sqlite:///{tmp_path}/m.db"))
    assert fine.log.chosen == ["mlflow"] and not list(tmp_path.iterdir())  # (the probe left nothing)


def test_an_mlflow_address_without_http_or_from_the_environment_is_checked_like_one_typed(monkeypatch, tmp_path):
    monkeypatch.setattr(host_trackers.importlib.util, "find_spec", lambda name, *a: object())  # (installed)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(LaunchError, match=r"127.0.0.1:5000 is not valid: a server's address starts with http://"):
        host_trackers.check(compose("log=[mlflow]", "log.mlflow.tracking_uri=127.0.0.1:5000"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/no/such/folder/x.db")
    with pytest.raises(LaunchError, match="the folder .* does not exist"):
        host_trackers.check(compose("log=[mlflow]"))


def test_tensorboard_false_still_turns_tensorboard_off():
    cfg, _ = host_trackers.check(compose("tensorboard=false", "log=[tensorboard,csv]"))
    assert cfg.log.chosen == ["csv"]


# ---- early stopping ---------------------------------------------------------------------------------

def rows(values, key="test_loss", evaluated=None):
    return [{"epoch": i + 1, "loss": 1.0, **({key: v} if evaluated is None or (i + 1) in evaluated else {})}
            for i, v in enumerate(values)]


def judge(history, **settings):
    cfg = compose(*(f"early_stop.{k}={v}" for k, v in settings.items()))
    return EarlyStop.from_config(cfg).judge(history)


def test_early_stop_counts_evaluations_without_improvement():
    history = rows([1.0, 0.5, 0.6, 0.55, 0.7])
    assert judge(history[:3], metric="val/loss", patience=2) is None
    assert judge(history[:4], metric="val/loss", patience=2)["epoch"] == 4
    assert judge(history[:4], metric="val/loss", patience=3) is None
    stop = judge(history, metric="val/loss", patience=3)
    assert stop["epoch"] == 5 and stop["best"] == 0.5 and stop["best_epoch"] == 2 and stop["metric"] == "test_loss"
    # a gain smaller than min_delta is no gain; a higher-is-better figure by name (acc) or by mode
    assert judge(rows([1.0, 0.999, 0.998]), metric="test_loss", patience=2, min_delta=0.01)["best_epoch"] == 1
    assert judge(rows([0.5, 0.6, 0.6, 0.6], "test_acc"), metric="test/acc", patience=2)["best_epoch"] == 2
    assert judge(rows([3.0, 2.0, 1.0], "test_score"), metric="test_score", mode="min", patience=2) is None
    assert judge(rows([float("nan"), float("nan")]), metric="test_loss", patience=2) is not None  # NaN: no gain


def test_early_stop_judges_only_evaluated_epochs_and_names_a_missing_figure():
    history = rows([1.0, 0.9, 0.9, 0.9, 0.9, 0.9], evaluated={2, 4, 6})
    assert judge(history[:5], metric="test_loss", patience=2) is None  # (epoch 5 was not evaluated)
    assert judge(history, metric="test_loss", patience=2)["epoch"] == 6
    from launcher.errors import ConfigError

    with pytest.raises(ConfigError, match=r"early_stop.metric=val/mae is not valid: names no figure of this run's "
                                          r"epochs; they are loss, test_loss"):
        judge(rows([1.0]), metric="val/mae", patience=2)
    with pytest.raises(ConfigError, match=r"\(e.g. launch early_stop.metric=test_loss\)"):  # the nearest figure
        judge(rows([1.0]), metric="val/los", patience=2)


# ---- best checkpoints -------------------------------------------------------------------------------

def test_the_best_k_are_linked_and_what_drops_out_is_removed_after(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    best = BestCheckpoints(folder, 2, "test_loss", minimize=True)
    for epoch, value in enumerate([0.9, 0.5, 0.7, 0.5, 0.3], start=1):
        tmp = folder / "tmp"  # (each epoch's last.pt is renamed over the one before, as save_atomic does)
        tmp.write_text(f"epoch {epoch}")
        os.replace(tmp, folder / "last.pt")
        if best.ranks(epoch, value):
            best.keep(epoch, value, folder / "last.pt", f"epoch-{epoch}.dcp")
    index = json.loads((folder / "best.json").read_text())
    assert [(e["epoch"], e["value"]) for e in index["kept"]] == [(5, 0.3), (2, 0.5)]  # (a tie keeps epoch 2)
    assert sorted(p.name for p in folder.glob("best*")) == ["best-epoch-0002.pt", "best-epoch-0005.pt", "best.json",
                                                            "best.pt"]
    assert (folder / "best.pt").read_text() == "epoch 5" and (folder / "best-epoch-0002.pt").read_text() == "epoch 2"
    assert kept_folders(folder) == {"epoch-5.dcp", "epoch-2.dcp"}
    # a restart in the same run dir goes on with what was kept
    again = BestCheckpoints(folder, 2, "test_loss", minimize=True)
    assert not again.ranks(6, 0.6) and again.ranks(6, 0.4)


class _Died(BaseException):
    """The process ending at this point (not an OSError: best.py copies where a hard link fails)."""


# (minimized; keep 2: a new best, drops of the old best and of others, a tie, and epochs that do not rank)
BEST_RUN = [0.9, 0.5, 0.7, 0.5, 0.3, 0.8, 0.1, 0.2]


def _best_run(folder, monkeypatch, die_at: int | None) -> tuple[int | None, int]:
    """Train BEST_RUN's epochs into `folder` as the loop does (last.pt replaced, then best.keep), the process
    dying at the `die_at`-th change best.py makes to the folder (os.link, os.replace, os.unlink), checked
    there; then a restart that goes on with the epochs after (the one being kept was not trained again).
    Returns (the epoch that died, or None; the changes counted)."""
    calls, died = [0], None
    real = {name: getattr(os, name) for name in ("link", "replace", "unlink")}

    def counted(name):
        def call(*args, **kwargs):
            calls[0] += 1
            if die_at is not None and calls[0] == die_at:
                raise _Died
            return real[name](*args, **kwargs)
        return call

    best = BestCheckpoints(folder, 2, "test_loss", minimize=True)
    for epoch, value in enumerate(BEST_RUN, start=1):
        tmp = folder / "tmp"  # (each epoch's last.pt is renamed over the one before, as save_atomic does)
        tmp.write_text(f"epoch {epoch}")
        real["replace"](tmp, folder / "last.pt")
        if not best.ranks(epoch, value):
            continue
        for name in real:
            monkeypatch.setattr(os, name, counted(name))
        try:
            best.keep(epoch, value, folder / "last.pt", None)
        except _Died:
            died = epoch
            _assert_best_whole(folder)
            best = BestCheckpoints(folder, 2, "test_loss", minimize=True)  # the restart
        finally:
            for name in real:
                monkeypatch.setattr(os, name, real[name])
        _assert_best_whole(folder)
    return died, calls[0]


def _assert_best_whole(folder):
    """Every file best.json names exists, and best.pt is one of them (until the first best.pt is linked, there
    is none: `launch eval RUN best` then says the run kept no best checkpoint, as before its first one)."""
    index = json.loads((folder / "best.json").read_text()) if (folder / "best.json").exists() else {"kept": []}
    named = [folder / e["file"] for e in index["kept"]]
    assert all(p.is_file() for p in named), (index, sorted(p.name for p in folder.iterdir()))
    if (folder / "best.pt").exists():
        assert any(os.path.samefile(folder / "best.pt", p) for p in named), (index, sorted(
            p.name for p in folder.iterdir()))


def test_best_checkpoints_stay_whole_wherever_the_process_dies_and_a_restart_goes_on(tmp_path, monkeypatch):
    """checkpoint.keep_best's files, the process killed at each of best.py's changes to the folder in turn:
    at every such moment every file best.json names exists and best.pt is one of them; the restart's later
    epochs leave the best 2 of the epochs recorded, best.pt the best, and nothing best.json does not name."""
    whole = tmp_path / "whole"
    whole.mkdir()
    _, changes = _best_run(whole, monkeypatch, None)
    assert changes > 10
    for die_at in range(1, changes + 1):
        folder = tmp_path / f"died-{die_at}"
        folder.mkdir()
        died, _ = _best_run(folder, monkeypatch, die_at)
        assert died is not None
        index = json.loads((folder / "best.json").read_text())
        kept = [(e["epoch"], e["value"]) for e in index["kept"]]
        # the best 2 of the epochs recorded: every one but the epoch that died, unless it made it into best.json
        recorded = [(e, v) for e, v in enumerate(BEST_RUN, start=1) if e != died or e in dict(kept)]
        best_two = sorted(recorded, key=lambda ev: (ev[1], ev[0]))[:2]
        assert kept == best_two, (die_at, died, kept)
        assert (folder / "best.pt").read_text() == f"epoch {kept[0][0]}"
        on_disk = sorted(p.name for p in folder.iterdir() if p.name.startswith("best-epoch-"))
        assert on_disk == sorted(e["file"] for e in index["kept"]), (die_at, on_disk)


def test_an_eval_or_export_of_best_without_best_checkpoints_is_one_line(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.pt").write_bytes(b"x")
    for command in (("eval", "run", "best"), ("export", "run", "best")):
        proc = subprocess.run([sys.executable, "-m", "launcher", *command], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
        assert "run kept no best checkpoint (it was trained without checkpoint.keep_best)" in lines[0]


def test_a_misspelled_best_or_last_after_eval_or_export_says_which_was_meant(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.pt").write_bytes(b"x")
    for command, meant in ((("eval", "run", "bset"), "launch eval run best?"),
                           (("export", "run", "bset"), "launch export run best?"),
                           (("export", "run", "lats"), "launch export run last?")):
        proc = subprocess.run([sys.executable, "-m", "launcher", *command], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
        assert f"did you mean {meant}" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no file named bset or lats was written


def test_a_restart_judged_by_another_figure_starts_its_best_afresh(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "last.pt").write_text("epoch 1")
    first = BestCheckpoints(folder, 2, "test_acc", minimize=False)
    first.keep(1, 0.9, folder / "last.pt", None)
    assert BestCheckpoints(folder, 2, "test_acc", minimize=False).kept  # the same figure: kept ones count
    assert BestCheckpoints(folder, 2, "test_loss", minimize=True).kept == []  # another: 0.9 is no loss
    assert BestCheckpoints(folder, 2, "test_acc", minimize=True).kept == []  # the other way


def test_the_run_is_judged_by_test_acc_where_it_has_one_else_its_first_held_out_figure():
    from launcher.train.early_stop import default_figure

    assert default_figure({"loss": 1.0, "test_loss": 0.5, "test_acc": 0.8}) == "test_acc"
    assert default_figure({"loss": 1.0, "test_mse": 0.5, "test_mae": 0.2, "train_s": 3.0}) == "test_mse"
    assert default_figure({"loss": 1.0, "train_acc": 0.5}) is None


# ---- the trackers, fed on rank 0's tracker thread (launcher/train/trackers.py) ------------------------

composed = functools.cache(compose)


class Recording(Tracker):
    """A tracker that notes what it is given; it raises at the epoch `fails_at`."""

    def __init__(self, name: str, fails_at: int | None = None):
        self.name, self.fails_at, self.calls = name, fails_at, []

    def epoch(self, row):
        self.calls.append(("epoch", row["epoch"]))
        if row["epoch"] == self.fails_at:
            raise ConnectionError("the server went away")

    def close(self, ok):
        self.calls.append(("close", ok))


def feeding(tmp_path, *trackers, ok=True, epochs=3):
    fed = Trackers(composed("log=[csv]"), tmp_path, enabled=True)
    fed.trackers = list(trackers)
    fed.start([], restarted=False)
    for n in range(1, epochs + 1):
        fed.epoch({"epoch": n, "loss": 1.0 / n})
    fed.ok = ok
    fed.close()


def test_a_tracker_that_fails_is_said_once_and_left_out_while_the_others_go_on(tmp_path, caplog):
    failing, other = Recording("mlflow", fails_at=1), Recording("csv")
    with caplog.at_level("WARNING", logger="launcher.train"):
        feeding(tmp_path, failing, other)
    assert caplog.text.count("log: mlflow failed") == 1
    assert failing.calls == [("epoch", 1), ("close", False)]  # (closed as failed once, then left alone)
    assert other.calls == [("epoch", 1), ("epoch", 2), ("epoch", 3), ("close", True)]


def test_a_run_that_failed_ends_its_tracker_runs_as_failed(tmp_path):
    failed, fine = Recording("a"), Recording("b")
    feeding(tmp_path, failed, ok=False)
    feeding(tmp_path, fine, ok=True)
    assert failed.calls[-1] == ("close", False) and fine.calls[-1] == ("close", True)


def test_only_rank_0_logs_to_the_trackers(tmp_path):
    cfg = composed("log=[csv,mlflow]")
    assert [t.name for t in Trackers(cfg, tmp_path, enabled=True).trackers] == ["csv", "mlflow"]
    other_rank = Trackers(cfg, tmp_path, enabled=False)
    assert not other_rank.trackers and not other_rank.active
    other_rank.start([{"epoch": 1, "loss": 1.0}], restarted=False)
    other_rank.epoch({"epoch": 2, "loss": 0.5})
    other_rank.close()
    assert not (tmp_path / "metrics.csv").exists()


def test_metrics_csv_holds_a_resumes_earlier_epochs_and_a_column_for_a_figure_that_appears_later(tmp_path):
    import csv

    cfg = composed("log=[csv]")
    table = CsvTracker(cfg.log.csv, tmp_path)
    table.start(RunInfo(tmp_path, cfg, history=[{"epoch": 1, "loss": 2.0}]))  # (a resume brought epoch 1)
    table.epoch({"epoch": 2, "loss": 1.5})
    table.epoch({"epoch": 3, "loss": 1.0, "test_acc": 0.75})  # (evaluated from epoch 3 on)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["epoch"], r["loss"], r["test_acc"]) for r in rows] == [("1", "2.0", ""), ("2", "1.5", ""),
                                                                     ("3", "1.0", "0.75")]


def test_mlflow_gets_each_epoch_at_its_step_a_resumes_epochs_and_one_parent_for_a_sweeps_runs(tmp_path, monkeypatch):
    """MLflow's own local store (a folder): what the tracker sent, read back through MLflow's client."""
    pytest.importorskip("mlflow")
    import dataclasses

    from mlflow.tracking import MlflowClient

    from launcher.files import SWEEP_MARK

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "mlruns").as_uri()
    cfg = composed("log=[mlflow]")
    section = dataclasses.replace(cfg.log.mlflow, tracking_uri=store)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / SWEEP_MARK).write_text("")
    ids = []
    for name in ("0", "1"):  # a sweep's two runs, each resumed after its second epoch
        run_dir = sweep / name
        run_dir.mkdir()
        tracker = MlflowTracker(section, run_dir)
        tracker.start(RunInfo(run_dir, cfg, history=[{"epoch": 1, "loss": 2.0}, {"epoch": 2, "loss": 1.5}]))
        tracker.epoch({"epoch": 3, "loss": 1.0, "started_unix": 1.7e9})
        tracker.close(True)
        ids.append(tracker.run_id)
    client = MlflowClient(tracking_uri=store)
    for run_id in ids:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
        assert history == [(1, 2.0), (2, 1.5), (3, 1.0)]
        assert client.get_metric_history(run_id, "started_unix") == []  # (a clock time, not a figure)
    parents = {client.get_run(i).data.tags["mlflow.parentRunId"] for i in ids}
    assert len(parents) == 1 and client.get_run(parents.pop()).info.run_name == "sweep"
