"""strategy=fsdp on 2 CPU ranks (gloo): FSDP2 trains what ddp trains, its sharded checkpoints
(torch.distributed.checkpoint) resume on another number of ranks and under other strategies, and a model
built on the meta device trains."""

import json
import math

import pytest

pytestmark = pytest.mark.distributed

MAX_BYTES = 40_000  # of the corpus: 18 steps an epoch at batch 64 x 32 bytes
TOY = ("recipe=text", "gpus=[]", "recipe.layers=2", "recipe.width=32", "recipe.heads=2", "recipe.context=32",
       f"recipe.max_bytes={MAX_BYTES}", "progress=lines", "recipe.sample_bytes=20")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def text_root(tmp_path_factory):
    return tmp_path_factory.mktemp("text-data")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, text_root, warm_launcher):
    """Two epochs of the same GPT under fsdp on 2 ranks, ddp on 2 ranks, and one process (launched as the
    `launch` fixture launches: forks of the warm launcher, tests/warm.py)."""
    from tests.conftest import clean_env

    cwd = tmp_path_factory.mktemp("fsdp-runs")
    # (fsdp and ddp keep no checkpoint before the last: test_a_rank_that_dies_... sees a kept one; fsdp its best)
    for name, how in (("fsdp", ("strategy=fsdp", "nprocs=2", "checkpoint.keep_previous=false",
                                "checkpoint.keep_best=1")),
                      ("ddp", ("strategy=ddp", "nprocs=2", "checkpoint.keep_previous=false")),
                      ("single", ("strategy=single",))):
        argv = [*TOY, f"data.root={text_root}", *how, "epochs=2", f"hydra.run.dir={name}"]
        code, out, err = warm_launcher.run(argv, cwd, clean_env(), 300)
        assert code == 0, out + err
    return cwd


def test_fsdp_and_ddp_on_two_ranks_follow_one_ranks_loss_curve_and_fsdp_shards_its_checkpoint(fsdp_run):
    """The same global batches, gradients averaged over the same tokens: equal up to float summation order."""
    one = _rows(fsdp_run / "single")
    for name in ("fsdp", "ddp"):
        for a, b in zip(_rows(fsdp_run / name), one, strict=True):
            for key in ("loss", "test_loss"):
                assert a[key] == pytest.approx(b[key], rel=1e-4), (name, key, a, b)
    results = json.loads((fsdp_run / "fsdp" / "results.json").read_text())
    assert results["strategy"] == "fsdp" and results["gradient_sync"] == "FSDP2 reduce-scatter"
    assert results["sharding"].startswith("fsdp: one unit, the root, gathered whole"), results["sharding"]
    assert json.loads((fsdp_run / "ddp" / "results.json").read_text())["sharding"] is None
    assert "fsdp: one unit, the root" in (fsdp_run / "fsdp" / "train.log").read_text()
    # (each rank holds other shards: no replicas to compare; every rank reports one digest of all of them)
    assert results["ranks_agree"] is None and len(set(results["weights_sha256"])) == 1
    assert json.loads((fsdp_run / "ddp" / "results.json").read_text())["ranks_agree"] is True
    folders = sorted(p.name for p in (fsdp_run / "fsdp" / "checkpoints").iterdir())
    # (checkpoint.keep_previous=false: epoch 1's folder, the best until epoch 2, went with the save after it,
    # and no previous.pt was made)
    rows = _rows(fsdp_run / "fsdp")
    assert rows[1]["test_loss"] < rows[0]["test_loss"], rows  # (so epoch 2 is the one best checkpoint kept)
    # (what each epoch's save held the steps for, as a whole checkpoint's is said: the GPU test of it bounds it)
    assert all(0 <= r["checkpoint_wait_s"] < 30 for r in rows), rows
    assert folders == ["best-epoch-0002.pt", "best.json", "best.pt", "epoch-2.dcp", "last.pt"]
    assert (fsdp_run / "fsdp" / "checkpoints" / "epoch-2.dcp" / ".metadata").is_file()
    assert sorted(p.name for p in (fsdp_run / "ddp" / "checkpoints").iterdir()) == ["last.pt"]
    assert sorted(p.name for p in (fsdp_run / "single" / "checkpoints").iterdir()) == ["last.pt", "previous.pt"]


def test_the_checkpoint_size_the_launch_judges_the_disk_by_is_what_a_run_writes(fsdp_run, text_root):
    """launcher/host/disk.py counts a checkpoint as the fp32 weights of the model's state_dict and AdamW's two
    moments, from the model counted on the meta device before any worker: ddp's last.pt holds that (its tied
    head once) and the pickled rest, and the shard folder fsdp's ranks wrote holds those tensors (the tied head
    under both names) in files that add a little for each (about 1.4 kB a tensor a rank: megabytes at 8B,
    where the tensors are ~96 GB)."""
    from torch.distributed.checkpoint import FileSystemReader

    from launcher.host import memory
    from launcher.host.disk import checkpoint_bytes
    from launcher.host.plan import make_plan
    from launcher.recipes import recipe_class
    from tests.conftest import config_of

    plan = make_plan(config_of(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2"), env={}, physical_count=0,
                     loads=[])
    fit = memory.check_fits(recipe_class("text")(plan.config), plan)
    assert fit.parameters == json.loads((fsdp_run / "fsdp" / "results.json").read_text())["parameters"]
    whole = (fsdp_run / "ddp" / "checkpoints" / "last.pt").stat().st_size
    estimate = checkpoint_bytes(fit, 2, sharded=False)
    assert estimate < whole < estimate * 1.15, (whole, estimate)
    folder = fsdp_run / "fsdp" / "checkpoints" / "epoch-2.dcp"
    entries = FileSystemReader(folder).read_metadata().state_dict_metadata.values()
    tensors = sum(math.prod(e.size) * e.properties.dtype.itemsize for e in entries if hasattr(e, "size"))
    estimate = checkpoint_bytes(fit, 2, sharded=True)
    assert estimate <= tensors < estimate * 1.005, (tensors, estimate)  # (AdamW's step counts: a number a tensor)
    files = sum(f.stat().st_size for f in folder.iterdir())
    assert files < tensors + 4_000 * 2 * len(entries), (files, tensors, len(entries))


@pytest.mark.parametrize("resumed_as", [("strategy=fsdp", "nprocs=1"),
                                        ("strategy=fsdp", "nprocs=2", "strategy.min_unit_params=0"),
                                        ("strategy=fsdp", "nprocs=2", "strategy.min_unit_params=0",
                                         "strategy.reshard_after_forward=true"),
                                        ("strategy=ddp", "nprocs=2"), ("strategy=single",)])
def test_a_sharded_checkpoint_resumes_on_other_ranks_and_strategies(launch, fsdp_run, text_root, resumed_as):
    """Saved on 2 ranks (this small GPT one unit, the root); resumed on 1, on 2 with every block a unit of
    its own (their gathered weights kept to the backward, as the memory estimate chooses on this machine, or
    freed), under ddp, and in one process without torch.distributed: the same third epoch, and no warning
    from torch about reading shards in one process."""
    result = launch(*TOY, f"data.root={text_root}", *resumed_as, "epochs=3", f"resume={fsdp_run / 'fsdp'}",
                    "hydra.run.dir=resumed")
    assert result.returncode == 0, result.output
    assert "UserWarning" not in result.output and "assuming the intent" not in result.output, result.output
    if "strategy.min_unit_params=0" in resumed_as:
        chosen = "true:" if "strategy.reshard_after_forward=true" in resumed_as else "false, by the memory estimate:"
        assert f"; reshard_after_forward={chosen}" in result.results()["sharding"], result.results()["sharding"]
    rows = _rows(result.cwd / "resumed")
    saved = _rows(fsdp_run / "fsdp")
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[:2] == saved
    assert rows[2]["loss"] < saved[1]["loss"]  # it continued from the trained weights, not from scratch
    # and from the schedule's place: its linear decay ends at 0 with the run, not after one epoch of warm-up
    assert rows[2]["lr"] < 0.1 * saved[0]["lr"], (rows[2]["lr"], saved[0]["lr"])
    reference = fsdp_run / "third-epoch.json"  # the first resume's third epoch is the others' reference
    if reference.exists():
        expected = json.loads(reference.read_text())
        assert rows[2]["loss"] == pytest.approx(expected["loss"], rel=1e-4)
        assert rows[2]["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-4)
    else:
        reference.write_text(json.dumps(rows[2]))


def test_a_tied_weight_is_stored_once_in_a_plain_checkpoint_and_resumes(launch, fsdp_run, text_root):
    """GPT's output layer is its embedding: one tensor under two names, stored once in ddp's last.pt (as
    torch.save of the live state_dict would; GPT-2 124M: 154 MB less in every checkpoint), and the run
    resumed from it in one process continues from the trained weights and saves it once again."""
    import torch

    def shared(checkpoint):
        weights = torch.load(checkpoint, weights_only=True)["net_state_dict"]
        head, tokens = weights["head.weight"], weights["tokens.weight"]
        return torch.equal(head, tokens) and head.untyped_storage().data_ptr() == tokens.untyped_storage().data_ptr()

    assert shared(fsdp_run / "ddp" / "checkpoints" / "last.pt")
    assert shared(fsdp_run / "single" / "checkpoints" / "last.pt")
    result = launch(*TOY, f"data.root={text_root}", "strategy=single", "epochs=3", f"resume={fsdp_run / 'ddp'}",
                    "hydra.run.dir=resumed-tied")
    assert result.returncode == 0, result.output
    rows, saved = _rows(result.cwd / "resumed-tied"), _rows(fsdp_run / "ddp")
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[:2] == saved
    assert rows[2]["loss"] < saved[1]["loss"]  # from the trained weights, not from scratch
    assert shared(result.cwd / "resumed-tied" / "checkpoints" / "last.pt")


def test_an_unsharded_checkpoint_does_not_resume_under_fsdp(launch, fsdp_run, text_root):
    result = launch(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2", "epochs=3",
                    f"resume={fsdp_run / 'ddp'}")
    assert result.returncode == 2, result.output
    assert "resumes under an unsharded strategy, ddp or single" in result.output and "Traceback" not in result.output


def test_meta_init_with_activation_checkpointing_trains(launch, text_root):
    result = launch(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2", "epochs=2", "checkpoint=false",
                    "strategy.meta_init=true", "strategy.activation_checkpointing=true")
    assert result.returncode == 0, result.output
    rows = _rows(result.run_dir())
    assert rows[-1]["loss"] < math.log(256) - 0.5 and result.results()["ranks_agree"] is None  # (starts near ln 256)
    assert result.results()["activation_checkpointing"] == "full"  # (fsdp's older key: full)


def test_gradient_accumulation_gives_the_same_steps(launch, fsdp_run, text_root):
    """batch_size stays the global step's: micro-batches summed before one synchronization (FSDP2's
    set_requires_gradient_sync; DDP's no_sync: tests/unit/test_fsdp_and_accumulation.py) train alike."""
    how = ("strategy=fsdp", "nprocs=2", "accumulate=4")
    result = launch(*TOY, f"data.root={text_root}", *how, "epochs=2", "checkpoint=false", "eval.every=0")
    assert result.returncode == 0, result.output
    plan = json.loads((result.run_dir() / "plan.json").read_text())
    accumulate = int(how[-1].split("=")[1])
    assert plan["accumulate"] == accumulate and plan["micro_batch"] == 32 // accumulate
    for a, b in zip(_rows(result.run_dir()), _rows(fsdp_run / "ddp"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-4)


def test_export_writes_weights_that_load_without_the_launcher(fsdp_run, tmp_path):
    """The sharded run's weights, gathered into one plain state_dict, are the ddp run's (they trained alike)."""
    import subprocess
    import sys

    import torch

    from launcher.host.export import main as export_main
    from tests.conftest import clean_env, launch_command

    proc = subprocess.run(launch_command("export", str(fsdp_run / "fsdp"), str(tmp_path / "fsdp.pt")),
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0 and f"to {tmp_path / 'fsdp.pt'}" in proc.stdout, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr  # (torch's "assuming the intent" for one process reading shards)
    assert export_main([str(fsdp_run / "ddp"), str(tmp_path / "ddp.pt")]) == 0
    assert export_main([str(fsdp_run / "ddp"), str(tmp_path / "ddp.pt")]) == 2  # never overwritten
    (tmp_path / "folder").mkdir()
    assert export_main([str(fsdp_run / "ddp"), str(tmp_path / "folder")]) == 0  # into it, as cp puts a file
    assert torch.load(tmp_path / "folder" / "model.pt").keys() == torch.load(tmp_path / "ddp.pt").keys()
    assert export_main([str(fsdp_run / "ddp"), str(tmp_path / "folder")]) == 2  # its model.pt is not overwritten
    (tmp_path / "dangling.pt").symlink_to(tmp_path / "nowhere.pt")  # a link pointing nowhere is not replaced either
    assert export_main([str(fsdp_run / "ddp"), str(tmp_path / "dangling.pt")]) == 2
    assert (tmp_path / "dangling.pt").is_symlink() and not (tmp_path / "nowhere.pt").exists()
    sharded, whole = torch.load(tmp_path / "fsdp.pt"), torch.load(tmp_path / "ddp.pt")
    assert sharded.keys() == whole.keys() and "blocks.1.qkv.weight" in sharded
    assert all(torch.allclose(sharded[k], whole[k], atol=1e-5) for k in whole)
    # the output layer tied to the embedding is one tensor in the file, counted once: the network's parameters
    parameters = json.loads((fsdp_run / "fsdp" / "results.json").read_text())["parameters"]
    assert f"({parameters:,} values; head.weight tied to tokens.weight)" in proc.stdout, proc.stdout
    for weights in (sharded, whole):
        assert weights["head.weight"].data_ptr() == weights["tokens.weight"].data_ptr()
    # the line names the vocabulary to build the network with (an interrupted run has no results.json to read
    # it from), and the network built with it and config.yaml's values takes the weights
    from launcher.recipes.text_models import GPT

    assert proc.stdout.rstrip().endswith("; build the network with vocab=256 (its embedding's rows, the padded "
                                         "vocabulary)"), proc.stdout
    GPT(256, 32, 2, 32, 2, 0.0).load_state_dict(sharded)
    # a fresh interpreter that never imports launcher reads it
    code = (f"import torch, sys; sd = torch.load({str(tmp_path / 'fsdp.pt')!r}); "
            "assert 'launcher' not in sys.modules; print(len(sd))")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert fresh.stdout.strip() == str(len(whole)), fresh.stderr


def test_export_that_cannot_write_says_so_in_one_line_and_leaves_nothing(fsdp_run, tmp_path, capsys, monkeypatch):
    """A missing output folder, or a disk that fills while the weights are written: one line each, no
    traceback, and no partial or temporary file left behind."""
    import errno

    import torch

    from launcher.host.export import main as export_main

    assert export_main([str(fsdp_run / "ddp"), str(tmp_path / "no" / "such" / "model.pt")]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "no/such does not exist" in said[0] and "mkdir -p" in said[0], said
    assert not (tmp_path / "no").exists()
    (tmp_path / "a-file").write_text("")
    assert export_main([str(fsdp_run / "ddp"), str(tmp_path / "a-file" / "model.pt")]) == 2
    assert "a-file is not a folder" in capsys.readouterr().err

    def fills_the_disk(obj, f, *args, **kwargs):
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", fills_the_disk)
    (tmp_path / "out").mkdir()
    assert export_main([str(fsdp_run / "ddp"), str(tmp_path / "out" / "model.pt")]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "no space left" in said[0] and "was not written" in said[0], said
    assert list((tmp_path / "out").iterdir()) == []  # neither the model nor its temporary file


def test_resnet18_trains_under_fsdp_as_under_ddp(launch, tmp_path_factory):
    """The image recipes keep working under fsdp (BatchNorm buffers stay per rank, averaged each epoch)."""
    from launcher.recipes.cifar10 import FOLDER, synthetic_splits, write_official_format

    root = tmp_path_factory.mktemp("cifar-fsdp")
    write_official_format(root / FOLDER, synthetic_splits(32, 8, seed=3))  # (2 steps of 8 a rank)
    losses = {}
    for strategy in ("ddp", "fsdp"):
        result = launch("recipe=cifar10", "recipe.model=resnet18", f"data.root={root}", "gpus=[]",
                        f"strategy={strategy}", "nprocs=2", "epochs=1", "batch_size=16", "lr=0.05", "checkpoint=false",
                        f"hydra.run.dir={strategy}")
        assert result.returncode == 0, result.output
        losses[strategy] = _rows(result.cwd / strategy)[0]["loss"]
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-3), losses


def test_a_rank_that_dies_restarts_the_world_from_the_last_async_sharded_checkpoint(launch, text_root):
    """Sharded checkpoints are saved asynchronously; last.pt follows each as soon as every rank's shards
    are on disk, so a rank dying in epoch 3 resumes after epoch 2 (not 1), and the run completes."""
    steps = ((MAX_BYTES - MAX_BYTES // 20) - 1) // 32 // 64  # windows of the training stream // batch 64
    result = launch(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2", "epochs=3", "fault.rank=1",
                    f"fault.step={2 * steps + 3}", "max_restarts=1", "recipe.sample_bytes=0")
    assert result.returncode == 0, result.output
    r, run_dir = result.results(), result.run_dir()
    assert r["restarts"] == 1 and r["resumed_from"].endswith("last.pt")
    assert "after epoch 2" in (run_dir / "train.log").read_text()
    assert [row["epoch"] for row in _rows(run_dir)] == [1, 2, 3]
    # (the checkpoint before the last is kept: previous.pt and the shard folder it names)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch-2.dcp", "epoch-3.dcp", "last.pt",
                                                                          "previous.pt"]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "Ctrl-C"])
def test_the_shard_writers_end_with_the_launch_however_it_ends(text_root, tmp_path, sig):
    """Each rank's shards are written by a process of its own (launcher/train/shard_writer.py, forked at
    the rank's start, named launch-shards): killed outright (kill -9), stopped, or Ctrl-C at a terminal
    (SIGINT to the whole process group) after the first save, the launch leaves none of them behind, nor
    multiprocessing's resource tracker or forkserver, 3 s after it exits, and a Ctrl-C is one line, no
    writer's traceback. What the stopped run says of its checkpoint is what its last.pt holds, whole."""
    import os
    import re
    import signal
    import subprocess
    import time

    from launcher.host.resume import load_checkpoint
    from launcher.train.shard_writer import PROCESS_NAME
    from tests.conftest import alive, clean_env, descendants, launch_command, named, running, stop_tree

    terminal = sig == "Ctrl-C"
    out = tmp_path / "out.txt"  # (not a pipe: reading it to its end would wait for every process holding it)
    with open(out, "w") as sink:
        proc = subprocess.Popen(launch_command(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2",
                                               "epochs=500", "recipe.sample_bytes=0", "hydra.run.dir=run"),
                                cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, text=True, env=clean_env(),
                                start_new_session=terminal,
                                preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if terminal else None)
    try:
        deadline = time.monotonic() + 240
        while "\nepoch" not in out.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # (the first epoch's checkpoint was handed to the writers before its line)
        assert "\nepoch" in out.read_text(), out.read_text()
        tree = descendants(proc.pid)
        assert len(named(tree, PROCESS_NAME)) == 2, tree
        assert running(tree, b"resource_tracker") and running(tree, b"forkserver"), tree
        if terminal:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=60)
        deadline = time.monotonic() + 3
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in tree if alive(p)], "processes outlived the launch by 3 s"
    finally:
        stop_tree(proc.pid)
    said = out.read_text()
    if terminal:
        assert proc.returncode == 130, said
        assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    claimed = re.search(r"goes on from its checkpoint \(epoch (\d+)", said)
    if sig == "SIGTERM":
        assert proc.returncode == 143 and (claimed or "no checkpoint to resume from" in said), said
    if last.exists():  # (kill -9 says nothing: last.pt itself is the claim) whole, as a resume checks it
        epoch = load_checkpoint(last, "resume")["epoch"]
        assert not claimed or epoch == int(claimed[1]), said
    else:
        assert not claimed, said


def test_a_dev_shm_too_small_for_the_shards_still_checkpoints_says_so_once_and_resumes(launch, text_root, tmp_path):
    """The writer processes read the shards from shared memory; where /dev/shm cannot hold them (a
    container's default is 64 MB) each save goes through the pipe instead, said once, and the run keeps
    its checkpoints."""
    import shlex
    import shutil
    import subprocess

    from tests.conftest import clean_env, launch_command

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("no mount namespace here (unshare -m) to give the run a small /dev/shm")
    command = launch_command(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2", "epochs=2",
                             "recipe.sample_bytes=0", "hydra.run.dir=shm")
    small = f"mount -t tmpfs -o size=128k tmpfs /dev/shm && exec {shlex.join(command)}"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", small], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("/dev/shm cannot hold this rank's shards") == 1, out
    assert "--shm-size" in out
    assert sorted(p.name for p in (tmp_path / "shm" / "checkpoints").iterdir()) == ["epoch-1.dcp", "epoch-2.dcp",
                                                                                   "last.pt", "previous.pt"]
    resumed = launch(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2", "epochs=3", "recipe.sample_bytes=0",
                     f"resume={tmp_path / 'shm'}")
    assert resumed.returncode == 0, resumed.output
    assert [row["epoch"] for row in _rows(resumed.run_dir())] == [1, 2, 3]


def test_a_restart_that_finds_its_sharded_checkpoint_damaged_goes_on_from_the_one_before(launch, text_root):
    """fault.kind=damage overwrites bytes of last.pt mid-epoch 3: rank 0 finds it damaged at the restart,
    every rank goes on from previous.pt (epoch 1's, whose shard folder was kept), and the run completes."""
    steps = ((MAX_BYTES - MAX_BYTES // 20) - 1) // 32 // 64
    result = launch(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2", "epochs=3", "fault.rank=0",
                    "fault.kind=damage", f"fault.step={2 * steps + steps // 2}", "max_restarts=1",
                    "recipe.sample_bytes=0")
    assert result.returncode == 0, result.output
    r, run_dir = result.results(), result.run_dir()
    assert r["restarts"] == 1 and r["resumed_from"].endswith("previous.pt")
    log = (run_dir / "train.log").read_text()
    assert "last.pt cannot be trusted" in log and "going on from the one before it" in log and "after epoch 1" in log
    assert [row["epoch"] for row in _rows(run_dir)] == [1, 2, 3]


def test_clipping_under_fsdp_uses_the_whole_models_gradient_norm(launch, tmp_path, text_root):
    """optim.clip_grad_norm small enough to clip every step: fsdp's ranks hold shards of the gradients,
    and the norm they clip to is the whole model's, so 2 ranks follow 1 rank as without clipping. (SGD:
    AdamW's steps hardly change when every gradient is scaled, so they would not show a wrong norm.)"""
    rows = {}
    for name, how in (("fsdp", ("strategy=fsdp", "nprocs=2")), ("single", ("strategy=single",))):
        result = launch(*TOY, f"data.root={text_root}", *how, "epochs=1", "optim=sgd", "lr=0.5",
                        "optim.clip_grad_norm=0.05", f"hydra.run.dir={name}", timeout=300)
        assert result.returncode == 0, result.output
        rows[name] = _rows(tmp_path / name)
    for a, b in zip(rows["fsdp"], rows["single"], strict=True):
        for key in ("loss", "test_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (key, a, b)


def test_a_damaged_sharded_checkpoint_is_one_line_before_any_worker(launch, fsdp_run, text_root, tmp_path):
    """Its folder without .metadata, a shard cut short, a folder gone: one line naming what, exit 2, no
    worker started (before, tracebacks from torch.distributed.checkpoint after the workers started)."""
    import shutil

    from launcher.errors import LaunchError
    from launcher.host.resume import load_checkpoint

    def damaged(name, harm):
        run = tmp_path / name
        shutil.copytree(fsdp_run / "fsdp", run)
        harm(run / "checkpoints" / "epoch-2.dcp")
        return run

    def cut(folder):
        shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    def zeroed(folder):  # the same size, some bytes inside a tensor zeroed: torch's loader reads zeros
        shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2:len(raw) // 2 + 64] = bytes(64)
        shard.write_bytes(bytes(raw))

    cases = {"no-index": (lambda f: (f / ".metadata").unlink(), "has no .metadata"),
             "cut": (cut, "is truncated"),
             "zeroed": (zeroed, "differs from the digest written with it"),
             "gone": (shutil.rmtree, "its shards' folder")}
    for name, (harm, why) in cases.items():
        run = damaged(name, harm)
        with pytest.raises(LaunchError, match=why):
            load_checkpoint(run / "checkpoints" / "last.pt", f"resume={run}")
    result = launch(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2", "epochs=3",
                    f"resume={tmp_path / 'cut'}", timeout=120)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "is truncated" in lines[0], result.output
    assert "Traceback" not in result.output
    # a whole checkpoint of another shape (recipe.width): one line as under ddp, not DCP's CheckpointException
    wider = launch(*TOY, f"data.root={text_root}", "strategy=fsdp", "nprocs=2", "epochs=3", "recipe.width=64",
                   f"resume={fsdp_run / 'fsdp'}", timeout=180)
    assert wider.returncode == 2 and "the checkpoint does not fit the network this config builds (it was trained " \
        "with recipe.width=32" in wider.stderr, wider.output
    assert "CheckpointException" not in wider.stderr
    # refused in the launcher, from the shard folder's metadata and the network built on the meta device: no
    # worker started, no run dir left failed (before, a worker's load found it); a whole checkpoint too
    assert not wider.run_dirs() and "is [256, 32], the network here has [256, 64]" in wider.stderr, wider.output
    deeper = launch(*TOY, f"data.root={text_root}", "strategy=ddp", "nprocs=2", "epochs=3", "recipe.layers=3",
                    f"resume={fsdp_run / 'ddp'}", timeout=180)
    assert deeper.returncode == 2 and not deeper.run_dirs(), deeper.output
    assert len([x for x in deeper.stderr.splitlines() if x.strip()]) == 1 and "recipe.layers=2" in deeper.stderr


# `launch eval` with the host's `pin` wrapped: once it has returned, the trained run's shard folder is
# removed and last.pt replaced by another checkpoint, as a live run does between its epochs.
_ROTATED_WHILE_EVALUATED = """
import os, shutil, sys
from pathlib import Path
import launcher.host.run_here as run_here
pin, rotated = run_here.pin, Path(sys.argv[1])
def pin_then_rotate(path, *rest):
    held = pin(path, *rest)
    shutil.rmtree(path.parent / "epoch-2.dcp")
    os.replace(rotated, path)
    return held
run_here.pin = pin_then_rotate
sys.argv = ["launch", *sys.argv[2:]]
from launcher.host.cli import main
main()
"""


def test_eval_of_a_live_sharded_run_reads_the_checkpoint_it_checked_on_every_rank(fsdp_run, tmp_path, launch):
    """A live run replaces last.pt and removes its older shard folder while `launch eval` reads it (issue
    34): the workers read hard links taken before they started, so both ranks evaluate the checkpoint that
    was checked, whole, and nothing of them is left afterwards; the run's own files are not touched."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import clean_env

    def evaluate(run, *more):
        """`launch eval` of the run (with `more`: rotating `more`'s checkpoint in while it reads, a fresh
        interpreter that patches run_here first; without: a fork of the warm launcher)."""
        args = ("eval", str(run), "gpus=[]", "strategy=fsdp", "nprocs=2")
        if more:
            proc = subprocess.run([sys.executable, "-c", _ROTATED_WHILE_EVALUATED, *more, *args], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=240, env=clean_env())
            assert proc.returncode == 0, proc.stdout + proc.stderr
        else:
            done = launch(*args, timeout=240)
            assert done.returncode == 0, done.output
        found = sorted(tmp_path.glob("outputs/**/eval.json"), key=lambda p: p.stat().st_mtime)[-1]
        return json.loads(found.read_text()), found.parent

    live = tmp_path / "live"
    shutil.copytree(fsdp_run / "fsdp", live)
    expected, _ = evaluate(live)
    other = tmp_path / "other.pt"  # the "next epoch's" last.pt, naming its own folder (not there yet)
    import torch

    state = torch.load(live / "checkpoints" / "last.pt", weights_only=True)
    torch.save({**state, "epoch": 3, "sharded": "epoch-3.dcp"}, other)
    got, eval_dir = evaluate(live, str(other))
    assert got["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-6), (got, expected)
    assert got["trained_epochs"] == 2 and got["world_size"] == 2
    assert got["evaluated"] == str(live / "checkpoints" / "last.pt")  # (the user's path, not the links)
    assert not (eval_dir / ".evaluated-checkpoint").exists()
    assert not (live / "checkpoints" / "epoch-2.dcp").exists()  # (what the "run" removed stays removed)


LLAMA = ("recipe=text", "gpus=[]", "recipe.model=llama", "recipe.layers=2", "recipe.width=64", "recipe.heads=4",
         "recipe.kv_heads=2", "recipe.context=32", f"recipe.max_bytes={MAX_BYTES}", "progress=lines",
         "recipe.sample_bytes=20", "epochs=2", "checkpoint=false")


def test_a_tiny_llama_sharded_on_two_ranks_with_its_blocks_recomputed_follows_one_process(launch, text_root):
    """Llama 3's decoder (grouped-query attention: 4 heads, 2 key/value heads) under fsdp on 2 gloo ranks, each
    block's activations recomputed in the backward (perf.activation_checkpointing=selective): the same losses
    as one process keeping them."""
    one = launch(*LLAMA, f"data.root={text_root}", "strategy=single")
    assert one.returncode == 0, one.output
    two = launch(*LLAMA, f"data.root={text_root}", "strategy=fsdp", "nprocs=2",
                 "perf.activation_checkpointing=selective")
    assert two.returncode == 0, two.output
    rows = _rows(two.run_dir())
    for a, b in zip(rows, _rows(one.run_dir()), strict=True):
        for key in ("loss", "test_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (key, a, b)
    assert rows[-1]["loss"] < math.log(256) - 0.5 and two.results()["ranks_agree"] is None  # (starts near ln 256)
    assert two.results()["parameters"] == one.results()["parameters"]
    assert (two.results()["activation_checkpointing"], one.results()["activation_checkpointing"]) == \
        ("selective", "none")
    assert "activation checkpointing: selective, 2 blocks" in two.output


def _materialize_on_two_ranks(rank: int, port: int, out: str) -> None:
    """One gloo rank: a model built on the meta device, sharded and materialized by strategy=fsdp as a run
    does it; rank 0 writes the whole first weight (gathered) and whether the ranks' generators agree after."""
    import os

    import torch
    import torch.distributed as dist

    from launcher import strategies
    from launcher.config import FSDPConfig, PerfConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)  # (the run's seed, the same on every rank)
    chosen = strategies.choose(FSDPConfig(meta_init=True, min_unit_params=0), strategies.Devices(()), nprocs=2,
                               global_batch=8, perf=PerfConfig(), gpus_text="[]", accumulate=1)
    def build():
        return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 8))

    model = chosen.strategy.build_model(build, torch.device("cpu"))
    chosen.strategy.wrap(model, torch.device("cpu"))
    weights = {name: p.full_tensor() for name, p in model.named_parameters()}
    after = torch.rand(4)  # the common generator after the initialization
    others = [torch.empty(4) for _ in range(2)]
    dist.all_gather(others, after)
    torch.manual_seed(0)  # the same run without meta init: a plain build from the same seed
    plain = build()
    plain_after = torch.rand(4)
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump({"weight": weights["0.weight"].tolist(), "agree_after": torch.equal(others[0], others[1]),
                       "as_plain": all(torch.equal(w, plain.state_dict()[n]) for n, w in weights.items()),
                       "generator_as_plain": torch.equal(after, plain_after)}, f)
    dist.destroy_process_group()
    # End as the launcher's workers end (forkserver children leave by os._exit): a spawned child that leaves
    # through the interpreter's exit can abort in gloo's teardown ("terminate called without an active
    # exception", SIGABRT), 1 run in ~16 here, after its work is done.
    os._exit(0)


def test_meta_init_on_cpu_ranks_gives_a_plain_inits_weights_and_generator(tmp_path):
    """On a CPU mesh DTensor has no RNG tracker: each rank drew its shard from its own generator, in the same
    state on every rank (the run's seed), so rank 1's rows of every weight repeated rank 0's (torch warns so).
    Issue 60: meta init gives the weights a plain init gives with the same seed, and the generator goes on
    from where that build left it (every rank alike)."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.json"
    mp.start_processes(_materialize_on_two_ranks, args=(port, str(out)), nprocs=2, start_method="spawn")
    result = json.loads(out.read_text())
    weight = torch.tensor(result["weight"])
    assert weight.shape == (8, 16) and not torch.equal(weight[:4], weight[4:]), "rank 1's rows repeat rank 0's"
    assert 0 < float(weight.abs().max()) <= 0.25  # (Linear's own reset_parameters: U(-1/4, 1/4) at 16 inputs)
    assert result["agree_after"]
    assert result["as_plain"] and result["generator_as_plain"], result
