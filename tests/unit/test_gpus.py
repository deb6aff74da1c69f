"""GPU list -> ids and CUDA_VISIBLE_DEVICES, with the inherited mask honoured (no GPU needed)."""

import pytest

from launcher.config import ConfigError
from launcher.gpus import cuda_visible_devices, select_gpus, visible_devices

FOUR = ["0", "1", "2", "3"]


@pytest.mark.parametrize("spec, ids", [
    ([0, 1], [0, 1]), ([3], [3]), ([2, 0], [2, 0]), (2, [0, 1]), (4, [0, 1, 2, 3]),
    ("all", [0, 1, 2, 3]), ("auto", [0, 1, 2, 3]), ([], []), ("cpu", []),
])
def test_valid_specs(spec, ids):
    assert select_gpus(spec, FOUR, env={}) == ids


@pytest.mark.parametrize("spec, words", [
    ([4], "GPU 4 does not exist"), ([-1], "cannot be negative"), ([0, 0], "listed twice"),
    (5, "asks for 5 GPUs but 4 GPUs visible"), (-2, "must be >= 1"), (0, "ambiguous"),
    ("some", "use a list of ids"), ([0.5], "must be integers"), (["a"], "must be integers"), (True, "use a list"),
    (1.5, "use a list"),
])
def test_invalid_specs_name_the_value_and_what_exists(spec, words):
    with pytest.raises(ConfigError) as err:
        select_gpus(spec, FOUR, env={})
    message = str(err.value)
    assert message.startswith("gpus=")
    assert words in message
    assert "\n" not in message


def test_all_without_gpus_points_to_cpu():
    with pytest.raises(ConfigError, match=r"no GPU is visible.*gpus=\[\]"):
        select_gpus("all", [], env={})
    assert select_gpus("auto", [], env={}) == []


def test_ids_are_relative_to_an_inherited_mask():
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    visible = visible_devices(env, physical_count=8)
    assert visible == ["4", "5"]
    assert cuda_visible_devices(select_gpus([1], visible, env), visible) == "5"
    assert cuda_visible_devices(select_gpus([1, 0], visible, env), visible) == "5,4"
    with pytest.raises(ConfigError, match="inherited CUDA_VISIBLE_DEVICES=4,5"):
        select_gpus([2], visible, env)


def test_mask_follows_cuda_rules():
    assert visible_devices({}, 2) == ["0", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, 2) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1,7,0"}, 2) == ["1"]  # CUDA stops at the invalid 7
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}, 2) == []
    uuid = "GPU-8c6a9f7e-0000-1111-2222-333344445555"
    assert visible_devices({"CUDA_VISIBLE_DEVICES": f"{uuid},0"}, 2) == [uuid, "0"]


def test_cpu_mask_hides_every_gpu():
    assert cuda_visible_devices([], FOUR) == ""


def test_gpu_loads_follow_the_mask_by_index_or_uuid(monkeypatch):
    """NVML read through a stand-in module (no driver here): the visible tokens pick the devices."""
    import sys
    import types

    from launcher.gpus import gpu_loads, physical_gpu_count

    class Err(Exception):
        pass

    devices = [("GPU-aaa", 10, 80, 99), ("GPU-bbb", 70, 80, 0)]
    fake = types.SimpleNamespace(
        NVMLError=Err, nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetUUID=lambda h: devices[h][0],
        nvmlDeviceGetName=lambda h: b"H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(free=devices[h][1] * 2**30,
                                                                total=devices[h][2] * 2**30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=devices[h][3]),
        nvmlSystemGetDriverVersion=lambda: "580.0")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    loads = gpu_loads(["GPU-bbb", "0"])  # CUDA_VISIBLE_DEVICES=GPU-bbb,0
    assert [(g.index, g.free_gib, g.util_pct) for g in loads] == [(0, 70.0, 0), (1, 10.0, 99)]
    assert gpu_loads(["5"]) is None  # a token NVML does not know: no partial answer
    assert physical_gpu_count() == 2  # the same NVML reading counts the GPUs
