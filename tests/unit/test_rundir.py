"""Run-dir claims (launcher/host/rundir.py), without Hydra: what may be claimed, and what a release removes."""

import json

import pytest

from launcher.errors import LaunchError
from launcher.host import rundir


def test_a_claim_between_the_check_and_the_create_is_lost_by_the_slower_launch(tmp_path, monkeypatch):
    """The race two launches started together run: both find the dir free, one creates the claim
    first. The exclusive create must refuse the other, not let it write its claim over the first."""
    target = tmp_path / "run"
    real = rundir._why_taken

    def rival_claims_meanwhile(path, setting):
        verdict = real(path, setting)
        target.mkdir(exist_ok=True)
        (target / ".launch-claim.json").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "t"}))
        return verdict

    monkeypatch.setattr(rundir, "_why_taken", rival_claims_meanwhile)
    with pytest.raises(LaunchError):
        rundir.claim(target)
    assert json.loads((target / ".launch-claim.json").read_text())["host"] == "elsewhere"  # the first one's


def test_a_claim_still_being_written_is_another_launchs_not_a_users_file(tmp_path):
    """A claim is created empty, then filled. A launch started beside it found it empty in between and
    called it a file launch did not write (seen in CI); it now waits for the content, and an empty
    claim that stays empty (its launch killed between the two steps) is still a launch's mark."""
    import os
    import socket
    import threading

    target = tmp_path / "run"
    target.mkdir()
    (target / ".launch-claim.json").touch()
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": "now", "argv": []}
    writer = threading.Timer(0.2, lambda: (target / ".launch-claim.json").write_text(json.dumps(record)))
    writer.start()
    try:
        with pytest.raises(LaunchError, match=f"being written by another launch \\(pid {os.getpid()}"):
            rundir.claim(target)
    finally:
        writer.join()
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / ".launch-claim.json").touch()
    with pytest.raises(LaunchError, match="already holds a run"):
        rundir.claim(torn)


def test_claim_and_release_take_back_only_what_the_launch_made(tmp_path):
    existing = tmp_path / "mine"
    existing.mkdir()
    taken = rundir.claim(existing / "a" / "b")
    assert taken is not None and taken.created == [existing / "a" / "b", existing / "a"]
    (existing / "a" / "b" / ".hydra").mkdir()
    rundir.release(existing / "a" / "b")
    assert existing.is_dir() and not any(existing.iterdir())
    rundir.claim(existing)  # an empty dir of the user's may be claimed...
    rundir.release(existing)
    assert existing.is_dir() and not any(existing.iterdir())  # ...and is never removed


@pytest.mark.parametrize(("files", "why"), [({"notes.txt": "x"}, "holds files launch did not write (notes.txt)"),
                                            ({"results.json": "{}"}, "already holds a run")])
def test_a_dir_with_files_is_refused(tmp_path, files, why):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(LaunchError, match=why.replace("(", r"\(").replace(")", r"\)")):
        rundir.claim(tmp_path)


def test_release_keeps_a_dir_something_ran_and_wrote_in(tmp_path):
    """A sweep's run dir (made by Hydra, claimed by no launch of its own) that a run wrote into stays whole."""
    ran = tmp_path / "sweep" / "0"
    (ran / ".hydra").mkdir(parents=True)
    (ran / "results.json").write_text("{}")
    rundir.release(ran)
    assert (ran / "results.json").exists() and (ran / ".hydra").is_dir()
    unused = tmp_path / "sweep" / "1"
    (unused / ".hydra").mkdir(parents=True)
    rundir.release(unused)  # (refused before it ran: nothing of it stays)
    assert not unused.exists()


def test_a_claim_of_another_machine_is_not_taken_for_a_live_launch(tmp_path, monkeypatch):
    """Run dirs on a shared file system: a pid in another machine's claim says nothing about this one's
    processes (here it is this test's own pid, alive): the dir is a run that holds its files, not one being
    written."""
    import json
    import os

    (tmp_path / ".launch-claim.json").write_text(json.dumps({"pid": os.getpid(), "host": "another-host"}))
    assert not rundir.pid_alive(os.getpid(), "another-host")
    with pytest.raises(LaunchError, match="already holds a run"):
        rundir.claim(tmp_path)
