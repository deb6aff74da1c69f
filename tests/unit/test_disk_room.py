"""Before any worker, the run dir's disk is judged against the run's checkpoints (launcher/host/disk.py): an 8B
model's are ~96 GB each, and a disk without room for them would fail the run at a save, hours in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.errors import LaunchError
from launcher.host import disk, run_here
from launcher.host.memory import Fit
from launcher.host.outcome import LaunchContext
from tests.conftest import config_of

GB = 10**9
LLAMA_8B = 8_030_261_248  # Llama 3.1 8B's parameters (untied, vocabulary 128,256)
EIGHT_B = Fit(parameters=LLAMA_8B, stored=(LLAMA_8B, LLAMA_8B))  # (no tied weight: each stored once either way)


@pytest.fixture
def free(monkeypatch):
    """free(N): the run dir's file system has N bytes free."""
    def set_free(nbytes: int) -> None:
        monkeypatch.setattr(disk, "free_bytes", lambda folder: nbytes)
    return set_free


def test_an_8b_fsdp_run_without_room_for_three_sharded_checkpoints_is_refused_and_told_what_fits(plan_on_h100s, free,
                                                                                                 tmp_path):
    plan = plan_on_h100s("recipe.size=8b", "strategy=fsdp", "gpus=[0,1]", "epochs=3", count=2)
    free(250 * GB)
    with pytest.raises(LaunchError) as refused:
        disk.check_room(plan, tmp_path / "run", EIGHT_B, 3)
    said = str(refused.value)
    assert "\n" not in said
    assert "~96.4 GB each (8.03B parameters: fp32 weights and adamw's 2 state tensors)" in said, said
    assert "up to 3 are on disk at once (the one being written, the last and the one before it): ~289.1 GB" in said
    assert "250.0 GB free" in said and str(tmp_path) in said, said
    assert said.endswith(": checkpoint.keep_previous=false (~192.7 GB: one fewer at once), or a run dir on a disk "
                         "with room (hydra.run.dir=/a/bigger/disk/run; a sweep's hydra.sweep.dir), or "
                         "checkpoint=false, or checkpoint.check_disk=false to start anyway"), said
    fewer = plan_on_h100s("recipe.size=8b", "strategy=fsdp", "gpus=[0,1]", "epochs=3", "checkpoint.keep_previous=false",
                          count=2)
    line = disk.check_room(fewer, tmp_path / "run", EIGHT_B, 3)
    assert line.startswith("~96.4 GB each (8.03B parameters: fp32 weights and adamw's 2 state tensors), up to 2 on "
                           "disk at once (the one being written and the last): ~192.7 GB; 250.0 GB free"), line


def test_the_copies_counted_are_the_saves_the_run_makes_and_the_best_it_keeps(plan_on_h100s, free, tmp_path):
    """A run of one epoch saves once; a whole checkpoint (ddp) has no third copy, so keep_previous is no fix for
    it; checkpoint.keep_best's copies count, and dropping them is offered where that fits."""
    def judged(*overrides: str, epochs_left: int, room: int) -> str:
        free(room)
        plan = plan_on_h100s("recipe.size=8b", *overrides, count=2)
        try:
            return disk.check_room(plan, tmp_path, EIGHT_B, epochs_left)
        except LaunchError as refused:
            return f"refused: {refused}"

    assert "one save" in judged("strategy=fsdp", "gpus=[0,1]", epochs_left=1, room=100 * GB)
    said = judged("strategy=fsdp", "gpus=[0,1]", epochs_left=1, room=90 * GB)
    assert "the run saves one, and the run dir's file system has 90.0 GB free" in said, said
    said = judged("strategy=ddp", "gpus=[0,1]", epochs_left=5, room=150 * GB)
    assert "up to 2 are on disk at once (the one being written and the last): ~192.7 GB" in said, said
    assert "keep_previous" not in said, said
    said = judged("strategy=fsdp", "gpus=[0,1]", "checkpoint.keep_best=2", epochs_left=9, room=300 * GB)
    assert "up to 5 are on disk at once (the one being written, the last, the one before it and up to 2 best)" in said
    assert ": checkpoint.keep_best=0, or a run dir" in said, said
    assert judged("strategy=fsdp", "gpus=[0,1]", "checkpoint=false", epochs_left=9, room=1) is None
    # (neither alone fits, both together do)
    said = judged("strategy=fsdp", "gpus=[0,1]", "checkpoint.keep_best=1", epochs_left=9, room=200 * GB)
    assert ": checkpoint.keep_best=0 checkpoint.keep_previous=false (~192.7 GB), or a run dir" in said, said
    # (checkpoint_every_steps's saves inside an epoch are not counted: the epoch's length is the data's, unknown
    # before the workers, and a run whose interval is past it saves once an epoch; nothing that fits is refused)
    said = judged("strategy=ddp", "gpus=[0,1]", "checkpoint_every_steps=100", epochs_left=1, room=150 * GB)
    assert "one save" in said, said


def test_a_restarted_run_counts_the_room_its_own_checkpoints_hold(plan_on_h100s, free, tmp_path):
    """A run restarted in its run dir (torchrun's --max-restarts, an srun requeue) saves over its own checkpoints:
    their room is its (each file once, however many names: previous.pt is a second name of a last.pt)."""
    plan = plan_on_h100s("recipe.size=8b", "strategy=ddp", "gpus=[0,1]", count=2)
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    with open(checkpoints / "last.pt", "wb") as f:
        f.truncate(60 * GB)  # (sparse: no real room taken)
    (checkpoints / "previous.pt").hardlink_to(checkpoints / "last.pt")
    free(150 * GB)
    line = disk.check_room(plan, tmp_path / "run", EIGHT_B, 5)
    assert "150.0 GB free and 60.0 GB in its own checkpoints where the run dir goes" in line, line
    free(130 * GB)
    with pytest.raises(LaunchError, match="130.0 GB free and 60.0 GB in its own checkpoints"):
        disk.check_room(plan, tmp_path / "run", EIGHT_B, 5)


def test_checkpoint_check_disk_false_starts_anyway_and_says_so(plan_on_h100s, free, tmp_path):
    plan = plan_on_h100s("recipe.size=8b", "strategy=fsdp", "gpus=[0,1]", "checkpoint.check_disk=false", count=2)
    free(100 * GB)
    line = disk.check_room(plan, tmp_path, EIGHT_B, 3)
    assert line.endswith("only 100.0 GB free where the run dir goes (%s): not refused (checkpoint.check_disk=false)"
                         % tmp_path), line


def test_a_host_of_several_counts_what_it_writes():
    """A sharded checkpoint: this host's ranks' shards; a whole one: all of it where rank 0 is, none elsewhere."""
    def plan(sharded: bool, processes: int, world: int, node_rank: int | None = 0, joined_rank: int | None = None):
        return SimpleNamespace(strategy=SimpleNamespace(sharded=sharded, processes=processes, world_size=world),
                               joined=None if joined_rank is None else SimpleNamespace(rank=joined_rank),
                               config=SimpleNamespace(node_rank=node_rank))

    assert disk.this_hosts_share(plan(True, 2, 2)) == 1.0
    assert disk.this_hosts_share(plan(True, 4, 8)) == 0.5
    assert disk.this_hosts_share(plan(False, 4, 8, node_rank=0)) == 1.0
    assert disk.this_hosts_share(plan(False, 4, 8, node_rank=1)) == 0.0
    assert disk.this_hosts_share(plan(False, 4, 8, node_rank=None, joined_rank=4)) == 0.0
    assert disk.this_hosts_share(plan(False, 4, 8, node_rank=None, joined_rank=0)) == 1.0


def test_the_launch_refuses_in_one_line_before_any_worker_and_the_dry_run_says_the_estimate(free, tmp_path, capsys):
    args = ("recipe=text", "recipe.size=debug", "gpus=[]", "recipe.max_bytes=20000")
    free(10**6)  # (the debug size's checkpoints: ~39 MB each)
    outcome = run_here.run_here(config_of(*args, "epochs=2"), tmp_path / "run", LaunchContext(started=0.0))
    assert outcome.exit_code == 2 and outcome.error.startswith("checkpoints of this run hold ~39 MB each"), outcome
    assert not (tmp_path / "run").exists()  # (nothing started: no run dir)
    free(10**12)
    outcome = run_here.run_here(config_of(*args, "dry_run=true"), tmp_path / "run", LaunchContext(started=0.0))
    assert outcome.exit_code == 0
    out = capsys.readouterr().out
    assert "\n  checkpoints   ~39 MB each (3M parameters: fp32 weights and adamw's 2 state tensors), up to 2 on disk " \
           "at once (the one being written and the last): ~77 MB; 1.00 TB free where the run dir goes" in out, out
    outcome = run_here.run_here(config_of(*args, "dry_run=true", "checkpoint=false"), tmp_path / "run",
                                LaunchContext(started=0.0))
    assert outcome.exit_code == 0 and "\n  checkpoints   none (checkpoint=false)" in capsys.readouterr().out


def test_a_resume_says_what_changed_in_the_users_words_and_not_how_checkpoints_are_kept():
    """A resume's line names the settings that differ from the checkpoint's: true/false as typed, not Python's;
    checkpoint.* (which checkpoints the new run keeps) changes nothing of the training and is not listed."""
    from pathlib import Path

    from launcher.host.resume import Resume, _differences

    saved = {"lr": 0.1, "checkpoint.keep_previous": False, "perf.compile": False, "epochs": 3}
    now = {"lr": 0.1, "checkpoint.keep_previous": True, "perf.compile": True, "epochs": 4}
    changed = _differences(saved, now)
    assert changed == {"perf.compile": (False, True), "epochs": (3, 4)}, changed
    said = Resume(Path("run/checkpoints/last.pt"), 3, changed).describe()
    assert said.endswith("changed here: perf.compile false -> true, epochs 3 -> 4"), said
