"""perf.precision=fp8: the blocks' linear layers multiply in float8, the rest of the step as under bf16.

Each `nn.Linear` inside the model's blocks (the shard units, launcher/strategies/recompute.py `shard_units`)
whose input and output widths divide by 16 becomes torchao's `Float8Linear` (torchao.float8, dynamic
per-tensor scales: its inputs, weights and output gradients cast to float8 e4m3/e5m2 for each matmul,
`torch._scaled_mm`), as torchtitan's Float8 converter does; the embeddings, the output layer and anything
outside the blocks stay in bf16 autocast, where the vocabulary's wide projection keeps its precision. The
weights, their gradients and the optimizer state keep their dtype (fp32, or bf16 under fsdp's policy), and
a Float8Linear's state_dict is a Linear's: checkpoints, `launch eval` and `launch export` read the same keys.

Applied on the model as built, before checkpointing and the strategy wrap it (meta device included).
Refused before any worker, in one line: on the CPU, without torchao, or where a chosen GPU has no float8
matmuls (compute capability below 8.9: before Ada and Hopper). torch.compile fuses the casts into the
neighbouring kernels; uncompiled, each cast is a kernel of its own (perf.compile=true with fp8). What it
gains is measured: BENCHMARKS.md (issue 60).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from launcher.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from launcher.config import Config, Precision
    from launcher.host.plan import Plan

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later
EXAMPLES = "compute capability 8.9 or later: H100, H200, L4, L40S, B200"


def check_config(cfg: Config) -> None:
    """What the config alone says against fp8 (a sweep checks it for each run before any starts): the CPU asked
    for (gpus=[] or cpu), or no torchao."""
    from launcher.config import Precision
    from launcher.host.gpus import GpuRequest, Kind

    if cfg.perf.precision is not Precision.fp8:
        return
    if GpuRequest.parse(cfg.gpus).kind is Kind.CPU:
        _refuse_cpu()
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("perf.precision", "fp8", "the linear layers multiply in float8 through torchao, which is "
                          "not installed here: pip install torchao, or use bf16", "perf.precision=bf16")


def check(plan: Plan) -> None:
    """Refuse (ConfigError) perf.precision=fp8 where it cannot run: the CPU, no torchao, or a chosen GPU
    without float8 matmuls (as NVML reports it; where NVML does not say, the worker checks its device)."""
    from launcher.config import Precision

    if plan.config.perf.precision is not Precision.fp8:
        return
    if not plan.gpu_ids:
        _refuse_cpu()
    check_config(plan.config)
    from launcher.host.gpus import gpu_loads

    for load in gpu_loads(plan.visible) or []:
        if load.index in plan.gpu_ids and load.capability is not None and load.capability < MIN_CAPABILITY:
            _refuse_device(f"GPU {load.index} ({load.name})", load.capability)


def check_device(device: object, precision: Precision) -> None:
    """The worker's own check of its GPU under fp8 (where NVML could not say on the host)."""
    import torch

    from launcher.config import Precision

    if precision is not Precision.fp8:
        return
    if getattr(device, "type", None) == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        _refuse_device(f"this rank's GPU ({torch.cuda.get_device_name(device)})",
                       torch.cuda.get_device_capability(device))


def _refuse_cpu() -> None:
    raise ConfigError("perf.precision", "fp8", f"float8 matmuls run on GPUs ({EXAMPLES}); this run trains on the CPU",
                      "perf.precision=auto")


def _refuse_device(which: str, capability: tuple[int, int]) -> None:
    raise ConfigError("perf.precision", "fp8", f"{which} has compute capability {capability[0]}.{capability[1]}, "
                      f"without float8 matmuls ({EXAMPLES})", "perf.precision=bf16")


def apply(model: nn.Module, precision: Precision) -> str | None:
    """Turn the blocks' linear layers of `model` into torchao's Float8Linear in place under fp8; what was
    done, in one line (None for any other precision)."""
    from launcher.config import Precision

    if precision is not Precision.fp8:
        return None
    from torch import nn
    from torchao.float8 import convert_to_float8_training

    from launcher.strategies.recompute import shard_units

    inside = {id(m) for block in shard_units(model) for m in block.modules() if isinstance(m, nn.Linear)}
    chosen = {fqn for fqn, m in model.named_modules() if id(m) in inside and eligible(m)}
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in chosen)
    linear = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    return (f"precision: fp8, {len(chosen)} of the model's {linear} linear layers multiply in float8 (torchao, "
            "per-tensor scales: those inside its blocks whose widths divide by 16), the rest in bf16")


def eligible(module: nn.Module) -> bool:
    """A linear layer float8's matmul takes: both widths multiples of 16 (torch._scaled_mm's rule)."""
    return module.in_features % 16 == 0 and module.out_features % 16 == 0
