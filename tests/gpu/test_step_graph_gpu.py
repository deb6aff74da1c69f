"""perf.cuda_graph=true on GPUs (marked `gpu`): the captured step trains like the eager one, on 1 GPU
and under ddp on 2, and a rank that dies mid-replay still brings the launch down.

    python -m pytest -m gpu tests/gpu/test_step_graph_gpu.py -v
"""

import contextlib
import json
import shutil

import pytest


def cross_entropy_step(model, batch):
    """The built-in classifiers' training_step: cross-entropy of the batch's images against its labels."""
    import torch

    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

two_gpus = pytest.mark.two_gpus

COMMON = ("recipe=cifar10", "data.synthetic=true", "epochs=3", "batch_size=1024", "seed=3", "checkpoint=false")


def _losses(launch, *overrides: str) -> tuple[list[float], dict]:
    result = launch(*COMMON, *overrides, timeout=600)
    assert result.returncode == 0, result.output
    rows = [json.loads(x) for x in (result.run_dir() / "metrics.jsonl").read_text().splitlines()]
    results = result.results()
    for d in result.run_dirs():
        shutil.rmtree(d)
    return [r["loss"] for r in rows], results


def test_captured_step_trains_like_the_eager_step_on_one_gpu(launch):
    """Same seed and data; the graph replays the same kernels (cuDNN may pick other algorithms, and
    random draws come from the same generator), so per-epoch loss agrees within 2%."""
    eager, _ = _losses(launch, "gpus=[0]", "perf.cuda_graph=false")
    graphed, r = _losses(launch, "gpus=[0]", "perf.cuda_graph=true")
    assert r["cuda_graph"] is True
    for a, b in zip(eager, graphed, strict=True):
        assert abs(a - b) / a < 0.02, (eager, graphed)


@two_gpus
def test_captured_ddp_step_on_two_gpus_follows_one_gpu(launch):
    """The gradients are averaged inside the graph (bucketed all-reduce); ranks must end identical and
    the run must track the 1-GPU run of the same global batch (5%, as for DDP: BatchNorm sees 512)."""
    one, _ = _losses(launch, "gpus=[0]", "perf.cuda_graph=true")
    two, r = _losses(launch, "gpus=[0,1]", "perf.cuda_graph=true")
    assert r["cuda_graph"] is True and r["gradient_sync"] == "flat all-reduce" and r["ranks_agree"]
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) / a < 0.05, (one, two)


@two_gpus
def test_a_rank_failing_during_graph_replays_ends_the_launch(launch):
    """Its peer may be inside a replayed all-reduce that no NCCL watchdog sees: supervision must still
    end the launch within seconds, naming the rank (as for eager DDP in test_gpu.py)."""
    result = launch(*COMMON, "gpus=[0,1]", "perf.cuda_graph=true", "fault.rank=1", "fault.step=30", timeout=300)
    assert result.returncode == 1, result.output
    assert "rank 1 failed: RuntimeError: injected failure" in result.stderr
    records = {p.name: json.loads(p.read_text()) for p in (result.run_dir() / "failures").glob("*.json")}
    assert result.finished_at - records["attempt0-rank1.json"]["time"] < 10


@two_gpus
def test_compile_auto_compiles_after_the_first_epoch_when_the_rest_is_long_enough(launch):
    """perf.compile=auto trains epoch 1 uncompiled, then compiles and captures again when the epochs
    left would take at least perf.compile_auto_min_s: with 0 it must compile (and the compiled
    captured ddp step must train like the uncompiled one, ranks identical); with a huge bound it must not."""
    plain, r_plain = _losses(launch, "gpus=[0,1]", "perf.compile=auto", "perf.compile_auto_min_s=1000000")
    assert r_plain["compiled"] is False and "less than" in r_plain["compile_decision"], r_plain["compile_decision"]
    assert r_plain["cudnn_benchmark"] is False  # perf.cudnn_benchmark=auto: no autotuning in a run that did not compile
    compiled, r = _losses(launch, "gpus=[0,1]", "perf.compile=auto", "perf.compile_auto_min_s=0")
    assert r["compiled"] is True and r["cuda_graph"] is True and r["ranks_agree"], r
    assert r["cudnn_benchmark"] is True  # autotuned with the compile, from epoch 2
    assert "at least 0s" in r["compile_decision"], r["compile_decision"]
    assert plain[0] == pytest.approx(compiled[0], rel=1e-3)  # epoch 1 ran the same uncompiled step
    for a, b in zip(plain, compiled, strict=True):
        assert abs(a - b) / a < 0.03, (plain, compiled)


@pytest.mark.parametrize("optimizer", ["muon", "sgd", "adamw"])
def test_optimizers_captured_in_the_graph_step_like_eager_ones(optimizer):
    """Muon + SGD (and fused SGD, fused AdamW alone) with learning rates that change every step, stepped
    inside the captured graph (their learning rates read from device tensors) must move the weights and
    the optimizer state as the eager step does, after the warm-up's state was put back into the live
    tensors."""
    import torch

    from launcher.config import AdamWConfig, MuonConfig, SGDConfig
    from launcher.recipes.vision_models import Airbench94
    from launcher.strategies.base import Nets
    from launcher.strategies.gradients import FlatGradients
    from launcher.train import checkpoint, optim
    from launcher.train.step import TrainStep

    device = torch.device("cuda")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    gen = torch.Generator(device=device).manual_seed(0)
    xs = torch.randn(8, 64, 3, 32, 32, device=device, generator=gen)
    ys = torch.randint(0, 10, (8, 64), device=device, generator=gen)
    idx = torch.arange(64, device=device)

    def trainer(captured: bool):
        torch.manual_seed(0)
        model = Airbench94(widths=(16, 32, 32)).to(device)
        options = {"muon": MuonConfig(), "sgd": SGDConfig(warmup_epochs=1), "adamw": AdamWConfig(warmup_epochs=1)}
        steppers = optim.build(options[optimizer], 0.24 if optimizer != "adamw" else 1e-3, 2, model, 4,
                               fused=True, graphed=captured)
        nets = Nets(model, model, model, FlatGradients(model.parameters()))
        step = TrainStep(nets, steppers, cross_entropy_step, lambda x: x, None,
                         contextlib.nullcontext, device)
        return model, steppers, step

    model_e, steppers_e, eager = trainer(False)
    model_c, steppers_c, graphed = trainer(True)
    saved = checkpoint.capture(None, graphed.nets, steppers_c, device, clone=True, local=True)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(2):
            graphed((xs[i], ys[i]), idx, 0, gen)
        graphed.capture((xs[0], ys[0]), idx, gen, stream=side)
    torch.cuda.current_stream(device).wait_stream(side)
    checkpoint.restore(saved, None, graphed.nets, steppers_c, device, local=True)
    graphed.zero_grads()
    assert graphed.optimizers_in_graph
    for i in range(8):
        eager((xs[i], ys[i]), idx, 0, gen)
        graphed((xs[i], ys[i]), idx, 0, gen)
    torch.cuda.synchronize()
    assert steppers_c[0].optimizer.param_groups[0]["lr"] == steppers_e[0].optimizer.param_groups[0]["lr"]
    for (name, a), b in zip(model_e.state_dict().items(), model_c.state_dict().values(), strict=True):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), name
    for s_e, s_c in zip(steppers_e, steppers_c, strict=True):
        for p_e, p_c in zip(s_e.optimizer.state.values(), s_c.optimizer.state.values(), strict=True):
            for key, value in p_e.items():
                assert torch.allclose(value.float(), p_c[key].float(), rtol=1e-3, atol=1e-4), key


@pytest.mark.parametrize("flip", ["random", "alternating"])
def test_compiled_augmentation_and_normalization_give_the_eager_batch(flip):
    """A compiled, captured step augments and normalizes through one compiled function: the batch it
    gives the network must be the eager one (same random draws from the same generator state)."""
    import torch

    from launcher.data.augment import ImageAugmentation
    from launcher.recipes.vision_models import AirbenchNet
    from launcher.strategies.base import Nets
    from launcher.train.step import TrainStep

    device = torch.device("cuda")
    mean = torch.tensor([125.3, 123.0, 113.9], device=device).view(1, -1, 1, 1)
    std = torch.tensor([63.0, 62.1, 66.7], device=device).view(1, -1, 1, 1)

    def normalize(x):
        return ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)

    model = AirbenchNet().to(device)
    step = TrainStep(Nets(model, model, model), [], cross_entropy_step, normalize,
                     ImageAugmentation(flip, 2, seed=1), contextlib.nullcontext, device)
    x = torch.randint(0, 256, (256, 3, 32, 32), dtype=torch.uint8, device=device)
    idx = torch.arange(256, device=device)
    epoch = torch.ones((), dtype=torch.long, device=device)
    eager = step.inputs((x,), idx, epoch, torch.Generator(device=device).manual_seed(7))[0]
    step.compile_captured(None)
    assert step.compiled_inputs is not None
    fused = step.inputs((x,), idx, epoch, torch.Generator(device=device).manual_seed(7))[0]
    assert fused.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(eager, fused, atol=1e-5), (eager - fused).abs().max()
