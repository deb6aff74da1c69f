"""A launch over two machines without SLURM: two network namespaces, one `launch` in each, gloo over
the veth pair between them (tests/multinode/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import descendants, listening_sockets, stop_tree
from tests.distributed.test_lifetime_and_binding import tagged, wait_for

pytestmark = pytest.mark.multinode

PORT = 29611
DDP = ("gpus=[]", "strategy=ddp", "nprocs=2")
STEPS_PER_EPOCH = 1438 // 64


def node_args(hosts, rank: int, port: int = PORT) -> tuple[str, ...]:
    return ("nodes=2", f"node_rank={rank}", f"rdzv={hosts.addresses[0]}:{port}")


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"a node's launch did not end within {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err


def wait_for_training(node0: subprocess.Popen, run_dir: Path, within: float = 90) -> None:
    """Until rank 0 has written its first epoch (both nodes are training)."""
    deadline = time.monotonic() + within
    while not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and node0.poll() is None, node0.communicate()
        time.sleep(0.2)


def start_without_shared_files(hosts, tmp_path: Path, args: tuple[str, ...],
                               port: int) -> tuple[Path, subprocess.Popen, subprocess.Popen]:
    """Both nodes started, each in a folder of its own, node 1 unable to see node 0's (a tmpfs over it in
    its own mount namespace): node 0's folder and the two launches."""
    mine, theirs = tmp_path / "node0", tmp_path / "node1"
    mine.mkdir()
    theirs.mkdir()
    node0 = hosts.start(0, *args, *node_args(hosts, 0, port), f"hydra.run.dir={mine / 'run'}", cwd=mine)
    node1 = hosts.start(1, *args, *node_args(hosts, 1, port), f"hydra.run.dir={theirs / 'run'}", cwd=theirs,
                        hide=(mine,))
    return mine, node0, node1


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_of_two_ranks_train_the_weights_of_one_node_of_four(hosts, tmp_path, launch):
    a, b = tmp_path / "a", tmp_path / "b"
    common = (*DDP, "epochs=2")
    node0 = hosts.start(0, *common, *node_args(hosts, 0), "hydra.run.dir=" + str(a), cwd=tmp_path)
    node1 = hosts.start(1, *common, *node_args(hosts, 1), "hydra.run.dir=" + str(b), cwd=tmp_path)
    seen_listening = set()
    deadline = time.monotonic() + 60
    while node0.poll() is None and not seen_listening and time.monotonic() < deadline:
        seen_listening = listening_sockets(descendants(node0.pid) | {node0.pid}, namespace_of=node0.pid)
        time.sleep(0.2)
    code0, out0, err0 = finish(node0)
    code1, out1, err1 = finish(node1)
    assert code0 == 0 and code1 == 0, f"{out0}{err0}\n---\n{out1}{err1}"
    # One run: rank 0's dir holds it; node 1's says where it is
    assert [r["epoch"] for r in metrics(a)] == [1, 2] and not (b / "results.json").exists()
    assert "node 1 of 2" in out1 and "ranks 2, 3 finished" in out1 and str(a) in out1, out1 + err1
    assert "Warning" not in err0 + err1 and "[W" not in err0 + err1, err0 + err1
    node = json.loads((b / "node.json").read_text())
    assert node["main_run_dir"] == str(a) and node["shared"] is True and node["ranks"] == [2, 3]
    plan = json.loads((a / "plan.json").read_text())
    assert plan["world_size"] == 4 and plan["nodes"]["interface"] == hosts.devices[0]
    assert plan["worker_env"]["GLOO_SOCKET_IFNAME"] == hosts.devices[0]
    # node 0 listened on its own address alone, never on every interface
    assert seen_listening and all(s.startswith(hosts.addresses[0] + ":") or s.startswith("127.0.0.1:")
                                  for s in seen_listening), seen_listening
    # the same training as 4 ranks on one machine, to the bit
    single = launch("gpus=[]", "strategy=ddp", "nprocs=4", "epochs=2", f"hydra.run.dir={tmp_path / 'one'}",
                    timeout=180)
    assert single.returncode == 0, single.output
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((a / "results.json").read_text())
    assert two["ranks_agree"] and len(two["weights_sha256"]) == 4
    assert two["weights_sha256"][0] == one["weights_sha256"][0]
    assert [r["loss"] for r in metrics(a)] == [r["loss"] for r in metrics(tmp_path / "one")]


def test_a_node_killed_outright_ends_the_other_node_within_seconds(hosts, tmp_path):
    tag = f"mn-kill-{os.getpid()}"
    common = (*DDP, "epochs=500", "checkpoint=false")
    node0 = hosts.start(0, *common, *node_args(hosts, 0, PORT + 1), f"hydra.run.dir={tmp_path / 'a'}",
                        cwd=tmp_path, tag=tag)
    node1 = hosts.start(1, *common, *node_args(hosts, 1, PORT + 1), f"hydra.run.dir={tmp_path / 'b'}",
                        cwd=tmp_path, tag=tag)
    try:
        wait_for_training(node0, tmp_path / "a")
        killed = descendants(node1.pid) | {node1.pid}
        for pid in killed:  # the machine goes away: its launch and its workers at once
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        code0, out0, err0 = finish(node0, timeout=60)
        took = time.monotonic() - start
    finally:
        stop_tree(node0.pid)
        stop_tree(node1.pid)
    node1.communicate()
    assert code0 == 1, err0
    assert took < 30, f"node 0 took {took:.1f} s to notice"
    assert "ranks 2-3 on another node stopped first" in err0 and "this node's ranks were stopped" in err0, err0
    assert "Traceback" not in err0
    # no process of either node (launch, forkserver, workers) outlives it
    assert wait_for(lambda: not tagged(tag), within=10), f"left running: {tagged(tag)}"


def test_a_restart_resumes_every_node_from_rank_0s_checkpoint_without_a_shared_file_system(hosts, tmp_path):
    """Node 1 does not see node 0's folders (a tmpfs over them in its own mount namespace): its ranks
    get the checkpoint from rank 0 when a rank of node 1 fails and both nodes restart."""
    common = (*DDP, "epochs=4", "max_restarts=1", "fault.rank=3", f"fault.step={2 * STEPS_PER_EPOCH + 3}")
    mine, node0, node1 = start_without_shared_files(hosts, tmp_path, common, PORT + 2)
    code0, out0, err0 = finish(node0)
    code1, out1, err1 = finish(node1)
    assert code0 == 0 and code1 == 0, f"{err0}\n---\n{err1}"
    run = mine / "run"
    assert [r["epoch"] for r in metrics(run)] == [1, 2, 3, 4]  # epochs 1-2 not trained again
    results = json.loads((run / "results.json").read_text())
    assert results["restarts"] == 1 and results["ranks_agree"]
    assert "resumed from" in err0 + out0 and "after epoch 2" in err0 + out0
    theirs = tmp_path / "node1"
    node = json.loads((theirs / "run" / "node.json").read_text())
    assert node["shared"] is False
    assert (theirs / "run" / "failures" / "attempt0-rank3.json").exists()  # its own failure, in its own dir


def test_a_node_cut_off_without_closing_its_connections_ends_both_within_the_collective_timeout(hosts, tmp_path):
    """Node 1's link goes down mid-run (packets dropped, no connection reset): no peer sees a socket
    close, so each rank's next collective waits out strategy.timeout_s; then both launches end."""
    common = (*DDP, "epochs=500", "checkpoint=false", "strategy.timeout_s=5")
    node0 = hosts.start(0, *common, *node_args(hosts, 0, PORT + 3), f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path)
    node1 = hosts.start(1, *common, *node_args(hosts, 1, PORT + 3), f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    try:
        wait_for_training(node0, tmp_path / "a")
        subprocess.run(["ip", "-n", hosts.names[1], "link", "set", hosts.devices[1], "down"], check=True)
        start = time.monotonic()
        code0, out0, err0 = finish(node0, timeout=90)
        code1, out1, err1 = finish(node1, timeout=90)
        took = time.monotonic() - start
    finally:
        subprocess.run(["ip", "-n", hosts.names[1], "link", "set", hosts.devices[1], "up"], check=True)
        stop_tree(node0.pid)
        stop_tree(node1.pid)
    assert code0 == 1 and code1 == 1, f"{err0}\n---\n{err1}"
    # (the collective timeout, then the rendezvous store's limit, 10 s here, on the node cut off from it)
    assert took < 5 + 10 + 10, f"the nodes took {took:.1f} s to end after the link went down"
    # Node 0 names what it can see. Both sides wait out the same timeout; when node 1's ranks have
    # recorded theirs (in rank 0's dir, which these two "hosts" share) it says both lost each other,
    # and when its own ranks end first, that node 1's ranks went away (as across a real partition,
    # where node 1's records could not reach it at all). CI saw the second, naming rank 2.
    assert ("the nodes lost each other" in err0 or "on another node stopped first (killed, unreachable" in err0
            and "rank 0 here saw" in err0), err0
    assert "Traceback" not in err0, err0
    assert "stopped answering" in err1 and "Traceback" not in err1, err1


def test_a_torchrun_style_script_runs_over_both_nodes(hosts, tmp_path):
    script = Path(__file__).parents[1] / "distributed" / "data" / "torchrun_style_script.py"
    common = ("gpus=[]", "strategy=ddp", "nprocs=2", f"script={script}", "+args.name=two-nodes")
    node0 = hosts.start(0, *common, *node_args(hosts, 0, PORT + 4), f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path)
    node1 = hosts.start(1, *common, *node_args(hosts, 1, PORT + 4), f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    code0, out0, err0 = finish(node0)
    code1, out1, err1 = finish(node1)
    assert code0 == 0 and code1 == 0, f"{out0}{err0}\n---\n{out1}{err1}"
    # one world of 4: every rank summed 1+2+3+4, each node ran its own two
    assert "rank 0 of 4 local 0 name=two-nodes sum=10.0" in out0 + err0
    assert "rank 3 of 4 local 1 name=two-nodes sum=10.0" in out1 + err1


TEXT = ("recipe=text", "gpus=[]", "strategy=fsdp", "nprocs=1", "recipe.layers=2", "recipe.width=32", "recipe.heads=2",
        "recipe.context=32", "recipe.max_bytes=100000", "progress=lines", "recipe.sample_bytes=20", "epochs=1")


def test_fsdp_over_two_nodes_writes_one_sharded_checkpoint_where_rank_0_is(hosts, tmp_path):
    """Every rank writes its shards into rank 0's run dir (both nodes see it); without a shared file
    system the same launch is refused in one line on both nodes, before training."""
    data = tmp_path / "text-data"
    common = (*TEXT, f"data.root={data}")
    node0 = hosts.start(0, *common, *node_args(hosts, 0, PORT + 5), f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path)
    node1 = hosts.start(1, *common, *node_args(hosts, 1, PORT + 5), f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    code0, out0, err0 = finish(node0)
    code1, out1, err1 = finish(node1)
    assert code0 == 0 and code1 == 0, f"{err0}\n---\n{err1}"
    shards = tmp_path / "a" / "checkpoints" / "epoch-1.dcp"
    assert (shards / ".metadata").is_file() and len(list(shards.glob("*.distcp"))) == 2, list(shards.iterdir())
    assert not (tmp_path / "b" / "checkpoints").exists()

    mine, node0, node1 = start_without_shared_files(hosts, tmp_path, common, PORT + 6)
    code0, out0, err0 = finish(node0)
    code1, out1, err1 = finish(node1)
    assert code0 == 2 and code1 == 2, f"{err0}\n---\n{err1}"
    for err in (err0, err1):
        lines = [line for line in err.splitlines() if line.startswith("launch:")]
        assert len(lines) == 1 and "a sharded strategy writes one checkpoint folder" in lines[0], err
        assert f"rank 0's run dir {mine / 'run'} is not visible" in lines[0] and "Traceback" not in err
    assert not (mine / "run" / "metrics.jsonl").exists()  # refused before training


def test_nodes_launched_with_different_settings_refuse_in_one_line_on_every_node(hosts, tmp_path):
    """Before, they trained apart (exit 0, different weights) or hung: each node's resolved config is
    compared at the start, and every node names what the commands typed differently, with both values, and
    exits 2. A recipe typed differently is named as typed, not as the values that follow from it (its
    epochs, lr, ...: the line listed them, cut off with '...', and never said recipe=)."""
    port = PORT + 7
    common = (*DDP, "data.synthetic=true", "lr=0.05")
    node0 = hosts.start(0, *common, "recipe=digits", *node_args(hosts, 0, port), f"hydra.run.dir={tmp_path / 'a'}",
                        cwd=tmp_path)
    node1 = hosts.start(1, *common, "recipe=cifar10", *node_args(hosts, 1, port), f"hydra.run.dir={tmp_path / 'b'}",
                        cwd=tmp_path)
    for proc in (node0, node1):
        code, out, err = finish(proc, timeout=120)
        assert code == 2, out + err
        said = [line for line in err.splitlines() if "launched with different settings" in line]
        assert len(said) == 1 and "settings: recipe=digits on " in said[0] and "but recipe=cifar10 on" in said[0], err
        assert "other values differ as a result. Give every node" in said[0], said[0]
        assert "lr=" not in said[0] and "epochs=" not in said[0] and "..." not in said[0] and "Traceback" not in err
    assert not (tmp_path / "a" / "metrics.jsonl").exists()  # nothing trained


def test_a_rendezvous_that_accepts_and_never_answers_ends_within_rdzv_timeout_s(launch):
    """Something at rdzv that takes connections and says nothing (a program of another kind on that port,
    a stuck proxy): torch's store client waited there past 300 s against rdzv_timeout_s=15. Now the node
    gives up at rdzv_timeout_s, in one line, exit 2, leaving no process behind."""
    import socket
    import threading

    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    taken = []

    def accept() -> None:
        while True:
            try:
                taken.append((mute.accept()[0], time.time()))
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        result = launch(*DDP[:2], "nprocs=1", "nodes=2", "node_rank=1", f"rdzv=127.0.0.1:{mute.getsockname()[1]}",
                        "rdzv_timeout_s=15", "epochs=1", timeout=120)
    finally:
        mute.close()
        for conn, _ in taken:
            conn.close()
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.output
    assert "did not answer as one (it accepted the connection but did not answer within rdzv_timeout_s" in lines[0]
    # timed from its first connection (the launch's own start-up, seconds under the suite's load, is not the wait)
    assert taken and result.finished_at - taken[0][1] < 15 + 10, (result.finished_at - taken[0][1], result.seconds)


def test_a_node_rank_given_twice_stops_every_node_in_one_line(hosts, tmp_path):
    """Three launches meant as nodes 0, 1, 2, the third typed with node_rank=1 again: no node trains; each
    says which ranks were given (two launches share the second machine here)."""
    port = PORT + 9
    args = ("gpus=[]", "strategy=ddp", "nprocs=1", "epochs=1", "batch_size=63", "nodes=3",
            f"rdzv={hosts.addresses[0]}:{port}", "rdzv_timeout_s=60")
    procs = [hosts.start(host, *args, f"node_rank={rank}", f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
             for host, rank, name in ((0, 0, "a"), (1, 1, "b"), (1, 1, "c"))]
    for proc in procs:
        code, out, err = finish(proc, timeout=120)
        said = [line for line in err.splitlines() if "gave node_rank" in line]
        assert code == 2 and len(said) == 1 and "gave node_rank 0, 1, 1" in said[0], out + err
        assert "Traceback" not in err
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_a_rendezvous_nobody_serves_ends_the_node_at_rdzv_timeout_s(launch):
    """Node 0 never started: node 1 waits rdzv_timeout_s for something to listen, then says so in one line."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = launch(*DDP[:2], "nprocs=1", "nodes=2", "node_rank=1", f"rdzv=127.0.0.1:{port}", "rdzv_timeout_s=5",
                    "epochs=1", timeout=120)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.output
    assert f"no rendezvous answered at 127.0.0.1:{port} within rdzv_timeout_s=5" in lines[0], lines
    assert result.seconds < 5 + 25, result.seconds
