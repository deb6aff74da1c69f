"""No process outlives the launch: every process launch starts dies when the process that started it
dies, however that one ended (kill -9 included) and however launch was started.

Linux's PR_SET_PDEATHSIG sends a signal to a process when its parent ends. torch.multiprocessing sets
SIGINT, which a launcher started as a background job of a shell script cannot deliver: such jobs
inherit SIGINT ignored, and so do their workers. Workers here ask for SIGKILL instead (their parent is
gone; nothing is left to report to). A user's script (`script=`) is started by elastic as a
subprocess in a session of its own, where no terminal signal reaches it and nobody set a parent-death
signal: it is started through `python -m launcher.lifetime -- python script.py ...`, which sets the
signal and then becomes the script (execv keeps the parent-death signal).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(signum: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Receive `signum` when the parent process ends; end now if it already has.

    parent: the pid the parent had, where the caller knows it: a parent that died before this call
    (its orphan already adopted by init or a subreaper) is then noticed too."""
    import ctypes

    parent = os.getppid() if parent is None else parent
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(128 + int(signum))


def end_with(ancestor: int, signum: int = signal.SIGTERM) -> threading.Event | None:
    """Receive `signum` when process `ancestor` (this process's parent, or the parent's parent, ...) ends;
    now if it already has. The event returned is set when it has ended. A parent-death signal covers the
    parent only: a run that submitit_local starts is a child of submitit's controller, itself launch's
    child, and trained on to its end after a kill -9 of launch. None, and nothing armed, where `ancestor`
    is not an ancestor of this process (a job on a SLURM node, whose pids are another machine's)."""
    if ancestor in _watching:
        return _watching[ancestor]
    try:
        watched = os.pidfd_open(ancestor)  # (first: the pid cannot be another process's while this is open)
    except ProcessLookupError:
        watched = None
    except (OSError, AttributeError):  # (a kernel before 5.3: no pidfd)
        return None
    if watched is not None and ancestor not in _ancestors():
        os.close(watched)
        return None
    ended = _watching[ancestor] = threading.Event()

    def wait() -> None:
        import select

        if watched is not None:
            select.select([watched], [], [])  # readable once the process has ended
        ended.set()
        os.kill(os.getpid(), signum)

    if watched is None:  # gone already, and this process is its orphan now
        wait()
    else:
        threading.Thread(target=wait, name=f"end-with-{ancestor}", daemon=True).start()
    return ended


_watching: dict[int, threading.Event] = {}


def _ancestors() -> list[int]:
    found, pid = [], os.getpid()
    while pid > 1 and len(found) < 64:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        found.append(pid)
    return found


def tie_joblib_workers() -> None:
    """joblib's worker processes (Hydra's `hydra/launcher=joblib`), started from here from now on, get
    SIGTERM when this process ends. The one running a run stops it (as at a `kill`); an idle one, which
    nothing else tells, waited for work until loky's idle time-out (300 s) after a kill -9 of launch."""
    import functools

    from joblib import register_parallel_backend
    from joblib._parallel_backends import LokyBackend

    tie = functools.partial(die_with_parent, signal.SIGTERM, os.getpid())

    class TiedLokyBackend(LokyBackend):
        def configure(self, n_jobs=1, parallel=None, prefer=None, require=None, idle_worker_timeout=None,
                      **kwargs):
            kwargs.setdefault("initializer", tie)
            return super().configure(n_jobs, parallel, prefer, require, idle_worker_timeout, **kwargs)

    register_parallel_backend("loky", TiedLokyBackend)
    # joblib's resource tracker outlives a launch ended by a signal by a moment, removes the shared-memory
    # folders the launch left, and warned about them on the terminal after the prompt came back.
    quiet = "ignore::UserWarning:joblib.externals.loky.backend.resource_tracker"
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), quiet)))


def name_this_process(name: str) -> None:
    """The name `ps -o comm`, top and /proc/<pid>/comm show for this process (at most 15 bytes): a process
    forked from a worker otherwise shows the worker's (python), and could not be told from it. Spaces become
    dashes: tools that read /proc/<pid>/stat take the name for one word (SLURM's proctrack/linuxproc then
    misread the parent, and `scancel --signal=USR2` never reached ranks named "launch rank 0": no requeue)."""
    import ctypes

    name = "-".join(name.split())
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


class _CtrlCHold:
    """Ctrl-C noted instead of raised, while the launcher runs library code that cannot take a
    KeyboardInterrupt anywhere:
    - importing torch: its import calls Python from C++, and a KeyboardInterrupt raised inside such a
      call ends the process in std::terminate ("terminate called after throwing an instance of
      'pybind11::error_already_set'", SIGABRT) instead of launch's "interrupted (Ctrl-C)";
    - importing Hydra and OmegaConf and composing the config: raised inside their code, an interrupt
      came out as another error (a RuntimeError from a dataclass, an AttributeError from OmegaConf's
      half-built nodes) with a traceback, or was lost: Hydra asks for the run mode inside `except
      Exception: return None`, and the run went on as if no key had been pressed.
    Only where Python's own handler is in place, on the main thread (a SIGINT ignored stays ignored)."""

    def __init__(self) -> None:
        self.pressed = False
        self.active = False

    def hold(self, taking_over: object = None, pressed: list | None = None) -> bool:
        """Start holding; False where there is nothing to hold (held already, or not Python's handler).
        `taking_over`: a handler that held it until now (launcher/__main__.py's first lines), standing for
        Python's; `pressed`: what that handler noted (non-empty: Ctrl-C was pressed meanwhile)."""
        current = signal.getsignal(signal.SIGINT)
        if (self.active or threading.current_thread() is not threading.main_thread()
                or (current is not signal.default_int_handler and (taking_over is None or current is not taking_over))):
            return False
        signal.signal(signal.SIGINT, self._note)
        self.active = True
        self.pressed = self.pressed or bool(pressed)
        return True

    def _note(self, signum: int, frame: object) -> None:
        self.pressed = True

    def let_through(self) -> None:
        if self.active:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.active = False
        if self.pressed:
            self.pressed = False
            raise KeyboardInterrupt


_hold = _CtrlCHold()


def hold_ctrl_c(taking_over: object = None, pressed: list | None = None) -> None:
    """From now on a Ctrl-C is noted, not raised, until `let_ctrl_c_through()` (`launch` holds it from
    its first line until its own code takes over: see _CtrlCHold and launcher/__main__.py)."""
    _hold.hold(taking_over, pressed)


def let_ctrl_c_through(*imports_first: str) -> None:
    """Import `imports_first` (still held), then hand Ctrl-C back to Python: a KeyboardInterrupt here
    and now if one was pressed while held. Nothing to do where nothing was held."""
    import importlib

    try:
        for name in imports_first:
            if _hold.active:
                importlib.import_module(name)
    finally:
        _hold.let_through()


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C back for the block and raise it when the block ends (for importing torch: see
    _CtrlCHold). Inside a hold already in place it changes nothing: that hold raises it later."""
    if not _hold.hold():
        yield
        return
    try:
        yield
    except BaseException:  # the block's own error wins; a Ctrl-C pressed meanwhile goes with it
        _hold.pressed = False
        _hold.let_through()
        raise
    _hold.let_through()


def never_lose_ctrl_c() -> None:
    """A Ctrl-C that Python could not raise where it landed is raised again a moment later.

    Python runs the SIGINT handler at the main thread's next check, and that may be inside a weakref
    callback or a `__del__` (a thread's entry leaving threading's WeakSet, an object freed by the
    collector), where an exception cannot propagate: the KeyboardInterrupt was printed as "Exception
    ignored in: ... KeyboardInterrupt" with a traceback, and lost (a worker went on training until the
    launcher's grace ran out; seen in CI under a joblib sweep). Here such a KeyboardInterrupt is said
    nowhere and SIGINT is sent again; its handler runs in the code that is running by then."""
    previous = sys.unraisablehook
    if getattr(previous, "never_lose_ctrl_c", False):
        return

    def hook(unraisable) -> None:
        if unraisable.exc_type is KeyboardInterrupt:
            # (from another thread once this hook has returned: raised in here, it would be lost in the hook
            # too. Not after a fixed delay: under load, a timer's SIGINT came while the main thread was still
            # in this hook, waiting for the timer's thread to start, and the Ctrl-C was lost again.)
            threading.Thread(target=_interrupt_after, args=(threading.get_ident(), hook.__code__),
                             name="ctrl-c-again", daemon=True).start()
            return
        previous(unraisable)

    hook.never_lose_ctrl_c = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _interrupt_after(thread: int, code) -> None:
    """SIGINT to this process once `thread` runs no frame of `code` (never_lose_ctrl_c's hook)."""
    import time

    while True:
        time.sleep(0.005)
        frame = sys._current_frames().get(thread)
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        if frame is None:
            break
    os.kill(os.getpid(), signal.SIGINT)


TERM_GRACE_S = 5  # after SIGTERM, how long a launch's workers get before SIGKILL (elastic's shutdown_timeout)

_finishers: list = []  # work a SIGTERM lets finish first: callables taking a deadline (time.monotonic)


def finish_first_on_sigterm(finisher) -> None:
    """Register `finisher(deadline)`: on SIGTERM it is called (and returns by `deadline`) before this process
    ends. finish_on_sigterm must be in place for it to matter."""
    _finishers.append(finisher)


def forget_on_sigterm(finisher) -> None:
    with contextlib.suppress(ValueError):
        _finishers.remove(finisher)


def finish_on_sigterm(grace_s: float = TERM_GRACE_S - 0.5) -> None:
    """SIGTERM ends this process (exit 128+15) as at once as it did with the default action, but lets the
    registered work in flight finish first, for at most `grace_s` seconds: a checkpoint being written.

    A worker gets SIGTERM when elastic's agent stops the run: a peer rank failed (the restart then resumes
    from the newest checkpoint on disk), the launch was killed, or SLURM ended the job. A write in flight was
    lost with it, and a failure one step after a checkpoint restarted from the one before. The signal is
    acted on by a thread that reads Python's signal wakeup fd, not by a Python handler: that would run only
    when the main thread next runs Python, and a rank whose peer died waits inside a collective that never
    returns. Processes forked from this one (DataLoader workers) get the default action back."""
    if _term_watch or threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()  # (close-on-exec: a program this process starts gets neither end)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, _term_noted)
    if not _at_fork:
        os.register_at_fork(after_in_child=_default_sigterm_in_child)
        _at_fork.append(True)
    _term_watch.append(read)
    _term_grace[0] = grace_s
    threading.Thread(target=_end_on_sigterm, args=(read, grace_s), name="launch-sigterm", daemon=True).start()


_term_watch: list[int] = []  # the watching thread's end of the pipe, once in place
_at_fork: list[bool] = []


def _term_noted(signum: int, frame: object) -> None:
    """SIGTERM's Python handler, on the main thread when it next runs Python: the same end as the watching
    thread's, whichever comes first (the thread hears nothing where other code took the wakeup fd)."""
    _finish_and_end(_term_grace[0])


def _default_sigterm_in_child() -> None:
    if _term_watch:
        _term_watch.clear()
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _end_on_sigterm(fd: int, grace_s: float) -> None:
    while True:
        try:
            got = os.read(fd, 64)  # (one byte a signal Python handles: SIGINT's and SIGUSR2's pass by)
        except OSError:
            return
        if not got:
            return
        if signal.SIGTERM in got:
            _finish_and_end(grace_s)
            return


_ending = threading.Lock()
_term_grace = [TERM_GRACE_S - 0.5]


def _finish_and_end(grace_s: float) -> None:
    """Run the finishers (by a deadline `grace_s` from now), then exit 128+15. A second caller returns at
    once (the main thread goes on until the exit: waiting there, it could hold a lock a finisher needs)."""
    import time

    if not _ending.acquire(blocking=False):
        return
    deadline = time.monotonic() + grace_s
    for finisher in list(_finishers):
        with contextlib.suppress(BaseException):
            finisher(deadline)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signal.SIGTERM)


def answer_sigint() -> None:
    """SIGINT ends this process as Ctrl-C does (KeyboardInterrupt), even where it started with SIGINT ignored:
    a launch started as a background job of a shell script (or by a tool that ignores it) passed that on to
    its workers, and the SIGINT that elastic's agent forwards at a Ctrl-C or `kill -INT` of launch did nothing
    there: they trained on for the agent's 5 s grace and were killed, a checkpoint mid-write with them. Only
    the launcher's own forwarding reaches a background job's workers (the terminal's Ctrl-C does not)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def exec_tied_to_parent(argv: list[str]) -> None:
    """Become `argv` (a new program in this process), killed when this process's parent ends, with SIGINT's
    default action (answer_sigint: a script's rank answers the agent's SIGINT too)."""
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (an ignored SIGINT stays ignored through exec)
    os.execvp(argv[0], argv)


def private_temp_dir() -> str | None:
    """Give this process's temporary files (multiprocessing's pymp-* folders with the forkserver's socket,
    elastic's torchelastic_* logs) a folder of its own, /tmp/launch-<uid>/<pid>, removed when the process
    exits; one left by a launch that was killed outright (kill -9: no exit handler runs) is removed by the
    next launch, once its pid is gone. Before, each such kill left its folders in /tmp for good. Only this
    process's `tempfile` default changes: workers and a user's code keep theirs (TMPDIR is not touched)."""
    import shutil
    import tempfile
    from multiprocessing import util

    base = os.path.join(tempfile.gettempdir(), f"launch-{os.getuid()}")
    namespace = _pid_namespace()
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        found = os.lstat(base)
        # Only a real folder of ours, closed to others: never one that a link (made by anyone, in a shared
        # /tmp) points elsewhere, whose pid-named entries would then be removed.
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
            return None
        for name in os.listdir(base):
            # (a pid means a process only in its own pid namespace: a folder made in another, a container
            # sharing this /tmp, is left alone)
            old = os.path.join(base, name)
            if name.isdigit() and not process_alive(int(name)) and _read(os.path.join(old, NAMESPACE)) == namespace:
                shutil.rmtree(old, ignore_errors=True)
        mine = os.path.join(base, str(os.getpid()))
        os.makedirs(mine, mode=0o700, exist_ok=True)
        with open(os.path.join(mine, NAMESPACE), "w") as f:
            f.write(namespace)
    except OSError:  # (a read-only or full /tmp: the default it is)
        return None
    tempfile.tempdir = mine
    # at exit, after multiprocessing has removed its own folders in it (they are finalized at priority -100)
    util.Finalize(None, shutil.rmtree, args=(mine,), kwargs={"ignore_errors": True}, exitpriority=-101)
    return mine


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


NAMESPACE = ".pid-namespace"  # in each of private_temp_dir's folders: the pid namespace its pid belongs to


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


if __name__ == "__main__":  # python -m launcher.lifetime -- PROGRAM ARGS...
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.exit("usage: python -m launcher.lifetime -- PROGRAM [ARGS...]")
    exec_tied_to_parent(args)
