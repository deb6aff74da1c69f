"""Issue 14 on GPUs: a resume that takes the new lr, `launch eval` on two GPUs, and a two-GPU launch whose
stores and NCCL bootstrap listen on loopback only (NCCL_SOCKET_IFNAME==lo must not break NCCL)."""

import json
import subprocess

import pytest

from tests.conftest import clean_env, descendants, is_loopback, launch_command, listening_sockets, stop_tree

two_gpus = pytest.mark.two_gpus
RUN = ("recipe=cifar10", "data.synthetic=true", "recipe.model=resnet18", "batch_size=512")


@two_gpus
def test_resume_with_a_new_lr_then_eval_on_two_gpus(launch, tmp_path):
    first = launch(*RUN, "epochs=2", "gpus=[0,1]", "hydra.run.dir=first", timeout=600)
    assert first.returncode == 0, first.output
    second = launch(*RUN, "epochs=3", "gpus=[0,1]", "resume=first", "lr=0.01", "hydra.run.dir=second", timeout=600)
    assert second.returncode == 0, second.output
    plan = json.loads((tmp_path / "second" / "plan.json").read_text())
    assert plan["resume"]["changed"]["lr"][1] == 0.01
    rows = [json.loads(x) for x in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[2]["lr"] < 0.01
    evaluated = launch("eval", "second", "gpus=[0,1]", timeout=600)
    assert evaluated.returncode == 0, evaluated.output
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/eval.json")]
    trained = json.loads((tmp_path / "second" / "results.json").read_text())
    assert report["device_type"] == "cuda" and report["world_size"] == 2
    assert report["test_acc"] == pytest.approx(trained["test_acc"], abs=0.01)  # bf16 on both; TTA as trained


@two_gpus
def test_a_two_gpu_launch_listens_on_loopback_only(tmp_path):
    proc = subprocess.Popen(launch_command(*RUN, "epochs=200", "gpus=[0,1]"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
    try:
        for line in proc.stdout:
            if line.startswith("epoch"):
                break
        sockets = listening_sockets({proc.pid} | descendants(proc.pid))
        assert sockets and all(is_loopback(s) for s in sockets), sorted(sockets)
    finally:
        stop_tree(proc.pid)
