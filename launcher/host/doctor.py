"""`launch doctor`: what this machine offers for training, in one screen (or JSON with --json).

torch, CUDA and NCCL versions; whether CUDA works; each visible device with its name and total/free
memory (through NVML where there is a driver); the inherited CUDA_VISIBLE_DEVICES and SLURM variables;
the launcher's caches on this machine, where they are and how much they hold; the network interfaces
and their addresses (what a launch over several machines binds and advertises).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Any


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _nvml_devices() -> tuple[list[dict[str, Any]], str | None]:
    from launcher.host.gpus import nvml_devices

    devices, driver = nvml_devices()
    return [{"physical_index": d.physical_index, "name": d.name, "total_mib": d.total_bytes // 2**20,
             "free_mib": d.free_bytes // 2**20, "utilization_pct": d.util_pct} for d in devices], driver


def _size(folder) -> tuple[int, int]:
    """(bytes, top-level entries) under `folder`, links not followed; (0, 0) when it does not exist."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # removed while we walk (a run writing its cache)
                pass
    try:
        entries = len(os.listdir(folder))
    except OSError:
        entries = 0
    return total, entries


def caches() -> list[dict[str, Any]]:
    """The launcher's caches: each can be removed at any time, and launch rebuilds what it needs (at the
    cost of decoding a dataset, compiling or byte-compiling again)."""
    from launcher import bytecode
    from launcher.data.cache import cache_root, default_data_root, inductor_dir, why_unusable

    found = []
    for what, folder in (("decoded datasets", cache_root() / "decoded"), ("inductor kernels", inductor_dir()),
                         ("bytecode", bytecode.cache_dir(os.environ)),
                         ("text corpora", default_data_root() / "text")):  # (recipe=text's byte copies)
        size, entries = _size(folder)
        found.append({"what": what, "path": str(folder), "mib": round(size / 2**20, 1), "entries": entries,
                      "unusable": why_unusable(folder)})
    return found


def collect() -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {p: _version(p) for p in ("torch", "hydra-core", "omegaconf", "submitit", "nvidia-ml-py",
                                                "launcher")},
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl": None,
        "distributed_backends": {b: getattr(torch.distributed, f"is_{b}_available", lambda: False)()
                                 for b in ("gloo", "nccl", "mpi")},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_")},
        "torchelastic": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LAUNCH_JOIN")
                         if k in os.environ},
    }
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            report["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
    nvml, driver = _nvml_devices()
    report["driver"] = driver
    report["nvml_devices"] = nvml
    visible = []
    for i in range(report["cuda_device_count"]):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        visible.append({"id": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                        "multiprocessors": props.multi_processor_count,
                        "total_mib": total // 2**20, "free_mib": free // 2**20})
    report["cuda_devices"] = visible
    report["caches"] = caches()
    report["network"] = network()
    return report


def network() -> dict[str, Any]:
    """This machine's interfaces and addresses (what `rdzv=` and GLOO/NCCL_SOCKET_IFNAME may name), and the
    variables that choose them."""
    import socket

    from launcher.host.network import interfaces

    return {"hostname": socket.gethostname(),
            "interfaces": [{"name": i.name, "address": i.address, "up": i.up, "loopback": i.loopback}
                           for i in interfaces()],
            "variables": {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",
                                                     "NCCL_IB_HCA", "NCCL_NET") if k in os.environ}}


def render(r: dict[str, Any]) -> str:
    lines = [
        f"python       {r['python']} on {r['platform']} ({r['cpus']} CPUs)",
        "packages     " + ", ".join(f"{k} {v or '-'}" for k, v in r["packages"].items()),
        f"torch CUDA   build {r['torch_cuda_build'] or 'none (CPU build)'}; available: {r['cuda_available']}; "
        f"devices: {r['cuda_device_count']}; NCCL: {r['nccl'] or '-'}",
        "backends     " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in r["distributed_backends"].items()),
        f"driver       {r['driver']}",
        f"CUDA_VISIBLE_DEVICES  {r['cuda_visible_devices'] if r['cuda_visible_devices'] is not None else '(not set)'}",
    ]
    for d in r["cuda_devices"]:
        lines.append(f"  cuda:{d['id']}  {d['name']}  sm_{d['capability'].replace('.', '')}  "
                     f"{d['multiprocessors']} SMs  {d['free_mib']:,} / {d['total_mib']:,} MiB free")
    if r["nvml_devices"] and not r["cuda_devices"]:
        for d in r["nvml_devices"]:
            free = f"{d['free_mib']:,} / {d['total_mib']:,} MiB free"
            lines.append(f"  physical {d['physical_index']}  {d['name']}  {free}")
    if not r["cuda_devices"] and not r["nvml_devices"]:
        lines.append("  no GPU: `launch` trains on CPU (gpus=[]), and strategy=ddp nprocs=N runs N gloo ranks")
    lines.append("SLURM        " + (" ".join(f"{k}={v}" for k, v in r["slurm"].items()) or "(not in a SLURM job)"))
    if r["torchelastic"]:
        lines.append("torchrun     " + " ".join(f"{k}={v}" for k, v in r["torchelastic"].items()))
    net = r["network"]
    lines.append(f"network      host {net['hostname']}; for nodes=N rdzv=HOST:PORT, HOST is node 0's address on a "
                 "network every node reaches (launch binds gloo/NCCL to the interface that leads there)")
    for i in net["interfaces"]:
        state = ("up" if i["up"] else "down") + ("  (loopback: this machine only)" if i["loopback"] else "")
        lines.append(f"  {i['name']:<15} {i['address']:<39} {state}")
    if net["variables"]:
        lines.append("  set here: " + " ".join(f"{k}={v}" for k, v in net["variables"].items()))
    lines.append("caches       (any can be removed; launch rebuilds what it needs)")
    for c in r["caches"]:
        lines.append(f"  {c['what']:<17} {c['path']}  {c['mib']:,.1f} MiB, {c['entries']} entries"
                     + (f"  UNUSABLE: {c['unusable']}" if c.get("unusable") else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--json"]):
        print(f"launch: doctor takes no arguments but --json, got {' '.join(argv)} (e.g. launch doctor --json)",
              file=sys.stderr)
        return 2
    report = collect()
    print(json.dumps(report, indent=2) if argv == ["--json"] else render(report))
    return 0
