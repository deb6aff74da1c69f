"""Probe (issue 15): the GPU time of recipe=cifar10_fast's step, part by part, each part replayed as a CUDA graph.

    python bench/probe/fast_parts.py                 # forward+backward per crop choice, Muon per implementation

Forward + backward of airbench94 at batch 2000 (bf16 autocast, channels_last, compiled with inductor's
default mode as the captured step compiles it), with the 3x3 convolutions before each 2x2 pool computed
everywhere (`none`, the network as it is) or only where the floor-mode pool reads (`all`, or only in
blocks 2-3: `blocks23`: the input padded at the top/left only, no padding in the convolution: the same
numbers for 6-27% fewer multiply-adds); then one Muon step over the network's six filter matrices:
torch.optim.Muon, the launcher's (padded into one batch on a GPU) and the launcher's by shape. Each part
is captured once and replayed; the figure is device time per replay (CUDA events around 50 replays).
One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn import functional as F

from launcher.recipes import vision_models
from launcher.strategies.gradients import FlatGradients
from launcher.train import optim
from launcher.train.compiling import compile_for_training


def conv_where_pooled(conv, x: torch.Tensor) -> torch.Tensor:
    """conv1 of a block (3x3, padding 1) only where the 2x2 floor-mode pool after it reads."""
    h, w = x.shape[-2:]
    weight = conv.weight.view(conv.filter_shape) if hasattr(conv, "filter_shape") else conv.weight
    return F.conv2d(F.pad(x, (1, 1 - w % 2, 1, 1 - h % 2)), weight, getattr(conv, "bias", None))


def crop_choice(kind: str):
    def forward(block, x):
        crop = kind == "all" or (kind == "blocks23" and x.shape[1] > 24)
        x = conv_where_pooled(block.conv1, x) if crop else block.conv1(x)
        x = F.gelu(block.norm1(block.pool(x)))
        return F.gelu(block.norm2(block.conv2(x)))

    return forward


def timed_graph(fn, replays: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / replays


def forward_backward(kind: str, batch: int, replays: int) -> dict:
    plain = vision_models._ConvPoolBlock.forward
    vision_models._ConvPoolBlock.forward = crop_choice(kind)
    torch.manual_seed(0)
    model = vision_models.Airbench94().cuda().to(memory_format=torch.channels_last)
    grads = FlatGradients(model.parameters())
    compile_for_training(model, None)
    x = torch.randn(batch, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        grads.zero()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.2)
        loss.backward()

    ms = timed_graph(step, replays)
    torch._dynamo.reset()
    vision_models._ConvPoolBlock.forward = plain
    return {"part": "forward+backward", "crop": kind, "batch": batch, "ms": round(ms, 4)}


def body(kind: str, batch: int, replays: int) -> dict:
    """The captured step's body as the launcher runs it for cifar10_fast (alternating flip, 2-pixel
    reflect shift, normalization, the compiled network, loss, the epoch's sums), with the input pipeline
    eager (`eager-inputs`, as now) or compiled as one function (`compiled-inputs`; the shifts drawn
    eagerly, since dynamo takes no generator)."""
    from launcher.recipes.cifar10 import MEAN, STD
    from launcher.train.augment import alternating_flip

    torch.manual_seed(0)
    model = vision_models.Airbench94().cuda().to(memory_format=torch.channels_last)
    grads = FlatGradients(model.parameters())
    compile_for_training(model, None)
    data = torch.randint(0, 256, (50_000, 3, 32, 32), dtype=torch.uint8, device="cuda")
    labels = torch.randint(0, 10, (50_000,), device="cuda")
    idx = torch.randperm(50_000, device="cuda")[:batch]
    mean = torch.tensor(MEAN, device="cuda").view(1, -1, 1, 1)
    std = torch.tensor(STD, device="cuda").view(1, -1, 1, 1)
    sums = torch.zeros(3, device="cuda")

    def pipeline(x, idx, dy, dx):
        x = alternating_flip(x, idx, 0, 0)
        n, _, h, w = x.shape
        padded = F.pad(x.float(), (2, 2, 2, 2), mode="reflect")
        rows = (dy.view(n, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1)
        cols = (dx.view(n, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w)
        b = torch.arange(n, device=x.device).view(n, 1, 1, 1)
        c = torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1)
        x = padded[b, c, rows, cols]
        return ((x - mean) / std).contiguous(memory_format=torch.channels_last)

    inputs = torch.compile(pipeline) if kind == "compiled-inputs" else pipeline

    def step():
        grads.zero()
        x, y = data[idx], labels[idx]
        dy = torch.randint(0, 5, (batch,), device="cuda")
        dx = torch.randint(0, 5, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inputs(x, idx, dy, dx))
            loss = F.cross_entropy(logits, y, label_smoothing=0.2)
        loss.backward()
        sums[0] += loss.detach().float() * batch
        sums[1] += (logits.argmax(-1) == y).sum()
        sums[2] += torch.isfinite(loss.detach())

    ms = timed_graph(step, replays)
    torch._dynamo.reset()
    return {"part": "step body", "inputs": kind, "batch": batch, "ms": round(ms, 4)}


def muon_step(kind: str, replays: int) -> dict:
    torch.manual_seed(0)
    model = vision_models.Airbench94().cuda()
    matrices = model.parameter_roles()["matrices"]
    for p in matrices:
        p.grad = torch.randn_like(p)
    opt = (torch.optim.Muon(matrices, lr=0.24, momentum=0.6, nesterov=True, weight_decay=0.0) if kind == "torch"
           else optim.Muon(matrices, lr=torch.tensor(0.24, device="cuda"), momentum=0.6, nesterov=True,
                           weight_decay=0.0))
    batches = optim._batches
    if kind == "launcher-by-shape":
        optim._batches = lambda shapes, waste: batches(shapes, 1.0)
    ms = timed_graph(opt.step, replays)
    optim._batches = batches
    return {"part": "muon step", "impl": kind, "shapes": [list(p.shape) for p in matrices], "ms": round(ms, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2000)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--crops", nargs="*", default=["none", "all", "blocks23", "none", "all", "blocks23"])
    p.add_argument("--bodies", nargs="*", default=[])
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for kind in ("torch", "launcher", "launcher-by-shape") * 2 if not args.bodies else ():
        print(json.dumps({**muon_step(kind, args.replays), **info}), flush=True)
    for kind in args.crops:
        print(json.dumps({**forward_backward(kind, args.batch, args.replays), **info}), flush=True)
    for kind in args.bodies:
        print(json.dumps({**body(kind, args.batch, args.replays), **info}), flush=True)


if __name__ == "__main__":
    main()
