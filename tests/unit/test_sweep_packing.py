"""How a sweep on this host shares the GPUs between its runs (made-up inventories, no processes)."""

from pathlib import Path

from launcher.host.packing import GpuPool, Need
from launcher.host.sweep import SweepJob, swept_keys


def test_a_two_gpu_host_runs_two_one_gpu_runs_at_once_on_different_gpus():
    pool = GpuPool(visible=2)
    first, second = pool.take(Need(1)), pool.take(Need(1))
    assert (first, second) == ([0], [1])  # the runs' CUDA_VISIBLE_DEVICES become 0 and 1
    assert pool.take(Need(1)) is None  # a third waits
    pool.give_back(first)
    assert pool.take(Need(1)) == [0]


def test_a_four_gpu_host_packs_two_gpu_and_one_gpu_runs():
    pool = GpuPool(visible=4)
    assert pool.take(Need(2)) == [0, 1]
    assert pool.take(Need(1)) == [2]
    assert pool.take(Need(2)) is None  # only GPU 3 is free
    assert pool.take(Need(1)) == [3]


def test_named_gpus_wait_for_exactly_those():
    pool = GpuPool(visible=2)
    assert pool.take(Need(1, (1,))) == [1]
    assert pool.take(Need(1, (1,))) is None
    assert pool.take(Need(1)) == [0]


def test_cpu_runs_take_turns_unless_told_otherwise():
    one, two = GpuPool(visible=0), GpuPool(visible=0, cpu_slots=2)
    assert one.take(Need(0)) == [] and one.take(Need(0)) is None
    assert two.take(Need(0)) == [] and two.take(Need(0)) == []


def test_the_swept_keys_are_the_ones_that_differ():
    jobs = [SweepJob(i, ["recipe=digits", f"batch_size={b}", "epochs=2"], None, None, Path("."))
            for i, b in enumerate((32, 64))]
    assert swept_keys(jobs) == ["batch_size"]


def test_a_finished_runs_line_shows_its_objective_and_throughput(tmp_path, capsys):
    """The line a sweep prints as each run ends said `no test` for a run ranked by test_rmse."""
    import json
    import time
    from types import SimpleNamespace

    from launcher.host.packing import SideBySide, _Running

    def finished(results: dict, objective: str) -> str:
        run = tmp_path / str(len(list(tmp_path.iterdir())))
        run.mkdir()
        (run / "results.json").write_text(json.dumps(results))
        (run / "result.json").write_text(json.dumps({"exit_code": 0}))
        job = SweepJob(0, ["recipe=regression"], None, SimpleNamespace(sweep=SimpleNamespace(objective=objective)),
                       run)
        SideBySide._finished(SimpleNamespace(), _Running(job, None, run / "result.json", time.monotonic()), 0)
        return capsys.readouterr().out

    own = {"test_acc": None, "objective": "test_rmse", "test_rmse": 0.4354, "final": {"samples_per_s": 23305.0}}
    assert ": test_rmse 0.4354, 23,305 samples/s\n" in finished(own, "test_rmse")
    assert ": test_rmse 0.4354, 23,305 samples/s\n" in finished(own, "test_acc")  # (ranked by its first figure)
    assert ": test acc 74.92%, 1,200 img/s\n" in finished({"test_acc": 0.7492, "final": {"img_per_s": 1200.0}},
                                                         "test_acc")
