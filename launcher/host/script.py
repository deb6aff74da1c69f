"""`launch script=train.py gpus=[0,1] -- --their --args`: a user's own torchrun-style script, supervised.

The script is what torchrun would run: it reads RANK, LOCAL_RANK, WORLD_SIZE (and MASTER_ADDR/PORT)
from its environment and calls init_process_group itself. The launcher picks the devices and the
process count exactly as for a recipe (one process per GPU, or `nprocs` CPU ranks), sets
CUDA_VISIBLE_DEVICES and the thread count, and starts the processes through torch.distributed.elastic
(the same agent as torchrun) with its own run dir: every rank's stdout/stderr is shown prefixed with
its rank and kept under `logs/` in the run dir. One rank failing stops the others; launch exits with
that rank's exit code and says which rank it was.

Arguments reach the script two ways: everything after `--` verbatim, and `args.KEY=VALUE` overrides as
`--KEY VALUE` (`true` -> `--KEY`, `false` -> left out), which is how `launch -m` sweeps over them:

    launch -m script=train.py gpus=1 +args.lr=0.1,0.2,0.4
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path
from typing import Any

from launcher.config import Config
from launcher.errors import ConfigError, LaunchError
from launcher.host.outcome import Outcome
from launcher.host.rendezvous import NodeLost
from launcher.host.spawn import (
    _quiet_elastic,
    launch_config,
    our_start_method,
    patched_environ,
    restored_signal_handlers,
)


def script_path(cfg: Config) -> Path:
    path = Path(cfg.script).expanduser()
    if not path.is_file():
        raise ConfigError("script", cfg.script, f"no such file (looked for {path.resolve()})", "script=train.py")
    return path.resolve()


def script_argv(cfg: Config) -> list[str]:
    """The script's command line: `args.*` as flags, then the arguments given after `--`."""
    argv: list[str] = []
    for key, value in (cfg.args or {}).items():
        if value is False or value is None:
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.append(",".join(map(str, value)) if isinstance(value, list) else str(value))
    return argv + [str(a) for a in cfg.script_args]


def run_script(path: Path, argv: list[str], run_dir: Path, nprocs: int, worker_env: dict[str, str],
               max_restarts: int, nodes=None) -> Outcome:
    """`nprocs` ranks of the script under torch.distributed.elastic, each rank's output kept in run_dir/logs."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _quiet_elastic()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**worker_env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONUNBUFFERED": "1"}
    with patched_environ(env), restored_signal_handlers(), our_start_method():
        config = launch_config(nprocs, max_restarts, str(logs), tee_output=True, nodes=nodes)
        try:
            # (through launcher.lifetime: elastic starts each rank in a session of its own, which
            # nothing would end if the launcher were killed outright)
            elastic_launch(config, sys.executable)("-m", "launcher.lifetime", "--", sys.executable, "-u", str(path),
                                                   *argv)
        except ChildFailedError as err:
            return _describe(err, path, logs)
        except LaunchError as err:  # the nodes could not meet (rendezvous.py): nothing started
            return Outcome(err.exit_code, error=str(err))
        except NodeLost as lost:  # (several machines) the rendezvous vanished mid-run: ranks here stopped
            return Outcome(1, error=f"{lost}; this node's ranks of {path.name} were stopped; their output is in {logs}")
        except SignalException as sig:
            name = signal.Signals(int(sig.sigval)).name  # (as a recipe's stop says it: stopped by SIGINT)
            return Outcome(128 + int(sig.sigval), error=f"stopped by {name}: all ranks of {path.name} ended; their "
                                                       f"output is in {logs}", stopped=True)
    return Outcome(0)


def run_in_this_process(path: Path, argv: list[str], worker_env: dict[str, str], rank: int) -> Outcome:
    """Inside torchrun/srun this process is one rank already: run the script here, as `python path argv`."""
    import os
    import runpy

    os.environ.update(worker_env)
    saved = sys.argv
    sys.argv = [str(path), *argv]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if code:
            return Outcome(code, error=f"rank {rank}: {path.name} exited with code {code}")
    finally:
        sys.argv = saved
    return Outcome(0)


def _describe(err: Any, path: Path, logs: Path) -> Outcome:
    rank, failure, message = _root_failure(err, logs)
    code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    last = str(message).strip().splitlines()[-1] if message else None
    if failure.exitcode == -signal.SIGABRT and last and not last.startswith("Signal "):
        # it raised, then aborted at exit: a gloo/NCCL group still alive when the interpreter ends aborts
        # it ("terminate called without an active exception"), and the signal hid what it raised
        return Outcome(1, error=f"rank {rank} of {path.name} raised {last} (then aborted at exit: signal 6). "
                                f"Output: {logs}")
    if failure.exitcode < 0:
        how = f"was killed by signal {-failure.exitcode}"
    else:
        how = f"exited with code {failure.exitcode}"
    if last:
        return Outcome(code, error=f"rank {rank} of {path.name} {how}: {last}. Output: {logs}")
    return Outcome(code, error=f"rank {rank} of {path.name} {how}; the other ranks were stopped. Output of every "
                               f"rank: {logs}")


def _message(failure: Any, logs: Path) -> str | None:
    message = failure.message if isinstance(failure.message, str) else (failure.message or {}).get("message")
    if not message or "To enable traceback" in str(message) or failure.exitcode == -signal.SIGABRT:
        # (elastic's message for a rank that aborted is "Signal 6 (SIGABRT) received by PID N": what it
        # raised before aborting, when it did, is in its stderr log)
        local = getattr(failure, "local_rank", None)
        aborted = failure.exitcode == -signal.SIGABRT  # (what it raised last, not an error it handled long before)
        message = (_raised(logs, local, tail=ABORT_TAIL if aborted else None) if local is not None else None) \
            or message
    return message


def _root_failure(err: Any, logs: Path) -> tuple[int, Any, str | None]:
    """The failed rank to name: one whose failure is its own (an exit code, or a signal other than the ones
    that stop a group), before one killed by SIGKILL, before the echoes: a rank killed by SIGTERM (elastic
    stops the others so, and under load a rank still exiting is caught by it) or whose error is a peer's
    (gloo's "Connection closed by peer"). Within each, elastic's first (by its records' times, whole
    seconds where a script wrote no error file: ties went to rank 0), then the earlier. With its message
    (_message: each rank's stderr log read once)."""
    from launcher.failures import reads_secondary

    first = err.get_first_failure()
    failures = getattr(err, "failures", None) or {first[0]: first[1]}

    messages = {rank: _message(failure, logs) for rank, failure in failures.items()}

    def echo(rank: int, failure: Any) -> int:
        code, message = failure.exitcode or 0, messages[rank]
        if code == -signal.SIGTERM:
            return 2
        if code == -signal.SIGKILL:
            return 1
        return 2 if message and reads_secondary(str(message).strip().splitlines()[-1]) else 0

    rank, failure = min(failures.items(), key=lambda item: (echo(*item), item[0] != first[0],
                                                            getattr(item[1], "timestamp", 0), item[0]))
    return rank, failure, messages[rank]


_TRACEBACK_END = re.compile(r"^(?:\[rank\d+\]:\s?)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\b.*)$")


ABORT_TAIL = 12  # lines after a traceback's last that an abort at exit may add ("terminate called ...", a stack)


def _raised(logs: Path, local_rank: int, tail: int | None = None) -> str | None:
    """What a script's rank raised, from the last line of the traceback in its newest stderr.log (elastic's
    tee: logs/RUN_ID/attempt_N/LOCAL_RANK/stderr.log): a script without torch's @record leaves no error file,
    and the line said only "exited with code 1" while the console showed the other ranks' tracebacks after
    the one that caused them. `tail`: only a traceback among the log's last lines counts (a rank that aborted:
    what it raised at its end, not an error it printed and went on from)."""
    found = sorted(logs.glob(f"*/attempt_*/{local_rank}/stderr.log"), key=lambda f: f.stat().st_mtime)
    if not found:
        return None
    with found[-1].open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - 65536))
        lines = f.read().decode(errors="replace").splitlines()
    if not any("Traceback (most recent call last)" in line for line in lines):
        return None
    if tail is not None:  # (only a traceback that ends the log, less what an abort adds after it)
        lines = [line for line in lines if line.strip()][-tail:]
    for line in reversed(lines):
        match = _TRACEBACK_END.match(line.strip())
        if match:
            return match.group(1)
    return None
