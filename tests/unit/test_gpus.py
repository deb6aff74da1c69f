"""`gpus=`: one reading for the plan, sweeps and SLURM, every spelling; the inherited mask honoured (no GPU needed)."""

from pathlib import Path

import pytest

from launcher.errors import ConfigError, LaunchError
from launcher.host.backends.slurm import sbatch_parameters
from launcher.host.gpus import GpuRequest, cuda_visible_devices, visible_devices
from launcher.host.packing import Need, need_of
from launcher.host.sweep import SweepJob
from tests.conftest import config_of

FOUR = ["0", "1", "2", "3"]


def select(spec, visible=FOUR, one_device=False):
    return GpuRequest.parse(spec).select(visible, env={}, one_device=one_device)


# (spelling on the command line, ids the plan uses on a 4-GPU host, what a sweep run waits for there,
#  GPUs per node a SLURM job asks for; None: refused with one line)
SPELLINGS = [
    ("gpus=[0,1]", [0, 1], Need(2, (0, 1)), 2),
    ("gpus=[2]", [2], Need(1, (2,)), 1),
    ("gpus=2", [0, 1], Need(2), 2),
    ("gpus=all", [0, 1, 2, 3], Need(4), None),
    ("gpus=ALL", [0, 1, 2, 3], Need(4), None),
    ("gpus=auto", [0, 1, 2, 3], Need(4), None),
    ("gpus=AUTO", [0, 1, 2, 3], Need(4), None),
    ("gpus=[]", [], Need(0), 0),
    ("gpus=cpu", [], Need(0), 0),
    ("gpus=CPU", [], Need(0), 0),
]


@pytest.mark.parametrize("override, ids, need, per_node", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_every_spelling_reads_the_same_in_the_plan_a_sweep_and_slurm(override, ids, need, per_node):
    cfg = config_of(override)
    assert GpuRequest.parse(cfg.gpus).select(FOUR, env={}) == ids  # the plan
    job = SweepJob(0, [override], None, cfg, Path("/sweep/0"))
    assert need_of(job, FOUR) == need  # a sweep on the same host
    slurm = config_of(override, "backend=slurm", "batch_size=64")
    if per_node is None:
        with pytest.raises(ConfigError, match="say how many GPUs per node"):
            sbatch_parameters(slurm)
    else:
        assert sbatch_parameters(slurm).get("gpus_per_node", 0) == per_node


def test_auto_under_single_is_the_first_gpu_in_the_plan_and_in_a_sweep():
    cfg = config_of("strategy=single")
    assert GpuRequest.parse(cfg.gpus).select(FOUR, env={}, one_device=True) == [0]
    assert need_of(SweepJob(0, [], None, cfg, Path("/s/0")), FOUR) == Need(1)


def test_a_sweep_run_that_cannot_fit_on_this_host_is_refused_before_anything_starts():
    job = SweepJob(3, ["gpus=8"], None, config_of("gpus=8"), Path("/s/3"))
    with pytest.raises(LaunchError, match=r"asks for 8 GPUs but 4 GPUs visible.*sweep run 3: gpus=8"):
        need_of(job, FOUR)


@pytest.mark.parametrize("spec, ids", [
    ([0, 1], [0, 1]), ([3], [3]), ([2, 0], [2, 0]), (2, [0, 1]), (4, [0, 1, 2, 3]),
    ("all", [0, 1, 2, 3]), ("auto", [0, 1, 2, 3]), ([], []), ("cpu", []), (" All ", [0, 1, 2, 3]),
])
def test_valid_specs(spec, ids):
    assert select(spec) == ids


@pytest.mark.parametrize("spec, words", [
    ([4], "GPU 4 does not exist"), ([-1], "cannot be negative"), ([0, 0], "listed twice"),
    (5, "asks for 5 GPUs but 4 GPUs visible"), (-2, "must be >= 1"), (0, "ambiguous"),
    ("some", "use a list of ids"), ([0.5], "must be integers"), (["a"], "must be integers"), (True, "use a list"),
    (1.5, "use a list"),
])
def test_invalid_specs_name_the_value_and_what_exists(spec, words):
    with pytest.raises(ConfigError) as err:
        select(spec)
    message = str(err.value)
    assert message.startswith("gpus=")
    assert words in message
    assert "\n" not in message


def test_all_without_gpus_points_to_cpu():
    with pytest.raises(ConfigError, match=r"no GPU is visible.*gpus=\[\]"):
        select("all", [])
    assert select("auto", []) == []


def test_ids_are_relative_to_an_inherited_mask():
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    visible = visible_devices(env, physical_count=8)
    assert visible == ["4", "5"]
    assert cuda_visible_devices(GpuRequest.parse([1]).select(visible, env), visible) == "5"
    assert cuda_visible_devices(GpuRequest.parse([1, 0]).select(visible, env), visible) == "5,4"
    with pytest.raises(ConfigError, match="inherited CUDA_VISIBLE_DEVICES=4,5"):
        GpuRequest.parse([2]).select(visible, env)


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

    from launcher.host.gpus import gpu_loads, physical_gpu_count

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


def test_a_mask_entry_for_a_gpu_the_machine_lacks_ends_the_list():
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1,2,0"}, physical_count=2) == ["1"]  # there is no GPU 2
