"""The pieces of perf.cuda_graph that need no process group or GPU."""

import pytest
import torch

from launcher.errors import ConfigError
from launcher.strategies.gradients import FlatGradients
from launcher.train.stall import DeviceTimeout, wait_for
from tests.conftest import config_of


def test_gradients_live_in_one_buffer_with_their_parameters_layout():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 36, 5))
    model = model.to(memory_format=torch.channels_last)
    grads = FlatGradients(model.parameters())
    (flat,) = grads.buffers
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        assert p.grad.stride() == p.stride()  # channels_last filters keep channels_last gradients
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    assert flat.abs().sum() > 0  # autograd accumulated into the views, not into new tensors
    assert all(p.grad is v for p, v in grads.views.items())
    grads.zero()
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())


def test_buckets_follow_the_backward_order_and_the_size_cap():
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))  # 16.6 KB per layer
    grads = FlatGradients(model.parameters(), bucket_mb=20_000 / 2**20)
    assert [b.numel() for b in grads.buckets] == [2 * (64 * 64 + 64)] * 2
    # the last layer's gradients (ready first in backward) are at the start of the first bucket
    last_weight = model[3].weight
    assert last_weight.grad.storage_offset() < grads.buckets[0].numel()


def test_frozen_parameters_get_no_flat_gradient():
    """A frozen layer (requires_grad=False: the record net's whitening stem) has no .grad an optimizer would
    step with, and takes no room in the buffers the ranks all-reduce."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    grads = FlatGradients(model.parameters())
    assert model[0].weight.grad is None and sum(b.numel() for b in grads.buffers) == 4 + 8 + 2
    model(torch.randn(3, 4)).sum().backward()
    assert model[0].weight.grad is None and model[0].bias.grad.abs().sum() > 0


def test_a_parameter_that_is_not_dense_is_refused():
    p = torch.nn.Parameter(torch.randn(4, 6)[:, ::2])
    with pytest.raises(ValueError, match="not dense"):
        FlatGradients([p])


class _NeverDone:
    def query(self):
        return False


def test_waiting_for_a_stuck_device_ends_with_the_reason():
    with pytest.raises(DeviceTimeout, match="strategy.timeout_s"):
        wait_for(_NeverDone(), 0.05, "the GPU's work of this epoch")


def test_cuda_graph_with_a_compile_mode_that_graphs_itself_is_refused():
    with pytest.raises(ConfigError, match="perf.compile_mode=default"):
        config_of("perf.cuda_graph=true", "perf.compile=true", "perf.compile_mode=reduce-overhead")


def test_the_trainer_is_freed_before_teardown_though_compiling_froze_the_heap(monkeypatch, tmp_path):
    """A captured step's CUDA graph holds NCCL's all-reduce: destroying the communicator while the graph
    lives blocks forever (a compiled, captured ddp run on 2x H200 hung after its last epoch). The trainer
    sits in reference cycles, and settle_heap froze them after compiling, so train() must unfreeze and
    collect before the strategy's teardown."""
    import gc
    import weakref
    from types import SimpleNamespace

    from launcher.train import compiling, loop

    alive: list[weakref.ref] = []
    seen_at_teardown: list[bool] = []

    class CyclicTrainer:
        def __init__(self, *args, **kwargs):
            self.step = lambda: self  # a closure over the trainer, as TrainStep's
            alive.append(weakref.ref(self))
            compiling.settle_heap()  # as after compiling: the cycle is frozen while it lives

        def run(self):
            return {"done": True}

    class Strategy:
        distributed = sharded = False

        def select_device(self, world, index):
            return torch.device("cpu")

        def setup(self, world, device):
            pass

        def teardown(self):
            seen_at_teardown.append(alive[0]() is not None)

    monkeypatch.setattr(loop, "Trainer", CyclicTrainer)
    monkeypatch.setattr(loop.nodes, "meet", lambda *args, **kwargs: None)
    monkeypatch.setattr(loop, "to_plain", lambda cfg: {})
    spec = SimpleNamespace(config=SimpleNamespace(saves=False), strategy=Strategy(), device_index=None,
                           run_dir=str(tmp_path), evaluate=None, typed=())
    try:
        assert loop.train(spec, SimpleNamespace(), SimpleNamespace(mark=lambda name: None)) == {"done": True}
    finally:
        gc.unfreeze()
    assert seen_at_teardown == [False]


def test_the_runs_end_leaves_what_the_forkserver_froze_frozen_unless_the_run_froze_too():
    """The forkserver freezes its imports (train/preload.py) so that no collection in a worker walks them:
    heap.release at a run's end keeps them frozen where the run froze nothing, and unfreezes (every freeze
    at once, as gc can) where it did, so that the run's own cycles are freed."""
    import gc

    from launcher import heap

    gc.freeze()  # as the forkserver, before the fork
    try:
        before = gc.get_freeze_count()
        assert before > 0
        heap.release()
        # still frozen: an unfreeze empties the permanent generation (a few of its objects may meanwhile be freed
        # by their reference counts, another thread's among them: CI saw 708,663 become 708,659)
        assert gc.get_freeze_count() > before // 2
        heap.freeze()  # as after compiling, or before a DataLoader forks its workers
        heap.release()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_worker_forked_from_the_launch_freezes_what_it_inherited_so_its_collections_skip_it(monkeypatch):
    """Under LAUNCH_START_METHOD=fork a worker is a fork of the launch, whose heap (torch's modules, Hydra's
    config, the plan) nothing froze as the forkserver freezes its imports: heap.release's collection at the
    run's end walked all of it. The worker freezes it as it starts; a forkserver's worker leaves the heap as
    the forkserver froze it."""
    import gc
    import signal

    from launcher.train import worker

    inherited = [[object()] for _ in range(50_000)]  # the launch's objects, tracked by the collector
    for method, frozen in (("forkserver", False), ("fork", True)):
        gc.unfreeze()
        monkeypatch.setenv("LAUNCH_START_METHOD", method)
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
        try:
            worker._as_a_fresh_process()
            assert (gc.get_freeze_count() >= len(inherited)) is frozen, method
        finally:
            gc.unfreeze()
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def test_cuda_graph_auto_keeps_a_replay_five_percent_shorter_or_a_tie_where_dataloader_workers_run():
    """Alone on the host the step's launches are not held up: the graph must gain 5%. Beside DataLoader workers
    (busy on the host's cores once training runs, resting while the warm-up times both ways) a replayed step,
    which needs almost no host time, wins a tie: on two H200s with 15 workers a rank, 38.1 ms replayed against
    39.2 eagerly in the warm-up, then 8,663-10,496 img/s an epoch replayed against 7,775-8,344 eagerly."""
    from launcher.train.warmup import keeps_graph

    assert keeps_graph(37.0, 40.0, workers=False) and not keeps_graph(37.7, 38.7, workers=False)
    assert keeps_graph(37.7, 38.7, workers=True) and keeps_graph(38.7, 38.7, workers=True)
    assert not keeps_graph(39.0, 38.7, workers=True)


def test_the_warm_up_leaves_no_trace_but_its_time():
    """The warm-up (warmup.py) trains a few steps on the real batches before the first epoch: afterwards the
    weights, the optimizer's momentum and the learning-rate schedule are as before, no gradient is left, the
    evaluation warms up again at its next run, and its time is counted apart from the training's."""
    import contextlib
    import gc
    import logging
    from types import SimpleNamespace

    from launcher.config import PerfConfig, SingleConfig
    from launcher.strategies import Devices, choose
    from launcher.train.misfit import FirstSteps
    from launcher.train.optim import _stepper
    from launcher.train.results import Timings
    from launcher.train.step import TrainStep
    from launcher.train.warmup import WARMUP_STEPS, WarmUp

    cpu = torch.device("cpu")
    strategy = choose(SingleConfig(), Devices(), nprocs=None, global_batch=8, perf=PerfConfig(),
                      gpus_text="[]").strategy
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    nets = strategy.wrap(model, cpu)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steppers = [_stepper(opt, lambda step: 1.0 / (step + 1))]

    def cross_entropy(net, batch):
        return torch.nn.functional.cross_entropy(net(batch[0]), batch[1])

    step = TrainStep(nets, steppers, cross_entropy, None, None, contextlib.nullcontext, cpu)
    seen = []

    class Split:
        def batches(self, rows):
            for r in rows:
                seen.append(r)
                yield (torch.randn(8, 3), torch.randint(0, 2, (8,))), r

    before = {k: v.clone() for k, v in model.state_dict().items()}
    timings, evaluation = Timings(), SimpleNamespace(warm=True)
    warm_up = WarmUp(config_of("gpus=[]"), strategy, cpu, timings, SimpleNamespace(mark=lambda name: None), evaluation,
                     auto_graph=False)
    order = lambda epoch: torch.arange(40).view(5, 8)  # noqa: E731
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(logging.getLogger("launcher.train"), "info", lambda *a, **k: None)
            warm_up(step, Split(), order, torch.Generator(), FirstSteps(None, False), compiled=True, captures=False)
    finally:
        gc.unfreeze()  # (settle_heap froze the heap, as after compiling)
    assert len(seen) == WARMUP_STEPS
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(not s["momentum_buffer"].any() for s in opt.state.values())  # (none before: zeros in place)
    assert steppers[0].scheduler.last_epoch == 0 and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert evaluation.warm is False and timings.warmup_s > 0 and timings.train_s == 0
