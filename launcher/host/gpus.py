"""`gpus=` -> device ids and the CUDA_VISIBLE_DEVICES value for the workers; which GPUs are busy. No CUDA here.

GpuRequest is the one reading of the `gpus` value: the plan, `launch -m` and backend=slurm all ask it.

Ids the user types are relative to what this process may see: if an inherited CUDA_VISIBLE_DEVICES
(SLURM sets one) says `4,5`, then `gpus=[1]` means physical GPU 5, exactly as the CUDA runtime
would number it. The launcher never initializes CUDA itself; it counts GPUs through NVML, which
leaves the mask free to be set for the workers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from omegaconf import OmegaConf

from launcher.errors import ConfigError, show

CPU_EXAMPLE = "gpus=[]"


def physical_gpu_count() -> int:
    """GPUs the driver knows, ignoring any mask. 0 when there is no driver. Never initializes CUDA."""
    try:
        import pynvml  # noqa: F401
    except ImportError:  # nvidia-ml-py is a dependency; without it, ask a throwaway child process
        return _count_in_child()
    devices, _ = nvml_devices()  # none when there is no driver
    return len(devices)


def _count_in_child() -> int:
    import subprocess
    import sys

    code = "import torch; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


def visible_devices(env: Mapping[str, str], physical_count: int) -> list[str]:
    """The device tokens this process may use, in CUDA's order: its index in this list is the id users type.

    Follows the CUDA runtime: an inherited CUDA_VISIBLE_DEVICES lists physical indices or UUIDs, and
    the list ends at the first entry that is not a valid device.
    """
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return [str(i) for i in range(physical_count)]
    tokens: list[str] = []
    for raw in mask.split(","):
        token = raw.strip()
        if token.startswith(("GPU-", "MIG-")):
            tokens.append(token)
        elif token.isdigit() and int(token) < physical_count and token not in tokens:
            tokens.append(token)
        else:
            break  # CUDA ignores this entry and everything after it
    return tokens


def describe_visible(visible: Sequence[str], env: Mapping[str, str]) -> str:
    if not visible:
        mask = env.get("CUDA_VISIBLE_DEVICES")
        return "no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={mask!r})" if mask is not None else "")
    ids = "id 0" if len(visible) == 1 else f"ids 0-{len(visible) - 1}"
    text = f"{len(visible)} GPU{'s' if len(visible) != 1 else ''} visible ({ids}"
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        text += f", inherited CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}"
    return text + ")"


class Kind(Enum):
    IDS = "ids"  # [0,1]: exactly these
    COUNT = "count"  # 2: that many (the least busy on a shared machine)
    ALL = "all"  # every visible GPU; an error where there is none
    AUTO = "auto"  # every visible GPU (one under strategy=single), or the CPU where there is none
    CPU = "cpu"  # [] or cpu


_SPELLINGS = "use a list of ids like [0,1], a count like 2, all, auto, or [] (or cpu) for the CPU"


@dataclass(frozen=True)
class GpuRequest:
    """What `gpus=` asks for, read once. The plan, sweeps and SLURM all take their answer from here.

        [0,1]   ids (relative to an inherited CUDA_VISIBLE_DEVICES, as CUDA numbers them)
        2       a count        all / ALL   every visible GPU       auto   every visible GPU, else the CPU
        [] / cpu / CPU         the CPU
    """

    kind: Kind
    ids: tuple[int, ...] = ()
    count: int = 0
    text: str = ""  # as the user typed it, for messages

    @classmethod
    def parse(cls, spec: Any) -> GpuRequest:
        """The request `spec` spells, or a ConfigError. Needs no GPU: only the spelling is checked here."""
        if OmegaConf.is_config(spec):
            spec = OmegaConf.to_container(spec)
        text = show(spec)
        if isinstance(spec, str):
            word = spec.strip().lower()
            if word in ("auto", "all", "cpu"):
                return cls(Kind(word), text=text)
            raise ConfigError("gpus", spec, _SPELLINGS, "gpus=[0,1]")
        if isinstance(spec, bool) or spec is None or isinstance(spec, float):
            raise ConfigError("gpus", spec, _SPELLINGS, "gpus=[0,1]")
        if isinstance(spec, int):
            if spec == 0:
                raise ConfigError("gpus", spec, "ambiguous: write gpus=[0] for GPU 0 or gpus=[] for CPU", "gpus=[0]")
            if spec < 0:
                raise ConfigError("gpus", spec, "a count must be >= 1", "gpus=1")
            return cls(Kind.COUNT, count=spec, text=text)
        if isinstance(spec, (list, tuple)):
            ids: list[int] = []
            for item in spec:
                if isinstance(item, bool) or not isinstance(item, int):
                    raise ConfigError("gpus", spec, f"ids must be integers, got {item!r}", "gpus=[0,1]")
                if item < 0:
                    raise ConfigError("gpus", spec, "ids cannot be negative", "gpus=[0]")
                if item in ids:
                    raise ConfigError("gpus", spec, f"GPU {item} is listed twice", "gpus=[0,1]")
                ids.append(item)
            return cls(Kind.IDS, ids=tuple(ids), text=text) if ids else cls(Kind.CPU, text=text)
        raise ConfigError("gpus", spec, _SPELLINGS, "gpus=[0,1]")

    @property
    def explicit(self) -> bool:
        """The user named the GPUs (a sweep then waits for exactly those)."""
        return self.kind is Kind.IDS

    def select(self, visible: Sequence[str], env: Mapping[str, str] | None = None,
               one_device: bool = False) -> list[int]:
        """The ids of the GPUs to use among `visible` ([] for the CPU), or a ConfigError naming what exists.

        one_device: the strategy uses one device (strategy=single), so `auto` means the first GPU.
        """
        env = os.environ if env is None else env
        n = len(visible)
        where = describe_visible(visible, env)
        if self.kind is Kind.CPU:
            return []
        if self.kind is Kind.AUTO:
            return list(range(min(n, 1) if one_device else n))
        if self.kind is Kind.ALL:
            if n == 0:
                raise ConfigError("gpus", self.text, f"{where}; train on CPU instead", CPU_EXAMPLE)
            return list(range(n))
        if self.kind is Kind.COUNT:
            if self.count > n:
                raise ConfigError("gpus", self.text, f"asks for {self.count} GPUs but {where}",
                                  f"gpus={n}" if n else CPU_EXAMPLE)
            return list(range(self.count))
        for item in self.ids:
            if item >= n:
                raise ConfigError("gpus", self.text, f"GPU {item} does not exist: {where}",
                                  f"gpus=[{','.join(str(i) for i in range(min(n, 2)))}]" if n else CPU_EXAMPLE)
        return list(self.ids)

    def per_node(self) -> int:
        """GPUs per node for a SLURM job, before the job has its nodes: a count or the length of a list."""
        if self.kind is Kind.CPU:
            return 0
        if self.kind is Kind.COUNT:
            return self.count
        if self.kind is Kind.IDS:
            return len(self.ids)
        raise ConfigError("gpus", self.text, "with backend=slurm say how many GPUs per node (the node is not "
                          "known yet), or [] for CPU", "gpus=4 backend=slurm")


def cuda_visible_devices(ids: Sequence[int], visible: Sequence[str]) -> str:
    """The mask for the workers: the chosen devices' tokens in the order given. '' hides every GPU (CPU runs)."""
    return ",".join(visible[i] for i in ids)


# ---- which GPUs are busy (NVML), for `gpus=N` on a shared machine --------------------------------

BUSY_UTIL_PCT = 50  # a GPU above this utilization, or with under half its memory free, counts as busy
BUSY_FREE_SHARE = 0.5
IDLE_USED_GIB = 1.0  # a GPU using less memory than this (the driver's own share) and at most
IDLE_UTIL_PCT = 5  # this utilization runs nothing: idle GPUs are taken in index order


@dataclass(frozen=True)
class GpuLoad:
    index: int  # relative id, as users type it
    name: str
    free_gib: float
    total_gib: float
    util_pct: int
    capability: tuple[int, int] | None = None  # CUDA compute capability (None where NVML does not say)

    @property
    def busy(self) -> bool:
        return self.util_pct > BUSY_UTIL_PCT or self.free_gib < BUSY_FREE_SHARE * self.total_gib

    @property
    def idle(self) -> bool:
        return self.total_gib - self.free_gib < IDLE_USED_GIB and self.util_pct <= IDLE_UTIL_PCT

    def describe(self) -> str:
        return f"GPU {self.index}: {self.free_gib:.1f} of {self.total_gib:.1f} GiB free, {self.util_pct}% busy"


@dataclass(frozen=True)
class NvmlDevice:
    physical_index: int
    uuid: str
    name: str
    free_bytes: int
    total_bytes: int
    util_pct: int
    capability: tuple[int, int] | None = None  # CUDA compute capability (None where NVML does not say)


def nvml_devices() -> tuple[list[NvmlDevice], str]:
    """Every GPU the driver knows, read through NVML (never CUDA), and the driver version or why
    there is no answer. Shared by `launch doctor` and the choice of GPUs for `gpus=N`."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML unavailable ({exc}): no NVIDIA driver on this machine"

    def text(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:  # MIG slices and some vGPUs report none
                util = 0
            try:
                capability = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            except (pynvml.NVMLError, AttributeError):  # (older NVML bindings lack the call)
                capability = None
            devices.append(NvmlDevice(i, text(pynvml.nvmlDeviceGetUUID(handle)), text(pynvml.nvmlDeviceGetName(handle)),
                                      int(memory.free), int(memory.total), util, capability))
        return devices, f"driver {text(pynvml.nvmlSystemGetDriverVersion())}"
    except pynvml.NVMLError as exc:
        return [], f"NVML failed while reading the GPUs ({exc})"
    finally:
        pynvml.nvmlShutdown()


def gpu_loads(visible: Sequence[str]) -> list[GpuLoad] | None:
    """Free memory and utilization of each visible GPU (None when NVML cannot say for every one)."""
    devices, _ = nvml_devices()
    by_token = {str(d.physical_index): d for d in devices} | {d.uuid: d for d in devices}
    if not devices or any(token not in by_token for token in visible):
        return None  # a partial answer is worse than none: the plan then keeps the first GPUs
    return [GpuLoad(index, by_token[token].name, by_token[token].free_bytes / 2**30,
                    by_token[token].total_bytes / 2**30, by_token[token].util_pct, by_token[token].capability)
            for index, token in enumerate(visible)]


def least_busy(loads: Sequence[GpuLoad], count: int) -> tuple[list[int], str]:
    """The `count` GPUs to use on a shared machine, and one line saying why.

    Idle GPUs first, in index order (an idle 8-GPU box gives [0..N-1], not an order set by a few MiB of
    driver memory); then GPUs in use but not busy, then busy ones, each by the most free memory, then
    the least utilization.
    """
    def rank(g: GpuLoad) -> tuple:
        return (0, g.index) if g.idle else (1 + g.busy, -round(g.free_gib, 1), g.util_pct, g.index)

    ranked = sorted(loads, key=rank)
    chosen = sorted(g.index for g in ranked[:count])
    passed = [g for g in loads if g.index not in chosen]
    why = f"gpus={count}: chose GPU{'s' if count > 1 else ''} {chosen}, the least busy of {len(loads)} (" + \
        "; ".join(g.describe() for g in loads if g.index in chosen) + ")"
    busy_passed = [g for g in passed if g.busy]
    if busy_passed:
        why += "; passed over busy " + "; ".join(g.describe() for g in busy_passed)
    if any(g.busy for g in loads if g.index in chosen):
        why += ". Some chosen GPUs are busy: another job shares them"
    return chosen, why
