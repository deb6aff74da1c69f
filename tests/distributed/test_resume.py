"""`resume=`: the checkpoint's training state continues with the checkpoint's settings, changed only
where this command line says so (docs/runs.md, "Resuming"); what cannot continue is refused in one line before
any worker starts, and a resumed run really starts after the checkpoint's epoch (a run from scratch is
deterministic too, so the tests look at what only a resume does)."""

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

STEPS = 1438 // 64  # digits: steps per epoch at batch 64


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def one_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("launch:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, warm_launcher):
    """A 2-epoch digits run to resume from (copied per test, so tests never share a run dir)."""
    from tests.conftest import warm_or_cold

    where = tmp_path_factory.mktemp("first")
    done = warm_or_cold(warm_launcher, where, ("gpus=[]", "epochs=2", "hydra.run.dir=first"))
    assert done.returncode == 0, done.output
    return where / "first"


@pytest.fixture
def first(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "first")
    return tmp_path / "first"


def test_a_resume_trains_with_the_new_settings_and_records_them(launch, first, tmp_path):
    result = launch("gpus=[]", "epochs=4", "resume=first", "hydra.run.dir=second", "lr=0.005",
                    "optim.weight_decay=0.1", "optim.momentum=0.5", "optim.decay=cosine", "optim.min_lr_ratio=0.1")
    assert result.returncode == 0, result.output
    second = tmp_path / "second"
    got = rows(second)
    assert [r["epoch"] for r in got] == [1, 2, 3, 4]
    assert got[:2] == rows(first)  # epochs 1-2 are the checkpoint's history, not trained again
    # epoch 3 ends at step 3*STEPS of 4*STEPS, warm-up 1 epoch: this command's lr on this command's schedule,
    # a cosine from 0.005 down to a tenth of it, a third of its way left there
    left = (4 * STEPS - 3 * STEPS) / (4 * STEPS - STEPS)
    assert got[2]["lr"] == pytest.approx(0.005 * (0.1 + 0.9 * 0.5 * (1 - math.cos(math.pi * left))))
    assert got[3]["lr"] == pytest.approx(0.0005)  # (the run's end: the floor, not 0)
    assert (f"optim: sgd, lr 0.005: a linear warm-up over {STEPS} steps, then a cosine decay to 0.0005 at step "
            f"{4 * STEPS} (4 epochs of {STEPS} steps)") in result.output, result.output
    state = torch.load(second / "checkpoints" / "last.pt", weights_only=True)
    group = state["optimizer_state_dicts"][0]["param_groups"][0]
    assert group["weight_decay"] == 0.1 and group["momentum"] == 0.5 and group["initial_lr"] == 0.005
    plan = json.loads((second / "plan.json").read_text())
    assert plan["resume"]["epoch"] == 2
    assert plan["resume"]["changed"] == {"optim.weight_decay": [0.0005, 0.1], "optim.momentum": [0.9, 0.5],
                                         "optim.decay": ["linear", "cosine"], "optim.min_lr_ratio": [0.0, 0.1],
                                         "epochs": [2, 4], "lr": [0.05, 0.005]}
    assert "changed here: optim.weight_decay 0.0005 -> 0.1" in result.stdout
    assert json.loads((second / "results.json").read_text())["resumed_from"] == str(first / "checkpoints" / "last.pt")


def test_a_crashed_run_resumed_with_nothing_else_typed_ends_as_if_never_stopped(launch, tmp_path):
    """`launch resume=RUN` alone: the run's own settings (epochs, lr, batch size, momentum), not the
    defaults; its last epochs are trained once more and its weights are those of a run never stopped."""
    settings = ("gpus=[]", "epochs=3", "lr=0.02", "batch_size=32", "optim.momentum=0.8")
    crashed = launch(*settings, "fault.rank=0", "fault.step=60", "fault.kind=exit", "hydra.run.dir=crashed")
    assert crashed.returncode == 1, crashed.output  # in epoch 2 (44 steps an epoch): epoch 1's checkpoint stays
    whole = launch(*settings, "hydra.run.dir=whole")
    assert whole.returncode == 0, whole.output

    result = launch("resume=crashed", "hydra.run.dir=resumed")
    assert result.returncode == 0, result.output
    assert "after epoch 1 with its settings" in result.stdout and "epochs 3 ->" not in result.stdout
    resumed = tmp_path / "resumed"
    assert [r["epoch"] for r in rows(resumed)] == [1, 2, 3]  # not the default 10 epochs
    assert [r["lr"] for r in rows(resumed)] == [r["lr"] for r in rows(tmp_path / "whole")]
    ours = torch.load(resumed / "checkpoints" / "last.pt", weights_only=True)
    theirs = torch.load(tmp_path / "whole" / "checkpoints" / "last.pt", weights_only=True)
    assert all(torch.equal(ours["net_state_dict"][k], v) for k, v in theirs["net_state_dict"].items())
    assert ours["optimizer_state_dicts"][0]["param_groups"][0]["momentum"] == 0.8
    plan = json.loads((resumed / "plan.json").read_text())
    assert set(plan["resume"]["changed"]) <= {"gpus"}  # the placement only: gpus [] -> auto
    assert plan["resume"]["epoch"] == 1


def test_resume_goes_with_hydras_flags_and_sweeps(launch, first):
    """The recipe and optimizer added for resume= keep the overrides one run of words (Hydra's parser
    refuses overrides split around --cfg job or -m)."""
    shown = launch("resume=first", "--cfg", "job", timeout=120)
    assert shown.returncode == 0 and "recipe:" in shown.stdout, shown.output
    planned = launch("-m", "resume=first", "epochs=4", "lr=0.3,0.4", "dry_run=true", timeout=120)
    assert planned.returncode == 0, planned.output
    lines = [x for x in planned.stdout.splitlines() if x.strip().startswith("training")]
    assert len(lines) == 2 and "lr=0.3" in lines[0] and "lr=0.4" in lines[1], planned.stdout
    resumes = [x for x in planned.stdout.splitlines() if x.strip().startswith("resume")]
    assert len(resumes) == 2 and all("resuming" in x for x in resumes), planned.stdout


def test_ctrl_c_while_a_resume_reads_its_checkpoint_is_one_line(first, tmp_path):
    """Reading the checkpoint on the command line imports torch in the launcher: Ctrl-C there (to the
    whole process group, as a terminal sends it) ends it with exit 130 and one line, no traceback."""
    import signal
    import subprocess
    import time

    from tests.conftest import clean_env, descendants, launch_command, running

    proc = subprocess.Popen(launch_command("resume=first", "epochs=4"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while not running(descendants(proc.pid), b"multiprocessing.forkserver") and time.monotonic() < deadline:
        time.sleep(0.01)  # (started just before the checkpoint is read)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("launch: interrupted"), err


def test_ctrl_c_after_a_checkpoint_says_how_to_go_on(tmp_path):
    import signal
    import subprocess
    import time

    from tests.conftest import clean_env, launch_command

    proc = subprocess.Popen(launch_command("gpus=[]", "epochs=200", "hydra.run.dir=run"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    said = re.search(rf"launch resume={re.escape(str(tmp_path / 'run'))} gpus=\[\] goes on from its checkpoint "
                     r"\(epoch (\d+)"
                     r"(; epoch \d+'s checkpoint was not finished)?\)$", err.strip().splitlines()[-1])
    assert said, err
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["epoch"] == int(said[1])


def test_a_resume_takes_a_user_recipe_and_its_values_from_the_checkpoint(launch, tmp_path):
    """No recipe= on the resuming command line: the checkpoint's (a user's module) with its values."""
    shutil.copytree(Path(__file__).parents[2] / "examples" / "my_pkg", tmp_path / "my_pkg")
    first = launch("recipe=my_pkg.my_recipe", "gpus=[]", "batch_size=32", "epochs=1", "recipe.hidden=16",
                   "hydra.run.dir=narrow")
    assert first.returncode == 0, first.output
    result = launch("resume=narrow", "epochs=2", "hydra.run.dir=more")
    assert result.returncode == 0, result.output
    assert "recipe.hidden" not in result.stdout and "epochs 1 -> 2" in result.stdout
    config = (tmp_path / "more" / "config.yaml").read_text()
    assert "name: my_pkg.my_recipe" in config and "hidden: 16" in config and "batch_size: 32" in config
    assert [r["epoch"] for r in rows(tmp_path / "more")] == [1, 2]


def _write_bad_files(where: Path, good: Path) -> dict[str, str]:
    state = torch.load(good, weights_only=True)
    (where / "empty.pt").write_bytes(b"")
    (where / "truncated.pt").write_bytes(good.read_bytes()[:2000])
    (where / "random.pt").write_bytes(bytes(range(256)) * 20)
    (where / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/bin/false\n")
    (where / "pickled.pt").write_bytes(b"\x80\x04K\x01.")  # (a pickle, not a zip: torch 2.13+ raises IndexError)
    torch.save(state["net_state_dict"], where / "weights.pt")
    torch.save(torch.ones(3), where / "tensor.pt")
    torch.save({**state, "epoch": "2"}, where / "epoch-text.pt")  # (edited by hand, or not by launch)
    torch.save({**state, "config": {"recipe": "digits"}}, where / "config-flat.pt")
    hostile = {**state["config"], "recipe": {**state["config"]["recipe"], "name": "digits hydra.run.dir=/"}}
    torch.save({**state, "config": hostile}, where / "recipe-override.pt")  # (would be added to the command line)
    return {"empty.pt": "the file is empty", "truncated.pt": "truncated", "random.pt": "not written by torch.save",
            "passwd": "not written by torch.save", "pickled.pt": "does not load with weights_only=True",
            "weights.pt": "a plain state_dict", "tensor.pt": "a single tensor",
            "epoch-text.pt": "its epoch is '2', not a count of epochs",
            "config-flat.pt": "its config is not the settings a launch writes",
            "recipe-override.pt": "its recipe is 'digits hydra.run.dir=/', not a recipe name"}


def test_a_file_that_is_not_a_launch_checkpoint_is_named_for_what_it_is(first, tmp_path):
    from launcher.errors import LaunchError
    from launcher.host.resume import load_checkpoint

    for name, why in _write_bad_files(tmp_path, first / "checkpoints" / "last.pt").items():
        with pytest.raises(LaunchError) as refused:
            load_checkpoint(tmp_path / name, f"resume={name}")
        assert str(refused.value).startswith(f"resume={name} is not valid:") and why in str(refused.value), name
        assert "is not a launch checkpoint" in str(refused.value)


def test_resuming_from_a_file_that_is_not_a_checkpoint_is_one_line_before_any_worker(launch, tmp_path):
    (tmp_path / "random.pt").write_bytes(bytes(range(256)) * 20)
    result = launch("gpus=[]", "epochs=3", "resume=random.pt", timeout=120)
    assert result.returncode == 2, result.output
    assert "resume=random.pt is not valid:" in one_line(result.stderr)
    assert not (tmp_path / "outputs").exists()  # nothing started, nothing left


@pytest.mark.parametrize(("change", "expected"), [
    ("optim=adamw", "optim=adamw is not valid with resume=R: the checkpoint was trained with optim=sgd"),
    ("recipe=cifar10", "recipe=cifar10 is not valid with resume=R: the checkpoint was trained with recipe=digits"),
    ("epochs=2", "epochs=2 is not valid with resume=R: the checkpoint has trained 2 epochs already"),
])
def test_what_a_checkpoint_cannot_continue_under_is_refused(first, change, expected):
    from launcher.errors import LaunchError
    from launcher.host.resume import inspect
    from tests.conftest import config_of

    cfg = config_of("gpus=[]", "epochs=3", "data.synthetic=true", change)
    with pytest.raises(LaunchError) as refused:
        inspect(str(first), cfg)
    assert expected.replace("resume=R", f"resume={first}") in str(refused.value)


def test_a_refusal_comes_before_any_worker_and_leaves_nothing(launch, first):
    result = launch("gpus=[]", "epochs=3", "resume=first", "optim=adamw", timeout=120)
    assert result.returncode == 2, result.output
    assert "optim=adamw is not valid with resume=first" in one_line(result.stderr)
    assert not result.run_dirs()


def test_a_network_of_another_shape_is_one_line(launch, tmp_path):
    shutil.copytree(Path(__file__).parents[2] / "examples" / "my_pkg", tmp_path / "my_pkg")
    base = ("recipe=my_pkg.my_recipe", "gpus=[]", "batch_size=32")
    first = launch(*base, "epochs=1", "recipe.hidden=16", "hydra.run.dir=narrow")
    assert first.returncode == 0, first.output
    result = launch(*base, "epochs=2", "recipe.hidden=32", "resume=narrow")
    assert result.returncode == 2, result.output
    line = one_line(result.stderr)
    assert "the checkpoint does not fit the network this config builds" in line and "recipe.hidden=16" in line


def test_an_fp16_resume_keeps_the_gradient_scalers_scale(launch, tmp_path):
    """perf.precision=fp16: the scale the scaler found (its first step overflowed at 65536 and was skipped) is
    in the checkpoint, so the resumed epoch does not skip steps to find it again."""
    # (batch_size=8: digits' first fp16 step overflows at 65536 with batches this small, not at 64; at width 4
    # as at the default 16, for a sixth of the CPU: fp16 convolutions are slow on a CPU)
    fp16 = ("gpus=[]", "perf.precision=fp16", "batch_size=8", "recipe.width=4")
    first = launch(*fp16, "epochs=1", "hydra.run.dir=fp16-first")
    assert first.returncode == 0, first.output
    assert rows(tmp_path / "fp16-first")[0]["overflow_steps"] == 1
    saved = torch.load(tmp_path / "fp16-first" / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert float(saved["grad_scaler"]["scale"]) == 32768.0
    resumed = launch(*fp16, "epochs=2", "hydra.run.dir=fp16-resumed", f"resume={tmp_path / 'fp16-first'}")
    assert resumed.returncode == 0, resumed.output
    assert [r["overflow_steps"] for r in rows(tmp_path / "fp16-resumed")] == [1, 0]  # (epoch 1: the checkpoint's)
    # the scale went on from the checkpoint's (afresh it would be back at 65536: an overflow is the only way down)
    again = torch.load(tmp_path / "fp16-resumed" / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert float(again["grad_scaler"]["scale"]) == 32768.0


def test_a_run_saved_before_a_recipe_key_existed_resumes_and_evaluates_the_network_it_trained(launch, tmp_path):
    """recipe=digits gained recipe.width (16) after runs were saved with 32 channels and no such key: their resume
    and `launch eval` build the 32-channel network (RecipeConfig.before_keys), with nothing typed."""
    first = launch("gpus=[]", "epochs=1", "recipe.width=32", "hydra.run.dir=old")
    assert first.returncode == 0, first.output
    last = tmp_path / "old" / "checkpoints" / "last.pt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    del state["config"]["recipe"]["width"]  # (as a run saved before the key existed; sealed again, as saved)
    from launcher.train.checkpoint import save_atomic

    save_atomic(state, last)
    resumed = launch("gpus=[]", "epochs=2", f"resume={tmp_path / 'old'}", "hydra.run.dir=resumed")
    assert resumed.returncode == 0, resumed.output
    assert [r["epoch"] for r in rows(tmp_path / "resumed")] == [1, 2]
    assert "  width: 32\n" in (tmp_path / "resumed" / "config.yaml").read_text()  # (what it ran with, recorded)
    evaluated = launch("eval", str(tmp_path / "old"), "gpus=[]")
    assert evaluated.returncode == 0, evaluated.output
    assert "test accuracy" in evaluated.stdout
