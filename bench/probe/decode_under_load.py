"""Probe (issue 33): why nvImageCodec's hardware decode of a batch takes twice as long beside training.

    python bench/probe/decode_under_load.py [--root /tmp/imagenet-gen] [--batch 256] [--reps 12]

The recipe's HardwareDecoder (recipes/imagefolder.py) decodes one batch of --batch training JPEGs, with the
JPEGs' bytes in pageable memory (as today) or pinned, split between 2, 4 or 8 decoders, their streams of the
default or the highest priority, alone and while
another thread keeps the GPU's SMs busy (a queue of large bf16 matmuls, as a training step keeps them).
One JSON line per case: ms a batch (the decode call, host wall time), and the kinds of memcpy it issued.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roi_decode import gpu_events  # noqa: E402  (bench/probe/roi_decode.py)


class Load:
    """A thread that keeps the GPU busy with bf16 matmuls on a stream of its own (a few queued ahead)."""

    def __init__(self, n: int = 8192):
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                for _ in range(4):
                    self.a @ self.a
                done = torch.cuda.Event()
                done.record(stream)
                while not done.query() and not self.stop.is_set():
                    time.sleep(0.0005)

    def __enter__(self):
        self.thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        torch.cuda.synchronize()


def memcpy_kinds(fn) -> dict:
    return dict(Counter(e.name for e in gpu_events(fn) if "Memcpy" in e.name))


def kernel_names(fn) -> dict:
    return dict(Counter(e.name[:60] for e in gpu_events(fn)))


def formats(batches: list, reps: int) -> None:
    """One decoder (the hardware backend), the batch decoded to each colour format: ms a batch alone and
    under load, the kernels it launched, and what the Python Image looks like."""
    from nvidia import nvimgcodec

    nv = nvimgcodec
    decoder = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)])
    for name, spec, fmt in (("rgb-interleaved", "SRGB", "I_RGB"), ("ycc-interleaved", "SYCC", "I_YCC"),
                            ("yuv-planar", "SYCC", "P_YUV"), ("unchanged-planar", "UNCHANGED", "P_UNCHANGED"),
                            ("rgb-planar", "SRGB", "P_RGB")):
        row: dict = {"format": name}
        try:
            params = nv.DecodeParams(apply_exif_orientation=False, color_spec=getattr(nv.ColorSpec, spec),
                                     sample_format=getattr(nv.SampleFormat, fmt))
            def once(params=params) -> float:
                start = time.perf_counter()
                out = None
                for b in batches:
                    data = b.data.numpy()
                    srcs = [nv.CodeStream(data[x:y]) for x, y in zip(b.offsets[:-1], b.offsets[1:], strict=True)]
                    out = decoder.decode(srcs, params=params)
                torch.cuda.synchronize()
                once.last = out
                return (time.perf_counter() - start) * 1000 / len(batches)

            once()
            img = once.last[0]
            row["image"] = {"shape": list(img.shape), "failed": sum(i is None for i in once.last),
                            "cai": {k: v for k, v in img.__cuda_array_interface__.items() if k != "data"}}
            for attr in ("sample_format", "color_spec", "chroma_subsampling", "num_planes", "planes"):
                if hasattr(img, attr):
                    row["image"][attr] = str(getattr(img, attr))[:200]
            row["kernels"] = kernel_names(once)
            row["alone_ms"] = round(min(once() for _ in range(reps // 4)), 2)
            with Load():
                row["loaded_ms"] = round(min(once() for _ in range(reps // 4)), 2)
        except Exception as exc:  # noqa: BLE001 - a probe: say what failed
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="/tmp/imagenet-gen")
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--formats", action="store_true", help="only the colour formats' rows")
    args = p.parse_args()
    import imagefolder as bench  # bench/imagefolder.py

    from launcher.recipes.imagefolder import HardwareDecoder, HostJpegs

    bench.make_folder(Path(args.root), args.n, 100)
    files = sorted(Path(args.root, "train").rglob("*.JPEG"))[: args.batch * 4]
    batches = []
    for k in range(4):
        datas = [f.read_bytes() for f in files[k * args.batch:(k + 1) * args.batch]]
        offsets = [0]
        for d in datas:
            offsets.append(offsets[-1] + len(d))
        data = torch.frombuffer(bytearray(b"".join(datas)), dtype=torch.uint8)
        n = len(datas)
        batches.append(HostJpegs(data, offsets, torch.zeros(n, 4), torch.zeros(n, dtype=torch.bool),
                                 torch.arange(n), [str(f) for f in files[:n]]))
    pinned = [HostJpegs(b.data.pin_memory(), b.offsets, b.boxes, b.flips, b.rows, b.paths) for b in batches]
    device = torch.device("cuda", 0)
    print(json.dumps({"device": torch.cuda.get_device_name(), "batch": args.batch,
                      "mean_kb": round(batches[0].data.numel() / args.batch / 1000, 1)}), flush=True)
    if args.formats:
        formats(batches, args.reps)
        return
    low, high = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    cases = [(2, "pageable", 0), (2, "pinned", 0), (2, "pageable", high), (4, "pageable", 0), (4, "pageable", high),
             (8, "pageable", 0), (8, "pageable", high)]
    for parts, memory, priority in cases:
        HardwareDecoder.PARTS = parts
        decoder = HardwareDecoder(device)
        first = torch.cuda.Stream(device, priority=priority)
        decoder._streams = [torch.cuda.Stream(device, priority=priority) for _ in range(parts - 1)]
        source = batches if memory == "pageable" else pinned
        def once(source=source, decoder=decoder, first=first) -> float:
            start = time.perf_counter()
            with torch.cuda.stream(first):
                for b in source:
                    decoder(b)
                    decoder.release_after()
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1000 / len(source)

        once()
        row = {"parts": parts, "memory": memory, "priority": priority,
               "memcpy": memcpy_kinds(lambda once=once: once())}
        row["alone_ms"] = round(min(once() for _ in range(args.reps // 4)), 2)
        with Load():
            row["loaded_ms"] = round(min(once() for _ in range(args.reps // 4)), 2)
            row["loaded_ms_median"] = round(sorted(once() for _ in range(args.reps // 4))[args.reps // 8], 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
