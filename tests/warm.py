"""A warm `launch` for the tests: the same command, started as a fork of a process that has already imported
torch, Hydra and the launcher, instead of a fresh interpreter that imports them again.

Most of a small test run's time on a CPU machine is imports: a fresh `python -m launcher` composes with Hydra
(its import included) and starts a forkserver that imports torch, torch._dynamo (which DDP's constructor
needs), TensorBoard and the recipes, before a worker exists. Paid once per test process here, each launch is a
fork of that process running `launcher.host.cli.main()` with the test's arguments, directory and environment,
and its workers are forks of that launch (LAUNCH_START_METHOD=fork, the start method torchrun also offers);
from there on it is the launch a user starts: Hydra composes, the plan is checked, torch.distributed.elastic
supervises the workers, the run dir, the console and the exit code are the same.

What a fork cannot show stays with fresh interpreters (`launch_command`, the `cold_launch` fixture): the
forkserver itself, start-up timings, signals sent to a launch, processes that must not outlive it, and any
test that passes its own environment (a variable read when a module is imported would be the warm process's).

    warm = WarmLauncher(); warm.run(argv, cwd, env, timeout) -> (returncode, stdout, stderr)
    warm.start(argv, cwd, env) -> a WarmLaunch, used as a subprocess.Popen (pid, poll, wait, communicate, kill)

The server (`python -m tests.warm`, one per pytest process, started on first use) reads one request per
connection on a Unix socket: {"argv", "cwd", "env", "out", "err"}; it forks, answers the child's pid, and when
the child has exited, its wait status. It runs no torch operation itself (a fork must not inherit a thread
pool) and ends with the pytest process that started it.
"""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# What a launch imports before its first worker: the forkserver's list (launcher/train/preload.py, without
# its process-lifetime side effects) and the host's own (Hydra, the CLI, the plan), and curves.png's plotting.
WARM_IMPORTS = (
    "torch", "torch._dynamo", "torch.nn.parallel.distributed", "torch.optim", "torch.distributed.elastic.agent.server",
    "torch.distributed.elastic.multiprocessing", "torch.distributed.checkpoint", "torch.utils.tensorboard",
    "hydra", "omegaconf", "launcher.host.cli", "launcher.host.compose", "launcher.host.run_here",
    "launcher.host.spawn", "launcher.host.plan", "launcher.train.loop", "launcher.train.worker",
    "matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg",
)


def _import_everything() -> None:
    import importlib

    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in WARM_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    from launcher.recipes import BUILTIN

    for module in BUILTIN.values():
        importlib.import_module(module)


def _child(request: dict) -> None:
    """In the forked child: become the launch the request describes, then exit with its code."""
    try:
        os.setsid()  # its own process group, as a shell's job: a timeout ends the whole tree
        from launcher.lifetime import die_with_parent

        die_with_parent(signal.SIGKILL)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                                (2, request["err"], os.O_WRONLY)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # (as in a fresh interpreter)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["LAUNCH_START_METHOD"] = "fork"
        sys.path[0] = ""  # python -m: the working directory first, where a user's recipe module lies
        import launcher.__main__ as entry

        sys.argv = [entry.__file__, *request["argv"]]
        code = 0
        try:
            from launcher.host.cli import main

            main()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException:  # noqa: BLE001 - as Python would: the traceback, exit 1
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        code = 1
    os._exit(code)


def serve(path: str) -> None:
    """The server's loop: one request per connection; fork; answer the pid, then the wait status. It ends when
    the process that started it has (polled, not a parent-death signal: that fires when the *thread* that
    started the server ends, and a test may make its first launch from a thread of a pool it then closes)."""
    parent = os.getppid()
    _import_everything()
    gc.freeze()  # as the forkserver does after its imports (launcher/train/preload.py)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _child(request)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                try:
                    # (and the CPU seconds of the launch and all it reaped: tests/cpu_report.py)
                    conn.sendall(json.dumps({"status": code, "cpu": usage.ru_utime + usage.ru_stime}).encode()
                                 + b"\n")
                except OSError:  # the client gave up on it (a timeout) and closed its end
                    pass
                finally:
                    conn.close()


CPU_SPENT = 0.0  # the CPU seconds of every launch this process's warm launchers ran (tests/cpu_report.py)


class WarmLaunch:
    """A launch the warm server started, used as a subprocess.Popen is: `pid` (the launch process, the leader
    of its own process group), `poll()`, `wait(timeout)`, `communicate(timeout)` -> (stdout, stderr),
    `returncode`, `kill()` (its whole process group)."""

    def __init__(self, conn: socket.socket, argv: list[str], scratch: str) -> None:
        self.args = ["launch", *argv]
        self.returncode: int | None = None
        self._conn, self._reader, self._scratch = conn, conn.makefile(), scratch
        self.pid = json.loads(self._reader.readline())["pid"]
        self._ended = threading.Event()
        threading.Thread(target=self._await_status, daemon=True).start()

    def _await_status(self) -> None:
        try:
            line = self._reader.readline()
        except OSError:
            line = ""
        global CPU_SPENT
        answer = json.loads(line) if line else {}
        CPU_SPENT += answer.get("cpu", 0.0)
        if os.environ.get("LAUNCH_WARM_LOG"):  # one line a launch: what it ran, its CPU seconds (finding costs)
            with open(os.environ["LAUNCH_WARM_LOG"], "a") as log:
                log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "argv": self.args[1:],
                                      "cpu": answer.get("cpu", 0.0)}) + "\n")
        # (a server that ended first, with the pytest process, leaves the launch killed with it)
        self.returncode = answer.get("status", -signal.SIGKILL)
        self._reader.close()
        self._conn.close()
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout, *self._output())
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        output = self._output()
        shutil.rmtree(self._scratch, ignore_errors=True)
        return output

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _output(self) -> tuple[str, str]:
        return tuple(Path(self._scratch, name).read_text(errors="replace") if Path(self._scratch, name).exists()
                     else "" for name in ("out", "err"))


class WarmLauncher:
    """The client: starts the server on first use, and runs launches through it. `prefix`: a command the
    server runs under (`ip netns exec NAME`: a warm launcher of another "machine", tests/multinode)."""

    def __init__(self, prefix: tuple[str, ...] = ()) -> None:
        self._prefix = list(prefix)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # (two threads may start launches at once: one server)
        self._dir = tempfile.mkdtemp(prefix="launch-warm-")
        self._path = os.path.join(self._dir, "socket")

    def _server(self) -> str:
        with self._lock:
            return self._start()

    def _start(self) -> str:
        if self._proc is None or self._proc.poll() is not None:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
            repo = str(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
            if os.path.exists(self._path):
                os.unlink(self._path)
            self._proc = subprocess.Popen([*self._prefix, sys.executable, "-m", "tests.warm", self._path], env=env,
                                          stdout=subprocess.PIPE, text=True)
            line = self._proc.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"the warm launcher did not start: {line!r}")
        return self._path

    def start(self, argv: list[str], cwd: Path, env: dict[str, str]) -> WarmLaunch:
        """`launch *argv` started in `cwd` with exactly `env`, not waited for."""
        path = self._server()
        scratch = tempfile.mkdtemp(prefix="launch-warm-run-")
        out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        for f in (out, err):
            Path(f).touch()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        conn.sendall(json.dumps({"argv": list(argv), "cwd": str(cwd), "env": dict(env), "out": out,
                                 "err": err}).encode() + b"\n")
        return WarmLaunch(conn, list(argv), scratch)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        """(returncode, stdout, stderr) of `launch *argv` run in `cwd` with exactly `env`; a launch still running
        after `timeout` seconds is killed with its process group and subprocess.TimeoutExpired raised, as
        subprocess.run would."""
        launch = self.start(argv, cwd, env)
        try:
            out, err = launch.communicate(timeout)
        except subprocess.TimeoutExpired:
            launch.kill()
            launch.wait(10)
            out, err = launch.communicate()
            raise subprocess.TimeoutExpired(launch.args, timeout, out, err) from None
        return launch.returncode, out, err

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if os.path.exists(self._path):
            os.unlink(self._path)
        os.rmdir(self._dir) if os.path.isdir(self._dir) else None


if __name__ == "__main__":
    serve(sys.argv[1])
