"""Each optimizer's parameter groups as docs/keys.md's `optim` row documents them: which parameters each group
holds (every trained one in exactly one), its weight decay, and its learning rate at the first step, at the end
of the warm-up and at the end of the run (launcher/train/optim.py)."""

import warnings

import pytest
import torch
from torch import nn

from launcher.config import AdamWConfig, MuonConfig, SGDConfig
from launcher.errors import ConfigError
from launcher.train import optim

LR, EPOCHS, STEPS = 0.2, 4, 10  # 40 steps; warmup_epochs=1: 10 of them


class Words(nn.Module):
    """Matrices, biases, a norm, an embedding and a head: what sgd and adamw take in one group."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.hidden, self.norm = nn.Embedding(11, 6), nn.Linear(6, 6), nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)


class Filters(nn.Module):
    """A model as the muon recipes' (recipes/vision_models.py): a stem with a bias, filter matrices, norms that
    train only their bias, a head without one; `parameter_roles()` says which is which."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv = nn.Linear(12, 4), nn.Linear(4, 4, bias=False)  # (Muon's filters: 2-D)
        self.norm = nn.BatchNorm1d(4)
        self.norm.weight.requires_grad_(False)
        self.head = nn.Linear(4, 3, bias=False)

    def parameter_roles(self) -> dict[str, list[nn.Parameter]]:
        return {"matrices": [self.stem.weight, self.conv.weight], "biases": [self.norm.bias],
                "stem_bias": [self.stem.bias], "head": [self.head.weight]}


def _lrs_at(stepper: optim.Stepper, step: int) -> list[float]:
    """Each group's learning rate once the schedule has taken `step` steps (from a fresh build)."""
    with warnings.catch_warnings():  # (the schedule stepped without an optimizer step: only its rates matter)
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(step - stepper.scheduler.last_epoch):
            stepper.scheduler.step()
    return [g["lr"] for g in stepper.optimizer.param_groups]


def _ids(params) -> set[int]:
    return {id(p) for p in params}


def _trained(model: nn.Module) -> set[int]:
    return {id(p) for p in model.parameters() if p.requires_grad}


@pytest.mark.parametrize("config", [SGDConfig(weight_decay=5e-4, warmup_epochs=1.0),
                                    AdamWConfig(weight_decay=0.01, warmup_epochs=1.0)])
def test_sgd_and_adamw_decay_every_parameter_alike_and_warm_up_then_decay_the_lr(config):
    """One group: every parameter (matrices, biases, norms, the embedding and the head) with optim.weight_decay;
    lr warms up linearly over optim.warmup_epochs (1/10 of lr at the first of its 10 steps), then falls
    linearly to 0 at the end of the run."""
    model = Words()
    [stepper] = optim.build(config, LR, EPOCHS, model, STEPS, fused=False)
    [group] = stepper.optimizer.param_groups
    assert _ids(group["params"]) >= _trained(model) and len(group["params"]) == len(list(model.parameters()))
    assert group["weight_decay"] == config.weight_decay
    if isinstance(config, SGDConfig):
        assert group["momentum"] == 0.9 and group["nesterov"]
    assert _lrs_at(stepper, 0) == [pytest.approx(LR / 10)]
    assert _lrs_at(stepper, 5) == [pytest.approx(LR * 6 / 10)]
    assert _lrs_at(stepper, 10) == [pytest.approx(LR)]  # the warm-up reached lr
    assert _lrs_at(stepper, 25) == [pytest.approx(LR / 2)]  # half way down
    assert _lrs_at(stepper, 40) == [pytest.approx(0.0)]


def test_adamw_takes_its_betas_and_eps_and_without_decay_1d_decays_matrices_and_embeddings_only():
    """nanoGPT's AdamW (betas 0.9, 0.95; decay on 2-D parameters only) could not be typed: optim.betas was an
    unknown key and every parameter decayed."""
    model = Words()
    config = AdamWConfig(weight_decay=0.1, beta1=0.8, beta2=0.95, eps=1e-6, decay_1d=False)
    [stepper] = optim.build(config, LR, EPOCHS, model, STEPS, fused=False)
    decayed, kept = stepper.optimizer.param_groups
    assert _ids(decayed["params"]) == _ids([model.embed.weight, model.hidden.weight, model.head.weight])
    assert _ids(kept["params"]) == _ids([model.hidden.bias, model.norm.weight, model.norm.bias, model.head.bias,
                                         model.frozen])
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.1, 0.0)
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in (decayed, kept))
    assert _lrs_at(stepper, 10) == [pytest.approx(LR)] * 2  # (one schedule for both)
    [group] = optim.build(AdamWConfig(), LR, EPOCHS, model, STEPS, fused=False)[0].optimizer.param_groups
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8  # (torch's own defaults)


def test_sgd_without_warm_up_starts_at_lr():
    [stepper] = optim.build(SGDConfig(warmup_epochs=0.0), LR, EPOCHS, Words(), STEPS, fused=False)
    assert _lrs_at(stepper, 0) == [pytest.approx(LR)] and _lrs_at(stepper, 20) == [pytest.approx(LR / 2)]


def test_muon_groups_each_parameter_kind_with_its_lr_decay_and_schedule():
    """Muon: the filter matrices at `lr`, no weight decay (kept at unit RMS instead). Nesterov SGD: the stem's
    bias and the norms' biases at optim.sgd_lr, the head at optim.head_lr, each with optim.weight_decay per step
    at full LR (SGD's decay x the group's lr = optim.weight_decay). All warm up and decay as `lr` does, but the
    stem's bias, which falls from sgd_lr to 0 over optim.stem_bias_epochs."""
    config = MuonConfig(weight_decay=0.004, warmup_epochs=1.0, sgd_lr=0.3, head_lr=0.7, stem_bias_epochs=2.0)
    model = Filters()
    muon, sgd = optim.build(config, LR, EPOCHS, model, STEPS, fused=False)
    roles = model.parameter_roles()
    [matrices] = muon.optimizer.param_groups
    assert isinstance(muon.optimizer, optim.Muon) and _ids(matrices["params"]) == _ids(roles["matrices"])
    assert matrices["weight_decay"] == 0.0
    stem, biases, head = sgd.optimizer.param_groups
    assert isinstance(sgd.optimizer, torch.optim.SGD)
    for group, role, lr in ((stem, "stem_bias", config.sgd_lr), (biases, "biases", config.sgd_lr),
                            (head, "head", config.head_lr)):
        assert _ids(group["params"]) == _ids(roles[role]), role
        assert group["weight_decay"] * lr == pytest.approx(config.weight_decay), role
        assert group["momentum"] == config.momentum and group["nesterov"], role
    everything = [p for g in (matrices, stem, biases, head) for p in g["params"]]
    assert _ids(everything) == _trained(model) and len(everything) == len(_trained(model))  # each once
    # (stem bias, norm biases, head) and the matrices, at the first step, the warm-up's end, mid-decay, the end
    for step, warm, stem_factor in ((0, 0.1, 1.0), (10, 1.0, 0.5), (25, 0.5, 0.0), (40, 0.0, 0.0)):
        assert _lrs_at(muon, step) == [pytest.approx(LR * warm)], step
        assert _lrs_at(sgd, step) == [pytest.approx(config.sgd_lr * stem_factor), pytest.approx(config.sgd_lr * warm),
                                      pytest.approx(config.head_lr * warm)], step


def test_muon_refuses_a_model_whose_roles_leave_a_parameter_out_or_name_one_twice():
    """A trained parameter in no role would never be stepped (its model trains less than it says, silently);
    one in two roles would be stepped twice."""
    model = Filters()
    left_out = {**model.parameter_roles(), "biases": []}
    model.parameter_roles = lambda: left_out
    with pytest.raises(ConfigError, match=r"norm\.bias"):
        optim.build(MuonConfig(), LR, EPOCHS, model, STEPS, fused=False)
    model = Filters()
    twice = {**model.parameter_roles(), "head": [model.head.weight, model.conv.weight]}
    model.parameter_roles = lambda: twice
    with pytest.raises(ConfigError, match=r"conv\.weight"):
        optim.build(MuonConfig(), LR, EPOCHS, model, STEPS, fused=False)


def test_the_memory_estimate_counts_the_state_each_optimizer_keeps_per_parameter():
    from launcher.config import AdamWConfig, SGDConfig
    from launcher.train.optim import state_per_parameter

    assert state_per_parameter(SGDConfig(momentum=0.0, nesterov=False)) == 0  # plain SGD keeps nothing
    assert state_per_parameter(SGDConfig()) == 1 and state_per_parameter(AdamWConfig()) == 2


@pytest.mark.parametrize("config", [SGDConfig(momentum=0.9), SGDConfig(momentum=0.0), AdamWConfig()],
                         ids=["sgd", "sgd-no-momentum", "adamw"])
def test_each_optimizer_built_as_on_a_gpu_steps_fsdps_sharded_parameters_as_it_steps_whole_ones(tmp_path, config):
    """On a GPU the trainer asks for fused optimizers (launcher/train/loop.py: fused=True). Under fsdp the
    parameters are DTensors, and torch's fused SGD has no DTensor rule: its first step raised
    NotImplementedError on the GPUs (`optim=sgd strategy=fsdp`). Built with fused=True here (fused runs on
    the CPU too), each optimizer's step over one rank's shards gives the weights its step over plain ones does."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        stepped = []
        for shard in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
            if shard:
                fully_shard(model)
            [stepper] = optim.build(config, LR, EPOCHS, model, STEPS, fused=True)
            for _ in range(2):
                model(torch.ones(4, 6)).square().sum().backward()
                stepper.optimizer.step()
                stepper.optimizer.zero_grad()
            stepped.append([p.full_tensor() if shard else p.detach() for p in model.parameters()])
        for a, b in zip(*stepped, strict=True):
            torch.testing.assert_close(a, b)
    finally:
        dist.destroy_process_group()
