"""Probe (issue 15): the launcher's captured step with compiled units, taken apart on one GPU.

    python bench/probe/whole_graph.py --model airbench --batch 1024 --steps 60
    python bench/probe/whole_graph.py --model airbench --variants captured-whole script-reduce-overhead --profile

Each variant trains the same network from the same weights on the same random CIFAR-shaped uint8 batches
(GPU-resident, the launcher's flip + 2-pixel reflect shift, normalization, bf16 autocast, channels_last,
label smoothing 0.2, fused SGD Nesterov). It prints one JSON line: the loss of the first steps, the
first non-finite step (every step's loss is kept on the device, read at the end), which parameters are
non-finite then, and img/s over timed steps (device clock, no host sync inside).

Variants:
  eager                      no compile, no capture, ordinary .grad
  captured                   the launcher's step: FlatGradients, body captured as one CUDA graph
  captured-blocks            captured, each block compiled on its own (stem, blocks/layers, head; inductor default)
  captured-whole             captured, the whole model compiled as one unit
  captured-whole-restored    captured-whole, then weights/optimizer put back after the warm-up, as
                             Trainer._warm_up does (checkpoint.capture/restore)
  uncaptured-whole           the whole model compiled (compile_for_training), flat grads, no capture
  script-default             torch.compile(model) + compiled input pipeline, ordinary .grad (the script)
  script-reduce-overhead     as script-default with mode=reduce-overhead (bench/torchrun_ddp.py's best)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from launcher.recipes.cifar10 import MEAN, STD
from launcher.recipes.vision_models import MODELS
from launcher.train.augment import ImageAugmentation
from launcher.train.compiling import compile_for_training, compiled
from launcher.train.step import CapturedStep, FlatGradients

ALL = ["eager", "captured", "captured-blocks", "captured-whole", "captured-whole-restored", "uncaptured-whole",
       "script-default", "script-reduce-overhead"]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Device-clock seconds (CUDA events) on a GPU, host seconds on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.events[0].record()
        self.t = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.t
        self.events[1].record()
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1000


GLOBAL_MAX = {  # AirbenchNet's global max-pool, written three ways (--global-max)
    "amax": lambda x: torch.amax(x, dim=(2, 3)),
    "max": lambda x: x.flatten(2).max(dim=2).values,
    "adaptive": lambda x: torch.flatten(torch.nn.functional.adaptive_max_pool2d(x, 1), 1),
}


def run(variant: str, args, images, labels, device) -> dict:
    torch.manual_seed(0)
    model = MODELS[args.model](10).to(device).to(memory_format=torch.channels_last)
    if args.global_max:
        pool = GLOBAL_MAX[args.global_max]

        def forward(x, m=model):
            x = m.blocks(torch.nn.functional.gelu(m.stem(x)))
            return m.head(pool(x)) * m.scale

        model.forward = forward
    mean = torch.tensor(MEAN, device=device).view(1, -1, 1, 1)
    std = torch.tensor(STD, device=device).view(1, -1, 1, 1)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.2)
    gen = torch.Generator(device=device).manual_seed(1)
    b = args.batch
    captured = variant.startswith("captured")
    flat = FlatGradients(model.parameters(), 1) if captured or variant == "uncaptured-whole" else None
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True)
    if variant == "captured-blocks":  # what launch did before c67572d: each block its own graph
        blocks = getattr(model, "blocks", None) or model.layers
        head = getattr(model, "head", None) or model.fc
        for unit in (model.stem, *blocks, head):
            compile_for_training(unit, None)
    elif variant in ("captured-whole", "captured-whole-restored", "uncaptured-whole"):
        compile_for_training(model, None)

    def inputs(x, idx):
        x = ImageAugmentation("random", 2, seed=0)(x, gen, indices=idx, epoch=0)
        return ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)

    net = model
    if variant.startswith("script"):
        mode = "reduce-overhead" if variant.endswith("reduce-overhead") else None
        net = compiled(model, mode)
        inputs = compiled(inputs, None)

    losses = torch.zeros(args.warmup + args.steps, device=device)

    def body(x, y, idx, k):
        if flat is not None:
            flat.zero()
        else:
            opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(net(inputs(x, idx)), y)
        loss.backward()
        k.copy_(loss.detach().float())

    n = images.shape[0]
    perm = torch.randperm(n, device=device, generator=torch.Generator(device=device).manual_seed(0))

    def batch(i):
        idx = perm[(i * b) % (n - b):(i * b) % (n - b) + b]
        return images[idx], labels[idx], idx

    t0 = time.perf_counter()
    step_slot = torch.zeros((), device=device)
    graph = None
    if captured:
        saved = None
        if variant == "captured-whole-restored":
            saved = ({k: v.detach().clone() for k, v in model.state_dict().items()}, None)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i in range(3):
                body(*batch(i), step_slot)
                opt.step()
            if saved is not None:
                saved = (saved[0], {"state": {k: {n_: t.clone() for n_, t in v.items()} for k, v in
                                              opt.state_dict()["state"].items()},
                                    "param_groups": opt.state_dict()["param_groups"]})
            graph = CapturedStep(lambda x, y, idx: body(x, y, idx, step_slot), generators=[gen])
            graph.capture(*batch(0), stream=side)
        torch.cuda.current_stream(device).wait_stream(side)
        if saved is not None:
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            flat.zero()
    sync(device)
    warm_s = time.perf_counter() - t0

    def one(i):
        x, y, idx = batch(i)
        if graph is not None:
            graph.run(x, y, idx)
            losses[i].copy_(step_slot)
        else:
            body(x, y, idx, losses[i])
        opt.step()

    t1 = time.perf_counter()
    for i in range(args.warmup):
        one(i)
    sync(device)
    first_s = time.perf_counter() - t1
    clock = Clock(device)
    prof = None
    if args.profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    clock.start()
    for i in range(args.warmup, args.warmup + args.steps):
        one(i)
    seconds = clock.stop()
    if prof is not None:
        prof.__exit__(None, None, None)
    values = losses.tolist()
    bad = next((i for i, v in enumerate(values) if not torch.isfinite(torch.tensor(v))), None)
    bad_params = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    row = {"variant": variant, "model": args.model, "global_max": args.global_max, "batch": b,
           "img_per_s": round(args.steps * b / seconds),
           "ms_per_step": round(1000 * seconds / args.steps, 3), "warm_s": round(warm_s, 1),
           "first_steps_s": round(first_s, 2), "loss_first": [round(v, 4) for v in values[:6]],
           "loss_last": round(values[-1], 4), "first_nonfinite_step": bad, "nonfinite_params": bad_params[:6],
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if prof is not None:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
        row["profile_top"] = table
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="airbench")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--variants", nargs="+", default=ALL)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--global-max", choices=sorted(GLOBAL_MAX), help="airbench: how its global max-pool is written")
    p.add_argument("--device", default="cuda:0", help="cpu: a smoke run of the uncaptured variants")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    g = torch.Generator(device=device).manual_seed(0)
    images = torch.randint(0, 256, (50_000, 3, 32, 32), dtype=torch.uint8, device=device, generator=g)
    labels = torch.randint(0, 10, (50_000,), device=device, generator=g)
    for variant in args.variants:
        try:
            row = run(variant, args, images, labels, device)
        except Exception as exc:  # a probe: report and go on
            row = {"variant": variant, "model": args.model, "error": f"{type(exc).__name__}: {str(exc)[:600]}"}
        table = row.pop("profile_top", None)
        print(json.dumps(row), flush=True)
        if table:
            print(table, flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
