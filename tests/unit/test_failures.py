"""Root cause: the earliest primary failure wins over the peers' echoes of it."""

from launcher.failures import FailureRecord, looks_secondary, root_cause, short_headline


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


def test_peer_loss_is_secondary():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    assert looks_secondary(gloo)
    assert not looks_secondary(ValueError("bad shape"))
    assert short_headline("RuntimeError: [/x/pair.cc:553] Connection closed by peer. This is typically caused") == \
        "RuntimeError: Connection closed by peer"
