"""Checkpoints resolve from a run dir, a file or `latest`; a torchrun/srun environment is recognised."""

import itertools
import os
import signal
import time
import warnings

import pytest
import torch

from launcher.errors import LaunchError
from launcher.host.resume import resolve as resolve_resume
from launcher.train import checkpoint
from launcher.world import WorldInfo, existing_world, refused_world


def test_atomic_save_and_weights_only_load(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    checkpoint.save_atomic({"net_state_dict": {"w": torch.ones(2)}, "epoch": 3, "history": [{"loss": 1.0}]}, path)
    state = checkpoint.load(path)
    assert state["epoch"] == 3 and torch.equal(state["net_state_dict"]["w"], torch.ones(2))
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temporary file left


def test_a_checkpoint_written_in_the_background_holds_the_state_of_when_it_was_taken(tmp_path):
    weights = torch.arange(4.0)
    writer = checkpoint.BackgroundWriter()
    writer.submit(checkpoint.HostSnapshot({"net_state_dict": {"w": weights}, "epoch": 1}), tmp_path / "last.pt")
    weights.add_(100)  # training goes on changing the weights in place
    writer.close()
    assert torch.equal(checkpoint.load(tmp_path / "last.pt")["net_state_dict"]["w"], torch.arange(4.0))


def test_background_writes_queue_in_order_and_a_failed_one_is_raised(tmp_path):
    writer = checkpoint.BackgroundWriter()
    weights = torch.zeros(3)
    for epoch in range(1, 5):  # more than may wait: submit waits for the oldest, the order holds
        weights.fill_(epoch)
        writer.submit(checkpoint.HostSnapshot({"net_state_dict": {"w": weights}, "epoch": epoch}), tmp_path / "last.pt")
    writer.wait()
    last = checkpoint.load(tmp_path / "last.pt")
    assert last["epoch"] == 4 and torch.equal(last["net_state_dict"]["w"], torch.full((3,), 4.0))
    (tmp_path / "a-folder").mkdir()  # a write that cannot land: a folder has the checkpoint's name
    writer.submit(checkpoint.HostSnapshot({"epoch": 5}), tmp_path / "a-folder")
    with pytest.raises(OSError):
        writer.close()


def test_a_snapshot_copies_the_tensors_it_is_given():
    """Deterministic (no writer thread): the snapshot must not alias the live weights."""
    weights = torch.arange(4.0)
    snapshot = checkpoint.HostSnapshot({"net_state_dict": {"w": weights}, "epoch": 1})
    weights.add_(100)
    assert torch.equal(snapshot.state()["net_state_dict"]["w"], torch.arange(4.0))


def test_a_snapshots_one_buffer_gives_each_tensor_its_place_dtype_and_layout():
    """HostSnapshot copies a state's GPU tensors into one flat buffer (checkpoint._Layout): each tensor
    must come back equal, with its dtype, and with its strides where they are dense (channels_last filters
    stay channels_last in the file); one with gaps comes back contiguous; none overlaps another."""
    tensors = [torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last), torch.randn(7).to(torch.bfloat16),
               torch.tensor(3), torch.zeros(0, 3), torch.randn(6, 4)[:, :2], torch.randn(4, 6).t(),
               torch.arange(9), torch.randn(3, 1, 5)[:, :, ::2], torch.ones(5, dtype=torch.bool)]
    layout = checkpoint._Layout(tensors)
    flat = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    views = layout.views(flat)
    torch._foreach_copy_(views, tensors)
    for view, t in zip(views, tensors, strict=True):
        assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(view, t)
        assert view.storage_offset() * view.element_size() % checkpoint._Layout.ALIGN == 0
    assert views[0].stride() == tensors[0].stride() and views[5].stride() == tensors[5].stride()
    assert views[7].is_contiguous()  # (the strided slice: copied without its gaps)
    assert views[0].clone().is_contiguous(memory_format=torch.channels_last)
    spans = sorted((v.storage_offset() * v.element_size(), (v.storage_offset() + v.numel()) * v.element_size())
                   for v in views if v.numel())
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def test_a_snapshot_whose_page_locked_memory_is_refused_copies_into_ordinary_memory_said_once(monkeypatch, caplog):
    """Pinned host memory can be refused (the host's memory short): the snapshot's buffer is then ordinary
    memory, whole and of its size, and the log says so once, not at every epoch."""
    empty = torch.empty

    def refusing(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refusing)
    monkeypatch.setattr(checkpoint, "_said_unpinned", [])
    with caplog.at_level("WARNING", logger="launcher.train"):
        buffers = [checkpoint._host_buffer(3 << 20) for _ in range(2)]
    assert all(b.numel() == 3 << 20 and b.dtype == torch.uint8 and not b.is_pinned() for b in buffers)
    said = [r.getMessage() for r in caplog.records if "page-locked" in r.getMessage()]
    assert len(said) == 1 and "3 MB" in said[0] and "out of memory" in said[0]


def test_capture_and_restore_put_back_weights_optimizer_state_and_rng():
    """The one pair that save, resume and the warm-up use: after restore, training goes on exactly as
    from the captured moment, the live tensors (which a captured step holds by address) kept."""
    from launcher.config import PerfConfig, SingleConfig
    from launcher.strategies import Devices, choose
    from launcher.train.optim import _stepper

    strategy = choose(SingleConfig(), Devices(), nprocs=None, global_batch=4, perf=PerfConfig(),
                      gpus_text="[]").strategy
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    nets = strategy.wrap(model, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steppers = [_stepper(opt, lambda step: 1.0 / (step + 1))]

    def step():
        model.zero_grad()
        (model(torch.randn(4, 3)) ** 2).sum().backward()
        steppers[0].step()

    step()
    saved = checkpoint.capture(strategy, nets, steppers, torch.device("cpu"), clone=True)
    weight = model.weight
    step()
    after_one = model.weight.detach().clone()
    step()
    checkpoint.restore(saved, strategy, nets, steppers, torch.device("cpu"))
    assert model.weight is weight  # restored in place
    step()
    assert torch.equal(model.weight, after_one)  # same weights, momentum, schedule and random draw


def test_resolve_resume(tmp_path):
    older, newer = tmp_path / "outputs" / "a", tmp_path / "outputs" / "b"
    for run in (older, newer):
        checkpoint.save_atomic({"epoch": 1}, run / "checkpoints" / "last.pt")
        time.sleep(0.01)
    os.utime(older / "checkpoints" / "last.pt", (1, 1))
    assert resolve_resume(str(newer)) == newer / "checkpoints" / "last.pt"
    assert resolve_resume(str(older / "checkpoints" / "last.pt")).parent.parent == older
    assert resolve_resume("latest", tmp_path / "outputs") == newer / "checkpoints" / "last.pt"
    with pytest.raises(LaunchError, match="does not exist"):
        resolve_resume(str(tmp_path / "nope"))
    with pytest.raises(LaunchError, match="no checkpoint"):
        resolve_resume("latest", tmp_path / "empty")


def test_data_whose_classes_differ_from_the_checkpoints_is_refused_even_in_another_order_only():
    """The distributed test covers other names; here the same names sorted otherwise (a user recipe's
    `data_classes`), and what is let through: equal lists, and either side naming none."""
    from launcher.errors import LaunchError
    from launcher.host.resume import check_classes, saved_classes

    with pytest.raises(LaunchError, match=r"holds 2 \(the same names in another order \(b, a\)\)"):
        check_classes(("a", "b"), ("b", "a"), "resume=RUN", "/data")
    for saved, here in ((("a", "b"), ("a", "b")), (None, ("a", "b")), (("a", "b"), ())):
        check_classes(saved, here, "resume=RUN", "/data")
    # (what an old checkpoint or another program wrote: no classes, or not a list of names)
    assert saved_classes({"classes": ["a", "b"]}) == ("a", "b")
    assert saved_classes({}) is None and saved_classes({"classes": [1, 2]}) is None


def test_torchrun_environment_is_joined():
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
           "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"}
    assert existing_world(env) == WorldInfo(1, 1, 2, 2, "h", 1234)
    assert existing_world({"PATH": "/bin"}) is None
    # a batch script of a 2-task job, or a one-task step: launch spawns its own workers
    batch = {"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert existing_world(batch) is None
    assert existing_world({**batch, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None


def test_torchrun_variables_without_torchrun_are_refused_not_joined():
    """The four variables alone (left exported in a shell) are no world to join: joining waited for ranks
    nobody starts. Refused, whatever WORLD_SIZE; joined under torchrun, srun, or LAUNCH_JOIN=1."""
    for size in ("1", "2"):
        stale = {"RANK": "0", "WORLD_SIZE": size, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
        assert existing_world(stale) is None
        assert "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT" in refused_world(stale)
        assert existing_world({**stale, "LAUNCH_JOIN": "1"}) == WorldInfo(0, 0, int(size), int(size), "127.0.0.1",
                                                                           1234)
        assert refused_world({**stale, "LAUNCH_JOIN": "1"}) is None
        assert refused_world({**stale, "TORCHELASTIC_RUN_ID": "x"}) is None
    assert refused_world({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) is None  # (spawned workers get their own)
    assert refused_world({"PATH": "/bin"}) is None
    assert "RANK, WORLD_SIZE are not set" in refused_world({"LAUNCH_JOIN": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert "LAUNCH_JOIN=yes is not valid" in refused_world({"LAUNCH_JOIN": "yes"})


def test_variables_left_in_a_shell_or_a_single_task_step_are_no_world_to_join():
    assert existing_world({"MASTER_PORT": "29500", "MASTER_ADDR": "h"}) is None  # (a torchrun that ended)
    batch = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    assert existing_world(batch) is None  # one task: it spawns its ranks itself


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_and_a_dead_writers_temporary_is_removed(tmp_path):
    import subprocess

    from launcher.files import remove_stale_temporaries, write_atomic, write_text_atomic

    target = tmp_path / "results.json"
    write_text_atomic(target, "old")

    def broken(f):
        f.write(b"half")
        raise OSError("the device failed")

    with pytest.raises(OSError, match="the device failed"):
        write_atomic(target, broken)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".last.pt.tmp-{dead.pid}").write_bytes(b"x")
    (tmp_path / f".metrics.jsonl.tmp-{os.getpid()}").write_bytes(b"x")  # (a live writer's: it renames it soon)
    remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".metrics.jsonl.tmp-{os.getpid()}", "results.json"]


def test_a_checkpoint_write_that_fails_leaves_the_previous_checkpoint_whole(tmp_path):
    """Atomic: the new state goes to a temporary file renamed over the old one; a write that fails
    half way (here: an object torch.save cannot pickle) leaves last.pt as it was, and no temporary file."""
    import torch

    from launcher.train.checkpoint import load, save_atomic

    path = tmp_path / "last.pt"
    save_atomic({"epoch": 1, "w": torch.arange(1000.0)}, path)
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises
        save_atomic({"epoch": 2, "w": torch.zeros(1000), "bad": lambda: 0}, path)
    assert path.read_bytes() == before and load(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.parametrize(("restarts", "cap", "may"), [(0, 0, False), (0, 1, True), (2, 3, True), (3, 3, False),
                                                      (4, 3, False)])
def test_a_job_requeues_itself_at_most_max_requeues_times(restarts, cap, may):
    from launcher.spec import RequeuePolicy
    from launcher.train.preemption import PreemptionWatch

    watch = PreemptionWatch(RequeuePolicy("42", restarts, cap))
    try:
        assert watch.may_requeue(warn=False) is may
    finally:
        watch.close()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.01),
])
def test_putting_optimizer_state_back_keeps_the_tensors_a_captured_step_holds(make):
    """A captured step holds the optimizer's state tensors by address: restoring a saved state (the
    warm-up's, saved before any step, or a checkpoint's) must write into them, and must then step
    exactly as the saved optimizer would."""
    import copy

    from launcher.train.checkpoint import load_optimizer_state

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = make(params)
    fresh = copy.deepcopy(opt.state_dict())
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]

    def step(k):
        for p, g in zip(params, grads[k], strict=True):
            p.grad = g.clone()
        opt.step()

    step(0)
    live = {id(p): {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params}
    after_one = copy.deepcopy(opt.state_dict())
    weights_after_one = [p.detach().clone() for p in params]
    step(1)
    load_optimizer_state(opt, after_one)  # a checkpoint
    for p in params:
        assert all(opt.state[p][k] is t for k, t in live[id(p)].items())
    with torch.no_grad():
        for p, w in zip(params, weights_after_one, strict=True):
            p.copy_(w)
    step(1)
    resumed = [p.detach().clone() for p in params]

    reference = make([torch.nn.Parameter(w.clone()) for w in weights_after_one])
    reference.load_state_dict(copy.deepcopy(after_one))
    for p, g in zip(reference.param_groups[0]["params"], grads[1], strict=True):
        p.grad = g.clone()
    reference.step()
    for a, b in zip(resumed, reference.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)

    load_optimizer_state(opt, fresh)  # saved before the first step: zeros, in the same tensors
    for p in params:
        assert all(opt.state[p][k] is t and not t.any() for k, t in live[id(p)].items())


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.01),
])
def test_optimizer_state_loaded_from_a_snapshot_takes_the_channels_last_layout_of_its_parameters(make):
    """Checkpoint snapshots copy tensors into contiguous host memory, so a channels_last filter's
    momentum comes back contiguous. The fused CUDA optimizers refuse parameters, gradients and state
    whose strides differ (a 2-GPU ResNet-18 resume failed so in its first step): loaded state must
    come back in its parameter's layout, with its values."""
    import copy

    from launcher.train.checkpoint import load_optimizer_state

    torch.manual_seed(0)
    filters = torch.nn.Parameter(torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last))
    bias = torch.nn.Parameter(torch.randn(8))
    opt = make([filters, bias])
    filters.grad, bias.grad = torch.randn_like(filters), torch.randn_like(bias)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for state in saved["state"].values():  # as a snapshot writes it
        for k, v in state.items():
            if v.dim() > 0:
                state[k] = torch.empty(v.shape, dtype=v.dtype).copy_(v)
    assert saved["state"][0][next(k for k in saved["state"][0] if k != "step")].is_contiguous()

    resumed = make([filters, bias])  # a new run: no live state yet
    load_optimizer_state(resumed, saved)
    for p in (filters, bias):
        for k, v in resumed.state[p].items():
            if v.dim() > 0:
                assert v.stride() == p.stride(), k
                assert torch.equal(v, opt.state[p][k])


def test_ctrl_c_while_the_launcher_imports_torch_is_held_back_to_the_end_of_the_import():
    """A KeyboardInterrupt raised inside one of torch's C++ -> Python calls ends the process in
    std::terminate (SIGABRT), seen once in CI; the launcher imports its recipe (and torch) with Ctrl-C
    held back, and raises it when the import is done."""
    import os
    import signal

    import pytest

    from launcher.lifetime import sigint_deferred

    reached_the_end = False
    # (Python's own handler, as in a terminal; pytest started as a background job has SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with sigint_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                reached_the_end = True
        assert reached_the_end and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's: left as it is
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_held_while_launch_composes_is_raised_when_launch_takes_over():
    """`launch` holds Ctrl-C from its first line (a library swallowing the interrupt meanwhile changes
    nothing) and raises it where its own code takes over; that hand-over gives Ctrl-C back to Python even
    when the import it does first fails."""
    import os
    import signal

    import pytest

    from launcher.lifetime import hold_ctrl_c, let_ctrl_c_through

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        hold_ctrl_c()
        try:  # what Hydra's get_mode does around a compose
            os.kill(os.getpid(), signal.SIGINT)
        except Exception:  # noqa: BLE001, S110
            pass
        with pytest.raises(KeyboardInterrupt):
            let_ctrl_c_through()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        let_ctrl_c_through()  # nothing held: nothing raised
        hold_ctrl_c()
        with pytest.raises(ModuleNotFoundError):
            let_ctrl_c_through("not_a_module_anywhere")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_full_disk_at_the_runs_end_keeps_the_runs_own_error(tmp_path, monkeypatch):
    """outcome.json cannot be written on a full disk: the launch's exit code and message stay the run's."""
    from launcher.files import DiskFull
    from launcher.host import run_here
    from launcher.host.outcome import Outcome

    def full(path, data):
        raise DiskFull(path)

    monkeypatch.setattr(run_here, "write_json", full)
    run_here._record_outcome(tmp_path, Outcome(1, error="No space left on device: writing checkpoints/last.pt"))
    assert not (tmp_path / "outcome.json").exists()


def test_an_outcome_json_that_cannot_be_written_is_named(tmp_path, monkeypatch, caplog):
    """A full disk at the launch's end: outcome.json is not written, and the console says which file and the
    exit code (it was left out without a word)."""
    import errno
    import logging

    from launcher.host import run_here
    from launcher.host.outcome import Outcome

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_here, "write_json", full)
    with caplog.at_level(logging.WARNING, logger="launcher"):
        run_here._record_outcome(tmp_path, Outcome(1, error="No space left on device: writing curves.png failed"))
    said = [r.getMessage() for r in caplog.records]
    assert any(f"{tmp_path / 'outcome.json'} could not be written (No space left on device); the exit code is 1" in m
               for m in said), said


def test_an_export_never_replaces_a_file_that_appeared_after_the_check(tmp_path):
    """launch export checks that its output does not exist, writes the weights beside it, then places them
    only if still nothing is there (a file or a link made meanwhile is the user's)."""
    from launcher.host.export import place_new

    written, target = tmp_path / ".model.pt.tmp", tmp_path / "model.pt"
    written.write_bytes(b"weights")
    target.write_bytes(b"the user's")  # (appeared between the check and the placing)
    assert not place_new(written, target) and target.read_bytes() == b"the user's"
    link = tmp_path / "link.pt"
    link.symlink_to(tmp_path / "nowhere")
    assert not place_new(written, link) and link.is_symlink() and not (tmp_path / "nowhere").exists()
    fresh = tmp_path / "fresh.pt"
    assert place_new(written, fresh) and fresh.read_bytes() == b"weights"


def test_an_export_copied_where_there_are_no_hard_links_leaves_no_partial_file(tmp_path, monkeypatch):
    """Where the file system has no hard links the weights are copied into an exclusively created file; a
    copy that fails (a full disk) removes that file, so no truncated model.pt is left for a user to load."""
    import shutil

    from launcher.host import export

    written, target = tmp_path / ".model.pt.tmp", tmp_path / "model.pt"
    written.write_bytes(b"weights" * 100)

    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    assert export.place_new(written, target) and target.read_bytes() == written.read_bytes()  # copied

    def fails_midway(src, dst, *args):
        dst.write(b"wei")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", fails_midway)
    with pytest.raises(OSError):
        export.place_new(written, tmp_path / "second.pt")
    assert not (tmp_path / "second.pt").exists()


def _sealed_run(root, name, value, **more):
    """A run dir holding a launch checkpoint (sealed as the loop's writer seals it) of weights `value`."""
    path = root / name / "checkpoints" / "last.pt"
    checkpoint.save_atomic({"net_state_dict": {"w": torch.full((1000,), value)}, "epoch": 2, "history": [],
                            "config": {"recipe": {"name": "digits"}, "optim": None}, **more}, path)
    return path


def test_a_checkpoint_whose_bytes_changed_after_it_was_saved_is_refused_in_one_line(tmp_path):
    """torch's loader reads zeroed bytes inside a tensor as zeros: resume, eval and export trained or
    reported on wrong weights with exit 0. The seal written with the checkpoint sees the change."""
    import struct

    from launcher.host.export import main as export_main
    from launcher.host.resume import load_checkpoint

    path = _sealed_run(tmp_path, "run", 1.2345)
    assert load_checkpoint(path, "resume")["epoch"] == 2  # whole: loads
    raw = bytearray(path.read_bytes())
    at = raw.find(struct.pack("<f", 1.2345) * 8)
    raw[at:at + 32] = bytes(32)
    path.write_bytes(bytes(raw))
    with pytest.raises(LaunchError, match="cannot be trusted: its contents differ from the digest written with it"):
        load_checkpoint(path, "resume")
    assert export_main([str(tmp_path / "run"), str(tmp_path / "model.pt")]) == 2
    assert not (tmp_path / "model.pt").exists()


def test_another_runs_checkpoint_copied_into_a_run_dir_is_refused(tmp_path):
    """A checkpoint names the run that wrote it; one found in another run's dir says so, while a run dir
    copied whole (its name with it) and a checkpoint from before seals existed still load."""
    import shutil

    from launcher.host.resume import load_checkpoint

    mine, theirs = _sealed_run(tmp_path, "mine", 1.0), _sealed_run(tmp_path, "theirs", 2.0)
    shutil.copy(theirs, mine)
    with pytest.raises(LaunchError, match="it belongs to another run"):
        load_checkpoint(mine, "launch eval")
    shutil.copytree(tmp_path / "theirs", tmp_path / "moved")
    assert load_checkpoint(tmp_path / "moved" / "checkpoints" / "last.pt", "resume")["epoch"] == 2
    old = tmp_path / "old.pt"
    torch.save({"net_state_dict": {"w": torch.ones(3)}, "epoch": 1}, old)  # (no seal: an earlier launch's)
    assert load_checkpoint(old, "resume")["epoch"] == 1



def test_an_export_of_a_live_run_whose_checkpoint_is_replaced_mid_read_reads_the_newer_one(tmp_path, monkeypatch):
    """A running run replaces last.pt (and removes a sharded one's older folder) while launch export reads
    it: the read fails; export then reads the newer checkpoint instead of failing."""
    from launcher.host import export

    path = _sealed_run(tmp_path, "live", 1.0)
    real, calls = export.weights, []

    def rotated_midway(where, state):
        calls.append(state["epoch"])
        if len(calls) == 1:  # the run writes epoch 3's checkpoint now; epoch 2's shards are gone
            checkpoint.save_atomic({"net_state_dict": {"w": torch.full((1000,), 3.0)}, "epoch": 3, "history": [],
                                    "config": {"recipe": {"name": "digits"}, "optim": None}}, path)
            raise FileNotFoundError(2, "No such file or directory", str(path.parent / "epoch-2.dcp"))
        return real(where, state)

    monkeypatch.setattr(export, "weights", rotated_midway)
    assert export.main([str(tmp_path / "live"), str(tmp_path / "model.pt")]) == 0
    assert calls == [2, 3] and torch.equal(torch.load(tmp_path / "model.pt")["w"], torch.full((1000,), 3.0))

    def broken(where, state):  # the same failure where nothing changed: one line, not a traceback
        raise FileNotFoundError(2, "No such file or directory", "x")

    monkeypatch.setattr(export, "weights", broken)
    assert export.main([str(tmp_path / "live"), str(tmp_path / "model-2.pt")]) == 2


def test_safetensors_are_written_a_tensor_at_a_time_and_read_back_by_safetensors_as_they_were(tmp_path):
    """launch export's .safetensors writer (safetensors.torch.save built the whole file in memory from clones:
    three copies of an 8B model's weights on the host): every dtype a model holds, a 0-dim and an empty tensor,
    a transposed view, tied names, read back equal by the safetensors package itself, HF's "format" said."""
    pytest.importorskip("safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_file

    from launcher.host.export import write_safetensors

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(7, 5, generator=g)
    model = {"a.step": torch.tensor(3, dtype=torch.int64), "embed.weight": embed, "out.weight": embed,
             "half": torch.randn(3, 4, generator=g).half(), "bf": torch.randn(9, generator=g).bfloat16(),
             "mask": torch.tensor([True, False, True]), "u8": torch.arange(5, dtype=torch.uint8),
             "i32": torch.arange(-3, 3, dtype=torch.int32), "f64": torch.randn(2, generator=g).double(),
             "t": torch.randn(4, 6, generator=g).t(), "empty": torch.zeros(0, 3)}
    with open(tmp_path / "m.safetensors", "wb") as f:
        write_safetensors(model, f)
    back = load_file(tmp_path / "m.safetensors")
    assert back.keys() == model.keys()
    for name, tensor in model.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(LaunchError, match="complex64, which safetensors does not store; export to a .pt file"):
        write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, open(tmp_path / "z.safetensors", "wb"))
    # and launch export writes through it: a run's weights as safetensors
    from launcher.host.export import main as export_main

    _sealed_run(tmp_path, "run", 1.5, classes=["ant", "bee"])
    assert export_main([str(tmp_path / "run"), str(tmp_path / "run.safetensors")]) == 0
    assert torch.equal(load_file(tmp_path / "run.safetensors")["w"], torch.full((1000,), 1.5))
    # the classes its outputs are, in order (an image folder's), in the header's metadata beside "format"
    with safe_open(tmp_path / "run.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "classes": '["ant", "bee"]'}


def test_export_says_which_outputs_are_the_classes_where_the_network_has_more(tmp_path, capsys):
    """A user's network built with 5 outputs for a Dataset of 3 classes trains (the 2 beyond are never a
    target); its export said "its outputs are the classes neg, pos, zero", wrong for 5 outputs."""
    from launcher.host.export import main as export_main

    for name, rows in (("five", 5), ("three", 3)):
        weights = {"0.weight": torch.zeros(8, 4), "0.bias": torch.zeros(8), "2.weight": torch.zeros(rows, 8),
                   "2.bias": torch.zeros(rows)}
        checkpoint.save_atomic({"net_state_dict": weights, "epoch": 1, "history": [], "classes": ["neg", "pos", "zero"],
                                "config": {"recipe": {"name": "mine"}, "optim": None}},
                               tmp_path / name / "checkpoints" / "last.pt")
        assert export_main([str(tmp_path / name), str(tmp_path / f"{name}.pt")]) == 0
    five, three = capsys.readouterr().out.strip().splitlines()
    assert five.endswith("; its last layer (2) gives 5 outputs for 3 classes (the 2 beyond them were never a "
                         "target); its first 3 outputs are the classes neg, pos, zero, in that order"), five
    assert three.endswith("; its outputs are the classes neg, pos, zero, in that order"), three


EXPORT_PEAK = """
import re, sys
import torch, launcher.host.resume, launcher.integrity  # (imported first: torch's import alone is ~500 MB)
from launcher.host.export import main

def status(key):  # KiB
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read())[1])

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (the peak resident memory, VmHWM, starts again from now)
except OSError:
    print("no /proc/self/clear_refs here")
    sys.exit(0)
now = status("VmRSS")
assert main([sys.argv[1], sys.argv[2]]) == 0
print((status("VmHWM") - now) >> 10)
"""


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_an_export_holds_the_weights_in_host_memory_once(tmp_path, suffix):
    """Issue 60: an 8B model's export must not need several copies of its weights in host memory. The export
    process's peak passes its resident memory before the export by about the weights (128 MB here) whatever
    the format; writing safetensors through safetensors.torch.save (clones, then the whole file as bytes)
    by three times that."""
    import subprocess
    import sys

    from tests.conftest import clean_env

    mb = 128
    checkpoint.save_atomic({"net_state_dict": {"w": torch.ones(mb << 18)}, "epoch": 2, "history": [],
                            "config": {"recipe": {"name": "digits"}, "optim": None}},
                           tmp_path / "run" / "checkpoints" / "last.pt")
    out = subprocess.run([sys.executable, "-c", EXPORT_PEAK, str(tmp_path / "run"), str(tmp_path / f"m{suffix}")],
                         capture_output=True, text=True, timeout=120, env=clean_env())
    assert out.returncode == 0, out.stderr
    if "no /proc/self/clear_refs" in out.stdout:
        pytest.skip("this kernel cannot reset a process's peak memory")
    grown = int(out.stdout.split()[-1])
    assert grown < 2 * mb, f"the export's peak passed its memory before it by {grown} MB for {mb} MB of weights"


def test_an_exported_file_has_a_new_files_usual_mode_and_a_taken_name_suggests_one_beside_it(tmp_path, capsys):
    """The weights are written through a private temporary file (0600); the file a user gets reads as any
    new file of theirs does (0666 less the umask). A name taken already suggests NAME-2, not model-2."""
    import os
    import stat

    from launcher.host import export

    _sealed_run(tmp_path, "run", 1.0)
    mask = os.umask(0o022)
    try:
        assert export.main([str(tmp_path / "run"), str(tmp_path / "weights.pt")]) == 0
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "weights.pt").stat().st_mode) == 0o644
    assert export.main([str(tmp_path / "run"), str(tmp_path / "weights.pt")]) == 2
    assert str(tmp_path / "weights-2.pt") in capsys.readouterr().err
    # a name of another format (a new user's trial: x.onnx got a torch pickle) is one line, nothing written
    assert export.main([str(tmp_path / "run"), str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert "x.onnx: launch export writes a state_dict as .pt (torch.save) or .safetensors" in err, err
    assert not (tmp_path / "x.onnx").exists() and not list(tmp_path.glob(".x.onnx*"))


def test_an_export_killed_outright_leaves_a_temporary_file_that_the_next_export_there_removes(tmp_path):
    """kill -9 of `launch export` (no handler runs) left its hidden temporary file beside the target for good.
    Named by the writer's pid, the next export into that folder removes one whose writer is gone and that
    nobody wrote to for a minute; a live writer's, a fresh one, and files of other names stay."""
    import os
    import subprocess
    import time

    from launcher.host import export

    _sealed_run(tmp_path, "run", 1.0)
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = time.time() - 3600
    stale = tmp_path / f".model.pt.abcd_123.tmp-{dead.pid}"
    fresh = tmp_path / f".other.safetensors.zzzz0000.tmp-{dead.pid}"
    live = tmp_path / f".model.pt.efgh4567.tmp-{os.getpid()}"
    mine = tmp_path / f".notes.tmp-{dead.pid}"
    for f in (stale, fresh, live, mine):
        f.write_bytes(b"partial")
        if f is not fresh:
            os.utime(f, (old, old))
    assert export.main([str(tmp_path / "run"), str(tmp_path / "weights.pt")]) == 0
    assert not stale.exists() and fresh.exists() and live.exists() and mine.exists()
    assert sorted(p.name for p in tmp_path.glob(".*.tmp-*")) == sorted(p.name for p in (fresh, live, mine))


def test_a_checkpoint_on_a_full_disk_says_so_in_one_line_even_before_its_run_is_named(tmp_path, monkeypatch):
    """The run's name is made with its first checkpoint; a disk that refuses that file must end in the
    checkpoint's own one-line DiskFull, not in an OSError from the naming."""
    import errno

    from launcher import integrity
    from launcher.files import DiskFull

    real_open = os.open

    def full(path, flags, mode=0o777, **kw):
        if str(path).endswith(integrity.RUN_ID) or ".tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", full)
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(DiskFull):
        checkpoint.save_atomic({"net_state_dict": {"w": torch.ones(2)}, "epoch": 1},
                               tmp_path / "run" / "checkpoints" / "last.pt")


def test_a_new_last_checkpoint_keeps_the_one_before_it_as_previous(tmp_path):
    """previous.pt is the replaced last.pt's own file (a hard link: nothing copied), and stays as it was when
    last.pt is replaced again."""
    path = _sealed_run(tmp_path, "run", 1.0)
    previous = path.with_name("previous.pt")
    assert not previous.exists()
    first = path.stat().st_ino
    checkpoint.save_atomic({"net_state_dict": {"w": torch.full((1000,), 2.0)}, "epoch": 3}, path)
    assert previous.stat().st_ino == first and float(checkpoint.load(previous)["net_state_dict"]["w"][0]) == 1.0
    assert float(checkpoint.load(path)["net_state_dict"]["w"][0]) == 2.0
    assert [p.name for p in sorted(path.parent.iterdir())] == ["last.pt", "previous.pt"]  # (no temporary left)


def test_checkpoint_keep_previous_false_leaves_no_checkpoint_before_the_last(tmp_path):
    """checkpoint.keep_previous=false: no previous.pt is made, and one left by an earlier save of the run (a
    restart in its run dir under the new setting) goes, with the blocks only it held."""
    path = _sealed_run(tmp_path, "run", 1.0)
    checkpoint.save_atomic({"net_state_dict": {"w": torch.full((1000,), 2.0)}, "epoch": 3}, path)
    assert path.with_name("previous.pt").is_file()
    checkpoint.save_atomic({"net_state_dict": {"w": torch.full((1000,), 3.0)}, "epoch": 4}, path, previous=False)
    assert [p.name for p in sorted(path.parent.iterdir())] == ["last.pt"]
    assert float(checkpoint.load(path)["net_state_dict"]["w"][0]) == 3.0


def test_a_restart_goes_on_from_the_previous_checkpoint_when_the_last_is_damaged(tmp_path, caplog):
    path = _sealed_run(tmp_path, "run", 1.0)
    checkpoint.save_atomic({"net_state_dict": {"w": torch.full((1000,), 2.0)}, "epoch": 3}, path)
    assert checkpoint.load_restart(path)[1]["epoch"] == 3  # whole: the last one
    with open(path, "r+b") as f:  # a failing disk: bytes changed in place
        f.seek(path.stat().st_size // 2)
        f.write(bytes(4096))
    with caplog.at_level("WARNING", logger="launcher.train"):
        used, state = checkpoint.load_restart(path)
    assert used == path.with_name("previous.pt") and state["epoch"] == 2
    assert f"{path} cannot be trusted" in caplog.text and "going on from the one before it" in caplog.text
    path.with_name("previous.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(LaunchError) as err:
        checkpoint.load_restart(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"this run's checkpoint {path} cannot be trusted: ")
    assert "and the one before it" in text and "resume=PATH" in text


def test_resume_of_a_damaged_last_checkpoint_names_the_whole_one_before_it(tmp_path):
    from launcher.host.resume import load_checkpoint

    path = _sealed_run(tmp_path, "run", 1.0)
    checkpoint.save_atomic({"net_state_dict": {"w": torch.full((1000,), 2.0)}, "epoch": 3}, path)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(bytes(4096))
    with pytest.raises(LaunchError) as err:
        load_checkpoint(path, "resume")
    assert str(err.value).endswith(f"the checkpoint before it, {path.with_name('previous.pt')}, is whole: give that "
                                   "path instead")


def test_an_export_stores_a_tied_weight_once_and_never_ties_weights_that_differ_in_one_value(tmp_path):
    """A tied embedding and output layer reach the checkpoint as two tensors; the exported file holds one
    under both names. A weight equal to another in all but one value (outside the values sampled first)
    stays its own, and so do vectors (biases, norms: equal at their initial values)."""
    from launcher.host.export import main as export_main

    embed = torch.randn(300, 16)
    near = embed.clone()
    near[299, 15] += 1.0
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    checkpoint.save_atomic({"net_state_dict": {"embed.weight": embed, "head.weight": embed.clone(), "near": near,
                                               "b1": torch.zeros(16), "b2": torch.zeros(16)},
                            "epoch": 1, "history": [], "config": {"recipe": {"name": "text"}, "optim": None}}, path)
    assert export_main([str(tmp_path / "run")]) == 0
    weights = torch.load(tmp_path / "run" / "model.pt")
    assert weights["head.weight"].data_ptr() == weights["embed.weight"].data_ptr()
    assert torch.equal(weights["near"], near) and weights["near"].data_ptr() != embed.data_ptr()
    assert weights["b1"].data_ptr() != weights["b2"].data_ptr()


def test_a_snapshot_copies_a_tensor_under_two_names_once_and_nothing_else_together(tmp_path):
    """A tied weight (one tensor, two names) is one copy in the snapshot and one storage in the file, as
    torch.save of the live state would write it; two views of one memory at other offsets or strides, and
    tensors without elements, stay copies of their own. Training changing the weight after the snapshot
    changes neither copy."""
    weight = torch.randn(8, 4)
    state = {"net_state_dict": {"embed.weight": weight.detach(), "head.weight": weight.detach(),
                                "row0": weight[0], "row1": weight[1], "t": weight.t(),
                                "e1": torch.zeros(0), "e2": torch.zeros(0, 3)}, "epoch": 1}
    snapshot, before = checkpoint.HostSnapshot(state), weight.clone()
    weight.add_(1.0)
    path = tmp_path / "last.pt"
    checkpoint.save_snapshot(snapshot, path)
    saved = torch.load(path, weights_only=True)["net_state_dict"]
    assert saved["embed.weight"].untyped_storage().data_ptr() == saved["head.weight"].untyped_storage().data_ptr()
    assert torch.equal(saved["embed.weight"], before)
    storages = {k: v.untyped_storage().data_ptr() for k, v in saved.items() if k not in ("embed.weight", "e1", "e2")}
    assert len(set(storages.values())) == len(storages)  # head, row0, row1, t: four copies
    assert torch.equal(saved["t"], before.t()) and torch.equal(saved["row1"], before[1])
    assert saved["e1"].shape == (0,) and saved["e2"].shape == (0, 3)
    alone = {k: v.clone() for k, v in state["net_state_dict"].items()}
    torch.save(alone, tmp_path / "apart.pt")
    assert path.stat().st_size < (tmp_path / "apart.pt").stat().st_size  # the tied weight's bytes once


def test_a_checkpoint_is_staged_on_the_gpu_only_while_the_steps_leave_room_for_the_kept_copy(monkeypatch):
    """The staging buffer stays on the GPU through the next epochs: a run whose first epoch peaked near the
    GPU's memory gets its checkpoints copied directly (and a buffer kept from before let go), rather than
    running out of memory in its second epoch. The peak read counts the kept buffer, which is taken out."""
    from types import SimpleNamespace

    gib = 1 << 30
    memory = {"peak": 0, "free": 0, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: memory["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (memory["free"], 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: memory["reserved"])
    stager = checkpoint.Stager(torch.device("cpu"))
    state = [torch.empty(gib // 4, dtype=torch.uint8) for _ in range(4)]  # 1 GiB, as GPT-2's 1.5 GB
    memory.update(peak=60 * gib, free=10 * gib, reserved=62 * gib)  # 72 GiB this process can have
    assert stager.takes(state)  # 61 <= 0.9 x 72
    stager._flat = torch.empty(gib, dtype=torch.uint8)  # (the buffer copy() kept from the last epoch)
    memory.update(peak=64 * gib)  # (held all epoch: the peak counts it)
    assert stager.takes(state)  # 63 + 1 <= 64.8
    memory.update(peak=66 * gib)
    assert not stager.takes(state) and stager._flat is None  # 65 + 1 > 64.8: copied directly, the buffer let go
    memory.update(peak=10 * gib, free=60 * gib, reserved=12 * gib)
    assert stager.takes(state)
    assert not stager.takes([*state, torch.empty(4 * gib, dtype=torch.uint8)])  # over 5% of the GPU: never staged


def test_ctrl_c_during_an_exports_write_is_one_line_exit_130_and_leaves_no_file(tmp_path, monkeypatch, capsys):
    """Ctrl-C while torch.save writes: its zip writer's close then fails ("unexpected pos"), a RuntimeError
    that hid the interrupt (exit 1 and a traceback, seen with a 1.6 GB export). The interrupt wins: one
    line, exit 130, and neither the file nor its temporary one is left."""
    from launcher.host.cli import main as launch_main

    path = tmp_path / "run" / "checkpoints" / "last.pt"
    checkpoint.save_atomic({"net_state_dict": {"w": torch.randn(64, 64)}, "epoch": 1, "history": [],
                            "config": {"recipe": {"name": "text"}, "optim": None}}, path)

    def interrupted(obj, f, *args, **kwargs):
        f.write(b"PK" * 100)
        try:
            raise KeyboardInterrupt
        finally:  # (as torch.save's _open_zipfile_writer.__exit__ does after a partial write)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 268438016 vs 268437968")

    monkeypatch.setattr(torch, "save", interrupted)
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as exit_:
        launch_main(["export", str(tmp_path / "run"), str(tmp_path / "out" / "model.pt")])
    assert exit_.value.code == 130
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["launch: interrupted (Ctrl-C)"], said
    assert list((tmp_path / "out").iterdir()) == []


def test_a_snapshot_still_copies_tensors_whose_memory_cannot_be_compared():
    """A sparse buffer (no storage to compare) is cloned on its own, in the snapshot and in the warm-up's
    copy of the state, as before tied weights were merged."""
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    state = {"net_state_dict": {"mask": sparse, "mask_again": sparse, "w": torch.ones(2)}, "epoch": 1}
    copied = checkpoint.HostSnapshot(state).state()["net_state_dict"]
    assert torch.equal(copied["mask"].to_dense(), sparse.to_dense()) and copied["mask_again"].is_sparse
    assert torch.equal(checkpoint._cloned(state)["net_state_dict"]["mask"].to_dense(), sparse.to_dense())


def test_an_export_of_sharded_weights_reads_the_model_entries_whole_and_nothing_else(tmp_path, monkeypatch):
    """A sharded checkpoint's model entries, read in one process into host tensors: tensors with dots in
    their names, an object entry (a module's extra state) nested as it was saved, and not the optimizer's
    entries; without the temporary whole-checkpoint file torch's dcp_to_torch_save would write."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    from launcher.host.export import weights

    model = {"blocks.0.w": torch.randn(3, 4), "head.weight": torch.randn(2, 4),
             "norm._extra_state": {"version": 2, "scales": [1.5, torch.ones(2)]}}
    dcp.save({"model": model, "optim": {"state.blocks.0.w.exp_avg": torch.randn(3, 4)}},
             checkpoint_id=tmp_path / "epoch-1.dcp", no_dist=True)

    def no_temporary_folder(*args, **kwargs):
        raise AssertionError("a temporary folder for the whole checkpoint")

    monkeypatch.setattr(tempfile, "TemporaryDirectory", no_temporary_folder)
    read = weights(tmp_path / "last.pt", {"sharded": "epoch-1.dcp"})
    assert read.keys() == model.keys()
    assert all(torch.equal(read[k], model[k]) for k in ("blocks.0.w", "head.weight"))
    extra = read["norm._extra_state"]
    assert extra["version"] == 2 and extra["scales"][0] == 1.5 and torch.equal(extra["scales"][1], torch.ones(2))


def test_the_shard_writer_process_writes_each_saves_own_values_and_hands_back_its_error(tmp_path):
    """strategy=fsdp's checkpoints are written by a process beside the rank (launcher/train/shard_writer.py),
    from a host copy it keeps for the run: each save holds the values of its own time, and a save that fails
    there fails here (one rank alone: its writer meets no other)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from launcher.train.shard_writer import ShardWriter
    from launcher.world import WorldInfo

    world = WorldInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1", master_port=0)
    writer = ShardWriter(world, torch.device("cpu"), timeout_s=120)
    try:
        state = {"w": torch.arange(6.0)}
        writer.save(state, tmp_path / "epoch-1.dcp").result(timeout=300)
        state["w"] += 10  # (trained on)
        writer.save(state, tmp_path / "epoch-2.dcp").result(timeout=300)
        for name, want in (("epoch-1.dcp", torch.arange(6.0)), ("epoch-2.dcp", torch.arange(6.0) + 10)):
            back = {"w": torch.zeros(6)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (torch: "assuming the intent is to load in a single process")
                dcp.load(back, checkpoint_id=tmp_path / name)
            assert torch.equal(back["w"], want), name
        (tmp_path / "a-file").write_text("")
        with pytest.raises(CheckpointException, match="Not a directory"):
            writer.save(state, tmp_path / "a-file" / "epoch-3.dcp").result(timeout=300)
    finally:
        writer.close()


def test_the_host_copy_of_a_ranks_shards_is_shared_memory_of_its_layout_with_nothing_read_from_the_shards(tmp_path):
    """The host copy keeps each tensor's shape and dtype (a DTensor's spec too: mesh, placements, global
    shape) in shared memory of exactly its size, and reads nothing from the state it copies: torch's own
    maker first copied every shard into ordinary memory and then into shared memory (two thirds of its
    time for an 8B model's shards), which a meta tensor, having no values, cannot do."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    from launcher.train.shard_writer import host_copy_of

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
        state = {"model": {"w": weight, "b": torch.empty(5, 2, device="meta", dtype=torch.bfloat16)},
                 "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 3)}},
                           "param_groups": [{"lr": 0.1, "params": ["w"]}]},
                 "pair": (torch.zeros(0), 7)}
        host = host_copy_of(state, pin=False, shared=True)
        w = host["model"]["w"]
        assert isinstance(w, DTensor) and w.placements == weight.placements and w.shape == weight.shape
        assert w.device_mesh == mesh and w._local_tensor.shape == weight._local_tensor.shape
        b = host["model"]["b"]
        assert b.device.type == "cpu" and b.shape == (5, 2) and b.dtype == torch.bfloat16
        tensors = [w._local_tensor, b, *host["optim"]["state"][0].values(), host["pair"][0]]
        assert all(t.is_shared() for t in tensors)
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
        assert w._local_tensor.data_ptr() != weight._local_tensor.data_ptr()
        assert host["optim"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
        assert isinstance(host["pair"], tuple) and host["pair"][1] == 7
        assert host["optim"]["state"][0]["step"].shape == ()
        assert not host_copy_of(state, pin=False, shared=False)["model"]["b"].is_shared()
    finally:
        dist.destroy_process_group()


def test_the_host_copy_of_a_ranks_shards_is_made_beside_the_first_epoch_and_each_save_writes_its_own_values(
        tmp_path, monkeypatch, caplog):
    """Making the host copy that fsdp's saves copy the shards into is the slow part of a save (on 2 H200s an
    8B model's first save held every step for ~30 s). It is made on a thread after the first step
    (Saves.warm_pinned_memory), not by the first save on the training thread; the saves after it write
    the values of their own time into it; a state of another layout gets a copy of its own."""
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from launcher.train import shard_writer
    from launcher.train.saving import Saves
    from launcher.train.threads import Asides
    from tests.conftest import config_of

    made_on = []
    make = shard_writer.host_copy_of

    def recorded(*args, **kwargs):
        made_on.append(threading.current_thread().name)
        return make(*args, **kwargs)

    monkeypatch.setattr(shard_writer, "host_copy_of", recorded)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    world = WorldInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1", master_port=0)
    writer = checkpoint.BackgroundWriter(world)
    try:
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        nets, steppers = SimpleNamespace(module=model), [SimpleNamespace(optimizer=optimizer, scheduler=scheduler)]
        strategy = SimpleNamespace(options=None, sharded=True, is_main=True, name="fsdp")
        cpu = torch.device("cpu")
        saves = Saves(config_of("recipe=digits", "strategy=fsdp"), strategy, cpu, tmp_path, writer,
                      SimpleNamespace(nets=nets, steppers=steppers, scaler=None))

        def train_step():
            model(torch.ones(4, 6)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        train_step()  # (the first step: the optimizer's state made)
        asides = Asides()
        saves.warm_pinned_memory(asides)  # (train/loop.py: after the first step)
        asides.wait()  # (train/epoch_end.py: at the first epoch's end, before its save)
        assert made_on and threading.main_thread().name not in made_on
        for epoch in (1, 2):
            train_step()
            folder = tmp_path / f"epoch-{epoch}.dcp"
            writer.shard_writer(strategy, cpu).save(checkpoint._dcp_state(nets, steppers), folder).result(timeout=300)
            want = {k: v.full_tensor() for k, v in model.state_dict().items()}
            back = {k: torch.zeros_like(v) for k, v in want.items()}
            dcp.load({"model": back}, checkpoint_id=folder)
            assert all(torch.equal(back[k], want[k]) for k in want), epoch
        assert len(made_on) == 1  # (made once, for the run)
        # an epoch's save through the run's path: its wait added to what the epoch's end waited already
        row = {"epoch": 3, "checkpoint_wait_s": 5.0}
        checkpoint.save_sharded(strategy, nets, steppers, cpu, tmp_path / "checkpoints" / "last.pt", 3,
                                {"epoch": 3, "history": [row]}, writer, row=row)
        writer.wait()
        assert 5.0 < row["checkpoint_wait_s"] < 60 and len(made_on) == 1
        assert checkpoint.load(tmp_path / "checkpoints" / "last.pt")["history"] == [row]
        with caplog.at_level("INFO", logger="launcher.train"):
            writer.shards.save({"w": torch.arange(3.0)}, tmp_path / "other.dcp").result(timeout=300)
        assert len(made_on) == 2 and made_on[-1] == threading.main_thread().name
        assert "its host copy is made again here, on the training thread" in caplog.text
        back = {"w": torch.zeros(3)}
        dcp.load(back, checkpoint_id=tmp_path / "other.dcp")
        assert torch.equal(back["w"], torch.arange(3.0))
    finally:
        writer.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("saves", [True, False])
def test_an_epoch_end_that_waits_for_the_checkpoints_host_memory_counts_it_in_the_rows_wait(saves):
    """The checkpoints' host memory is made on a thread beside the first epoch; where it is not ready at the
    epoch's end, the steps wait for it there, and the row's checkpoint_wait_s (to which the save adds its own
    wait) says so. A run without checkpoints has no such figure."""
    from types import SimpleNamespace

    from launcher.train.epoch_end import EpochEnds
    from launcher.train.threads import Asides

    asides = Asides()
    asides.start(None, time.sleep, 0.3)  # (a host copy still being made)
    sums = SimpleNamespace(finite_steps=torch.tensor(4.0), overflowed=torch.tensor(0.0),
                           figures=SimpleNamespace(tensors=lambda: [torch.tensor(2.0)], names=["loss"]))
    scheduler = SimpleNamespace(get_last_lr=lambda: [0.1])
    ends = SimpleNamespace(asides=asides, cfg=SimpleNamespace(saves=saves), device=torch.device("cpu"),
                           step=SimpleNamespace(nets=SimpleNamespace(module=None), sums=sums,
                                                steppers=[SimpleNamespace(scheduler=scheduler)]),
                           strategy=SimpleNamespace(average_buffers=lambda module: None),
                           evaluation=SimpleNamespace(after=lambda epoch: False),
                           saves=SimpleNamespace(snapshot=lambda: None), _local_memory_mb=lambda: [-1.0, -1.0])
    row = {"epoch": 1}
    EpochEnds.queue(ends, 0, row, None, 0.0, 4, 0, 0, None, False)
    if saves:
        assert 0.25 < row["checkpoint_wait_s"] < 5, row
    else:
        assert "checkpoint_wait_s" not in row


def test_a_dev_shm_too_small_for_the_shards_is_said_with_their_size():
    from launcher.train.shard_writer import _short_of_shared_memory

    said = _short_of_shared_memory({"w": torch.zeros(3 * 2**18)})  # 3 MB of float32
    assert "/dev/shm cannot hold this rank's shards (3.0 MB;" in said and "--shm-size" in said


def test_a_forkserver_whose_launcher_is_already_gone_ends_at_once():
    """The forkserver's preload (launcher/train/preload.py) arms its parent-death signal first, against the
    launcher's pid it was given: a launcher killed before that (the forkserver then belongs to init) is
    noticed, not left behind importing torch for seconds and writing to a console that is gone."""
    import subprocess
    import sys

    from tests.conftest import clean_env

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    proc = subprocess.run([sys.executable, "-c", "import launcher.train.preload"], capture_output=True, text=True,
                          env=clean_env(LAUNCH_FORKSERVER_PARENT=str(gone.pid)), timeout=300)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-2000:]  # (before any import of torch)


def test_a_stopped_run_names_the_epoch_its_checkpoint_holds_not_the_last_one_logged(tmp_path):
    """An epoch's line comes before its checkpoint (written in the background) is whole: the line a
    stopped run ends with names the epoch last.pt holds, and the logged one whose checkpoint was not
    finished; none at all, none is claimed. A sharded last.pt whose shards are not all there is none."""
    import json

    from launcher.host.resume import what_a_resume_finds
    from launcher.train.checkpoint import save_atomic

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e, "loss": 1.0}) + "\n" for e in (1, 2, 3)))
    assert what_a_resume_finds(run) == "epoch 3's checkpoint was not finished: no checkpoint to resume from"
    save_atomic({"epoch": 2, "net_state_dict": {}}, run / "checkpoints" / "last.pt")
    assert what_a_resume_finds(run) == (f"launch resume={run} goes on from its checkpoint (epoch 2; epoch 3's "
                                        "checkpoint was not finished)")
    save_atomic({"epoch": 3, "net_state_dict": {}}, run / "checkpoints" / "last.pt")
    assert what_a_resume_finds(run) == f"launch resume={run} goes on from its checkpoint (epoch 3)"
    # written inside the next epoch (checkpoint_every_steps): said "epoch 3", and the resume "after epoch 3",
    # where it went on at epoch 4's step 51
    save_atomic({"epoch": 3, "step_in_epoch": 50, "net_state_dict": {}}, run / "checkpoints" / "last.pt")
    assert what_a_resume_finds(run) == f"launch resume={run} goes on from its checkpoint (epoch 4 after its step 50)"
    from launcher.host.resume import Resume

    assert Resume(run, 3, step=50).describe() == f"resuming {run} at step 51 of epoch 4, every setting as it was"
    save_atomic({"epoch": 3, "net_state_dict": {}}, run / "checkpoints" / "last.pt")
    # where it ran, as typed, is said again (a resume takes it from its own command line, not the checkpoint)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- recipe=digits\n- gpus=[]\n- strategy=ddp\n- nprocs=2\n"
                                                   "- strategy.timeout_s=60\n- lr=0.1\n- +backend.note=a b\n"
                                                   "- perf.activation_checkpointing=selective\n- data.root=/d\n")
    assert what_a_resume_finds(run) == (f"launch resume={run} gpus=[] strategy=ddp nprocs=2 strategy.timeout_s=60 "
                                        "'+backend.note=a b' perf.activation_checkpointing=selective goes on from its "
                                        "checkpoint (epoch 3)")
    save_atomic({"epoch": 3, "sharded": "epoch-3.dcp"}, run / "checkpoints" / "last.pt")  # (its folder is missing)
    assert "no checkpoint to resume from" in what_a_resume_finds(run)
    assert what_a_resume_finds(tmp_path / "nothing") == ""


def test_an_export_of_the_best_checkpoint_goes_beside_the_runs_and_counts_a_tied_weight_once(tmp_path, capsys):
    from launcher.host.export import main as export_main

    embed = torch.randn(30, 16)
    state = {"net_state_dict": {"embed.weight": embed, "head.weight": embed.clone(), "b": torch.zeros(16)},
             "epoch": 1, "history": [], "config": {"recipe": {"name": "text"}, "optim": None}}
    checkpoint.save_atomic(state, tmp_path / "run" / "checkpoints" / "last.pt")
    checkpoint.save_atomic(state, tmp_path / "run" / "checkpoints" / "best.pt")
    assert export_main([str(tmp_path / "run"), "best"]) == 0
    assert (tmp_path / "run" / "model-best.pt").is_file() and not (tmp_path / "run" / "model.pt").exists()
    assert "exported 3 tensors (496 values; head.weight tied to embed.weight)" in capsys.readouterr().out


def test_a_resume_records_only_the_settings_this_launch_changed(tmp_path, monkeypatch):
    from launcher.host.resume import inspect
    from tests.conftest import config_of

    monkeypatch.chdir(tmp_path)
    torch.save({"net_state_dict": {}, "epoch": 1, "config": {"recipe": {"name": "digits"}, "optim": {"name": "sgd"},
                                                             "lr": 0.07, "epochs": 5}}, "ck.pt")
    resume = inspect("ck.pt", config_of("resume=ck.pt", "epochs=8", "gpus=[]"))
    assert resume.changed == {"epochs": (5, 8)}
    assert "changed here: epochs 5 -> 8" in resume.describe()


def test_a_refused_resume_latest_names_the_checkpoint_latest_found(tmp_path):
    """resume=latest takes the newest run that has a checkpoint (a newer one run with checkpoint=false has none):
    a refusal names which checkpoint that was, which `latest` alone does not (a new user's trial)."""
    from launcher.errors import LaunchError
    from launcher.host.resume import inspect
    from tests.conftest import config_of

    path = _sealed_run(tmp_path / "outputs", "2026-11-30/10-00-00-digits-aaaa", 1.0)
    (tmp_path / "outputs" / "2026-11-30" / "11-00-00-digits-bbbb").mkdir()  # (newer, no checkpoint)
    with pytest.raises(LaunchError) as refused:
        inspect("latest", config_of("recipe=digits", "gpus=[]", "epochs=2"), tmp_path / "outputs")
    assert str(refused.value).startswith(f"epochs=2 is not valid with resume=latest: the checkpoint ({path}) has "
                                         "trained 2 epochs already"), refused.value
