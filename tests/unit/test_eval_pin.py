"""`launch eval` holds the checkpoint it evaluates still while its workers read it (launcher/host/evaluate.py
`pin`): hard links, so a live run replacing its last.pt or removing a sharded checkpoint's older folder
cannot change or break what the ranks read."""

import errno
import os
import shutil

import pytest
import torch

from launcher.errors import LaunchError
from launcher.host import evaluate


def _sharded(tmp_path, name="epoch-2.dcp", value=2.0):
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / name).mkdir(parents=True)
    (checkpoints / name / ".metadata").write_bytes(b"index")
    (checkpoints / name / "__0_0.distcp").write_bytes(b"shard" * 100)
    path = checkpoints / "last.pt"
    torch.save({"sharded": name, "epoch": int(value), "history": []}, checkpoints / "new.tmp")
    os.replace(checkpoints / "new.tmp", path)  # (as a run replaces it: a new file renamed over the old)
    return path


def test_the_pinned_checkpoint_is_the_same_files_and_survives_the_run_removing_them(tmp_path, monkeypatch):
    path = _sharded(tmp_path)
    monkeypatch.setattr(evaluate, "load_checkpoint", lambda *a: pytest.fail("checked twice"))
    into = tmp_path / "eval" / "pinned"
    pinned = evaluate.pin(path, evaluate.identity(path), into, "launch eval run")
    assert pinned == into / "last.pt" and os.path.samefile(pinned, path)
    assert os.path.samefile(into / "epoch-2.dcp" / "__0_0.distcp", path.parent / "epoch-2.dcp" / "__0_0.distcp")
    shutil.rmtree(path.parent / "epoch-2.dcp")  # the run moved on
    assert (into / "epoch-2.dcp" / "__0_0.distcp").read_bytes() == b"shard" * 100
    evaluate.unpin(into)
    assert not into.exists() and path.is_file()


def test_a_checkpoint_replaced_while_it_is_pinned_pins_the_newer_one_checked(tmp_path, monkeypatch):
    path = _sharded(tmp_path)
    checked = evaluate.identity(path)
    real, calls, seen = evaluate._link_files, [], []

    def rotated_first(folder, into):
        calls.append(folder.name)
        if len(calls) == 1:  # the run wrote epoch 3 and removed epoch 2's folder meanwhile
            _sharded(tmp_path, "epoch-3.dcp", 3.0)
            shutil.rmtree(folder)
        return real(folder, into)

    monkeypatch.setattr(evaluate, "_link_files", rotated_first)
    monkeypatch.setattr(evaluate, "load_checkpoint", lambda p, setting: seen.append(p))
    into = tmp_path / "eval" / "pinned"
    pinned = evaluate.pin(path, checked, into, "launch eval run")
    assert calls == ["epoch-2.dcp", "epoch-3.dcp"]
    assert torch.load(pinned)["epoch"] == 3 and (into / "epoch-3.dcp" / ".metadata").is_file()
    assert not (into / "epoch-2.dcp").exists()
    assert seen == [pinned]  # (not the file that was checked: checked now)


def test_where_links_cannot_be_made_the_workers_read_in_place(tmp_path, monkeypatch):
    path = _sharded(tmp_path)

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(evaluate.os, "link", cross_device)
    into = tmp_path / "eval" / "pinned"
    assert evaluate.pin(path, evaluate.identity(path), into, "launch eval run") is None
    assert not into.exists()


def test_a_run_replacing_its_checkpoint_faster_than_it_can_be_pinned_is_one_line(tmp_path, monkeypatch):
    path = _sharded(tmp_path)

    def always_gone(folder, into):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(folder))

    monkeypatch.setattr(evaluate, "_link_files", always_gone)
    with pytest.raises(LaunchError, match="was replaced 3 times while it was read"):
        evaluate.pin(path, evaluate.identity(path), tmp_path / "eval" / "pinned", "launch eval run")


def test_launch_eval_takes_the_data_batch_and_recipe_values_the_checkpoint_was_trained_with(tmp_path):
    """A model trained on generated data is scored on generated data, at the batch its data was checked
    against, with its recipe's values; what the command line gives wins."""
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    path.parent.mkdir(parents=True)
    torch.save({"net_state_dict": {}, "epoch": 1, "config": {
        "recipe": {"name": "digits", "model": "cnn", "translate": 1}, "optim": {"name": "sgd"}, "batch_size": 256,
        "data": {"synthetic": True, "root": str(tmp_path)}}}, path)
    line = evaluate.command_line(["eval", str(tmp_path / "run")])
    assert {"recipe=digits", "recipe.translate=1", "data.synthetic=true", "batch_size=256",
            f"data.root='{tmp_path}'"} <= set(line)
    typed = evaluate.command_line(["eval", str(tmp_path / "run"), "batch_size=64", "data.root=/elsewhere"])
    assert "batch_size=256" not in typed and typed[-2:] == ["batch_size=64", "data.root=/elsewhere"]
    assert f"data.root='{tmp_path}'" not in typed
