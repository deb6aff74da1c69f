"""Root cause: the earliest primary failure wins over the peers' echoes of it. A worker's failure: its exit
code, its record, and under SLURM whether its job is requeued."""

import functools
import json
import logging
import os

import pytest

from launcher.errors import ConfigError
from launcher.failures import FailureRecord, looks_secondary, root_cause, short_headline, span
from launcher.files import FAILURES
from launcher.spec import RequeuePolicy, WorkerSpec
from launcher.train.stops import NonFiniteLoss
from tests.conftest import config_of


def rec(rank, t, secondary, attempt=0):
    return FailureRecord(rank, attempt, t, "RuntimeError", f"boom {rank}", "tb", secondary, 1)


def test_primary_beats_earlier_echo():
    assert root_cause([rec(0, 1.0, True), rec(1, 2.0, False)]).rank == 1


def test_earliest_primary_and_last_attempt():
    records = [rec(3, 0.5, False, attempt=0), rec(2, 5.0, False, attempt=1), rec(1, 4.0, False, attempt=1)]
    assert root_cause(records).rank == 1


def test_all_echoes_gives_earliest():
    assert root_cause([rec(1, 2.0, True), rec(0, 1.0, True)]).rank == 0
    assert root_cause([]) is None


def test_ranks_are_said_as_a_person_reads_them():
    assert (span([3, 2]), span([1, 4]), span([0, 1, 2, 3]), span([5])) == ("2-3", "1, 4", "0-3", "5")


def test_peer_loss_is_secondary():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    assert looks_secondary(gloo)
    assert not looks_secondary(ValueError("bad shape"))
    assert short_headline("RuntimeError: [/x/pair.cc:553] Connection closed by peer. This is typically caused") == \
        "RuntimeError: Connection closed by peer"


# ---- a worker's failure (launcher/train/worker.py): its exit code, its record, and a SLURM requeue ------

composed = functools.cache(functools.partial(config_of, "gpus=[]"))


class Exited(Exception):
    """os._exit, as the test sees it: the code the worker process would have ended with."""


@pytest.fixture
def worker(monkeypatch, tmp_path):
    """worker_main in this process: `train` raises the exception given; the worker's exit code is returned.
    (What would touch this process's parent-death signal, console and logging is left out.) A fake
    `scontrol` notes each requeue it is asked for in tmp_path/requeues."""
    from launcher import logs
    from launcher.train import loop
    from launcher.train import worker as worker_module

    monkeypatch.setattr(worker_module, "die_with_parent", lambda *a: None)
    monkeypatch.setattr(worker_module, "_let_forkserver_end_with_the_launcher", lambda: None)
    monkeypatch.setattr(logs, "survive_closed_console", lambda: None)
    monkeypatch.setattr(logs, "setup_worker_logging", lambda run_dir, rank: None)
    monkeypatch.setattr(logging, "shutdown", lambda: None)
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)

    def exit_now(code):
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'requeues'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def run(exc: BaseException, max_restarts: int = 0, restart_count: int = 0) -> int:
        def train(*args):
            raise exc

        monkeypatch.setattr(loop, "train", train)
        run_dir = tmp_path / "run"
        (run_dir / FAILURES).mkdir(parents=True, exist_ok=True)
        policy = RequeuePolicy("4242", restart_count, 0) if max_restarts else None  # (a SLURM job's)
        spec = WorkerSpec(config=composed(f"max_restarts={max_restarts}"), strategy=None,
                          run_dir=str(run_dir), requeue=policy)
        with pytest.raises(Exited) as ended:
            worker_module.worker_main(spec)
        return ended.value.args[0]

    return run


def requeues(tmp_path) -> list[str]:
    path = tmp_path / "requeues"
    return path.read_text().splitlines() if path.exists() else []


def test_bad_input_found_in_a_worker_ends_it_with_exit_2_and_its_record_says_so(worker, tmp_path):
    code = worker(ConfigError("batch_size", 5000, "larger than the 1438 training images", "batch_size=359"))
    assert code == 2
    record = json.loads((tmp_path / "run" / FAILURES / "attempt0-rank0.json").read_text())
    assert record["exit_code"] == 2 and "batch_size=5000" in record["message"]
    assert worker(RuntimeError("boom")) == 1


def test_under_slurm_a_failed_job_is_requeued_but_never_after_a_nan_stop_or_bad_input(worker, tmp_path):
    assert worker(NonFiniteLoss("the training loss became nan"), max_restarts=2) == 1
    assert worker(ConfigError("lr", -1, "must be positive", "lr=0.1"), max_restarts=2) == 2
    assert requeues(tmp_path) == []  # (the same again would stop the same way)
    assert worker(RuntimeError("a node went away"), max_restarts=2) == 1
    assert requeues(tmp_path) == ["requeue 4242"]


def test_a_slurm_job_is_requeued_at_most_max_restarts_times(worker, tmp_path, capsys):
    for run in range(4):  # the job's first run, then each run after a requeue, every one failing
        worker(RuntimeError("a node went away"), max_restarts=2, restart_count=run)
    assert requeues(tmp_path) == ["requeue 4242", "requeue 4242"]
    said = capsys.readouterr().err
    assert "restart 1 of max_restarts=2" in said and "restart 2 of max_restarts=2" in said
    assert "restart 3" not in said


# ---- the launch's one line when workers fail (launcher/host/spawn.py describe_failure) ----------------

def _failure(exitcode, timestamp=0.0, pid=7):
    import signal
    import types

    return types.SimpleNamespace(exitcode=exitcode, pid=pid, timestamp=timestamp,
                                 signal_name=lambda: signal.Signals(-exitcode).name if exitcode < 0 else "")


def _elastic_error(failed):
    import types

    return types.SimpleNamespace(failures=failed)


def test_a_rank_killed_on_the_last_attempt_is_named_over_an_earlier_attempts_error(tmp_path):
    from launcher import failures
    from launcher.host.spawn import describe_failure

    failures.write_record(tmp_path, 1, 0, ValueError("bad shape"), 1)  # attempt 0: rank 1 said why
    failures.write_record(tmp_path, 0, 1, RuntimeError("Connection closed by peer"), 1)  # attempt 1: an echo
    outcome = describe_failure(tmp_path, _elastic_error({1: _failure(-9)}), nprocs=2, max_restarts=1)
    assert outcome.exit_code == 1
    assert outcome.error.startswith("rank 1 (pid 7) was killed by SIGKILL without a Python traceback (SIGKILL is "
                                    "often the out-of-memory killer) after 1 restart"), outcome.error
    assert "the other 1 rank was stopped" in outcome.error


def test_the_first_of_two_silent_ranks_to_die_is_named(tmp_path):
    from launcher.host.spawn import describe_failure

    err = _elastic_error({0: _failure(-9, timestamp=20.0, pid=10), 2: _failure(-15, timestamp=10.0, pid=12)})
    outcome = describe_failure(tmp_path, err, nprocs=3, max_restarts=0)
    assert outcome.error.startswith("rank 2 (pid 12) was killed by SIGTERM"), outcome.error
    assert "the other 2 ranks were stopped" in outcome.error


def test_bad_input_a_worker_finds_is_exit_2_and_its_one_line(tmp_path):
    from launcher import failures
    from launcher.errors import LaunchError
    from launcher.host.spawn import describe_failure

    failures.write_record(tmp_path, 0, 0, LaunchError("data.root=/x is not valid: no images"), 2)
    outcome = describe_failure(tmp_path, _elastic_error({0: _failure(2)}), nprocs=2, max_restarts=0)
    assert (outcome.exit_code, outcome.error) == (2, "data.root=/x is not valid: no images")


def _nodes(node_rank):
    from launcher.host.network import NodeNetwork
    from launcher.host.spawn import Nodes

    return Nodes(2, node_rank, NodeNetwork("10.0.0.1", "10.0.0.1", 29400, "10.0.0.2", "eth0", False), 300, 30)


def test_a_nodes_own_ranks_are_never_said_to_be_on_another_node(tmp_path):
    from launcher.host.spawn import describe_failure

    outcome = describe_failure(tmp_path, _elastic_error({2: _failure(-15)}), nprocs=2, max_restarts=0,
                               nodes=_nodes(1))
    assert outcome.error.startswith("ranks 0-1 on another node stopped first"), outcome.error


def test_each_node_asks_the_rendezvous_for_its_node_rank_and_the_restarts_asked_for(tmp_path):
    from launcher.host.spawn import launch_config

    config = launch_config(2, 3, str(tmp_path), nodes=_nodes(1))
    assert (config.min_nodes, config.max_nodes, config.max_restarts, config.nproc_per_node) == (2, 2, 3, 2)
    assert config.rdzv_configs["node_rank"] == 1 and config.rdzv_endpoint == "10.0.0.1:29400"
    assert launch_config(2, 0, str(tmp_path), nodes=_nodes(None)).rdzv_configs["node_rank"] == -1


def test_the_node_ranks_given_become_the_ranks_and_a_rank_given_twice_stops_every_node():
    """rendezvous.py _NodeRanks over a stand-in of elastic's round: its store and the ranks by address."""
    import types

    import pytest

    from launcher.host.rendezvous import RendezvousError, _NodeRanks

    class Store(dict):
        def set(self, key, value):
            self[key] = value

        def wait(self, keys, timeout):
            pass

        def multi_get(self, keys):
            return [self[k].encode() for k in keys]

    def round_of(given_by_others):
        store = Store({f"{_NodeRanks.PREFIX}{r}": str(g) for r, g in given_by_others.items()})
        info = types.SimpleNamespace(store=store, rank=0, world_size=2, bootstrap_store_info=None)
        return types.SimpleNamespace(next_rendezvous=lambda: info)

    handler = round_of({1: 0})  # elastic ranked this node first by address; the other node said node_rank=0
    _NodeRanks(handler, node_rank=1, timeout_s=1).install()
    assert handler.next_rendezvous().rank == 1
    handler = round_of({1: 1})
    _NodeRanks(handler, node_rank=1, timeout_s=1).install()
    with pytest.raises(RendezvousError, match="the 2 nodes gave node_rank 1, 1: each needs its own"):
        handler.next_rendezvous()
