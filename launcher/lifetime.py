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
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Receive `signum` when the parent process ends; end now if it already has.

    parent: the pid the parent had, where the caller knows it: a parent that died before this call
    (its orphan already adopted by init or a subreaper) is then noticed too."""
    parent = os.getppid() if parent is None else parent
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(128 + int(signum))


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C back until the block ends, then raise KeyboardInterrupt there. For importing torch in
    the launcher: its import calls Python from C++, and a KeyboardInterrupt raised inside such a call
    ends the process in std::terminate ("terminate called after throwing an instance of
    'pybind11::error_already_set'", SIGABRT) instead of launch's "interrupted (Ctrl-C)". Only where
    Python's own handler is in place, on the main thread (a SIGINT ignored stays ignored)."""
    import threading

    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def exec_tied_to_parent(argv: list[str]) -> None:
    """Become `argv` (a new program in this process), killed when this process's parent ends."""
    die_with_parent(signal.SIGKILL)
    os.execvp(argv[0], argv)


if __name__ == "__main__":  # python -m launcher.lifetime -- PROGRAM ARGS...
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.exit("usage: python -m launcher.lifetime -- PROGRAM [ARGS...]")
    exec_tied_to_parent(args)
