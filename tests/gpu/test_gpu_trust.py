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


@pytest.mark.parametrize("gpus", ["[0]", pytest.param("[0,1]", marks=two_gpus)])
def test_a_captured_resnet_run_resumes_in_its_fused_optimizer(launch, tmp_path, gpus):
    """ResNet-18's filters are channels_last on a GPU; its checkpoint holds the momentum contiguous (host
    snapshots are). Resumed, the fused SGD refused the mixed strides in the first step (it failed so on
    2x H200 in the warm-up before the capture). The resumed run trains its next epoch on CUDA."""
    first = launch(*RUN, "epochs=1", f"gpus={gpus}", "hydra.run.dir=first", timeout=600)
    assert first.returncode == 0, first.output
    second = launch(*RUN, "epochs=2", f"gpus={gpus}", "resume=first", "hydra.run.dir=second", timeout=600)
    assert second.returncode == 0, second.output
    rows = [json.loads(x) for x in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    results = json.loads((tmp_path / "second" / "results.json").read_text())
    assert [r["epoch"] for r in rows] == [1, 2] and results["device_type"] == "cuda" and results["cuda_graph"]
    assert rows[1]["loss"] < rows[0]["loss"]


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


@pytest.mark.parametrize("optim", ["adamw", "sgd"])  # (muon: recipe=cifar10_fast, too slow on a CPU)
def test_a_checkpoint_moves_between_the_cpu_and_a_captured_gpu_step(launch, tmp_path_factory, optim):
    """A run trained on the CPU (unfused optimizers, their step counts CPU tensors) resumes on a GPU whose
    step is one CUDA graph, the optimizer inside it (fused/capturable: step counts on the GPU, updated by
    address), and that run's checkpoint resumes on the CPU again: each continues at the next epoch and
    keeps learning."""
    cpu = tmp_path_factory.mktemp(f"cpu-{optim}")  # (outside tmp_path: its results say device_type cpu)
    gpu = tmp_path_factory.mktemp(f"gpu-{optim}")
    lr = ("lr=1e-3",) if optim == "adamw" else ()
    first = launch("gpus=[]", f"optim={optim}", *lr, "epochs=2", f"hydra.run.dir={cpu / 'first'}", timeout=300)
    assert first.returncode == 0, first.output
    second = launch("gpus=[0]", f"optim={optim}", *lr, "epochs=4", "perf.cuda_graph=true", f"resume={cpu / 'first'}",
                    f"hydra.run.dir={gpu / 'second'}", timeout=300)
    assert second.returncode == 0, second.output
    third = launch("gpus=[]", f"optim={optim}", *lr, "epochs=5", f"resume={gpu / 'second'}",
                   f"hydra.run.dir={cpu / 'third'}", timeout=300)
    assert third.returncode == 0, third.output
    results = {name: json.loads((folder / name / "results.json").read_text())
               for folder, name in ((cpu, "first"), (gpu, "second"), (cpu, "third"))}
    assert [r["device_type"] for r in results.values()] == ["cpu", "cuda", "cpu"]
    rows = [json.loads(x) for x in (gpu / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]
    assert results["second"]["cuda_graph"] is True  # it ran the captured step
    # moments and step counts carried over: no restart-from-scratch jump in the loss at epoch 3
    assert rows[2]["loss"] < rows[1]["loss"] * 1.25, rows
    assert results["third"]["test_acc"] >= results["first"]["test_acc"] - 0.02, results
