"""How a sweep on this host shares the GPUs between its runs (made-up inventories, no processes)."""

from pathlib import Path

from launcher.sweep import GpuPool, GpuRequest, SweepJob, child_overrides, gpu_request, swept_keys


def test_what_each_gpus_value_asks_for():
    assert gpu_request(1, "auto", 2) == GpuRequest(1)
    assert gpu_request([1], "auto", 2) == GpuRequest(1, (1,))
    assert gpu_request([], "auto", 2) == GpuRequest(0)
    assert gpu_request("auto", "single", 2) == GpuRequest(1)  # as the plan reads auto under single
    assert gpu_request("auto", "auto", 2) == GpuRequest(2)
    assert gpu_request("auto", "auto", 0) == GpuRequest(0)  # no GPU: a CPU run
    assert gpu_request("all", "ddp", 4) == GpuRequest(4)


def test_a_two_gpu_host_runs_two_one_gpu_runs_at_once_on_different_gpus():
    pool = GpuPool(visible=2)
    first, second = pool.take(GpuRequest(1)), pool.take(GpuRequest(1))
    assert (first, second) == ([0], [1])  # the runs' CUDA_VISIBLE_DEVICES become 0 and 1
    assert pool.take(GpuRequest(1)) is None  # a third waits
    pool.give_back(first)
    assert pool.take(GpuRequest(1)) == [0]


def test_a_four_gpu_host_packs_two_gpu_and_one_gpu_runs():
    pool = GpuPool(visible=4)
    assert pool.take(GpuRequest(2)) == [0, 1]
    assert pool.take(GpuRequest(1)) == [2]
    assert pool.take(GpuRequest(2)) is None  # only GPU 3 is free
    assert pool.take(GpuRequest(1)) == [3]


def test_named_gpus_wait_for_exactly_those():
    pool = GpuPool(visible=2)
    assert pool.take(GpuRequest(1, (1,))) == [1]
    assert pool.take(GpuRequest(1, (1,))) is None
    assert pool.take(GpuRequest(1)) == [0]


def test_a_run_larger_than_the_host_goes_alone_and_fails_by_itself():
    pool = GpuPool(visible=2)
    assert pool.take(GpuRequest(4)) == [0, 1]  # the child then reports that 4 GPUs are not there
    pool.give_back([0, 1])
    held = pool.take(GpuRequest(1))
    assert pool.take(GpuRequest(4)) is None and held == [0]


def test_cpu_runs_take_turns_unless_told_otherwise():
    one, two = GpuPool(visible=0), GpuPool(visible=0, cpu_slots=2)
    assert one.take(GpuRequest(0)) == [] and one.take(GpuRequest(0)) is None
    assert two.take(GpuRequest(0)) == [] and two.take(GpuRequest(0)) == []


def test_the_child_gets_its_gpus_and_the_jobs_run_dir():
    job = SweepJob(3, ["batch_size=512", "gpus=1"], Path("/sweep/3"), GpuRequest(1), gpus=[1])
    assert child_overrides(job) == ["batch_size=512", "gpus=[1]", "hydra.run.dir=/sweep/3"]


def test_the_swept_keys_are_the_ones_that_differ():
    jobs = [SweepJob(i, ["recipe=digits", f"batch_size={b}", "epochs=2"], Path("."), GpuRequest(0))
            for i, b in enumerate((32, 64))]
    assert swept_keys(jobs) == ["batch_size"]
