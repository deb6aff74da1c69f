"""The data path on CPU: prefetcher passthrough, the host gatherer, placement choice and the stall clock."""

import math
import time

import pytest
import torch

from launcher.data.placement import HostData, ResidentData, choose_placement, make_data, rank_order
from launcher.data.prefetch import CudaPrefetcher, batch_len
from launcher.train.stall import INPUT_BOUND, StepClock, input_advice

CPU = torch.device("cpu")


def test_prefetcher_passes_batches_through_unchanged_on_cpu():
    batches = [(torch.arange(4) + i, torch.ones(2) * i) for i in range(5)]
    out = list(CudaPrefetcher(iter(batches), CPU, depth=2))
    assert out == batches and all(o is b for o, b in zip(out, batches, strict=True))  # the same tuples


def test_threaded_prefetcher_keeps_the_order_applies_after_and_raises_its_errors_here():
    import threading

    batches = [(torch.full((2,), float(i)), i) for i in range(7)]
    out = list(CudaPrefetcher(iter(batches), CPU, depth=2, after=lambda b: (b[0] * 10, b[1]), threaded=True))
    assert [i for _, i in out] == list(range(7)) and all(torch.equal(x, torch.full((2,), 10.0 * i)) for x, i in out)

    def recipes_own_hook(batch):
        if batch[1] == 3:
            raise KeyError("bad sample 3")
        return batch

    seen = []
    with pytest.raises(KeyError, match="bad sample 3") as raised:
        for _, i in CudaPrefetcher(iter(batches), CPU, depth=2, after=recipes_own_hook, threaded=True):
            seen.append(i)
    assert seen == [0, 1, 2]
    assert any(frame.name == "recipes_own_hook" for frame in raised.traceback)  # the user's frame is shown
    # leaving early stops the thread and waits for it (the next epoch may use the same DataLoader)
    for _, i in CudaPrefetcher(iter(batches), CPU, depth=2, threaded=True):
        if i == 1:
            break
    assert not [t for t in threading.enumerate() if t.name == "launch-prefetch"]


def test_prefetcher_rejects_a_depth_below_one():
    with pytest.raises(ValueError, match="depth"):
        CudaPrefetcher([], CPU, depth=0)


def small_set(n=100):
    x = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 4, 4).contiguous()
    return x, torch.arange(n)


def test_host_gatherer_yields_each_steps_rows_in_order():
    x, y = small_set()
    order = rank_order(100, 20, seed=1, epoch=0, world_size=2, rank=1)
    host = HostData(x, y, CPU, depth=2)
    got = list(host.batches(order))
    assert len(got) == len(order) == 5
    for ((bx, by), idx), rows in zip(got, order, strict=True):
        assert torch.equal(idx, rows) and torch.equal(by, y[rows]) and torch.equal(bx, x[rows])


def test_host_gatherer_stops_its_thread_when_the_loop_stops_early():
    x, y = small_set()
    host = HostData(x, y, CPU, depth=1)
    stream = host.batches(rank_order(100, 10, seed=0, epoch=0))
    next(stream)
    stream.close()  # what a training loop that raises does to its generator
    time.sleep(0.2)
    import threading

    assert not [t for t in threading.enumerate() if t.name == "launcher-gather" and t.is_alive()]


def test_host_gatherer_hands_errors_to_the_training_loop():
    x, y = small_set()
    bad = [torch.tensor([0, 1]), torch.tensor([5, 500])]
    with pytest.raises(IndexError):
        list(HostData(x, y, CPU).batches(bad))


def test_on_cpu_the_data_stays_where_it_is_and_gathers_match():
    x, y = small_set()
    data = make_data(x, y, CPU, "host", 2)
    assert isinstance(data, ResidentData) and data.placement == "host"
    assert choose_placement("auto", CPU, 10**12) == ("host", "the device is the CPU")
    (bx, by), idx = next(data.batches(torch.tensor([[3, 7]])))
    assert torch.equal(by, torch.tensor([3, 7])) and bx[1, 0, 0, 0] == 7


def test_stall_clock_counts_only_the_waits_for_input():
    """The input wait is the time from a step's end to the next batch, the span the whole: each checked
    against this test's own clock (a loaded machine's sleeps overrun; fixed bounds failed in CI)."""
    clock = StepClock(CPU)
    waited = stepped = 0.0
    t0 = time.perf_counter()
    clock.start()
    for _ in range(3):
        t = time.perf_counter()
        time.sleep(0.03)  # waiting for a batch
        clock.batch_ready()
        waited += time.perf_counter() - t
        t = time.perf_counter()
        time.sleep(0.01)  # the step
        clock.step_end()
        stepped += time.perf_counter() - t
    timing = clock.finish()
    span = time.perf_counter() - t0
    assert abs(timing.input_wait_s - waited) < 0.006 and waited >= 0.09
    assert stepped - 0.006 < timing.span_s - timing.input_wait_s < stepped + 0.006
    assert timing.span_s <= span and math.isclose(timing.stall_fraction, timing.input_wait_s / timing.span_s)


def test_the_step_pace_keeps_each_steps_own_time_without_its_wait_for_input():
    """StepPace (what recipe=imagefolder's data.decode=auto times the steps by): each training step from its
    batch being ready to its end, the waits for input left out; the median of the last n, None while fewer
    steps have run; an end without a batch ready is no step."""
    from launcher.data.pace import StepPace

    pace = StepPace(keep=4)
    clock = StepClock(CPU, pace=pace)
    clock.start()
    assert pace.median_s(1) is None
    for step in (0.01, 0.01, 0.05, 0.01, 0.01):
        time.sleep(0.04)  # waiting for a batch
        clock.batch_ready()
        time.sleep(step)
        clock.step_end()
    assert pace.median_s(5) is None  # (the last 4 kept)
    assert 0.009 < pace.median_s(4) < 0.03 and 0.009 < pace.median_s(1) < 0.03
    clock.start()
    clock.step_end()  # (an end without a batch ready: not a step)
    assert len(pace._steps) == 4


def test_input_bound_advice_names_the_setting_that_helps():
    assert input_advice(INPUT_BOUND / 2, "host", 180, False) is None
    host = input_advice(0.4, "host", 180, False)
    assert "40%" in host and "data.placement=gpu" in host
    assert "perf.compile=true" in input_advice(0.4, "gpu", 180, False)
    assert "batch_size" in input_advice(0.4, "gpu", 180, True)


def test_threaded_prefetcher_reads_no_further_ahead_than_its_depth():
    """data.prefetch_depth bounds what the thread holds (each batch a GPU copy, or a decoded one)."""
    read = []

    def source():
        for i in range(50):
            read.append(i)
            yield i

    batches = iter(CudaPrefetcher(source(), CPU, depth=2, threaded=True))
    assert next(batches) == 0
    time.sleep(0.5)  # (time for the thread to read as far as it may)
    assert len(read) <= 2 + 2, read  # the one handed out, `depth` waiting, one held by the thread
    assert list(batches) == list(range(1, 50))


def test_a_batchs_sample_count_is_the_leading_size_of_its_first_tensor():
    assert batch_len({"image": torch.zeros(5, 3, 8, 8), "label": torch.zeros(5, dtype=torch.long)}) == 5
    assert batch_len((torch.tensor(0.5), torch.zeros(7, 4))) == 7  # (a scalar first: the next tensor's)
    assert batch_len(["no tensor"]) == 1


def test_images_reach_the_network_as_their_distance_from_the_mean_in_standard_deviations():
    from launcher.config import DataConfig
    from launcher.data.placement import Data
    from launcher.recipes import Splits

    x, y = torch.zeros(4, 1, 2, 2, dtype=torch.uint8), torch.zeros(4, dtype=torch.long)
    data = Data.place(Splits(x, y, x, y, 2, (4.0,), (2.0,)), DataConfig(), torch.device("cpu"), False)
    assert data.normalize(torch.full((1, 1, 2, 2), 10, dtype=torch.uint8)).eq(3.0).all()  # (10 - 4) / 2


def test_the_input_wait_counts_each_gap_from_a_step_end_to_the_next_batch_once(monkeypatch):
    """A step that takes two batches (accumulation) marks two batches ready after one end: only the first
    batch's arrival is time the step waited for its input."""
    from launcher.train import stall

    clock = stall.StepClock(torch.device("cpu"))
    times = iter([0.0, 1.0, 3.0, 4.0])  # end (start), ready after 1 s, ready again, end
    monkeypatch.setattr(stall.time, "perf_counter", lambda: next(times))
    clock.start()
    clock.batch_ready()
    clock.batch_ready()
    clock.step_end()
    timing = clock.finish()
    assert (timing.span_s, timing.input_wait_s) == (4.0, 1.0)


def test_the_step_pace_is_the_median_of_the_latest_steps():
    from launcher.data.pace import StepPace

    pace = StepPace(keep=64)
    for own in range(1, 11):  # steps slowing down: 1 s ... 10 s
        pace.add(0.0, float(own))
    assert pace.median_s(3) == 9.0 and pace.median_s(11) is None
