"""Strategies as objects: auto never picks dp, combinations that cannot work fail with the fix, and each
strategy answers the host-side questions the plan and SLURM ask (no process needed)."""

import pytest

from launcher import strategies
from launcher.config import (
    AutoStrategyConfig,
    CompileMode,
    DataParallelConfig,
    DDPConfig,
    PerfConfig,
    ProcessGroupBackend,
    SingleConfig,
    Toggle,
)
from launcher.errors import ConfigError
from launcher.strategies import CapturedDDP, DataParallel, Devices, Single
from launcher.world import WorldInfo

OPTIONS = {"auto": AutoStrategyConfig(), "single": SingleConfig(), "dp": DataParallelConfig(), "ddp": DDPConfig()}


def choose(name, gpus, nprocs, global_batch=64, perf=None, backend="auto", nodes=1):
    options = OPTIONS[name] if backend == "auto" else DDPConfig(backend=ProcessGroupBackend[backend])
    return strategies.choose(options, Devices(tuple(range(gpus))), nprocs=nprocs, global_batch=global_batch,
                             perf=perf or PerfConfig(), gpus_text=str(gpus), nodes=nodes).strategy


@pytest.mark.parametrize("name, gpus, nprocs, expect, procs, backend", [
    ("auto", 0, None, "single", 1, None),
    ("auto", 1, None, "single", 1, None),
    ("auto", 2, None, "ddp", 2, "nccl"),
    ("auto", 8, None, "ddp", 8, "nccl"),
    ("auto", 0, 2, "ddp", 2, "gloo"),
    ("single", 1, None, "single", 1, None),
    ("dp", 2, None, "dp", 1, None),
    ("ddp", 2, None, "ddp", 2, "nccl"),
    ("ddp", 0, 2, "ddp", 2, "gloo"),
    ("ddp", 0, None, "ddp", 1, "gloo"),
])
def test_choice(name, gpus, nprocs, expect, procs, backend):
    strategy = choose(name, gpus, nprocs)
    assert (strategy.name, strategy.processes, strategy.process_group_backend) == (expect, procs, backend)


def test_global_batch_is_split_only_over_ranks():
    assert choose("ddp", 2, None, 512).batch_per_process == 256
    assert choose("dp", 2, None, 512).batch_per_process == 512  # DataParallel splits it inside the step
    assert choose("single", 1, None, 512).batch_per_process == 512
    two_nodes = choose("ddp", 2, None, 512, nodes=2)  # a SLURM job of 2 nodes x 2 tasks
    assert (two_nodes.world_size, two_nodes.batch_per_process) == (4, 128)


@pytest.mark.parametrize("name, gpus, nprocs, batch, words", [
    ("dp", 0, None, 64, "DataParallel needs GPUs"),
    ("single", 2, None, 64, "single uses one device"),
    ("single", 0, 2, 64, "single runs one process"),
    ("ddp", 2, 3, 64, "nprocs sets CPU ranks"),
    ("ddp", 0, 3, 64, "split evenly over 3 ranks"),
    ("dp", 2, 2, 64, "runs one process"),
])
def test_bad_combinations(name, gpus, nprocs, batch, words):
    with pytest.raises(ConfigError, match=words):
        choose(name, gpus, nprocs, batch)


def test_nccl_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="nccl needs GPUs"):
        choose("ddp", 0, 2, 64, backend="nccl")


def test_batch_suggestion_is_divisible():
    with pytest.raises(ConfigError, match=r"batch_size=62"):
        choose("ddp", 0, 2, 63)
    # each rank's share must split into the micro-batches too: 6 over 2 ranks is 3 a rank, not 2 x 1.5
    with pytest.raises(ConfigError, match=r"accumulate=2 is not valid: each rank's 3 samples .*batch_size=4 "
                                          r"accumulate=2"):
        strategies.check_batch_splits(6, 2, 2)


def test_several_nodes_need_a_strategy_that_spans_them():
    with pytest.raises(ConfigError, match="^nodes=2 .*strategy=dp runs one process"):
        choose("dp", 2, None, nodes=2)


def test_cuda_graph_picks_the_captured_ddp_and_static_gradients_on_one_device():
    graphed = PerfConfig(cuda_graph=True)
    assert type(choose("ddp", 2, None, perf=graphed)) is CapturedDDP
    assert type(choose("auto", 0, 2, perf=graphed)) is CapturedDDP  # on CPU the same path runs eagerly
    single = choose("single", 1, None, perf=graphed)
    assert type(single) is Single and single.static_gradients


def _chosen(name, gpus, nprocs=None, accumulate=1, **perf):
    return strategies.choose(OPTIONS[name], Devices(tuple(range(gpus))), nprocs=nprocs, global_batch=64,
                             perf=PerfConfig(**perf), gpus_text=str(gpus), accumulate=accumulate)


def test_cuda_graph_auto_is_tried_on_gpus_one_process_each_and_off_elsewhere_without_a_word():
    one = _chosen("auto", 1)
    assert one.perf.cuda_graph is Toggle.auto and type(one.strategy) is Single and one.strategy.static_gradients
    # ddp on GPUs: both ways of the trial average flat gradients (DDP's reducer runs host code a replay skips)
    for two in (_chosen("auto", 2), _chosen("ddp", 2)):
        assert two.perf.cuda_graph is Toggle.auto and type(two.strategy) is CapturedDDP
        assert two.strategy.static_gradients
        assert "cuda_graph" not in (two.note or "")
    # DDP's reducer asked for, or several nodes (its overlap of the all-reduce with the backward pass matters
    # over a network): DDP's reducer
    kept = [strategies.choose(asked, Devices((0, 1)), nprocs=None, global_batch=64, perf=PerfConfig(),
                              gpus_text="[0,1]", nodes=nodes)
            for asked, nodes in ((DDPConfig(find_unused_parameters=True), 1), (DDPConfig(static_graph=True), 1),
                                 (DDPConfig(), 2), (AutoStrategyConfig(), 2))]
    spanning = WorldInfo(0, 0, 4, 2, "localhost", 29500)  # (torchrun or srun: 2 nodes of 2 ranks)
    kept.append(strategies.for_world(AutoStrategyConfig(), spanning, Devices((0, 1)), global_batch=64,
                                     perf=PerfConfig()))
    for chosen in kept:
        assert chosen.perf.cuda_graph is Toggle.false and type(chosen.strategy) is not CapturedDDP
    within = WorldInfo(0, 0, 2, 2, "localhost", 29500)
    assert type(strategies.for_world(AutoStrategyConfig(), within, Devices((0, 1)), global_batch=64,
                                     perf=PerfConfig()).strategy) is CapturedDDP
    # (elsewhere the plain path, unchanged: DDP's own reducer, plain gradients, and no note about graphs)
    for chosen in (_chosen("auto", 2, accumulate=2), _chosen("auto", 0), _chosen("auto", 0, nprocs=2), _chosen("dp", 2),
                   _chosen("auto", 1, accumulate=2), _chosen("auto", 1, precision="fp16"),
                   _chosen("auto", 1, compile=True, compile_mode=CompileMode["reduce-overhead"])):
        assert chosen.perf.cuda_graph is Toggle.false and not chosen.strategy.static_gradients
        assert type(chosen.strategy) is not CapturedDDP and "cuda_graph" not in (chosen.note or "")
    assert _chosen("auto", 1, cuda_graph="false").perf.cuda_graph is Toggle.false  # (the command line's words too)
    assert type(_chosen("auto", 2, cuda_graph="true").strategy) is CapturedDDP


def test_cuda_graph_takes_true_false_or_auto_only():
    with pytest.raises(ConfigError, match="^perf.cuda_graph=sometimes .*choose true, false or auto"):
        PerfConfig(cuda_graph="sometimes").check("perf")


def test_dataparallel_turns_off_compile_graphs_and_cudnn_autotuning():
    choice = strategies.choose(DataParallelConfig(), Devices((0, 1)), nprocs=None, global_batch=64,
                               perf=PerfConfig(compile=True, cuda_graph=True), gpus_text="[0,1]")
    assert type(choice.strategy) is DataParallel and choice.note and "off under strategy=dp" in choice.note
    assert choice.perf.compile is choice.perf.cuda_graph is choice.perf.cudnn_benchmark is Toggle.false
    assert "DataParallel" in choice.strategy.warning()
    graphs_only = strategies.choose(DataParallelConfig(), Devices((0, 1)), nprocs=None, global_batch=64,
                                    perf=PerfConfig(compile=False, cuda_graph=True), gpus_text="[0,1]")
    assert graphs_only.perf.cuda_graph is Toggle.false and "off under strategy=dp" in (graphs_only.note or "")


def test_gpus_auto_means_one_gpu_only_for_single():
    assert strategies.one_device(SingleConfig()) and not strategies.one_device(AutoStrategyConfig())
    assert not strategies.one_device(DDPConfig())


def test_inside_a_world_torchrun_started():
    world = WorldInfo(1, 1, 2, 2, "localhost", 29500)
    choice = strategies.for_world(AutoStrategyConfig(), world, Devices(()), global_batch=64, perf=PerfConfig())
    assert (choice.strategy.name, choice.strategy.world_size, choice.strategy.processes) == ("ddp", 2, 2)
    with pytest.raises(ConfigError, match="which is ddp"):
        strategies.for_world(SingleConfig(), world, Devices(()), global_batch=64, perf=PerfConfig())


def test_a_strategy_travels_to_the_workers():
    import pickle

    strategy = choose("ddp", 0, 2)
    again = pickle.loads(pickle.dumps(strategy))
    assert (again.name, again.world_size, again.process_group_backend) == ("ddp", 2, "gloo")


def test_ddp_buckets_grow_with_the_model_unless_the_user_chose_them():
    """strategy.bucket_cap_mb=0 (the default): torch's 25 MB for a small model, a fifth of the gradients for a
    larger one, at most 100 MB (GPT-2 124M's 498 MB of fp32 gradients ran 4% faster on 2 GPUs at 100 than
    at 25); a number the user typed is used as it is."""
    import torch

    from launcher.strategies.base import bucket_mb

    def linear(n):  # (on the meta device: sizes without memory)
        return torch.nn.Linear(n, n, device="meta")

    small = linear(1000)  # 4 MB of gradients
    mid = linear(8192)  # 256 MB
    large = torch.nn.Sequential(*(linear(8192) for _ in range(4)))  # 1 GB
    frozen = linear(8192).requires_grad_(False)
    assert DDPConfig().bucket_cap_mb == 0
    assert [bucket_mb(0, m) for m in (small, mid, large, frozen)] == [25, 51, 100, 25]
    assert bucket_mb(10, large) == 10 and bucket_mb(300, small) == 300
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        DDPConfig(bucket_cap_mb=-1).check("strategy")


def test_dataparallel_reports_the_peak_memory_of_every_gpu_it_drives():
    import torch

    assert choose("dp", 3, None).memory_devices(torch.device("cuda", 0)) == [0, 1, 2]
    assert choose("ddp", 2, None).memory_devices(torch.device("cuda", 1)) == [1]
    assert choose("single", 0, None).memory_devices(torch.device("cpu")) == []


def test_the_weights_digest_tells_apart_weights_that_differ_below_one():
    """results.json's ranks_agree compares these digests: ranks whose weights differ in any bit must differ."""
    import torch

    from launcher.strategies.base import weights_sha256

    state = {"w": torch.tensor([0.25, 1.5]), "steps": torch.tensor(3)}
    assert weights_sha256(state) == weights_sha256({k: v.clone() for k, v in state.items()})
    assert weights_sha256(state) != weights_sha256({"w": torch.tensor([0.25, 1.25]), "steps": torch.tensor(3)})
    assert weights_sha256(state) != weights_sha256({"w": torch.tensor([0.25, 1.5]), "steps": torch.tensor(4)})


def test_ddp_averages_the_ranks_batchnorm_statistics():
    """At an epoch's end every rank holds the mean of the ranks' running statistics (here a world of two,
    the other rank's statistics added by the all-reduce); the step counter is left as it is."""
    import torch

    strategy = choose("ddp", 0, 2)
    bn = torch.nn.BatchNorm1d(3)
    bn.running_mean.fill_(1.0)
    bn.running_var.fill_(4.0)
    bn.num_batches_tracked.fill_(7)
    other = torch.cat([torch.full((3,), 3.0), torch.full((3,), 2.0)])  # the other rank's mean, then var

    def all_reduce(tensor, op="sum"):
        return tensor.add_(other)

    strategy.all_reduce = all_reduce
    strategy.average_buffers(bn)
    assert torch.equal(bn.running_mean, torch.full((3,), 2.0)) and torch.equal(bn.running_var, torch.full((3,), 3.0))
    assert int(bn.num_batches_tracked) == 7
