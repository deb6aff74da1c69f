"""Image classifiers for 32x32 inputs, written for this project from their papers' descriptions.

- `airbench`: a fast three-block conv net in the style of Keller Jordan's CIFAR-10 speed records
  (conv -> max-pool -> BatchNorm -> GELU blocks of width 64/256/256 after a 2x2 patch stem).
- `airbench94`: the records' network itself as published in words: frozen patch-whitening stem,
  shift-only BatchNorm, filter matrices for Muon (the `cifar10_fast` configuration).
- `resnet18`: He et al. 2016, the CIFAR variant (3x3 stem, no max-pool), 11.2M parameters.
- `mobilenetv3_small`: Howard et al. 2019, the small network's block table, with the stem and first
  block at stride 1 so that 32x32 inputs keep enough resolution.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class _ConvPoolBlock(nn.Module):
    """conv -> max-pool -> norm -> GELU -> conv -> norm -> GELU: one block of the airbench networks.

    `conv(c_in, c_out)` and `norm(channels)` make the layers, so the plain net and the record net
    share the block and differ only in their convolution and BatchNorm kinds.
    """

    def __init__(self, c_in: int, c_out: int, conv, norm):
        super().__init__()
        self.conv1 = conv(c_in, c_out)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = norm(c_out)
        self.conv2 = conv(c_out, c_out)
        self.norm2 = norm(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(self.pool(self.conv1(x))))
        return F.gelu(self.norm2(self.conv2(x)))


def _conv3x3(c_in: int, c_out: int) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)


def _batchnorm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, momentum=0.4)


def _blocks(widths: tuple[int, int, int], conv, norm) -> nn.Sequential:
    ins = (24, *widths[:2])  # after the 24-filter 2x2 stem
    return nn.Sequential(*(_ConvPoolBlock(c_in, c_out, conv, norm) for c_in, c_out in zip(ins, widths, strict=True)))


class AirbenchNet(nn.Module):
    def __init__(self, num_classes: int = 10, widths: tuple[int, int, int] = (64, 256, 256)):
        super().__init__()
        self.stem = nn.Conv2d(3, 24, 2, bias=True)  # 2x2 patches: 32x32 -> 31x31
        self.blocks = _blocks(widths, _conv3x3, _batchnorm)
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.scale = 1 / 9  # keeps the initial logits small, which the records found to train faster

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.gelu(self.stem(x)))
        # The global max with its indices (the backward puts each gradient at the max's index), not
        # torch.amax: compiled under bf16 autocast, amax's backward made every gradient below the head
        # NaN at the first step (inductor, CPU and GPU, torch 2.11 and 2.13), as if it found no element
        # equal to the max it had rounded. adaptive_max_pool2d trains too, a little slower (measured:
        # BENCHMARKS.md section 2).
        x = x.flatten(2).max(dim=2).values
        return self.head(x) * self.scale


class MatrixConv2d(nn.Module):
    """A 'same'-padded convolution whose filters are stored as one (out, in*k*k) matrix.

    That is the shape Muon orthogonalizes (torch.optim.Muon takes 2-D parameters only); the forward
    pass views it back as (out, in, k, k). The first `in` filters start as identities (Dirac), the rest
    with nn.Conv2d's default initialization, as in the speed records.
    """

    def __init__(self, c_in: int, c_out: int, kernel: int = 3):
        super().__init__()
        weight = torch.empty(c_out, c_in, kernel, kernel)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        nn.init.dirac_(weight[:c_in])
        self.filter_shape = (c_out, c_in, kernel, kernel)
        self.weight = nn.Parameter(weight.reshape(c_out, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight.view(self.filter_shape), padding=self.filter_shape[2] // 2)


class ShiftOnlyBatchNorm(nn.BatchNorm2d):
    """BatchNorm with a learned shift and no learned scale (the scale stays 1)."""

    def __init__(self, channels: int, momentum: float = 0.4, eps: float = 1e-12):
        super().__init__(channels, eps=eps, momentum=momentum)
        self.weight.requires_grad_(False)


class Airbench94(nn.Module):
    """The record-speed network of Jordan 2024 ("94% on CIFAR-10 in 3.29 seconds"), from its description.

    A frozen 2x2 patch-whitening stem (24 filters: the whitened eigenvectors of the training set's
    2x2 patches and their negatives; only its bias trains), three conv blocks of width 64/256/256 with
    shift-only BatchNorm and GELU, a 3x3 max-pool to 1x1, and a bias-free linear head with unit-std
    weights whose output is divided by its width. Call `init_whitening` with normalized training
    images before training.
    """

    def __init__(self, num_classes: int = 10, widths: tuple[int, int, int] = (64, 256, 256)):
        super().__init__()
        self.stem = nn.Conv2d(3, 24, 2, bias=True)  # 32x32 -> 31x31
        self.stem.weight.requires_grad_(False)
        self.blocks = _blocks(widths, MatrixConv2d, ShiftOnlyBatchNorm)  # 31 -> 15 -> 7 -> 3
        self.pool = nn.MaxPool2d(3)  # 3x3 -> 1x1
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        with torch.no_grad():
            self.head.weight.div_(self.head.weight.std())
        self.scale = 1 / widths[2]  # with unit-std weights: small initial logits, as the records found best

    @torch.no_grad()
    def init_whitening(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """Set the stem to whiten 2x2 patches: filters v / sqrt(lambda + eps) and their negatives."""
        c, k = images.shape[1], self.stem.kernel_size[0]
        patches = images.float().unfold(2, k, 1).unfold(3, k, 1)  # (N, C, H', W', k, k)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k)
        # float32 for the big product (5,000 images give 4.8M patches), float64 for the small eigh
        covariance = (patches.T @ patches / len(patches)).double()
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)  # ascending
        eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
        filters = (eigenvectors / torch.sqrt(eigenvalues.clamp_min(0) + eps)).T.reshape(-1, c, k, k)
        self.stem.weight.copy_(torch.cat([filters, -filters]).to(self.stem.weight))
        self.stem.bias.zero_()

    def parameter_roles(self) -> dict[str, list[nn.Parameter]]:
        """Which parameters are which, for recipe.optimizer=muon (launcher/optim.py)."""
        convs = [m for m in self.modules() if isinstance(m, MatrixConv2d)]
        norms = [m for m in self.modules() if isinstance(m, ShiftOnlyBatchNorm)]
        return {"matrices": [m.weight for m in convs], "biases": [m.bias for m in norms],
                "stem_bias": [self.stem.bias], "head": [self.head.weight]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.blocks(F.gelu(self.stem(x))))
        return self.head(torch.flatten(x, 1)) * self.scale


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        layers, c_in = [], 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_BasicBlock(c_in, c_out, stride), _BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _make_divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        squeezed = _make_divisible(channels / 4)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class _InvertedResidual(nn.Module):
    def __init__(self, c_in: int, kernel: int, expanded: int, c_out: int, se: bool, hswish: bool, stride: int):
        super().__init__()
        act = nn.Hardswish if hswish else nn.ReLU
        layers: list[nn.Module] = []
        if expanded != c_in:
            layers += [nn.Conv2d(c_in, expanded, 1, bias=False), nn.BatchNorm2d(expanded), act()]
        layers += [nn.Conv2d(expanded, expanded, kernel, stride, kernel // 2, groups=expanded, bias=False),
                   nn.BatchNorm2d(expanded), act()]
        if se:
            layers.append(_SqueezeExcite(expanded))
        layers += [nn.Conv2d(expanded, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.residual else out


# kernel, expanded, out, squeeze-excite, hard-swish, stride: the paper's MobileNetV3-Small table,
# with the first block's stride 2 -> 1 for 32x32 inputs.
_MOBILENETV3_SMALL = [
    (3, 16, 16, True, False, 1), (3, 72, 24, False, False, 2), (3, 88, 24, False, False, 1),
    (5, 96, 40, True, True, 2), (5, 240, 40, True, True, 1), (5, 240, 40, True, True, 1),
    (5, 120, 48, True, True, 1), (5, 144, 48, True, True, 1), (5, 288, 96, True, True, 2),
    (5, 576, 96, True, True, 1), (5, 576, 96, True, True, 1),
]


class MobileNetV3Small(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish()]
        c_in = 16
        for kernel, expanded, c_out, se, hswish, stride in _MOBILENETV3_SMALL:
            layers.append(_InvertedResidual(c_in, kernel, expanded, c_out, se, hswish, stride))
            c_in = c_out
        layers += [nn.Conv2d(c_in, 576, 1, bias=False), nn.BatchNorm2d(576), nn.Hardswish()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Dropout(0.2),
                                        nn.Linear(1024, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


MODELS = {"airbench": AirbenchNet, "airbench94": Airbench94, "resnet18": ResNet18,
          "mobilenetv3_small": MobileNetV3Small}
