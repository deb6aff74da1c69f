"""The plan the launcher makes before any worker starts: devices, strategy and the worker environment."""

import os

import pytest

from launcher.config import Toggle
from launcher.errors import ConfigError
from launcher.host import plan as plan_module
from launcher.host.gpus import GpuLoad, least_busy
from launcher.host.plan import make_plan
from launcher.world import WorldInfo
from tests.conftest import config_of


@pytest.fixture
def cuda_build(monkeypatch):
    monkeypatch.setattr(plan_module, "torch_has_cuda", lambda: True)


def test_gpu_list_becomes_the_workers_mask(cuda_build):
    plan = make_plan(config_of("gpus=[1,3]"), env={}, physical_count=4)
    assert plan.strategy.name == "ddp" and plan.strategy.processes == 2
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_gpu_workers_get_one_cpu_thread_unless_the_user_chose(cuda_build):
    # torchrun's default for GPU workers; CPU workers share the cores instead (below).
    assert make_plan(config_of("gpus=[0,1]"), env={}, physical_count=2).env["OMP_NUM_THREADS"] == "1"
    chosen = make_plan(config_of("gpus=[0,1]"), env={"OMP_NUM_THREADS": "4"}, physical_count=2)
    assert "OMP_NUM_THREADS" not in chosen.env  # inherited as the user set it


def test_inherited_mask_is_respected(cuda_build):
    plan = make_plan(config_of("gpus=[0]"), env={"CUDA_VISIBLE_DEVICES": "6,7"}, physical_count=8)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "6" and plan.strategy.name == "single"


def test_cpu_runs_hide_the_gpus_and_share_the_cores(cuda_build):
    plan = make_plan(config_of("gpus=[]", "strategy=ddp", "nprocs=2"), env={}, physical_count=2)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "" and plan.strategy.process_group_backend == "gloo"
    assert int(plan.env["OMP_NUM_THREADS"]) == max(1, len(os.sched_getaffinity(0)) // 2)


@pytest.mark.parametrize(("cores", "nprocs", "threads"), [(16, 2, 8), (16, 1, 16), (3, 2, 1), (1, 2, 1)])
def test_cpu_ranks_split_the_cores_the_launch_may_use(cuda_build, cores, nprocs, threads):
    """Stated as numbers (SLURM's count of this job's CPUs), not as the formula again."""
    plan = make_plan(config_of("gpus=[]", "strategy=ddp", f"nprocs={nprocs}"), env={"SLURM_CPUS_ON_NODE": str(cores)},
                     physical_count=0)
    assert plan.env["OMP_NUM_THREADS"] == str(threads)


def test_cpu_threads_follow_a_slurm_allocation_not_the_whole_host(cuda_build):
    env = {"SLURM_CPUS_ON_NODE": "8"}
    plan = make_plan(config_of("gpus=[]", "strategy=ddp", "nprocs=2"), env=env, physical_count=0)
    assert plan.env["OMP_NUM_THREADS"] == "4"


def _cpu_epoch_advice(monkeypatch, caplog, load: float, threads: int, worker_env: dict) -> list[str]:
    """What a CPU run's rank 0 logs after its second epoch (EpochEnds._advise) with `threads` torch threads on a
    2-core machine whose load average is `load`; `worker_env`: what launch put in the workers' env."""
    import logging
    from types import SimpleNamespace

    import torch

    from launcher.train.epoch_end import EpochEnds

    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    ends = SimpleNamespace(device=torch.device("cpu"), cfg=SimpleNamespace(epochs=3),
                           strategy=SimpleNamespace(processes=1), env=worker_env)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="launcher.train"):
        EpochEnds._advise(ends, {"input_stall": 0.0}, 1, compiled=False)
    return [r.getMessage() for r in caplog.records]


def test_a_cpu_run_on_a_busy_machine_is_told_its_thread_count_and_how_to_change_it(monkeypatch, caplog):
    """A one-process CPU run with as many threads as cores, on a machine other work keeps busy, ran many
    times slower than with one thread and said nothing of its threads."""
    [said] = _cpu_epoch_advice(monkeypatch, caplog, 7.5, 2, {"OMP_NUM_THREADS": "2"})
    assert said.startswith("slow epochs? this machine is busy (load 7.5 on the 2 cores this run may use) and each "
                           "process trained with 2 threads (OMP_NUM_THREADS=2, launch's choice: the 2 cores this run "
                           "may use over its 1 process)"), said
    assert said.endswith("try OMP_NUM_THREADS=1 launch ... (or another count below 2)")
    [own] = _cpu_epoch_advice(monkeypatch, caplog, 7.5, 2, {})  # (the user's OMP_NUM_THREADS: launch left it)
    assert "(OMP_NUM_THREADS=2, OMP_NUM_THREADS as set where launch ran)" in own
    assert _cpu_epoch_advice(monkeypatch, caplog, 2.5, 2, {"OMP_NUM_THREADS": "2"}) == []  # its own threads' load
    assert _cpu_epoch_advice(monkeypatch, caplog, 7.5, 1, {"OMP_NUM_THREADS": "1"}) == []  # one thread already


def test_cuda_graphs_asked_for_on_the_cpu_are_said_to_run_uncaptured(cuda_build):
    """perf.cuda_graph=true on the CPU trains uncaptured (the captured step's flat all-reduce still syncs ddp's
    gradients, which the CPU tests use): a note says so, where the run went on in silence."""
    plan = make_plan(config_of("gpus=[]", "perf.cuda_graph=true"), env={}, physical_count=0)
    assert any(n.startswith("perf.cuda_graph=true: CUDA graphs replay steps on GPUs; this run on the CPU runs its "
                            "steps uncaptured") for n in plan.notes), plan.notes
    assert not any("cuda_graph" in n for n in make_plan(config_of("gpus=[]"), env={}, physical_count=0).notes)
    assert not any("cuda_graph" in n for n in make_plan(config_of("gpus=[0]", "perf.cuda_graph=true"), env={},
                                                        physical_count=1).notes)


def test_fsdp_on_one_process_says_it_shards_nothing(cuda_build):
    """strategy=fsdp gpus=[] without nprocs trained one unsharded process and said nothing of it."""
    one = make_plan(config_of("gpus=[]", "strategy=fsdp"), env={}, physical_count=0)
    assert "strategy=fsdp on one process shards nothing: its one rank holds the whole model (give nprocs=2 (CPU " \
           "ranks) to shard it)" in one.notes
    two = make_plan(config_of("gpus=[]", "strategy=fsdp", "nprocs=2"), env={}, physical_count=0)
    assert not any("shards nothing" in n for n in two.notes)


def test_gpus_with_a_cpu_build_of_torch_is_refused(monkeypatch):
    monkeypatch.setattr(plan_module, "torch_has_cuda", lambda: False)
    with pytest.raises(ConfigError, match="CPU build"):
        make_plan(config_of("gpus=[0]"), env={}, physical_count=1)


def test_joined_world_gets_one_gpu_per_local_rank_and_the_env_contract(cuda_build):
    world = WorldInfo(rank=3, local_rank=1, world_size=4, local_world_size=2, master_addr="node1", master_port=29400)
    plan = make_plan(config_of("gpus=auto"), joined=world, env={}, physical_count=2)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1" and plan.env["RANK"] == "3" and plan.env["WORLD_SIZE"] == "4"
    strategy = plan.strategy
    assert strategy.name == "ddp" and strategy.world_size == 4 and strategy.process_group_backend == "nccl"
    assert plan.device_index == 0  # its one GPU is cuda:0 in its own mask


def test_joined_world_refuses_dp(cuda_build):
    world = WorldInfo(0, 0, 2, 2, "localhost", 1)
    with pytest.raises(ConfigError, match="which is ddp"):
        make_plan(config_of("strategy=dp"), joined=world, env={}, physical_count=2)


def test_auto_gpus_with_single_takes_the_first_gpu(cuda_build):
    plan = make_plan(config_of("strategy=single"), env={}, physical_count=2)
    assert plan.gpu_ids == [0] and plan.strategy.name == "single"
    with pytest.raises(ConfigError, match="single uses one device"):
        make_plan(config_of("strategy=single", "gpus=[0,1]"), env={}, physical_count=2)


def test_dataparallel_turns_off_what_it_cannot_honour_and_says_so(cuda_build):
    plan = make_plan(config_of("recipe=cifar10", "gpus=[0,1]", "strategy=dp"), env={}, physical_count=2)
    assert plan.config.perf.cuda_graph is plan.config.perf.cudnn_benchmark is Toggle.false
    assert any("off under strategy=dp" in n for n in plan.notes) and any("DataParallel" in n for n in plan.notes)


def test_cuda_graph_under_ddp_is_the_captured_strategy(cuda_build):
    captured = make_plan(config_of("recipe=cifar10", "gpus=[0,1]"), env={}, physical_count=2).strategy
    eager = make_plan(config_of("recipe=cifar10", "gpus=[0,1]", "perf.cuda_graph=false"), env={},
                      physical_count=2).strategy
    assert (captured.name, captured.gradient_sync) == ("ddp", "flat all-reduce")
    assert (eager.name, eager.gradient_sync) == ("ddp", "DDP")


def test_a_count_on_a_shared_machine_masks_the_least_busy_gpus(cuda_build):
    loads = [GpuLoad(0, "H200", 5.0, 140.0, 99), GpuLoad(1, "H200", 139.0, 140.0, 0)]
    plan = make_plan(config_of("gpus=1"), env={}, physical_count=2, loads=loads)
    assert plan.gpu_ids == [1] and plan.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "chose GPU [1]" in plan.gpu_choice and "passed over busy GPU 0" in plan.gpu_choice


def test_a_count_on_an_idle_machine_takes_the_first_gpus_whatever_their_driver_memory():
    idle = [GpuLoad(i, "H200", 139.5 - 0.2 * (i % 3), 140.0, 0) for i in range(8)]
    assert least_busy(idle, 2)[0] == [0, 1]
    # one GPU running a small job: the idle ones still come first, in index order
    in_use = [GpuLoad(0, "H200", 120.0, 140.0, 20), *idle[1:]]
    assert least_busy(in_use, 2)[0] == [1, 2]


def test_among_gpus_in_use_the_one_with_the_most_free_memory_is_taken():
    loads = [GpuLoad(0, "H200", 100.0, 140.0, 10), GpuLoad(1, "H200", 130.0, 140.0, 10),
             GpuLoad(2, "H200", 110.0, 140.0, 10)]
    assert least_busy(loads, 1)[0] == [1]
    assert least_busy(loads, 2)[0] == [1, 2]


def test_a_gpu_computing_with_little_memory_is_not_idle():
    """Utilization counts: a small job at 90% leaves the driver's share of memory but is busy."""
    loads = [GpuLoad(0, "H200", 139.8, 140.0, 90), GpuLoad(1, "H200", 139.5, 140.0, 0)]
    assert not loads[0].idle and loads[0].busy and loads[1].idle
    assert least_busy(loads, 1)[0] == [1]


def test_a_users_process_group_backend_is_kept_on_gpus(cuda_build):
    plan = make_plan(config_of("gpus=[0,1]", "strategy=ddp", "strategy.backend=gloo"), env={}, physical_count=2)
    assert plan.strategy.process_group_backend == "gloo"
    default = make_plan(config_of("gpus=[0,1]", "strategy=ddp"), env={}, physical_count=2)
    assert default.strategy.process_group_backend == "nccl"


def test_a_local_launch_keeps_its_sockets_on_loopback_unless_the_user_chose(cuda_build):
    plan = make_plan(config_of("gpus=[]", "strategy=ddp", "nprocs=2"), env={}, physical_count=0)
    assert plan.env["GLOO_SOCKET_IFNAME"] == "lo" and plan.env["NCCL_SOCKET_IFNAME"] == "=lo"
    chosen = make_plan(config_of("gpus=[]", "strategy=ddp", "nprocs=2"), env={"GLOO_SOCKET_IFNAME": "eth1"},
                       physical_count=0)
    assert "GLOO_SOCKET_IFNAME" not in chosen.env


def test_data_on_the_gpu_for_a_cpu_run_is_refused(cuda_build):
    with pytest.raises(ConfigError, match=r"^data.placement=gpu is not valid: this run trains on the CPU"):
        make_plan(config_of("gpus=[]", "data.placement=gpu"), env={}, physical_count=2)


def test_a_gpu_with_little_free_memory_is_busy_even_when_idle_by_utilization():
    loads = [GpuLoad(0, "H200", 10.0, 140.0, 0), GpuLoad(1, "H200", 20.0, 140.0, 0)]
    chosen, why = least_busy(loads, 1)
    assert chosen == [1] and "passed over busy GPU 0" in why and "Some chosen GPUs are busy" in why


@pytest.fixture
def fits_on_h100s(plan_on_h100s):
    """fits(*overrides, count=N) -> what memory.check_fits says of recipe=text with `overrides` on N simulated
    80 GiB H100s: the refusal's line (LaunchError), or the estimate that passed."""
    from launcher.errors import LaunchError
    from launcher.host import memory
    from launcher.recipes import recipe_class

    def fits(*overrides: str, count: int) -> tuple[bool, str | None]:
        plan = plan_on_h100s(*overrides, count=count)
        try:
            return True, memory.check_fits(recipe_class("text")(plan.config), plan).line
        except LaunchError as err:
            return False, str(err)

    return fits


def test_a_model_whose_training_state_outgrows_its_gpu_is_refused_before_any_worker_with_a_setting_that_fits(
        fits_on_h100s):
    """recipe.size=8b on one 80 GiB GPU: 8.03B parameters x 16 bytes (fp32 weights, gradients, AdamW's two
    moments) is ~120 GiB before any activation; said in one line with the fsdp setting that fits, instead of
    an out-of-memory error in the worker after its start-up. Sharded over 2 ranks it fits (~60 GiB each); at
    64 layers (~240 GiB) 2 ranks do not."""
    size = ("recipe.size=8b", "recipe.vocab_size=128256", "recipe.corpus=/shards/*.npy")

    def refusal(*overrides: str, count: int) -> str | None:
        passed, said = fits_on_h100s(*size, *overrides, count=count)
        return None if passed else said

    line = refusal("gpus=[0]", count=1)
    assert line is not None and "8.03B parameters need ~120 GiB a rank" in line, line
    assert "GPU 0 (H100) holds 80 GiB: shard them: strategy=fsdp strategy.meta_init=true gpus=3" in line, line
    # sharded over 2 ranks the state fits (~60 GiB each), and what the activations add is judged next
    assert refusal("gpus=2", "strategy=fsdp", "perf.activation_checkpointing=full", count=2) is None
    line = refusal("gpus=2", "strategy=fsdp", "recipe.layers=64", count=2)
    assert line is not None and "divided over 2 ranks by fsdp" in line and "more GPUs" in line, line
    # a network from config (model._target_) is not the recipe's own, and the launcher builds none: not judged
    assert refusal("gpus=[0]", "model._target_=torch.nn.Linear", "+model.in_features=2", "+model.out_features=2",
                   count=1) is None


def test_a_cpu_run_whose_state_outgrows_each_ddp_rank_is_told_to_shard_over_its_ranks_not_to_pick_its_own_size(
        plan_on_h100s):
    """On the CPU the ranks share the machine's memory, so ddp keeps the whole state once a rank where fsdp
    over the same ranks divides it: the refusal names fsdp where that fits, and never a size by name (it told
    a user of recipe.size=1b to choose recipe.size=1b)."""
    from launcher.host.memory import GIB, _what_fits

    ddp = plan_on_h100s("recipe=text", "gpus=[]", "strategy=ddp", "nprocs=2", count=0)
    said = _what_fits(ddp, need=15 * GIB, holds=11 * GIB)
    assert said.startswith("shard them over the 2 ranks: strategy=fsdp strategy.meta_init=true (~8 GiB each)"), said
    assert "recipe.size=1b" not in said
    said = _what_fits(ddp, need=30 * GIB, holds=11 * GIB)  # (15 GiB a rank sharded: no more room than that)
    assert "strategy=fsdp" not in said and said.startswith("a smaller model"), said
    single = plan_on_h100s("recipe=text", "gpus=[]", count=0)
    assert "strategy=fsdp" not in _what_fits(single, need=15 * GIB, holds=11 * GIB)


def test_activations_that_outgrow_the_gpu_beside_the_state_are_refused_naming_the_checkpointing_or_batch_that_fits(
        fits_on_h100s):
    """Llama 3.2 1B's shape at 8 windows of 8,192 tokens on one 80 GiB GPU: ~18 GiB of training state fits, but
    the activations the backward keeps without checkpointing (measured by a forward on the meta device, in bf16)
    do not; the line names the estimate and what fits. Full checkpointing fits; 8B under fsdp on 2 GPUs at
    Llama 3's 2 x 8,192 a rank needs full there too (selective keeps ~60 GiB of activations beside ~60 GiB)."""
    shards = ("recipe.vocab_size=128256", "recipe.corpus=/shards/*.npy", "recipe.context=8192")

    def refusal(*overrides: str, count: int) -> str | None:
        passed, said = fits_on_h100s(*shards, *overrides, count=count)
        return None if passed else said

    line = refusal("recipe.size=1b", "gpus=[0]", "batch_size=8", count=1)
    assert line is not None and line.startswith("recipe=text: at a micro-batch of 8, the activations the backward "
                                                "pass keeps come to ~"), line
    assert "(perf.activation_checkpointing=none), beside ~18.4 GiB of weights, gradients and optimizer state; GPU 0 " \
           "(H100) holds 80 GiB: perf.activation_checkpointing=full (~" in line, line
    assert line.endswith("or batch_size=3 (a micro-batch of 3 a rank)"), line
    assert refusal("recipe.size=1b", "gpus=[0]", "batch_size=8", "perf.activation_checkpointing=full", count=1) is None
    # what passes is said too (`launch ... dry_run=true` shows it)
    passed, said = fits_on_h100s(*shards, "recipe.size=1b", "gpus=[0]", "batch_size=8",
                                 "perf.activation_checkpointing=full", count=1)
    assert passed and said is not None and said.startswith("~") and "GiB a rank: ~18.4 GiB of weights, gradients " \
        "and optimizer state + ~" in said and "at a micro-batch of 8 (perf.activation_checkpointing=full; none ~" in \
        said, said
    assert said.endswith("GPU 0 (H100) holds 80 GiB"), said
    assert refusal("recipe.size=1b", "gpus=[0]", "batch_size=3", count=1) is None
    eight = ("recipe.size=8b", "gpus=2", "strategy=fsdp", "batch_size=4")
    line = refusal(*eight, "perf.activation_checkpointing=selective", count=2)
    assert line is not None and "a micro-batch of 2 a rank, batch_size=4 over 2 ranks" in line, line
    assert "(perf.activation_checkpointing=selective)" in line and "perf.activation_checkpointing=full (~" in line
    assert refusal(*eight, "perf.activation_checkpointing=full", count=2) is None


def test_the_memory_check_runs_the_model_in_a_child_so_nothing_it_touches_stays_in_the_launch(fits_on_h100s,
                                                                                                monkeypatch):
    """Building and running the model on the meta device can reach the CUDA driver (recipe=text's LSTM and GRU
    did on a GPU machine, and their workers, forked from the launch, then failed to initialize CUDA): the check
    runs in a forked child, and the launch process is as it was."""
    import os

    import torch

    from launcher.recipes import recipe_class

    Text = recipe_class("text")
    built = Text.model_to_size

    def touching(self):
        os.environ["LAUNCH_TEST_TOUCHED"] = str(os.getpid())  # (stands for the driver's state)
        return built(self)

    monkeypatch.setattr(Text, "model_to_size", touching)
    monkeypatch.delenv("LAUNCH_TEST_TOUCHED", raising=False)
    fits, said = fits_on_h100s("recipe.model=lstm", count=1)
    assert fits and said.startswith("~") and "GPU 0 (H100) holds 80 GiB" in said, said
    assert "LAUNCH_TEST_TOUCHED" not in os.environ
    fits, said = fits_on_h100s("recipe.size=8b", "recipe.vocab_size=128256", "recipe.corpus=/shards/*.npy", count=1)
    assert not fits and "8.03B parameters" in said and "LAUNCH_TEST_TOUCHED" not in os.environ, said
    assert not torch.cuda.is_initialized()


def test_a_memory_check_child_that_cannot_answer_ends_there_and_never_runs_the_launch(monkeypatch, tmp_path):
    """The verdict's write failing in the child (a parent gone, a broken pipe): the child still ends at once
    (os._exit) instead of returning into the launch's own code, and the launch is told the check failed."""
    import os

    from launcher.host import memory

    def broken(verdict, out):
        raise BrokenPipeError("the parent is gone")

    monkeypatch.setattr(memory, "_check_fits", lambda recipe, plan: memory.Fit("fits"))
    monkeypatch.setattr(memory.pickle, "dump", broken)
    me = os.getpid()
    try:
        memory.check_fits(None, None)
        told: BaseException | None = None
    except BaseException as error:  # noqa: BLE001 - what came back, in whichever process
        told = error
    if os.getpid() != me:  # a child that came back into the caller: leave a mark and end it here
        (tmp_path / f"child-{os.getpid()}").touch()
        os._exit(0)
    assert isinstance(told, RuntimeError) and "ended without a verdict" in str(told), told
    assert not list(tmp_path.iterdir())  # (the parent waited for the child, so a mark would be there now)


def test_the_batch_size_an_activation_refusal_names_is_one_the_check_accepts(monkeypatch):
    """The activations a run keeps are not all in proportion to its micro-batch (on the CPU in fp32 the weights
    the backward reads are counted at any batch): the batch_size a refusal names must pass the same check, not
    lead to another refusal naming a smaller one (a new user's trial: 8 -> 4 -> 2 -> refused), and none is named
    where no batch fits."""
    import re

    from launcher.errors import LaunchError
    from launcher.host import memory
    from launcher.host.plan import make_plan
    from launcher.recipes import recipe_class
    from tests.conftest import config_of

    monkeypatch.setattr(memory, "capacity", lambda plan: (11 * 2**30, "each of this machine's 2 ranks has 11 GiB"))

    def said(batch: int) -> str | None:
        plan = make_plan(config_of("recipe=text", "recipe.size=1b", "gpus=[]", "strategy=fsdp", "nprocs=2",
                                   f"batch_size={batch}"), env={}, physical_count=0, loads=[])
        try:
            memory.check_fits(recipe_class("text")(plan.config), plan)
            return None
        except LaunchError as err:
            return str(err)

    line = said(64)
    assert line is not None and "perf.activation_checkpointing=full" in line, line
    named = re.search(r"batch_size=(\d+) \(a micro-batch", line)
    if named:
        assert said(int(named.group(1))) is None, (line, said(int(named.group(1))))
    smallest = said(2)  # (a micro-batch of 1 a rank: no smaller batch to name)
    assert smallest is not None and not re.search(r"batch_size=\d+ \(a micro-batch", smallest), smallest
