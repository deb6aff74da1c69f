"""Shared helpers: run `launch` as a user would (a subprocess in a scratch directory) and inspect what it left."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A suite started as a background job of a non-interactive shell (`nohup bash .ci/run &`) inherits SIGINT
# ignored, and so does every process it starts: the tests of what a Ctrl-C does then saw nothing happen (four
# failed so). Python's own handler here; the processes the tests start get the default at their exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Decoded datasets and compiled kernels go to a cache of this test session, not the user's ~/.cache
# (launcher/data/cache.py; launches started by the tests inherit it); this user's seal key
# (launcher/integrity.py) likewise to a config folder of this session, not ~/.config/launcher.
for _variable, _prefix in (("LAUNCH_CACHE_DIR", "launch-test-cache-"), ("LAUNCH_CONFIG_DIR", "launch-test-config-")):
    if _variable not in os.environ:
        import atexit
        import shutil
        import tempfile

        os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_variable], ignore_errors=True)


# Under xdist (the README's command), one thread per process (torch's default is one per core): the workers
# run many processes side by side on few cores (each launch with its ranks), and there a single-process CPU
# run with torch's default took 13 times as long as on an idle machine, its OpenMP threads waiting on each
# other for cores that other processes held (as the launcher's own advice on a slow CPU epoch says:
# launcher/train/stall.py). Set before torch is imported; every launch a test starts inherits it. A value the
# user set stays; a run without -n (the GPU tests on the device) keeps torch's default.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# `python -m pytest -q -n 3` (pytest-xdist; the README's test command) on CI's 2 cores: the tests run in
# units, each unit on one worker, one test at a time, a worker taking the next unit when it is nearly done:
# - "waiting": the SLURM and two-node tests, which mostly wait on the scheduler, requeues, rendezvous and
#   collective timeouts (one unit: they share one test cluster and its network namespaces);
# - the unit tests, the CLI tests (one process each), and each file of tests/distributed (each test starts
#   two gloo ranks: both cores), a unit each, handed out heaviest first (HEAVY_FIRST) so that the suite
#   does not end on one long unit while the other workers are idle.
# With tests/distributed in two fixed units, the unit and CLI tests' worker stood idle for the suite's last
# part while one worker went on alone; more workers were slower on 2 cores (BENCHMARKS.md §4). A scheduler
# of xdist's by-scope kind whose scopes are these units (xdist's own `loadgroup` renames the node ids, which
# pytest 9.2 no longer reads).
HEAVY_FIRST = ("waiting", "tests/unit", "tests/distributed/test_fsdp.py", "tests/cli",
               "tests/distributed/test_hydra_plugins.py", "tests/distributed/test_lifetime_and_binding.py",
               "tests/distributed/test_nothing_silent.py", "tests/distributed/test_imagefolder_launch.py",
               "tests/distributed/test_trackers.py", "tests/distributed/test_runs.py",
               "tests/distributed/test_own_data.py", "tests/distributed/test_resume.py",
               "tests/distributed/test_supervision.py")  # (by wall time, as `-p tests.cpu_report` measured them)


def xdist_group_of(nodeid: str) -> str:
    """The xdist unit a test runs in (see above)."""
    path = nodeid.split("::")[0]
    if path.startswith(("tests/slurm/", "tests/multinode/")):
        return "waiting"
    if path.startswith("tests/distributed/"):
        return path
    return "/".join(path.split("/")[:2])


def _heaviness(unit: str) -> int:
    return HEAVY_FIRST.index(unit) if unit in HEAVY_FIRST else len(HEAVY_FIRST)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # (without pytest-xdist: one process, nothing to schedule)
    LoadScopeScheduling = None
else:
    class SideBySide(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # the units handed out heaviest first, whatever order the tests were collected in
            for scope in sorted(self.workqueue, key=_heaviness):
                self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    def pytest_xdist_make_scheduler(config, log):
        return SideBySide(config, log)


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    cwd: Path
    finished_at: float  # time.time() when the launch process had exited

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def run_dirs(self) -> list[Path]:
        return sorted(p.parent for p in self.cwd.glob("outputs/**/.hydra"))

    def run_dir(self) -> Path:
        """This launch's run dir: the one its output names, else the only one under its directory."""
        named = re.findall(r"^launch: run dir: (.+)$", self.stdout, re.MULTILINE)
        if len(named) == 1 and Path(named[0]).is_dir():
            return Path(named[0])
        dirs = self.run_dirs()
        assert len(dirs) == 1, f"expected one run dir, found {dirs}\n{self.output}"
        return dirs[0]

    def results(self) -> dict:
        return json.loads((self.run_dir() / "results.json").read_text())


def launch_command(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *overrides]


def composed(*overrides: str):
    """The launch config Hydra composes for `overrides` (a DictConfig), as `launch` would, nothing started."""
    from launcher.host.compose import compose

    return compose(list(overrides))


def config_of(*overrides: str):
    """The typed, frozen config a launch runs with, checked (a ConfigError otherwise)."""
    from launcher.host.compose import config_for

    return config_for(*overrides)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "HYDRA_FULL_ERROR", "LAUNCH_DEBUG"):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def warm_launcher():
    """One warm launcher per pytest process (tests/warm.py), started on its first launch."""
    from tests.warm import WarmLauncher

    warm = WarmLauncher()
    yield warm
    warm.close()


def _cold(cwd: Path, overrides: tuple[str, ...], timeout: float, env: dict[str, str] | None) -> Launch:
    start = time.monotonic()
    proc = subprocess.run(launch_command(*overrides), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env or clean_env())
    return Launch(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start, cwd, time.time())


def warm_or_cold(warm_launcher, cwd: Path, overrides: tuple[str, ...], timeout: float = 240,
                 env: dict[str, str] | None = None) -> Launch:
    """`launch *overrides` in `cwd`: a fork of the warm launcher (tests/warm.py: the same command without a
    fresh interpreter's imports), except where `env` is given, or LAUNCH_TESTS_COLD=1 asks for fresh
    interpreters throughout."""
    if env is not None or os.environ.get("LAUNCH_TESTS_COLD") == "1":
        return _cold(cwd, overrides, timeout, env)
    start = time.monotonic()
    code, out, err = warm_launcher.run(list(overrides), cwd, clean_env(), timeout)
    return Launch(code, out, err, time.monotonic() - start, cwd, time.time())


@pytest.fixture
def launch(tmp_path, warm_launcher):
    """launch(*overrides, timeout=..., env=..., cwd=...) -> Launch, run in a fresh directory like a user's
    project (or in `cwd`), as `warm_or_cold` starts it; `cold_launch` always starts `python -m launcher`."""

    def run(*overrides: str, timeout: float = 240, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> Launch:
        return warm_or_cold(warm_launcher, tmp_path if cwd is None else cwd, overrides, timeout, env)

    return run


@pytest.fixture
def plan_on_h100s(monkeypatch):
    """plan(*overrides, count=N) -> the Plan of recipe=text with `overrides` on N simulated 80 GiB H100s (NVML's
    reading and torch's CUDA build faked): what the memory check before any worker judges."""
    from launcher.host import gpus
    from launcher.host.plan import make_plan

    monkeypatch.setattr(gpus, "gpu_loads", lambda visible: [gpus.GpuLoad(i, "H100", 79.0, 80.0, 0)
                                                          for i in range(len(visible))])
    monkeypatch.setattr("launcher.host.plan.torch_has_cuda", lambda: True)

    def plan(*overrides: str, count: int):
        return make_plan(config_of("recipe=text", *overrides), env={}, physical_count=count, loads=[])

    return plan


@pytest.fixture
def cold_launch(tmp_path):
    """launch(*overrides, timeout=..., env=...) -> Launch as a fresh `python -m launcher` process: for what a
    fork of a warm process cannot show (the forkserver, start-up, a first import)."""

    def run(*overrides: str, timeout: float = 240, env: dict[str, str] | None = None) -> Launch:
        return _cold(tmp_path, overrides, timeout, env)

    return run


def descendants(pid: int) -> set[int]:
    """All live processes below `pid`, read from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's bookkeeping remains


def running(pids, marker: bytes) -> list[int]:
    """Those of `pids` whose command line holds `marker` (read from /proc)."""
    found = []
    for pid in pids:
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def named(pids, name: str) -> list[int]:
    """Those of `pids` whose process name (/proc/<pid>/comm: what ps and top show) is `name`."""
    found = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
        except OSError:
            continue
    return found


def start_as_terminal_job(command: list[str], cwd, **popen) -> subprocess.Popen:
    """`command` as a terminal's foreground job: a process group of its own (where a Ctrl-C,
    `os.killpg(proc.pid, SIGINT)`, reaches every process), SIGINT at its default even where the tests run
    with it ignored (a background job of a non-interactive shell inherits SIG_IGN)."""
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


def ctrl_c_after(command: list[str], cwd, after_s: float) -> tuple[int, str]:
    """Start `command` as a terminal job, press Ctrl-C after `after_s`: its exit code and stderr."""
    proc = start_as_terminal_job(command, cwd)
    try:
        time.sleep(after_s)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        stop_tree(proc.pid)
    return proc.returncode, err


def stop_tree(pid: int) -> None:
    for p in descendants(pid) | {pid}:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def cifar_root(tmp_path_factory) -> Path:
    """A small CIFAR-10 stand-in in the official python format (the real archive is not on these machines)."""
    from launcher.recipes.cifar10 import FOLDER, synthetic_splits, write_official_format

    root = tmp_path_factory.mktemp("cifar")
    write_official_format(root / FOLDER, synthetic_splits(500, 100, seed=3))
    return root


def _listening_inodes(pid: int | str = "self") -> dict[int, str]:
    """socket inode -> 'address:port' for every TCP socket in LISTEN state in the network namespace of
    process `pid` (this process's: this machine's)."""
    found = {}
    for table, family in ((f"/proc/{pid}/net/tcp", 4), (f"/proc/{pid}/net/tcp6", 6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != "0A":
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            if family == 4:
                addr = ipaddress.IPv4Address(raw[::-1])
            else:  # four little-endian 32-bit words
                addr = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found[inode] = f"{addr}:{int(hex_port, 16)}"
    return found


def listening_sockets(pids: set[int], namespace_of: int | str = "self") -> set[str]:
    """What `pids` listen on; namespace_of: a process in their network namespace, when not this one's."""
    inodes = _listening_inodes(namespace_of)
    found = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in inodes:
                    found.add(inodes[inode])
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
