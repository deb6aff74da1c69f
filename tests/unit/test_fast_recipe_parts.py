"""The record-speed recipe's parts on CPU: whitening, alternating flips, TTA, and Muon's parameter groups."""

import copy

import pytest
import torch

from launcher.config import MuonConfig
from launcher.data.augment import alternating_flip, tta_logits, tta_views
from launcher.recipes.vision_models import Airbench94
from launcher.train import optim
from launcher.train.checkpoint import optimizer_states


def build_muon(model, steps_per_epoch=2, epochs=4):
    return optim.build(MuonConfig(), 0.24, epochs, model, steps_per_epoch, fused=False)


def test_whitening_stem_decorrelates_2x2_patches():
    torch.manual_seed(0)
    mix = torch.randn(3, 3) * 3
    images = torch.einsum("dc,nchw->ndhw", mix, torch.randn(400, 3, 32, 32))  # correlated channels
    net = Airbench94()
    net.init_whitening(images)
    assert not net.stem.weight.requires_grad and net.stem.weight.shape == (24, 3, 2, 2)
    out = torch.nn.functional.conv2d(images, net.stem.weight[:12])  # the positive half, no bias
    flat = out.permute(0, 2, 3, 1).reshape(-1, 12)
    cov = flat.T @ flat / len(flat)
    assert torch.allclose(cov, torch.eye(12), atol=0.05)
    assert torch.allclose(net.stem.weight[12:], -net.stem.weight[:12])


def test_the_record_nets_batchnorm_keeps_its_scale_at_one_under_any_optimizer():
    """Shift-only BatchNorm: its scale is no parameter that trains (an SGD or AdamW step over the model's
    trainable parameters leaves it at 1), only its shift does."""
    from launcher.recipes.vision_models import ShiftOnlyBatchNorm

    torch.manual_seed(0)
    net = Airbench94()
    norms = [m for m in net.modules() if isinstance(m, ShiftOnlyBatchNorm)]
    sgd = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
    net(torch.randn(4, 3, 32, 32)).square().mean().backward()
    sgd.step()
    assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert any(not torch.equal(m.bias, torch.zeros_like(m.bias)) for m in norms)


def test_alternating_flip_mirrors_complementary_halves_on_even_and_odd_epochs():
    x = torch.arange(8 * 4, dtype=torch.float32).view(8, 1, 1, 4)
    idx = torch.arange(8)
    even, odd = alternating_flip(x, idx, epoch=0, seed=0), alternating_flip(x, idx, epoch=1, seed=0)
    flipped_even = (even != x).any(dim=3).view(-1)
    flipped_odd = (odd != x).any(dim=3).view(-1)
    assert torch.equal(flipped_even, ~flipped_odd) and 0 < flipped_even.sum() < 8
    assert torch.equal(alternating_flip(x, idx, epoch=2, seed=0), even)  # a property of the image, not the call


def test_tta_views_and_weights():
    x = torch.randn(5, 3, 8, 8)
    for level, count in ((0, 1), (1, 2), (2, 6)):
        views, weights = tta_views(x, level)
        assert views.shape[0] == 5 * count and abs(sum(weights) - 1) < 1e-9
    views, _ = tta_views(x, 2)
    assert torch.equal(views[5:10], x.flip(3))

    def net(v):  # a "network" that ignores mirroring and shifts: TTA must give back its plain logits
        return v.mean(dim=(1, 2, 3)).unsqueeze(1).expand(-1, 4) * 0 + torch.arange(4.0)

    assert torch.allclose(tta_logits(net, x, 2), torch.arange(4.0).expand(5, 4))


def test_tta_views_are_six_different_images_weighted_as_stated():
    """A network that reads pixels by position sees every view differently: each view must be its own
    image (mirror, one-pixel shifts up-left and down-right), and the logits their weighted mean."""
    x = torch.randn(3, 1, 6, 6)
    views, weights = tta_views(x, 2)
    chunks = views.split(3)
    assert all(not torch.equal(chunks[i], chunks[j]) for i in range(6) for j in range(i + 1, 6))
    assert torch.equal(chunks[2][:, :, 1:, 1:], x[:, :, :-1, :-1])  # shifted: the pixel up-left moved in
    assert torch.equal(chunks[4][:, :, :-1, :-1], x[:, :, 1:, 1:])  # and down-right
    assert torch.equal(chunks[3], chunks[2].flip(3)) and torch.equal(chunks[5], chunks[4].flip(3))

    def by_position(v):  # logits = the first row's first four pixels
        return v[:, 0, 0, :4]

    expected = sum(w * by_position(c) for w, c in zip(weights, chunks, strict=True))
    assert torch.allclose(tta_logits(by_position, x, 2), expected)
    assert weights == [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]


def test_muon_groups_train_matrices_and_keep_their_scale():
    torch.manual_seed(0)
    net = Airbench94()
    steppers = build_muon(net)
    muon, sgd = (s.optimizer for s in steppers)
    assert isinstance(muon, optim.Muon) and isinstance(sgd, torch.optim.SGD)
    matrices = net.parameter_roles()["matrices"]
    assert {id(p) for p in matrices} == {id(p) for g in muon.param_groups for p in g["params"]}
    before = [p.detach().clone() for p in matrices]
    for _ in range(3):
        net.zero_grad()
        net(torch.randn(8, 3, 32, 32)).square().mean().backward()
        for s in steppers:
            s.step()
    for p, old in zip(matrices, before, strict=True):
        assert not torch.equal(p, old)
        assert abs(p.norm().item() - len(p) ** 0.5) < 1e-3  # norm sqrt(rows) after every step
    # the stem bias trains for stem_bias_epochs (3 of 4 epochs = 6 steps), the rest decay over 8 steps
    stem_lr = sgd.param_groups[0]["lr"]
    assert 0 < stem_lr < MuonConfig().sgd_lr
    for _ in range(3):
        steppers[1].scheduler.step()
    assert sgd.param_groups[0]["lr"] == 0.0 and sgd.param_groups[1]["lr"] > 0


@pytest.mark.parametrize("shapes", [
    [(16, 72), (16, 72), (64, 32), (8, 8), (16, 72)],  # batched by shape
    [(16, 72), (12, 72), (16, 60), (72, 16)],  # one zero-padded batch
])
def test_launchers_muon_computes_torchs_muon_and_loads_its_checkpoints(shapes, monkeypatch):
    """optim.Muon orthogonalizes its matrices in batches (by shape, or zero-padded to one shape) and may
    take a tensor learning rate; the update must be torch.optim.Muon's (to bf16 rounding), wide and tall
    matrices, weight decay and Nesterov included."""
    batches = optim._batches([torch.Size(s) for s in shapes], waste=2.0)
    assert len(batches) == (1 if len(shapes) == 4 else 3)
    if len(batches) == 1:  # (on the CPU the step pads nothing: the padded batch is tested by hand here)
        monkeypatch.setattr(optim, "_batches", lambda shapes, waste: batches)
    monkeypatch.setattr(optim, "ns_dtype", lambda device: torch.bfloat16)  # torch's precision, as on GPUs
    torch.manual_seed(0)
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    runs = {}
    for kind in ("torch", "launcher", "launcher-tensor-lr"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        if kind == "torch":
            opt = torch.optim.Muon(params, lr=0.05, weight_decay=0.1, momentum=0.9)
        else:
            lr = torch.tensor(0.05) if kind.endswith("tensor-lr") else 0.05
            opt = optim.Muon(params, lr=lr, weight_decay=0.1, momentum=0.9)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        runs[kind] = (params, opt)
    reference = runs["torch"][0]
    for kind in ("launcher", "launcher-tensor-lr"):
        for p, q in zip(runs[kind][0], reference, strict=True):
            assert (p - q).abs().max() < 2e-3 * q.abs().max(), kind
        assert not torch.equal(runs[kind][0][0], start[0])
    # the same state: torch's checkpoint loads into the launcher's Muon and the next steps agree
    mine = optim.Muon([torch.nn.Parameter(p.detach().clone()) for p in reference], lr=0.05, weight_decay=0.1,
                      momentum=0.9)
    mine.load_state_dict(copy.deepcopy(runs["torch"][1].state_dict()))  # (not sharing its buffers)
    theirs = runs["torch"]
    for p, q, g in zip(mine.param_groups[0]["params"], theirs[0], grads[0], strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    mine.step()
    theirs[1].step()
    for p, q in zip(mine.param_groups[0]["params"], theirs[0], strict=True):
        assert (p - q).abs().max() < 2e-3 * q.abs().max()


def test_muon_on_the_cpu_orthogonalizes_in_float32_close_to_torchs_bf16():
    torch.manual_seed(0)
    start = [torch.randn(64, 216), torch.randn(256, 576)]
    grads = [torch.randn_like(t) for t in start]
    moved = []
    for make in (torch.optim.Muon, optim.Muon):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(params, lr=0.05, momentum=0.9, weight_decay=0.0)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        moved.append([p.detach() - t for p, t in zip(params, start, strict=True)])
    assert optim.ns_dtype(torch.device("cpu")) is torch.float32
    for theirs, mine in zip(*moved, strict=True):  # the same update, to bf16's precision
        assert (theirs - mine).norm() < 0.03 * theirs.norm()


def test_muon_needs_a_model_that_names_its_matrices():
    from launcher.errors import ConfigError

    with pytest.raises(ConfigError, match="parameter_roles"):
        build_muon(torch.nn.Linear(3, 3))


def test_checkpoints_from_one_optimizer_still_load():
    assert optimizer_states({"optimizer_state_dict": {"a": 1}, "scheduler_state_dict": {"b": 2}}) == (
        [{"a": 1}], [{"b": 2}])


def test_tta_of_level_one_is_the_mean_of_the_image_and_its_mirror():
    x = torch.randn(3, 1, 6, 6)

    def by_position(v):  # a network that sees a mirrored image differently
        return v[:, 0, 0, :4]

    assert torch.allclose(tta_logits(by_position, x, 1), 0.5 * by_position(x) + 0.5 * by_position(x.flip(3)))
    assert torch.equal(tta_logits(by_position, x, 0), by_position(x))


def test_random_flips_mirror_about_half_of_the_images_and_nothing_else():
    from launcher.data.augment import ImageAugmentation

    x = torch.arange(400 * 4, dtype=torch.float32).view(400, 1, 1, 4)
    out = ImageAugmentation("random", 0, seed=0)(x, torch.Generator().manual_seed(0), indices=torch.arange(400),
                                                 epoch=0)
    mirrored = (out != x).any(dim=3).view(-1)
    assert torch.equal(out[mirrored], x[mirrored].flip(3)) and torch.equal(out[~mirrored], x[~mirrored])
    assert 150 < int(mirrored.sum()) < 250
    same = ImageAugmentation("none", 0, seed=0)(x, torch.Generator().manual_seed(0), indices=torch.arange(400),
                                                epoch=0)
    assert torch.equal(same, x)
