"""Every `launch` command README.md and docs/*.md show, read out of them, runs as written from a fresh
clone (from examples/, where the files the docs' own recipes need are): each is composed, checked and
planned (`dry_run=true`: nothing trains; `launch doctor`, `runs`, `--help`, `--version` run whole). What
this machine cannot have is put in its place and said: GPUs (`gpus=` becomes `gpus=[]`), the folder a
command names as DIR (a generated image folder), a machine's address (127.0.0.1). Commands that name a
run dir of the docs' author (or an earlier run here), a cluster, a GPU-only strategy or a package not
installed here are listed as left out, so that the list of what is checked stays visible in the test's
output. A command shown on several pages runs once; each place it is shown is a test of its own."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import clean_env

REPO = Path(__file__).resolve().parents[2]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
PLACEHOLDERS = ("RUN_DIR", "outputs/", "/data/", "...", "DIR/")


def page_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(`page:line`, argv after `launch`) for each `launch ...` line of a page's indented code blocks,
    with its continuation lines joined and its comment removed."""
    name = page.relative_to(REPO).as_posix()
    lines = page.read_text().splitlines()
    found, i, fenced = [], 0, False
    while i < len(lines):
        line, start = lines[i], i + 1
        if line.startswith("```"):
            fenced = not fenced
        text = line.strip()
        if not fenced and line.startswith("    ") and text.startswith("launch "):
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            found.append((f"{name}:{start}", shlex.split(text, comments=True)[1:]))
        i += 1
    return found


def doc_commands() -> list[tuple[str, list[str]]]:
    """Every page's commands, README.md first."""
    return [found for page in PAGES for found in page_commands(page)]


def left_out(argv: list[str]) -> str | None:
    """Why this command cannot run on a CPU machine without a cluster, or None."""
    text = " ".join(argv)
    if any(p in text for p in PLACEHOLDERS) or "DIR" in text.replace("data.root=DIR", ""):
        return "names a run dir or data of the docs' author"
    if "resume=latest" in text:
        return "continues the newest run here, and a fresh copy of examples/ holds none"
    if "backend=slurm" in text:
        return "needs a SLURM cluster (tests/slurm runs those)"
    if "strategy=dp" in text:
        return "DataParallel needs GPUs"
    if "hydra/sweeper=optuna" in text and importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None:
        return "hydra-optuna-sweeper is not installed"
    if "timm." in text and importlib.util.find_spec("timm") is None:
        return "timm is not installed"
    return None


def as_run_here(argv: list[str], images: Path) -> list[str]:
    """The command as it runs on this machine: no GPUs, DIR an image folder, a local rendezvous address;
    planned, not trained."""
    out = []
    for arg in argv:
        if arg.startswith("gpus="):
            arg = "gpus=[]"
        arg = arg.replace("data.root=DIR", f"data.root={images}").replace("10.0.0.1", "127.0.0.1")
        out.append(arg)
    if out and out[0] in ("doctor", "runs", "--help", "--version") or "--cfg" in out:
        return out
    before, dashes, after = (out, [], []) if "--" not in out else (
        out[:out.index("--")], ["--"], out[out.index("--") + 1:])
    return [*before, "dry_run=true", *dashes, *after]


COMMANDS = doc_commands()


def test_the_docs_show_the_commands_this_test_reads():
    assert len(COMMANDS) > 40
    assert any(argv[:1] == ["recipe=my_pkg.my_recipe"] for _, argv in COMMANDS)
    assert {where.split(":")[0] for where, _ in COMMANDS} >= {"README.md", "docs/keys.md", "docs/own-code.md"}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Path, Path]:
    """A fresh copy of examples/ to run from, with the script the docs' script= commands name, and
    a small image folder for their DIR."""
    from tests.imagefolders import write_image_folder

    root = tmp_path_factory.mktemp("readme")
    here = root / "examples"
    shutil.copytree(REPO / "examples", here)
    shutil.copy(REPO / "tests" / "distributed" / "data" / "torchrun_style_script.py", here / "train.py")
    images = root / "images"
    write_image_folder(images, train_per_class=2, val_per_class=1)
    return here, images


def _run(warm_launcher, command: list[str], here: Path) -> subprocess.CompletedProcess:
    """`launch *command` in `here` as a fork of the warm launcher (tests/warm.py)."""
    code, out, err = warm_launcher.run(command, here, clean_env(), timeout=180)
    return subprocess.CompletedProcess(["launch", *command], code, out, err)


@pytest.fixture(scope="module")
def ran(project, warm_launcher) -> dict[str, tuple[list[str], Future]]:
    """Every command that runs here, started two at a time as the module begins (each is a process that is
    mostly one core's work: composing, checking, importing its recipe), so that the tests below mostly find
    theirs done; a command shown twice runs once. `page:line` -> (the command as run, its CompletedProcess
    to come)."""
    here, images = project
    pool = ThreadPoolExecutor(max_workers=2)
    started, by_command = {}, {}
    for where, argv in COMMANDS:
        if left_out(argv) is None:
            command = as_run_here(argv, images)
            if tuple(command) not in by_command:
                by_command[tuple(command)] = pool.submit(_run, warm_launcher, command, here)
            started[where] = (command, by_command[tuple(command)])
    yield started
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_docs_command_runs_as_written(where, argv, ran):
    why = left_out(argv)
    if why:
        pytest.skip(f"{where} `launch {' '.join(argv)}`: {why}")
    command, proc = ran[where]
    proc = proc.result()
    shown = f"{where}: launch {' '.join(command)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, shown
    assert "Traceback" not in proc.stderr, shown
    assert not re.search(r"is not valid|unknown key", proc.stderr), shown
