"""Root cause: the earliest primary failure wins over the peers' echoes of it."""

from launcher.failures import FailureRecord, looks_secondary, root_cause, short_headline, span


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
