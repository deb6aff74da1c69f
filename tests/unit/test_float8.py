"""perf.precision=fp8 (launcher/strategies/float8.py): which layers multiply in float8, and the refusals before
any worker. The float8 matmuls themselves need a GPU of compute capability 8.9+: tests/gpu/test_gpu_text_fsdp.py."""

import pytest

from launcher.config import Precision
from launcher.errors import ConfigError
from launcher.host.gpus import GpuLoad
from launcher.host.plan import make_plan
from launcher.strategies import float8
from tests.conftest import config_of

torchao = pytest.importorskip("torchao")


def _llama():
    from recipes.text_models import Llama

    # 2 blocks of width 64 (every projection a multiple of 16), the output layer 64 x 128 (one too, but outside them)
    return Llama(128, 32, layers=2, width=64, heads=4, kv_heads=2, ffn=128, tie_embeddings=False)


def test_fp8_turns_the_blocks_linear_layers_to_float8_and_leaves_the_embeddings_and_output_layer_alone():
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    model = _llama()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    said = float8.apply(model, Precision.fp8)
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == [f"blocks.{i}.{p}" for i in range(2) for p in ("down", "gate", "kv", "out", "q", "up")]
    assert type(model.head) is nn.Linear and type(model.tokens) is nn.Embedding
    assert said == ("precision: fp8, 12 of the model's 13 linear layers multiply in float8 (torchao, per-tensor "
                    "scales: those inside its blocks whose widths divide by 16), the rest in bf16")
    # a checkpoint of the bf16 run loads as it is (the same names and shapes), and the weights are the model's
    model.load_state_dict(plain, strict=True)
    assert set(model.state_dict()) == set(plain)


def test_a_linear_layer_whose_width_does_not_divide_by_16_stays_as_it_is():
    from torchao.float8.float8_linear import Float8Linear

    from recipes.text_models import Llama

    model = Llama(100, 32, layers=1, width=40, heads=4, kv_heads=2, ffn=96)  # q: 40 x 40, the MLP 40 x 96
    float8.apply(model, Precision.fp8)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_other_precisions_leave_the_model_alone():
    model = _llama()
    before = [type(m) for m in model.modules()]
    for precision in (Precision.auto, Precision.bf16, Precision.fp32, Precision.fp16):
        assert float8.apply(model, precision) is None
    assert [type(m) for m in model.modules()] == before


@pytest.fixture
def on_gpus(monkeypatch):
    """plan(capability) -> make_plan of recipe=text perf.precision=fp8 on two simulated GPUs of that capability."""
    from launcher.host import gpus

    def plan(capability, name="H100"):
        loads = [GpuLoad(i, name, 79.0, 80.0, 0, capability) for i in range(2)]
        monkeypatch.setattr(gpus, "gpu_loads", lambda visible: loads)
        monkeypatch.setattr("launcher.host.plan.torch_has_cuda", lambda: True)
        return make_plan(config_of("recipe=text", "perf.precision=fp8", "gpus=2"), env={}, physical_count=2,
                         loads=loads)

    return plan


def test_fp8_on_gpus_without_float8_matmuls_is_refused_naming_the_gpu_and_what_has_them(on_gpus):
    with pytest.raises(ConfigError) as refused:
        float8.check(on_gpus((8, 0), "A100"))
    assert str(refused.value) == ("perf.precision=fp8 is not valid: GPU 0 (A100) has compute capability 8.0, without "
                                  "float8 matmuls (compute capability 8.9 or later: H100, H200, L4, L40S, B200) (e.g. "
                                  "launch perf.precision=bf16)")
    float8.check(on_gpus((9, 0)))  # Hopper: runs
    float8.check(on_gpus((8, 9), "L40S"))  # Ada: runs
    float8.check(on_gpus(None))  # NVML did not say: the worker checks its device


def test_fp8_without_torchao_is_refused_with_what_to_install(on_gpus, monkeypatch):
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else found(name, *a))
    with pytest.raises(ConfigError, match="through torchao, which is not installed here: pip install torchao"):
        float8.check(on_gpus((9, 0)))


def test_the_gpus_compute_capability_comes_from_nvml(monkeypatch):
    """gpu_loads carries what NVML says of each GPU's compute capability (and None where it cannot say)."""
    import sys
    import types

    from launcher.host import gpus

    class NVMLError(Exception):
        pass

    def capability(handle):
        if handle == 1:
            raise NVMLError("not supported")
        return (9, 0)

    fake = types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetCudaComputeCapability=capability,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(free=2**30, total=2**31),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=0),
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}", nvmlDeviceGetName=lambda h: "H100",
        nvmlSystemGetDriverVersion=lambda: "580")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    loads = gpus.gpu_loads(["0", "1"])
    assert [load.capability for load in loads] == [(9, 0), None]
