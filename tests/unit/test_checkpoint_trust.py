"""What a checkpoint may make launch do: its saved config names code (model._target_, a recipe module) that
runs only with the user's consent (typed, or a seal of this user's key); its seal covers every value in it;
`latest` is the checkpoint written last."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from omegaconf import OmegaConf, read_write

from launcher import integrity
from launcher.errors import LaunchError
from launcher.host import evaluate, resume
from launcher.train import checkpoint

TARGET = "shutil.copyfile"


def _state(config: dict) -> dict:
    return {"net_state_dict": {"w": torch.ones(3)}, "epoch": 1, "history": [{"epoch": 1, "test_acc": 0.5}],
            "config": {"recipe": {"name": "digits", "model": "cnn"}, "optim": {"name": "sgd"}, **config}}


def _write(run, state: dict, how: str, monkeypatch, tmp_path):
    """`state` as run/checkpoints/last.pt: sealed by a run of this user's ("mine"), by another user's run
    ("another user's key"), with its seal removed, or resealed with a recomputed plain digest."""
    path = run / "checkpoints" / "last.pt"
    if how == "mine":
        checkpoint.save_atomic(state, path)
    elif how == "another user's key":
        with monkeypatch.context() as m:
            m.setenv("LAUNCH_CONFIG_DIR", str(tmp_path / "someone-else"))
            checkpoint.save_atomic(state, path)
    else:
        path.parent.mkdir(parents=True)
        if how == "resealed":
            state[integrity.SEAL] = {"run": None, "epoch": state["epoch"]}
            state[integrity.SEAL]["sha256"] = integrity.state_digest(state)  # (as anyone can compute it)
        torch.save(state, path)
    return path


@pytest.fixture
def hostile(tmp_path, monkeypatch, request):
    """A run dir whose checkpoint builds its network with shutil.copyfile(bait, victim), and the victim."""
    victim, bait = tmp_path / "victim.txt", tmp_path / "bait.txt"
    victim.write_text("mine")
    bait.write_text("theirs")
    run = tmp_path / "shared-run"
    _write(run, _state({"model": {"_target_": TARGET, "src": str(bait), "dst": str(victim)}}), request.param,
           monkeypatch, tmp_path)
    return run, victim


REFUSED = ["seal removed", "resealed", "another user's key"]


@pytest.mark.parametrize("hostile", REFUSED, indirect=True)
def test_a_checkpoint_from_elsewhere_naming_code_is_refused_in_one_line_until_the_user_types_it(hostile):
    """A shared checkpoint whose config named shutil.copyfile with arguments overwrote a file before the
    'not an nn.Module' check (resume= and launch eval built the network from its config). Its code runs
    only with consent: typed on this command line, or a seal of this user's key (a digest alone anyone can
    recompute)."""
    run, victim = hostile
    for refused in (lambda: resume.with_saved_choices([f"resume={run}"]),
                    lambda: evaluate.command_line(["eval", str(run), "gpus=[]"])):
        with pytest.raises(LaunchError) as err:
            refused()
        line = str(err.value)
        assert f"checkpoint names model._target_={TARGET}, code that launch runs only with your consent: it " \
               "was not written by a run of yours (" in line
        assert line.endswith(f"; to run it, add model._target_={TARGET}")
        assert "\n" not in line
    assert victim.read_text() == "mine"
    # the sweep's way in (several resume values: each run's composed config is filled from its checkpoint)
    with pytest.raises(LaunchError, match="code that launch runs only with your consent"):
        resume.carry_settings(_composed(run), [f"resume={run}"])
    # typed: the user's consent, the checkpoint's arguments kept
    typed = f"model._target_={TARGET}"
    assert resume.with_saved_choices([f"resume={run}", typed]) == [f"resume={run}", "recipe=digits", "optim=sgd",
                                                                     typed]
    carried = resume.carry_settings(_composed(run, typed), [f"resume={run}", typed])
    assert carried.model.dst == str(victim)
    argv = evaluate.command_line(["eval", str(run), typed])
    assert f"+model.dst='{victim}'" in argv and typed in argv
    assert not [a for a in argv if a.startswith("model._target_=") and a != typed]
    # another network typed: the saved one (and its arguments) is not used, nothing to consent to
    argv = evaluate.command_line(["eval", str(run), "model._target_=torch.nn.Identity"])
    assert not [a for a in argv if str(victim) in a or TARGET in a]
    assert victim.read_text() == "mine"  # (nothing was called: a worker would)


def _composed(run, *typed: str):
    """The config Hydra composes for the command line `typed` (before a checkpoint's values are carried
    into it), with resume=run: what carry_settings gets for each run of a sweep over resume values."""
    from tests.conftest import composed

    cfg = composed("recipe=digits", "optim=sgd", *typed)
    with read_write(cfg):
        cfg.resume = str(run)
    return cfg


def test_a_checkpoint_of_this_users_run_builds_its_saved_network_without_asking(tmp_path, monkeypatch):
    run = tmp_path / "mine"
    _write(run, _state({"model": {"_target_": "torch.nn.Linear", "in_features": 64, "out_features": 10}}), "mine",
           monkeypatch, tmp_path)
    assert resume.with_saved_choices([f"resume={run}"]) == [f"resume={run}", "recipe=digits", "optim=sgd"]
    argv = evaluate.command_line(["eval", str(run)])
    assert "model._target_='torch.nn.Linear'" in argv and "+model.in_features=64" in argv
    # a resume builds it with its arguments too (they were left behind: the weights did not fit the defaults)
    carried = resume.carry_settings(_composed(run), [f"resume={run}"]).model
    assert (carried._target_, carried.in_features, carried.out_features) == ("torch.nn.Linear", 64, 10)
    carried = resume.carry_settings(_composed(run, "+model.out_features=5"), [f"resume={run}", "+model.out_features=5"])
    assert carried.model.out_features == 5  # (typed wins)


@pytest.mark.parametrize("how", REFUSED)
def test_a_recipe_module_or_a_nested_target_from_a_checkpoint_is_not_imported_without_consent(tmp_path, monkeypatch,
                                                                                            how):
    """`recipe=my_pkg.my_recipe` imports (runs) that module, and Hydra instantiates a `_target_` nested in
    the model's arguments: a checkpoint from elsewhere names neither into a launch unasked."""
    package = tmp_path / "evilpkg"
    package.mkdir()
    marker = tmp_path / "imported"
    (package / "__init__.py").write_text("")
    (package / "recipe.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    state = _state({})
    state["config"]["recipe"] = {"name": "evilpkg.recipe", "model": "default"}
    _write(run, state, how, monkeypatch, tmp_path)
    from tests.conftest import composed

    with pytest.raises(LaunchError, match=r"names recipe=evilpkg\.recipe, code that .* add recipe=evilpkg\.recipe$"):
        composed(f"resume={run}")
    with pytest.raises(LaunchError, match=r"names recipe=evilpkg\.recipe, code that"):
        evaluate.command_line(["eval", str(run)])
    assert not marker.exists() and "evilpkg.recipe" not in sys.modules
    typed = [f"resume={run}", "recipe=evilpkg.recipe"]
    assert resume.with_saved_choices(typed) == [f"resume={run}", "optim=sgd", "recipe=evilpkg.recipe"]

    nested = tmp_path / "nested"
    _write(nested, _state({"model": {"_target_": "torch.nn.Sequential",
                                     "inner": {"_target_": "os.system", "command": "true"}}}), how,
           monkeypatch, tmp_path)
    with pytest.raises(LaunchError, match=r"names model\._target_=torch\.nn\.Sequential"):
        resume.with_saved_choices([f"resume={nested}"])
    with pytest.raises(LaunchError, match=r"names model\.inner\._target_=os\.system, .* add "
                                          r"\+model\.inner\._target_=os\.system$"):
        resume.with_saved_choices([f"resume={nested}", "model._target_=torch.nn.Sequential"])


def test_a_saved_configs_interpolations_stay_text_in_the_run_that_resumes_or_evaluates_it(tmp_path, monkeypatch):
    """launch writes configs resolved: a `${...}` in a checkpoint's config is text. Carried into a resume or
    an eval run, Hydra resolved it (`${oc.env:...}` read this machine's environment into the run's config,
    passed to the network as an argument); a backslash before it escaped the escape."""
    monkeypatch.setenv("LAUNCH_TEST_SECRET", "s3cret")
    saved = ["${oc.env:LAUNCH_TEST_SECRET}", "a\\${oc.env:LAUNCH_TEST_SECRET}", "C:\\dir\\", "it's"]
    run = tmp_path / "run"
    _write(run, _state({"model": {"_target_": "torch.nn.Identity", **{f"v{i}": v for i, v in enumerate(saved)},
                                  "listed": [{"x": saved[0]}]}}), "mine", monkeypatch, tmp_path)
    from tests.conftest import composed

    evaluated = OmegaConf.to_container(composed(*evaluate.command_line(["eval", str(run)])).model, resolve=True)
    resumed = OmegaConf.to_container(resume.carry_settings(_composed(run), [f"resume={run}"]).model, resolve=True)
    for model in (evaluated, resumed):
        assert [model[f"v{i}"] for i in range(len(saved))] == saved, model
        assert model["listed"] == [{"x": saved[0]}]


def test_launch_runs_shows_a_run_dirs_config_as_written(tmp_path, monkeypatch, capsys):
    import json

    from launcher.host import runs

    monkeypatch.setenv("LAUNCH_TEST_SECRET", "s3cret")
    run = tmp_path / "outputs" / "2026-11-01" / "10-00-00-x"
    run.mkdir(parents=True)
    (run / "plan.json").write_text("{}")
    (run / "config.yaml").write_text("recipe:\n  name: ${oc.env:LAUNCH_TEST_SECRET}\n  model: cnn\nepochs: 4\n")
    assert runs.main(["--json"], root=tmp_path) == 0
    assert json.loads(capsys.readouterr().out)[0]["recipe"] == "${oc.env:LAUNCH_TEST_SECRET}"


def test_the_seal_key_is_made_once_private_and_its_mark_proves_only_its_users_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH_CONFIG_DIR", str(tmp_path / "config"))
    state = _state({})
    integrity.seal(state, "run-1")
    key = tmp_path / "config" / integrity.KEY_FILE
    assert key.is_file() and (key.stat().st_mode & 0o777) == 0o600
    assert integrity.unproven(state) is None
    before = key.read_text()
    integrity.seal(_state({}), "run-2")
    assert key.read_text() == before  # (made once, never replaced)
    state[integrity.SEAL]["epoch"] = 7  # a mark is of its digest, run and epoch
    assert "not made with your key" in integrity.unproven(state)
    state[integrity.SEAL][integrity.MAC] = "é" * 64  # (not even hex: still the one answer, not a TypeError)
    assert "not made with your key" in integrity.unproven(state)
    mine = integrity.seal(_state({}), "run-3")
    monkeypatch.setenv("LAUNCH_CONFIG_DIR", str(tmp_path / "another"))  # (another user, or a machine of its own)
    assert "you have no seal key here" in integrity.unproven(mine)
    integrity.seal(_state({}), "theirs")
    assert "not made with your key" in integrity.unproven(mine)


CHANGES = {
    "the epoch": lambda s: s.update(epoch=3),
    "the step inside an epoch": lambda s: s.update(step=41),
    "a history value": lambda s: s["history"][0].update(test_acc=0.9),
    "a history row added": lambda s: s["history"].append({"epoch": 2, "test_acc": 0.9}),
    "a setting": lambda s: s["config"]["optim"].update(lr=1.0),
    "a setting's text": lambda s: s["config"]["recipe"].update(model="resnet"),
    "a flag": lambda s: s["config"]["data"].update(synthetic=False),
    "an unset value set": lambda s: s["config"]["data"].update(root=""),
    "a key renamed": lambda s: s["config"].update(data={"synthetic_": True, "root": None}),
    "a value's type": lambda s: s.update(step=41.0),
}


def test_a_changed_non_tensor_value_in_a_sealed_checkpoint_breaks_its_seal(tmp_path):
    """The seal is a digest of every value, not only the tensors: an epoch, a step, the history, a setting
    changed after the checkpoint was written is one line (exit 2), whatever reads it."""
    state = _state({"data": {"synthetic": True, "root": None}})
    state["step"] = 40
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    checkpoint.save_atomic(state, path)
    for what, change in CHANGES.items():
        edited = torch.load(path, weights_only=True)
        change(edited)
        torch.save(edited, tmp_path / "edited.pt")
        with pytest.raises(LaunchError) as err:
            resume.load_checkpoint(tmp_path / "edited.pt", "resume")
        line = str(err.value)
        assert err.value.exit_code == 2 and "its contents differ from the digest written with it" in line, what
        assert "\n" not in line
    assert resume.load_checkpoint(path, "resume")["step"] == 40  # (unchanged: whole)


def test_a_set_in_a_checkpoint_keeps_its_seal_whatever_order_it_iterates_in(tmp_path):
    """A set of strings (a module's extra state, say) iterates in an order each process's hash seed makes:
    the digest was of that order, so the checkpoint read by another process looked changed. Here the same
    set in two orders (ints colliding in the table, as strings do across processes)."""
    first, second = set(), set()
    for n in (1, 9):
        first.add(n)
    for n in (9, 1):
        second.add(n)
    assert list(first) != list(second) and first == second
    state = _state({})
    checkpoint.save_atomic({**state, "tags": first}, tmp_path / "run" / "checkpoints" / "last.pt")
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    torch.save({**saved, "tags": second}, tmp_path / "read-elsewhere.pt")
    assert resume.load_checkpoint(tmp_path / "read-elsewhere.pt", "resume")["tags"] == {1, 9}
    saved["tags"].add(2)
    assert "its contents differ" in integrity.broken_seal(saved, tmp_path / "x.pt")


def test_latest_is_the_checkpoint_written_last_whatever_the_run_dirs_names_say(tmp_path, monkeypatch, capsys):
    """Two runs where the name-later one (started later) holds the older last.pt: the earlier run went on
    training, or was resumed in place. `latest` is the one written last, and `launch runs`, which lists
    runs by when they started, says which run that is."""
    import json
    import time

    from launcher.host import runs

    outputs = tmp_path / "outputs"
    named_later = outputs / "2026-11-02" / "10-00-00-digits-bbbb"
    named_earlier = outputs / "2026-11-01" / "09-00-00-digits-aaaa"
    now = time.time()
    for run, written in ((named_later, now - 3600), (named_earlier, now)):
        checkpoint.save_atomic(_state({}), run / "checkpoints" / "last.pt")
        os.utime(run / "checkpoints" / "last.pt", (written, written))
        (run / "plan.json").write_text("{}")
    meant = named_earlier / "checkpoints" / "last.pt"
    assert resume.resolve("latest", outputs) == meant
    monkeypatch.chdir(tmp_path)
    assert f"eval.checkpoint='{meant.resolve()}'" in evaluate.command_line(["eval", "latest"])
    assert runs.main(["--json"], root=tmp_path) == 0
    marked = [r["dir"] for r in json.loads(capsys.readouterr().out) if r["resume_latest"]]
    assert marked == [str(named_earlier)]
    assert runs.main([], root=tmp_path) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        f"resume=latest and launch eval latest: {named_earlier} (its checkpoint, written ")


def test_a_sharded_checkpoints_files_hashed_side_by_side_keep_their_own_digests(tmp_path):
    """The seal's shard files are hashed a thread a file (an 8B run's state is ~96 GB in a file a rank, hashed
    when it is written and again before a resume): each digest must still be its own file's, and a damaged
    file among several named as the one damaged."""
    import hashlib

    folder = tmp_path / "epoch-1.dcp"
    folder.mkdir()
    for i in range(5):
        (folder / f"__{i}_0.distcp").write_bytes(bytes([i]) * (integrity.FILE_CHUNK + 1000 * i))
    (folder / ".metadata").write_bytes(b"meta")
    digests = integrity.folder_digests(folder)
    assert digests == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    state = {"epoch": 1, "sharded": folder.name}
    integrity.seal(state, None, folder)
    assert integrity.broken_seal(state, tmp_path / "last.pt") is None
    damaged = folder / "__3_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x07")
    assert integrity.broken_seal(state, tmp_path / "last.pt") == (
        f"its shard file {damaged} differs from the digest written with it (changed or damaged)")
