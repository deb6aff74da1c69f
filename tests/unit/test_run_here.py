"""One launch on this host (launcher/host/run_here.py), in this process with nothing started: which run dirs it
refuses, its last line, how it records its end, a node's limits on the rendezvous."""

from __future__ import annotations

import json
import logging

from launcher.host import run_here
from launcher.host.outcome import LaunchContext, Outcome
from launcher.spec import RequeuePolicy
from tests.conftest import config_of

DRY = ("gpus=[]", "dry_run=true")


def test_a_run_dir_holding_a_finished_or_stopped_run_is_never_run_into(tmp_path):
    finished, stopped = tmp_path / "finished", tmp_path / "stopped"
    (finished / "results.json").parent.mkdir()
    (finished / "results.json").write_text("{}")
    (stopped / "checkpoints").mkdir(parents=True)
    (stopped / "checkpoints" / "last.pt").write_bytes(b"x")  # (Ctrl-C'd: a checkpoint, no results)
    for run_dir in (finished, stopped):
        outcome = run_here.run_here(config_of(*DRY), run_dir, LaunchContext(started=0.0))
        assert outcome.exit_code == 2 and "already holds a run: continue it with resume=" in outcome.error


def test_a_slurm_jobs_first_run_is_refused_a_finished_dir_and_only_its_requeued_run_continues_it(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    first = LaunchContext(started=0.0, requeue=RequeuePolicy("77", restart_count=0, max_requeues=3))
    assert run_here.run_here(config_of(*DRY), tmp_path, first).exit_code == 2
    again = LaunchContext(started=0.0, requeue=RequeuePolicy("77", restart_count=1, max_requeues=3))
    assert run_here.run_here(config_of(*DRY), tmp_path, again).exit_code == 0


def test_the_last_line_gives_accuracy_in_percent_and_a_recipes_own_objective_first(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="launcher"):
        run_here.summarize({"test_acc": 0.9123, "final": {"loss": 0.3}}, tmp_path, 1.0)
        run_here.summarize({"objective": "test_rmse", "final": {"test_mae": 0.5, "test_rmse": 0.25}}, tmp_path, 1.0)
        (tmp_path / "checkpoints").mkdir()
        run_here.summarize({"test_acc": 0.5}, tmp_path, 1.0)
    first, second, saved = [r.getMessage() for r in caplog.records]
    assert "test accuracy 91.23%" in first
    assert "done in 1.0s: test_rmse 0.25, test_mae 0.5." in second
    # (a run without checkpoints, checkpoint=false, names no checkpoints folder: there is none)
    assert "checkpoints:" not in first and f"checkpoints: {tmp_path / 'checkpoints'}  log:" in saved, (first, saved)


def test_a_language_model_not_past_its_unigram_baseline_is_said_so_in_the_last_line(tmp_path, caplog):
    """A short run can end worse than predicting the training tokens' frequencies: the line said the two
    figures and left the comparison to the user (a new user's trial)."""
    with caplog.at_level(logging.INFO, logger="launcher"):
        run_here.summarize({"final": {"test_bpb": 5.17, "test_loss": 3.58}, "unigram_test_bpb": 4.726}, tmp_path, 1.0)
        run_here.summarize({"final": {"test_bpb": 3.87}, "unigram_test_bpb": 4.631}, tmp_path, 1.0)
        run_here.summarize({"final": {"test_ppl": 30.0, "test_loss": 3.4}, "unigram_test_ppl": 24.5}, tmp_path, 1.0)
        # (a token run stopped early where its last epoch was not evaluated: no figure to compare)
        run_here.summarize({"final": {"loss": 3.1}, "unigram_test_ppl": 900.0}, tmp_path, 1.0)
    short, past, tokens, unevaluated = [r.getMessage() for r in caplog.records]
    assert "training loss 3.1 (no evaluation)" in unevaluated, unevaluated
    assert "held-out 5.170 bits/byte (unigram baseline 4.726 - not past it yet: more epochs, data or a higher lr)" \
        in short, short
    assert "held-out 3.870 bits/byte (unigram baseline 4.631)." in past, past
    assert "perplexity 30.0 (unigram baseline 24.5 - not past it yet" in tokens, tokens


def test_a_launch_stopped_by_a_signal_is_recorded_so_and_runs_lists_it_stopped(tmp_path):
    from launcher.host.runs import describe

    run_here._record_outcome(tmp_path, Outcome(130, error="stopped by SIGINT"))
    assert json.loads((tmp_path / "outcome.json").read_text())["stopped_by"] == "SIGINT"
    assert describe(tmp_path)["state"] == "stopped (SIGINT)"


def test_a_node_gives_up_on_a_silent_rendezvous_within_30_s_and_no_sooner_than_10(tmp_path):
    import socket

    from launcher.host.plan import make_plan

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = ("gpus=[]", "strategy=ddp", "nprocs=2", "nodes=2", "node_rank=0", f"rdzv=127.0.0.1:{port}")
    assert run_here.nodes_of(make_plan(config_of(*node))).store_read_s == 30  # (strategy.timeout_s=600)
    assert run_here.nodes_of(make_plan(config_of(*node, "strategy.timeout_s=5"))).store_read_s == 10
    assert run_here.nodes_of(make_plan(config_of(*node, "strategy.timeout_s=20"))).store_read_s == 20


STOPPED_WHILE_STARTING = """
import json, os, signal, sys, time
import torch.distributed.launcher.api as elastic
from launcher.host import run_here
from launcher.host.outcome import LaunchContext
from tests.conftest import config_of

def signalled(*args, **kwargs):  # before the agent started the workers, and installed its own handlers
    os.kill(os.getpid(), signal.SIGHUP)  # ignored, as under nohup: changes nothing
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(20)

write_run_files = run_here._write_run_files
def signalled_while_writing(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    write_run_files(*args)

signal.signal(signal.SIGHUP, signal.SIG_IGN)
elastic.elastic_launch = lambda config, entry: signalled
for where in ("agent", "files"):
    if where == "files":
        run_here._write_run_files = signalled_while_writing
    outcome = run_here.run_here(config_of("gpus=[]"), os.path.join(sys.argv[1], where), LaunchContext(started=0.0))
    print(json.dumps([outcome.exit_code, outcome.stopped, outcome.error,
                      signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
                      signal.getsignal(signal.SIGHUP) is signal.SIG_IGN]))
"""


def test_a_run_stopped_while_its_workers_start_is_recorded_stopped_not_left_as_failed(tmp_path):
    """A SIGTERM between the run dir's first files and elastic's agent taking the signals over (a joblib
    sweep's run when launch was killed) ended the process by Python's default action: no outcome.json,
    and `launch runs` listed the run as failed."""
    import subprocess
    import sys

    from launcher.host.runs import describe
    from tests.conftest import REPO, clean_env

    done = subprocess.run([sys.executable, "-c", STOPPED_WHILE_STARTING, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    for where, line in zip(("agent", "files"), [x for x in done.stdout.splitlines() if x[:1] == "["],
                           strict=True):
        code, stopped, error, term_restored, nohup_kept = json.loads(line)
        assert (code, stopped, term_restored, nohup_kept) == (143, True, True, True), line
        assert error.startswith("stopped by SIGTERM: before the workers started; what was written is in"), error
        assert json.loads((tmp_path / where / "outcome.json").read_text())["stopped_by"] == "SIGTERM"
        assert describe(tmp_path / where)["state"] == "stopped (SIGTERM)"
        assert (tmp_path / where / "train.log").read_text().count("run dir:") == 1  # (said once)


def test_a_dry_run_names_the_network_from_config_and_says_its_memory_is_not_estimated(tmp_path):
    """`launch recipe=text model._target_=transformers.LlamaForCausalLM ... dry_run=true` said "text (gpt)" (the
    recipe's own model, which does not train) and gave no memory line."""
    from launcher.host import memory
    from launcher.host.plan import make_plan
    from launcher.host.run_here import describe_dry_run
    from launcher.recipes import recipe_class

    cfg = config_of("recipe=text", "gpus=[]", "model._target_=torch.nn.Identity")
    plan = make_plan(cfg, env={}, physical_count=0, loads=[])
    fits = memory.check_fits(recipe_class("text")(plan.config), plan).line
    said = describe_dry_run(plan, tmp_path, None, None, fits)
    assert said.startswith("dry run: nothing started. text (torch.nn.Identity): "), said
    assert "  memory        not estimated: a network from config (model._target_) is built in the workers only" \
        in said, said
