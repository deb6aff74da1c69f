"""The plan the launcher makes before any worker starts: devices, strategy and the worker environment."""

import os

import pytest
from hydra import compose, initialize_config_module

from launcher import plan as plan_module
from launcher.config import ConfigError, register
from launcher.distenv import WorldInfo
from launcher.plan import make_plan


@pytest.fixture
def cuda_build(monkeypatch):
    monkeypatch.setattr(plan_module, "torch_has_cuda", lambda: True)


def composed(*overrides):
    register()
    with initialize_config_module(config_module="launcher.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_gpu_list_becomes_the_workers_mask(cuda_build):
    plan = make_plan(composed("gpus=[1,3]"), env={}, physical_count=4)
    assert plan.layout.strategy == "ddp" and plan.layout.nprocs == 2
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_gpu_workers_get_one_cpu_thread_unless_the_user_chose(cuda_build):
    # torchrun's default for GPU workers; CPU workers share the cores instead (below).
    assert make_plan(composed("gpus=[0,1]"), env={}, physical_count=2).env["OMP_NUM_THREADS"] == "1"
    chosen = make_plan(composed("gpus=[0,1]"), env={"OMP_NUM_THREADS": "4"}, physical_count=2)
    assert "OMP_NUM_THREADS" not in chosen.env  # inherited as the user set it


def test_inherited_mask_is_respected(cuda_build):
    plan = make_plan(composed("gpus=[0]"), env={"CUDA_VISIBLE_DEVICES": "6,7"}, physical_count=8)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "6" and plan.layout.strategy == "single"


def test_cpu_runs_hide_the_gpus_and_share_the_cores(cuda_build):
    plan = make_plan(composed("gpus=[]", "strategy=ddp", "nprocs=2"), env={}, physical_count=2)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "" and plan.layout.dist_backend == "gloo"
    assert int(plan.env["OMP_NUM_THREADS"]) == max(1, len(os.sched_getaffinity(0)) // 2)


def test_cpu_threads_follow_a_slurm_allocation_not_the_whole_host(cuda_build):
    env = {"SLURM_CPUS_ON_NODE": "8"}
    plan = make_plan(composed("gpus=[]", "strategy=ddp", "nprocs=2"), env=env, physical_count=0)
    assert plan.env["OMP_NUM_THREADS"] == "4"


def test_gpus_with_a_cpu_build_of_torch_is_refused(monkeypatch):
    monkeypatch.setattr(plan_module, "torch_has_cuda", lambda: False)
    with pytest.raises(ConfigError, match="CPU build"):
        make_plan(composed("gpus=[0]"), env={}, physical_count=1)


def test_joined_world_gets_one_gpu_per_local_rank_and_the_env_contract(cuda_build):
    world = WorldInfo(rank=3, local_rank=1, world_size=4, local_world_size=2, master_addr="node1", master_port=29400)
    plan = make_plan(composed("gpus=auto"), joined=world, env={}, physical_count=2)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1" and plan.env["RANK"] == "3" and plan.env["WORLD_SIZE"] == "4"
    assert plan.layout.strategy == "ddp" and plan.layout.world_size == 4 and plan.layout.dist_backend == "nccl"


def test_joined_world_refuses_dp(cuda_build):
    world = WorldInfo(0, 0, 2, 2, "localhost", 1)
    with pytest.raises(ConfigError, match="which is ddp"):
        make_plan(composed("strategy=dp"), joined=world, env={}, physical_count=2)


def test_auto_gpus_with_single_takes_the_first_gpu(cuda_build):
    plan = make_plan(composed("strategy=single"), env={}, physical_count=2)
    assert plan.gpu_ids == [0] and plan.layout.strategy == "single"
    with pytest.raises(ConfigError, match="single uses one device"):
        make_plan(composed("strategy=single", "gpus=[0,1]"), env={}, physical_count=2)


def test_a_count_on_a_shared_machine_masks_the_least_busy_gpus(cuda_build):
    from launcher.gpus import GpuLoad

    loads = [GpuLoad(0, "H200", 5.0, 140.0, 99), GpuLoad(1, "H200", 139.0, 140.0, 0)]
    plan = make_plan(composed("gpus=1"), env={}, physical_count=2, loads=loads)
    assert plan.gpu_ids == [1] and plan.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "chose GPU [1]" in plan.gpu_choice and "passed over busy GPU 0" in plan.gpu_choice


def test_a_count_on_an_idle_machine_takes_the_first_gpus_whatever_their_driver_memory():
    from launcher.gpus import GpuLoad, least_busy

    idle = [GpuLoad(i, "H200", 139.5 - 0.2 * (i % 3), 140.0, 0) for i in range(8)]
    assert least_busy(idle, 2)[0] == [0, 1]
    # one GPU running a small job: the idle ones still come first, in index order
    in_use = [GpuLoad(0, "H200", 120.0, 140.0, 20), *idle[1:]]
    assert least_busy(in_use, 2)[0] == [1, 2]
