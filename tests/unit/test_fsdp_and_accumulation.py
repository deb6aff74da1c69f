"""strategy=fsdp's host-side facts and its per-block sharding choice; gradient accumulation's split and
its synchronization only after the last micro-batch; evaluation chunks that keep sharded ranks in step."""

import contextlib

import pytest
import torch
from torch import nn

from launcher import strategies
from launcher.config import CompileMode, DDPConfig, FSDPConfig, PerfConfig, Toggle
from launcher.data.placement import eval_chunks
from launcher.errors import ConfigError
from launcher.strategies import FSDP, Devices
from launcher.strategies.fsdp import describe_units, shard_groups, shard_units
from launcher.train.step import TrainStep
from tests.conftest import config_of


def choose(gpus=2, nprocs=None, perf=None, accumulate=1, global_batch=64, options=None):
    return strategies.choose(options or FSDPConfig(), Devices(tuple(range(gpus))), nprocs=nprocs,
                             global_batch=global_batch, perf=perf or PerfConfig(), gpus_text=str(gpus),
                             accumulate=accumulate)


def test_fsdp_is_one_process_per_gpu_or_cpu_rank_and_shards_checkpoints():
    chosen = choose(gpus=2)
    s = chosen.strategy
    assert isinstance(s, FSDP) and s.processes == 2 and s.process_group_backend == "nccl"
    assert s.sharded and not s.overlaps_epoch_ends and s.lockstep_eval
    cpu = choose(gpus=0, nprocs=2).strategy
    assert cpu.processes == 2 and cpu.process_group_backend == "gloo"
    assert config_of("strategy=fsdp").strategy.reshard_after_forward is Toggle.auto
    assert config_of("strategy=fsdp", "strategy.reshard_after_forward=false").strategy.reshard_after_forward \
        is Toggle.false
    with pytest.raises(ConfigError, match="choose true, false or auto"):
        config_of("strategy=fsdp", "strategy.reshard_after_forward=sometimes")


def test_reshard_after_forward_auto_keeps_the_gathered_weights_where_the_estimate_has_room_for_them(fits_on_h100s):
    """Llama 3.2 1B at 2 x 8,192 tokens with full checkpointing on 2 80 GiB GPUs leaves ~40 GiB beside its
    estimate: its 2.3 GiB of bf16 weights stay gathered from each unit's forward to its backward (1.9-2.1%
    faster at 1B on 2 H200s, BENCHMARKS.md section 5). 8B's 15 GiB do not fit beside its ~77 GiB; without an
    estimate, or with the key typed, nothing is decided here."""
    shards = ("recipe.vocab_size=128256", "recipe.corpus=/shards/*.npy", "recipe.context=8192", "gpus=2",
              "strategy=fsdp", "batch_size=4")
    full = (*shards, "perf.activation_checkpointing=full")
    said, strategy = fits_on_h100s(*full, "recipe.size=1b", count=2)
    assert strategy.keep_gathered is True, said
    assert said.endswith("; strategy.reshard_after_forward=auto: false (the gathered weights, ~2.3 GiB, fit beside "
                         "the estimate: kept from each unit's forward to its backward)"), said
    said, strategy = fits_on_h100s(*full, "recipe.size=8b", count=2)
    assert strategy.keep_gathered is False and said.endswith("auto: true (the gathered weights, ~15.0 GiB, do not fit "
                                                             "beside the estimate)"), said
    said, strategy = fits_on_h100s(*full, "recipe.size=1b", "strategy.reshard_after_forward=true", count=2)
    assert strategy.keep_gathered is None and "reshard_after_forward" not in said, said
    # 3B with selective checkpointing: ~64 GiB and 6 GiB gathered would fit in 80 GiB, not beside a 15% margin
    said, strategy = fits_on_h100s(*shards, "recipe.size=3b", "perf.activation_checkpointing=selective", count=2)
    assert said.startswith("~64.4 GiB a rank") and strategy.keep_gathered is False, said
    strategy = choose(gpus=2).strategy  # (a network the launcher cannot size: the recipe's own, or from config)
    assert strategy.fit_memory(None, 0) == "strategy.reshard_after_forward=auto: true (no estimate)"
    assert strategy.keep_gathered is False


@pytest.fixture
def fits_on_h100s(plan_on_h100s):
    """fits(*overrides, count=N) -> (the memory line as a dry run shows it, the strategy told the estimate)
    for recipe=text on N simulated 80 GiB H100s, as run_here tells it."""
    from launcher.host import memory
    from launcher.recipes import recipe_class

    def fits(*overrides: str, count: int):
        plan = plan_on_h100s(*overrides, count=count)
        fit = memory.check_fits(recipe_class("text")(plan.config), plan)
        chosen = plan.strategy.fit_memory(fit.spare_bytes, fit.parameters)
        return "; ".join(said for said in (fit.line, chosen) if said), plan.strategy

    return fits


@pytest.mark.parametrize("setting, verdict, expected", [("auto", None, True), ("auto", True, False),
                                                        ("auto", False, True), ("true", True, True),
                                                        ("false", None, False)])
def test_the_ranks_agree_on_reshard_after_forward_and_the_last_unit_is_never_freed(tmp_path, monkeypatch, setting,
                                                                                  verdict, expected):
    """Under auto each rank brings its host's verdict to an all-reduce (a rank left unfreed would skip the
    all-gathers its peers' backward waits in); none judged means free them. Either way the last unit and the
    root are kept gathered: their backward comes first, and freeing them would only gather them again (torch
    keeps the root so where the value is left to it: an explicit true freed it)."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    from launcher.recipes.text_models import Llama

    told = []
    real = fsdp.fully_shard

    def recording(module, **kwargs):
        told.append(kwargs["reshard_after_forward"])
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", recording)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        strategy = FSDP(FSDPConfig(min_unit_params=0, mixed_precision=False, reshard_after_forward=setting),
                        Devices(()), processes=1, global_batch=2)
        strategy.keep_gathered = verdict
        model = Llama(64, 16, layers=3, width=32, heads=4, kv_heads=2)
        strategy.wrap(model, torch.device("cpu"))
        model(torch.randint(0, 64, (2, 16)))
        # after the forward: a freed unit's weights are its shards again (DTensors); kept ones stay gathered
        from torch.distributed.tensor import DTensor

        freed = [isinstance(m.weight, DTensor) for m in (model.blocks[0].q, model.blocks[1].q, model.blocks[2].q,
                                                         model.tokens)]
    finally:
        dist.destroy_process_group()
    assert told == [expected, expected, False, None], told  # (3 blocks a unit each, then the root: torch's choice)
    assert freed == [expected, expected, False, False], freed
    assert f"reshard_after_forward={str(expected).lower()}" in strategy.layout, strategy.layout
    assert ("by the memory estimate" in strategy.layout) == (setting == "auto"), strategy.layout


def test_fsdp_compiles_but_says_what_it_turns_off():
    chosen = choose(perf=PerfConfig(compile=True, cuda_graph=True, compile_mode=CompileMode["reduce-overhead"]))
    assert chosen.perf.compile is Toggle.true and chosen.perf.cuda_graph is Toggle.false
    assert chosen.perf.compile_mode.value == "default"
    assert "perf.cuda_graph is off under strategy=fsdp" in chosen.note and "reduce-overhead" in chosen.note
    quiet = choose(perf=PerfConfig(compile=True, cuda_graph=False))
    assert quiet.note is None and quiet.perf.compile is Toggle.true
    # auto decides after the first epoch, as under the other strategies (compiled paid under fsdp: 1.24x-1.36x
    # on 2 H200s, GPT-2 124M)
    assert choose(perf=PerfConfig(compile="auto", cuda_graph=False)).perf.compile is Toggle.auto
    graphs = choose(perf=PerfConfig(compile="auto", cuda_graph=False, compile_mode=CompileMode["reduce-overhead"]))
    assert graphs.perf.compile_mode.value == "default" and "reduce-overhead" in graphs.note


@pytest.mark.parametrize("recompute, min_unit_params", [(False, 0), (True, 0), (False, None), (True, None)])
def test_fsdp_compiles_each_block_in_place_around_its_hooks(tmp_path, recompute, min_unit_params):
    """Sharded a block a unit (min_unit_params=0), every block's forward runs compiled (traced by dynamo)
    inside FSDP2's hooks; a model smaller than the default min_unit_params is one unit, the root, and
    its forward one graph, blocks and all. Either way the model computes what the eager sharded model
    computes, gradients included."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule

    from launcher.config import Recompute
    from launcher.recipes.text_models import GPT
    from launcher.strategies import recompute as recomputed
    from launcher.strategies.base import Nets

    traced, graphs = [], []

    def recording(gm, example_inputs):
        graphs.append({getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                       if n.op == "call_function"})
        return gm.forward

    def eager_backend(fn):  # (the trainer hands in torch.compile with the run's mode and caches)
        traced.append(fn)
        return torch.compile(fn, backend=recording)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        nets = []
        for _ in range(2):
            torch.manual_seed(0)
            options = FSDPConfig()
            if min_unit_params is not None:
                options.min_unit_params = min_unit_params
            s = choose(gpus=0, nprocs=1, options=options).strategy
            model = GPT(256, 16, 2, 32, 2, 0.0)
            recomputed.apply(model, Recompute.full if recompute else Recompute.none)  # (as the loop does)
            nets.append(s.wrap(model, torch.device("cpu")))
        per_block = min_unit_params == 0
        assert all(isinstance(b, FSDPModule) == per_block for b in nets[1].module.blocks)
        # (what the worker logs and results.json keeps as `sharding`)
        said = "fsdp: 3 units, 2 of 1 block (" if per_block else "fsdp: one unit, the root,"
        assert s.layout.startswith(said), s.layout
        compiled = s.compile(nets[1], eager_backend)
        assert isinstance(compiled, Nets) and compiled.module is nets[1].module
        # each block compiled apart where FSDP2's hooks or the recomputation stand around it, then the root
        assert len(traced) == (3 if per_block or recompute else 1)
        x = torch.randint(0, 256, (4, 16))
        torch._dynamo.reset()  # (a graph cached by an earlier test would not be traced again)
        counters.clear()
        outs = []
        for n in (nets[0], compiled):
            out = n.train(x)
            out.float().pow(2).mean().backward()
            outs.append((out.detach(), [p.grad.full_tensor() for p in n.module.parameters()]))
        assert counters["stats"]["unique_graphs"] >= 1  # (the blocks share one graph: weights are its inputs)
        torch.testing.assert_close(outs[0][0], outs[1][0])
        for a, b in zip(outs[0][1], outs[1][1], strict=True):
            torch.testing.assert_close(a, b)
        # The root's forward is compiled around the blocks: its embedding before them, and with targets
        # its head and loss after them (GPT.trunk runs the blocks, so the graph resumes after it)
        graphs.clear()
        losses = [n.train(x[:, :-1], x[:, 1:])[0] for n in (nets[0], compiled)]
        torch.testing.assert_close(losses[0], losses[1])
        assert any("embedding" in g for g in graphs) and any("cross_entropy" in g for g in graphs), graphs
        if not (per_block or recompute):  # (one graph: the embedding, the blocks' attention, the loss)
            assert any({"embedding", "scaled_dot_product_attention", "cross_entropy"} <= g for g in graphs), graphs
    finally:
        dist.destroy_process_group()


def test_blocks_are_sharded_in_units_of_at_least_min_unit_params():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.head = nn.Linear(4, 2)

    net = Net()
    assert shard_units(net) == list(net.blocks)
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert shard_units(plain) == [plain[0], plain[2]]  # (the ReLU holds nothing to shard)
    # units: consecutive blocks until one holds min_unit_params (each Linear(4, 4) holds 20); the rest
    # is gathered with the root
    b = list(net.blocks)
    assert shard_groups(net, 0) == [[b[0]], [b[1]], [b[2]]]
    assert shard_groups(net, 20) == [[b[0]], [b[1]], [b[2]]]
    assert shard_groups(net, 40) == [[b[0], b[1]]]
    assert describe_units(net, shard_groups(net, 40), 40).startswith("fsdp: 2 units, 1 of 2 blocks (40 parameters) and "
                                                                      "the root (70, with 1 block left over)")
    assert shard_groups(net, 61) == [] and shard_groups(net, FSDPConfig().min_unit_params) == []
    assert FSDPConfig().min_unit_params == 100_000_000 == config_of("strategy=fsdp").strategy.min_unit_params
    with pytest.raises(ConfigError, match="min_unit_params"):
        config_of("strategy=fsdp", "strategy.min_unit_params=-1")


def test_accumulate_splits_each_ranks_share_or_says_how():
    s = choose(accumulate=4).strategy
    assert s.facts()["micro_batch"] == 8 and s.facts()["accumulate"] == 4
    with pytest.raises(ConfigError, match=r"accumulate=3 is not valid: each rank's 32 samples .* 3 micro-batches"):
        choose(accumulate=3)
    chosen = strategies.choose(DDPConfig(), Devices((0, 1)), nprocs=None, global_batch=64,
                               perf=PerfConfig(cuda_graph=True), gpus_text="2", accumulate=2)
    assert chosen.perf.cuda_graph is Toggle.false and "accumulate=2" in chosen.note
    with pytest.raises(ConfigError, match="accumulate"):
        config_of("accumulate=0")


def cross_entropy_step(model, batch):
    x, y = batch
    return nn.CrossEntropyLoss()(model(x), y)


def test_only_the_last_micro_batch_synchronizes():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    calls = []

    @contextlib.contextmanager
    def no_sync():
        calls.append("no_sync")
        yield

    class Nets:
        module = train = eval = model
        grads = None

    step = TrainStep(Nets(), [], cross_entropy_step, lambda x: x, None, contextlib.nullcontext,
                     torch.device("cpu"), accumulate=4, no_sync=no_sync)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    step.body((x, y), torch.arange(8), 0, torch.Generator())
    assert calls == ["no_sync"] * 3
    accumulated = model.weight.grad.clone()
    model.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    assert torch.allclose(accumulated, model.weight.grad, atol=1e-6)  # the whole batch's mean gradient
    loss_sum, count = step.sums.figures.sums["loss"]
    assert count.item() == 8
    assert loss_sum.item() == pytest.approx(nn.CrossEntropyLoss()(model(x), y).item() * 8, rel=1e-5)


@pytest.mark.parametrize("n, chunk, world", [(10, 3, 3), (1001, 256, 2), (7, 1, 2), (5, 100, 4)])
def test_evaluation_chunks_keep_sharded_ranks_in_step(n, chunk, world):
    per_rank = [eval_chunks(n, chunk, world, r, equal_counts=True) for r in range(world)]
    assert len({len(c) for c in per_rank}) == 1  # as many forwards on every rank
    assert all(len(c) <= chunk for chunks in per_rank for c in chunks)
    seen = sorted(int(i) for chunks in per_rank for c in chunks for i in c)
    assert seen == list(range(n))  # every example once


class _GPU:
    name, total_memory = "NVIDIA H200", 140 * 2**30


@pytest.fixture
def on_a_gpu(monkeypatch):
    """_oom_message as it reads a 140 GiB GPU (device properties and the allocator's peak)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _GPU())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 139 * 2**30)
    return torch.device("cuda", 0)


def test_out_of_memory_with_a_model_whose_training_state_fills_the_gpu_says_to_shard_it(on_a_gpu):
    """~8.5B parameters under ddp (16 bytes each with AdamW): lowering batch_size=1 cannot help (the
    message used to say "lower it (e.g. batch_size=1)"); fsdp over enough GPUs can."""
    from launcher.train.stops import oom_message as _oom_message

    cfg = config_of("recipe=text", "batch_size=2", "strategy=ddp")
    big = [torch.empty(1, 1).expand(4096, 4096)] * 500 + [torch.empty(1).expand(8_000_000)]  # 8.40B, no memory
    ddp = choose(gpus=2, global_batch=2, options=DDPConfig()).strategy
    line = _oom_message(cfg, ddp, on_a_gpu, big)
    assert "8.40B parameters (16 bytes each) need 125 GiB" in line and "batch_size=1" not in line
    assert "strategy=fsdp" in line and "gpus=2 strategy=fsdp strategy.meta_init=true" in line, line
    fsdp = choose(gpus=2, global_batch=2).strategy  # its shards: what each rank holds
    shards = [type("Shard", (), {"numel": p.numel, "to_local": lambda self, p=p: p[: p.shape[0] // 2]})()
              for p in big]
    line = _oom_message(cfg, fsdp, on_a_gpu, shards)
    assert "its shard of the weights" not in line  # 62 GiB a rank: not the state, the activations
    assert "one sample's activations do not fit" in line and "perf.activation_checkpointing=selective" in line, line


def test_out_of_memory_at_a_larger_batch_offers_a_smaller_one_or_accumulation(on_a_gpu):
    from launcher.train.stops import oom_message as _oom_message

    cfg = config_of("recipe=text", "batch_size=64")
    line = _oom_message(cfg, choose(gpus=2, global_batch=64, options=DDPConfig()).strategy, on_a_gpu,
                        [torch.empty(1000)])
    assert "at batch_size=64 = 32 per rank: lower it (e.g. batch_size=32)" in line
    assert "accumulate=2" in line and "GPU 0 (NVIDIA H200, 140 GiB; this process peaked at 139.0 GiB" in line, line


@pytest.mark.parametrize("accumulate", [1, 2])
def test_optim_clip_grad_norm_scales_the_whole_step_s_gradients_down_to_it(accumulate):
    """optim.clip_grad_norm=N: after the last micro-batch, the gradients of every parameter together
    have an L2 norm of at most N, in the direction they had; a smaller norm is left as it is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Linear(8, 2))

    class Nets:
        module = train = eval = model
        grads = None

    x, y = torch.randn(8, 3) * 100, torch.randint(0, 2, (8,))

    def gradients(clip):
        step = TrainStep(Nets(), [], cross_entropy_step, lambda x: x, None, contextlib.nullcontext,
                         torch.device("cpu"), accumulate=accumulate, clip_grad_norm=clip)
        step.body((x, y), torch.arange(8), 0, torch.Generator())
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    free = gradients(0.0)
    assert free.norm() > 1.0
    clipped = gradients(1.0)
    assert clipped.norm() == pytest.approx(1.0, rel=1e-4)
    assert torch.allclose(clipped, free / free.norm(), atol=1e-5)
    assert torch.equal(gradients(float(free.norm()) * 2), free)  # under the limit: untouched
    assert config_of("recipe=text").optim.clip_grad_norm == 1.0 and config_of().optim.clip_grad_norm == 0.0


@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # (norms above it: scaled down; below it: left as they are)
def test_clipping_fsdp_shards_matches_torchs_clipping_of_the_dtensors(tmp_path, max_norm):
    """Under fsdp the gradients are DTensor shards: clip_gradients takes their norm from each rank's
    own shards and one all-reduce (not DTensor's dispatch, which took 4.7-5.5 ms of host time a step
    on GPT-2 124M against 2.9), and scales them as torch's clip_grad_norm_ does on the DTensors."""
    import torch.distributed as dist

    from launcher.recipes.text_models import GPT
    from launcher.train import step as steps

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        clipped = []
        for ours in (True, False):
            torch.manual_seed(0)
            nets = choose(gpus=0, nprocs=1).strategy.wrap(GPT(256, 16, 2, 32, 2, 0.0), torch.device("cpu"))
            x = torch.randint(0, 256, (4, 17))
            nets.train(x[:, :-1], x[:, 1:])[0].backward()
            grads = [p.grad for p in nets.module.parameters()]
            if ours:
                assert steps._sharded_group(grads) is not None
                total = steps.clip_gradients(nets.module, max_norm)
            else:
                total = torch.nn.utils.clip_grad_norm_(list(nets.module.parameters()), max_norm).full_tensor()
            clipped.append((total, [g.full_tensor() for g in grads]))
        assert float(clipped[0][0]) > 0.05  # (so at 0.05 the gradients were scaled, at 1e6 they were not)
        torch.testing.assert_close(clipped[0][0], clipped[1][0])
        for a, b in zip(clipped[0][1], clipped[1][1], strict=True):
            torch.testing.assert_close(a, b)
        assert steps._sharded_group([torch.zeros(2)]) is None  # (plain gradients: torch's own path)
    finally:
        dist.destroy_process_group()


def test_fp16_skips_and_counts_a_step_whose_gradients_overflow():
    from launcher.train.optim import Stepper

    torch.manual_seed(0)
    model = nn.Linear(3, 2)

    class Nets:
        module = train = eval = model
        grads = None

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = Stepper(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    scale = torch.tensor(float("inf"))

    def step(model, batch):  # an overflowing loss on the second call
        x, y = batch
        return nn.CrossEntropyLoss()(model(x), y) * scale

    train = TrainStep(Nets(), [stepper], step, lambda x: x, None, contextlib.nullcontext, torch.device("cpu"),
                      scaler=torch.amp.GradScaler("cpu"))
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    before = model.weight.detach().clone()
    train((x, y), torch.arange(8), 0, torch.Generator())
    assert torch.equal(model.weight, before) and train.sums.overflowed.item() == 1  # skipped, counted
    scale.fill_(1.0)
    train((x, y), torch.arange(8), 0, torch.Generator())
    assert not torch.equal(model.weight, before) and train.sums.overflowed.item() == 1  # stepped
    assert config_of("perf.precision=fp16", "recipe=cifar10").perf.precision.value == "fp16"


def test_fp16_runs_its_step_eagerly_and_is_refused_under_fsdp():
    from launcher.config import FSDPConfig, Precision

    chosen = strategies.choose(DDPConfig(), Devices((0, 1)), nprocs=None, global_batch=64,
                               perf=PerfConfig(cuda_graph=True, precision=Precision.fp16), gpus_text="2")
    assert chosen.perf.cuda_graph is Toggle.false and "perf.precision=fp16" in chosen.note
    with pytest.raises(ConfigError, match=r"perf.precision=fp16 is not valid: strategy=fsdp"):
        strategies.choose(FSDPConfig(), Devices((0, 1)), nprocs=None, global_batch=64,
                          perf=PerfConfig(precision=Precision.fp16), gpus_text="2")


def test_out_of_memory_suggests_a_smaller_batch_that_every_rank_gets_an_equal_share_of(on_a_gpu):
    from launcher.train.stops import oom_message as _oom_message

    cfg = config_of("recipe=text", "batch_size=36")
    line = _oom_message(cfg, choose(gpus=4, global_batch=36, options=DDPConfig()).strategy, on_a_gpu,
                        [torch.empty(1000)])
    assert "at batch_size=36 = 9 per rank: lower it (e.g. batch_size=16)" in line, line  # (18: not 4 equal shares)


def test_meta_init_builds_the_model_on_the_meta_device_and_without_it_on_the_device():
    def build():
        return nn.Linear(4, 4)

    meta = choose(gpus=0, nprocs=1, options=FSDPConfig(meta_init=True)).strategy
    assert all(p.is_meta for p in meta.build_model(build, torch.device("cpu")).parameters())
    whole = choose(gpus=0, nprocs=1).strategy
    assert not any(p.is_meta for p in whole.build_model(build, torch.device("cpu")).parameters())


def test_weights_materialized_from_the_meta_device_get_the_models_own_initialization():
    """A model with init_weights() (GPT-2's scheme in recipe=text) gets that and nothing after it; one
    without gets every submodule's reset_parameters()."""
    from launcher.strategies.fsdp import initialize

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def init_weights(self):
            nn.init.constant_(self.layer.weight, 0.5)
            nn.init.zeros_(self.layer.bias)

    net = Net()
    initialize(net)
    assert (net.layer.weight == 0.5).all() and (net.layer.bias == 0).all()
    plain = nn.Linear(3, 3)
    with torch.no_grad():
        plain.weight.zero_()
    initialize(plain)
    assert plain.weight.abs().sum() > 0


def test_fsdp_synchronizes_gradients_again_after_the_micro_batches_that_skip_it():
    from types import SimpleNamespace

    from launcher.strategies.base import Nets

    said = []
    module = SimpleNamespace(set_requires_gradient_sync=said.append)
    strategy = choose().strategy
    nets = Nets(module, module, module)
    with strategy.no_sync(nets):
        assert said == [False]
    assert said == [False, True]
    with pytest.raises(RuntimeError), strategy.no_sync(nets):
        raise RuntimeError("a micro-batch failed")
    assert said[-1] is True


def test_fsdps_weights_digest_comes_from_each_ranks_shards_without_gathering_the_model(tmp_path, monkeypatch):
    """results.json's weights_sha256 under fsdp: no rank gathers the whole model for it (at 8B parameters that
    took minutes at the end of every run); the digest follows the weights (one changed value changes it) and is
    the same for the same weights."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as dcp_state

    from launcher.recipes.text_models import Llama

    def gathered(*args, **kwargs):
        raise AssertionError("the digest gathered the whole model")

    monkeypatch.setattr(dcp_state, "get_model_state_dict", gathered)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        digests = []
        for change in (False, False, True):
            torch.manual_seed(0)
            model = Llama(64, 16, layers=2, width=32, heads=4, kv_heads=2)
            strategy = FSDP(FSDPConfig(min_unit_params=0, mixed_precision=False), Devices(()), processes=1,
                            global_batch=2)
            nets = strategy.wrap(model, torch.device("cpu"))
            if change:
                with torch.no_grad():
                    model.blocks[1].down.weight.to_local()[0, 0] += 1e-3
            digests.append(strategy.weights_digest(nets))
    finally:
        dist.destroy_process_group()
    assert digests[0] == digests[1] != digests[2] and len(digests[0]) == 64, digests
