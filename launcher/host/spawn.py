"""Start one worker per device with torch.distributed.elastic (what torchrun uses) and supervise them.

- Rendezvous is elastic's c10d rendezvous on a store bound to 127.0.0.1 (rendezvous.py), at a port the
  OS picks: launches never collide, and nothing listens on an interface another machine can reach.
- One rank failing ends all of them within the agent's monitor interval; the launcher then prints the
  root cause (see failures.py) instead of elastic's table of every rank's exit.
- Workers are forks of a forkserver started when `launch` starts (see prestart_worker_interpreter),
  or fresh interpreters with LAUNCH_START_METHOD=spawn.
- SIGINT/SIGTERM to the launcher: the agent forwards the signal, waits briefly, then kills; the
  workers also die with their parent (PR_SET_PDEATHSIG; under the forkserver, that parent ends with
  the launcher, see worker.py), so nothing is orphaned.
- `max_restarts`: the agent restarts the whole group; workers see TORCHELASTIC_RESTART_COUNT>0 and
  resume from the run's last checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from launcher import failures
from launcher.errors import LaunchError
from launcher.files import FULL_BELOW_BYTES, LOG, free_bytes, remove_stale_temporaries
from launcher.host.network import NodeNetwork
from launcher.host.outcome import Outcome
from launcher.lifetime import TERM_GRACE_S
from launcher.logs import QUIET_PREFIXES

log = logging.getLogger("launcher.spawn")

SHUTDOWN_GRACE_S = TERM_GRACE_S  # after SIGTERM, how long workers get before SIGKILL


@contextlib.contextmanager
def patched_environ(changes: Mapping[str, str]) -> Iterator[None]:
    """Apply `changes` to os.environ for the duration (workers inherit it), then restore it exactly."""
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def restored_signal_handlers() -> Iterator[None]:
    # elastic installs handlers that raise SignalException; a later sweep job must not inherit them.
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    saved = {s: signal.getsignal(s) for s in signals}
    try:
        yield
    finally:
        for s, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(s, handler)


STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # what elastic's agent stops the workers on


class StopSignals:
    """SIGTERM, SIGHUP and SIGQUIT while a run is set up and its workers start, before elastic's agent takes
    them over: the run ends as a stopped run (elastic's SignalException, as the agent raises it later), its
    outcome.json says the signal, `launch runs` shows it stopped, exit 128+N. Before, Python's default
    action ended the process at once and the run read as failed (a joblib sweep's run, killed in that
    moment with launch, left no outcome.json).

    A signal is only noted while the run's files are written and while its outcome is (an exception
    raised inside a write of the log was swallowed by logging and wrote the line twice); it is raised
    from `raising()` on, at once for one noted before. One stop raises once: later signals are noted.
    A signal that was ignored (`nohup`'s SIGHUP) stays ignored. Used as a context manager, in the main
    thread; elsewhere it does nothing."""

    def __init__(self) -> None:
        self.noted: int | None = None
        self._raising = False
        self._raised = False
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        with contextlib.suppress(ValueError):  # (not the main thread: its signals are not ours to take)
            for s in STOPPING_SIGNALS:
                if signal.getsignal(s) is signal.SIG_DFL:
                    signal.signal(s, self._handle)
                    self._saved[s] = signal.SIG_DFL
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)

    def raising(self) -> None:
        """From here a stop signal raises SignalException; one noted before raises now."""
        if self.noted is not None and not self._raised:
            self._raise()
        self._raising = True

    def hold(self) -> None:
        """From here a stop signal is only noted (see `unacted`)."""
        self._raising = False

    @property
    def raised(self) -> bool:
        """Whether a stop was raised from here (not by elastic's agent: no worker had started)."""
        return self._raised

    @property
    def unacted(self) -> int | None:
        """A signal noted and never raised (it came while the outcome was written): the caller sends it
        again once the handlers are restored, so that it acts as it would have."""
        return self.noted if not self._raised else None

    def _handle(self, signum: int, frame) -> None:
        if self.noted is None:
            self.noted = signum
            if self._raising:
                self._raise()

    def _raise(self) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self._raising, self._raised = False, True
        name = signal.Signals(self.noted).name
        raise SignalException(f"stopped by {name}", sigval=signal.Signals(self.noted))


@contextlib.contextmanager
def our_start_method() -> Iterator[None]:
    """multiprocessing's process-wide start method set to ours while elastic starts the workers.

    Every child multiprocessing starts is told the parent's start method and sets it first thing. Under
    another Hydra launcher the task may run in a joblib (loky) worker whose start method is `loky`, which
    a fresh child does not know: every worker failed at start ("cannot find context for 'loky'").
    """
    import multiprocessing

    previous = multiprocessing.get_start_method(allow_none=True)
    if previous in (None, start_method()):
        yield
        return
    multiprocessing.set_start_method(start_method(), force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous, force=True)


def _quiet_elastic() -> None:
    """Elastic logs every rank's exit with its own handler; the launcher reports the root cause instead."""
    if os.environ.get("LAUNCH_DEBUG"):
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(QUIET_PREFIXES):
            logging.getLogger(name).setLevel(logging.CRITICAL)


PRELOAD_ALSO = "LAUNCH_FORKSERVER_ALSO"  # modules the forkserver imports after the workers' (comma-separated)


def start_method() -> str:
    """How workers start, from LAUNCH_START_METHOD: `forkserver` (default), `spawn` (each a fresh interpreter),
    or `fork` (each a fork of this launch process: only for a launch that is itself a fork of a process that
    has imported torch and the training modules and run no torch operation, as the tests' warm launcher is;
    torchrun offers the same start method)."""
    method = os.environ.get("LAUNCH_START_METHOD", "forkserver")
    return method if method in ("forkserver", "spawn", "fork") else "forkserver"


def prestart_worker_interpreter() -> None:
    """Start the process that workers will be forked from now, while the launcher composes its config.

    With `spawn`, every worker is a fresh interpreter that imports torch and the training modules
    before it can do anything (seconds on a GPU machine, each worker). The forkserver pays that once,
    in parallel with the launcher's own start-up, and each worker is then a fork of it. It holds no
    threads and never touches CUDA, so the forks are safe; it exits when the launcher does, and
    workers still die with it (torch's PR_SET_PDEATHSIG), so nothing is orphaned.
    """
    from launcher.data.cache import prepare_inductor_dir

    try:
        prepare_inductor_dir()  # (before any process imports torch)
    except LaunchError:  # nothing started: run_here asks again and says it, before any worker
        return
    if start_method() != "forkserver":
        return
    start_forkserver()


def start_forkserver(also: tuple[str, ...] = ()) -> None:
    """Start multiprocessing's forkserver with the workers' imports (launcher/train/preload.py) and the
    modules in `also` (a local sweep's runs are forks of it too: launcher/host/packing.py). Idempotent.
    It ends with this process; see prestart_worker_interpreter."""
    import atexit
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    multiprocessing.set_forkserver_preload(["launcher.train.preload"])
    os.environ["LAUNCH_FORKSERVER_PARENT"] = str(os.getpid())  # (the preload ends it if this pid is gone)
    # Ctrl-C reaches the forkserver with the launcher (one process group), and until its preload ignores
    # SIGINT it printed a KeyboardInterrupt traceback from its start-up. It starts with SIGINT blocked (a
    # child inherits the mask) and the preload unblocks it once ignored. Here a Ctrl-C meanwhile waits
    # for the unblocking below. (multiprocessing's resource tracker, which ensure_running starts first,
    # unblocks SIGINT after starting itself: it is started before the block.)
    # The tracker outlives a launch killed outright (kill -9) for a moment, frees the semaphores its workers
    # held, and warned of them on the console ("There appear to be 9 leaked semaphore objects to clean up"):
    # noise after a kill the user chose. It starts with that warning ignored (-W, taken from warnoptions).
    quiet = "ignore:resource_tracker:UserWarning"
    sys.warnoptions.append(quiet)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(quiet)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if also:
        os.environ[PRELOAD_ALSO] = ",".join(also)  # (read by the preload; the forkserver's own environment)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(PRELOAD_ALSO, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    atexit.unregister(_stop_forkserver)  # (once, however often this is called)
    atexit.register(_stop_forkserver)


def _forkserver_died() -> bool:
    """Whether the forkserver this process started has exited (reaped here: it is our child). Its
    socket closes as it dies, so give its exit a moment to land."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return False
    for _ in range(20):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:  # already reaped
            return True
        time.sleep(0.05)
    return False


def _stop_forkserver() -> None:
    """At exit, end the forkserver now: it shares the launcher's stdout, so anything reading that
    (a pipe, `| tee`, a test) would otherwise wait for it to finish importing torch and notice."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """A launch over several machines, as this node takes part in it (from the plan)."""

    count: int
    node_rank: int | None  # None: elastic assigns it at the rendezvous
    network: NodeNetwork
    timeout_s: int  # rdzv_timeout_s
    store_read_s: int  # one call on the rendezvous store, mid-run (rendezvous.py's _StoreGuard)

    @property
    def endpoint(self) -> str:
        host = self.network.rdzv_address
        return f"[{host}]:{self.network.rdzv_port}" if ":" in host else f"{host}:{self.network.rdzv_port}"


def launch_config(nprocs: int, max_restarts: int, log_dir: str, tee_output: bool = False, nodes: Nodes | None = None):
    """elastic's LaunchConfig for `nprocs` local workers (also used for user scripts, launcher/host/script.py).

    tee_output: every rank's stdout/stderr also goes to files under log_dir, prefixed [rankN]: on the
    console (a script's own output); otherwise the workers' output is inherited as is.
    nodes: this node's part in a launch over several machines (rendezvous.py's `launch-nodes`).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    from launcher.host import rendezvous

    rendezvous.register()
    if nodes is None:
        where: dict[str, Any] = dict(min_nodes=1, max_nodes=1, run_id=f"launch-{uuid.uuid4().hex[:12]}",
                                     rdzv_backend=rendezvous.BACKEND, rdzv_endpoint=f"{rendezvous.LOOPBACK}:0",
                                     local_addr=rendezvous.LOOPBACK)
    else:  # every node must name the same run: the rendezvous point is what they share
        where = dict(min_nodes=nodes.count, max_nodes=nodes.count, run_id=f"launch-{nodes.endpoint}",
                     rdzv_backend=rendezvous.NODES_BACKEND, rdzv_endpoint=nodes.endpoint,
                     local_addr=nodes.network.address,
                     rdzv_configs={"join_timeout": nodes.timeout_s, "read_timeout": nodes.store_read_s,
                                   "listen": nodes.network.hosts_rdzv,
                                   "node_rank": -1 if nodes.node_rank is None else nodes.node_rank,
                                   "last_call_timeout": 1, "close_timeout": 10})
    options: dict[str, Any] = dict(
        **where, nproc_per_node=nprocs,
        max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method(),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL if tee_output else Std.NONE),
        role="rank" if tee_output else "default",
    )
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    if "shutdown_timeout" in known:  # newer torch; older ones read TORCH_ELASTIC_SHUTDOWN_TIMEOUT or wait 30 s
        options["shutdown_timeout"] = SHUTDOWN_GRACE_S
    return LaunchConfig(**options)


def launch_local(spec, nprocs: int, max_restarts: int, nodes: Nodes | None = None,
                 stops: StopSignals | None = None) -> Outcome:
    """Run `worker_main(spec)` in `nprocs` supervised processes on this host (this node's, with `nodes`).
    stops: the run's StopSignals, raising from the moment its agent is made (elastic's own take over
    when it starts the workers)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    from launcher.host import rendezvous
    from launcher.train.worker import worker_main  # the entry point of the training wing

    _quiet_elastic()
    run_dir = Path(spec.run_dir)
    scratch = tempfile.mkdtemp(prefix="launch-elastic-")  # elastic's per-attempt error files
    env = dict(spec.env)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    # elastic asks torch.cuda.is_available() in this process; answer it from NVML so that the
    # launcher never starts CUDA (it costs seconds, and the workers need the devices, not us).
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        with patched_environ(env), restored_signal_handlers(), our_start_method():
            config = launch_config(nprocs, max_restarts, scratch, nodes=nodes)
            try:
                if stops is not None:
                    stops.raising()
                returns = elastic_launch(config, worker_main)(spec)
                if nodes is not None:  # (node 0: serve the rendezvous until the others closed it)
                    rendezvous.release(config.run_id, others=nodes.count - 1)
            except ChildFailedError as err:
                clear_console_line()
                outcome = describe_failure(run_dir, err, nprocs, max_restarts, nodes)
                if nodes is not None and outcome.exit_code == 2:  # (node 0: a refusal every rank raises alike, as
                    # train/nodes.py's meet does; serve the rendezvous until the others have closed it, or they
                    # end on "launch itself failed: RendezvousConnectionError" instead of the refusal's line)
                    rendezvous.release(config.run_id, others=nodes.count - 1)
                return outcome
            except LaunchError as err:  # the nodes could not meet (rendezvous.py): nothing started
                if nodes is not None:  # (node 0: every node refuses alike; serve it until they have closed)
                    rendezvous.release(config.run_id, others=nodes.count - 1)
                return Outcome(err.exit_code, error=str(err))
            except rendezvous.NodeLost as lost:  # (several machines) the workers here were stopped
                clear_console_line()
                return Outcome(1, error=f"{lost}; this node's ranks were stopped. Log: {run_dir / LOG}")
            except RendezvousTimeoutError:
                if nodes is None:  # (one machine: its own workers never joined; not a user's mistake)
                    raise
                return Outcome(2, error=f"the {nodes.count} nodes did not all join within rdzv_timeout_s="
                               f"{nodes.timeout_s}: start the same launch on every node (with the same nodes and "
                               "rdzv), and check each reaches the rendezvous")
            except EOFError:  # multiprocessing's forkserver ended before it could fork a worker
                if start_method() != "forkserver" or not _forkserver_died():
                    raise
                return Outcome(1, error="the process that starts the workers (multiprocessing's forkserver, which "
                               "imports torch for them) failed before any worker started: its traceback is above. "
                               "Fix what it names (often the Python environment: PYTHONPATH, a broken package); "
                               "LAUNCH_START_METHOD=spawn starts each worker without it")
            except SignalException as sig:
                rendezvous.stop_heartbeats()
                clear_console_line()
                name = signal.Signals(sig.sigval).name
                from launcher.host.resume import what_a_resume_finds

                go_on = what_a_resume_finds(Path(run_dir))
                ended = ("before the workers started" if stops is not None and stops.raised else
                         f"all {nprocs} worker{'s' if nprocs > 1 else ''} ended")
                return Outcome(128 + int(sig.sigval), error=f"stopped by {name}: {ended}; what was written is in "
                               f"{run_dir}{'; ' + go_on if go_on else ''}", stopped=True)
            finally:
                if stops is not None:  # (elastic's handlers give way to the run's again as this block ends)
                    stops.hold()
        if 0 not in returns:  # another node holds rank 0: the run's results and files are there
            return Outcome(0, results=None, node_ranks=sorted(returns))
        return Outcome(0, results=returns.get(0))
    finally:
        rendezvous.release(None, others=0)  # (a run that failed or was stopped: no waiting for the others)
        shutil.rmtree(scratch, ignore_errors=True)
        remove_stale_temporaries(run_dir)  # a worker stopped in the middle of a write


def clear_console_line() -> None:
    """Rank 0's live bar, if a stopped or failed rank left it drawn on the terminal."""
    with contextlib.suppress(OSError, ValueError):
        if sys.stdout.isatty():
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


def describe_failure(run_dir: Path, err, nprocs: int, max_restarts: int, nodes: Nodes | None = None) -> Outcome:
    """Turn elastic's ChildFailedError into the root cause: which rank, what it raised, where the log is.

    Several machines: the records of every node's ranks are read where they reach this node (rank 0's
    run dir, when the nodes share it: files.NODE says where); a rank of another node that left none here
    is named as such, with what the ranks here saw."""
    # elastic gives up only after its last restart, so the failure to explain is that attempt's.
    records = [r for r in failures.read_records(run_dir, also=failures.main_run_dir(run_dir))
               if r.attempt == max_restarts]
    cause = failures.root_cause(records)
    log_path = run_dir / LOG
    if nodes is not None:
        # This node's global ranks: its block of nprocs (every node runs as many; elastic numbers them
        # node by node). Not only the ones elastic lists as failed: a rank here that it stopped is not
        # another node's (it was named "ranks 1-3 on another node" beside rank 0).
        failed = set(err.failures)
        block = min(failed) // nprocs if failed else nodes.node_rank
        mine = failed | (set(range(block * nprocs, (block + 1) * nprocs)) if block is not None else set())
        world = nprocs * nodes.count
        if cause is None or cause.secondary:
            away = sorted(set(range(world)) - {r.rank for r in records} - mine)
            if away:
                seen = f"; rank {cause.rank} here saw: {failures.short_headline(cause.headline)}" if cause else ""
                ranks = f"rank{'s' if len(away) > 1 else ''} {failures.span(away)}"
                return Outcome(1, error=f"{ranks} on another node stopped first (killed, unreachable, or failed: "
                               f"that node's launch and log say why){seen}; "
                               f"this node's ranks were stopped. Log: {log_path}")
            if cause is not None:  # every rank recorded, each only saw its peers go quiet
                return Outcome(1, error=f"the nodes lost each other: every rank's peers stopped answering (the "
                               f"network between the nodes failed, or a node hung past strategy.timeout_s); "
                               f"rank {cause.rank} first saw: {failures.short_headline(cause.headline)}; every "
                               f"rank was stopped. Log: {log_path}")
    others = nprocs - 1
    stopped = f"; the other {others} rank{'s were' if others > 1 else ' was'} stopped" if others else ""
    restarts = f" after {max_restarts} restart{'s' if max_restarts > 1 else ''}" if max_restarts else ""
    if cause is not None and cause.exit_code == 2:  # a LaunchError: the message is the whole story
        return Outcome(2, error=cause.message)
    if cause is not None and cause.explained:  # a stop that says what to do (errors.ExplainedStop)
        return Outcome(1, error=f"{cause.message}. Log: {log_path}")
    # A rank that died without a traceback (killed, os._exit, segfault) leaves no record. When the
    # records only show peers complaining that someone vanished, the silent rank is the root cause.
    if cause is None or cause.secondary:
        silent = sorted(set(range(nprocs)) - {r.rank for r in records})
        if silent:
            return Outcome(1, error=_silent_death(silent, err, cause, restarts, stopped, log_path))
    if cause is None:
        return Outcome(1, error=f"a worker failed{restarts} without a report{stopped}{_if_disk_full(run_dir)}. "
                                f"Log: {log_path}")
    trace = textwrap.indent(cause.traceback.rstrip(), "  | ")
    text = (f"rank {cause.rank} failed{restarts}: {cause.headline}\n{trace}\n"
            f"root cause: rank {cause.rank}{stopped}. Log: {log_path}")
    return Outcome(1, error=text)


def _silent_death(silent: list[int], err, echo, restarts: str, stopped: str, log_path: Path) -> str:
    known = {rank: f for rank, f in err.failures.items() if rank in silent}
    if len(silent) == 1 or known:
        rank = silent[0] if len(silent) == 1 else min(known, key=lambda r: known[r].timestamp)
        failure = known.get(rank)
        if failure is not None and failure.exitcode is not None and failure.exitcode < 0:
            sig = failure.signal_name()
            hint = " (SIGKILL is often the out-of-memory killer)" if sig == "SIGKILL" else ""
            what = f"rank {rank} (pid {failure.pid}) was killed by {sig} without a Python traceback{hint}"
        elif failure is not None:
            what = f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode} without a Python traceback"
        elif echo is not None and any(w in echo.message.lower() for w in ("timed out", "timeout")):
            # It did not exit by itself (the supervisor stopped it) and its peer gave up waiting on it.
            return (f"rank {rank} stopped responding (hung, or stuck outside a collective its peers were in): "
                    f"rank {echo.rank} gave up waiting for it after strategy.timeout_s "
                    f"({failures.short_headline(echo.headline)}){restarts}; rank {rank} was stopped. Log: {log_path}")
        else:
            what = f"rank {rank} died without a Python traceback (killed by a signal, or os._exit)"
    else:
        what = f"one of ranks {silent} died without a Python traceback"
    seen = f"; rank {echo.rank} then saw: {failures.short_headline(echo.headline)}" if echo else ""
    return f"{what}{restarts}{seen}{stopped}{_if_disk_full(log_path.parent)}. Log: {log_path}"


def _if_disk_full(run_dir: Path) -> str:
    """A rank that could not even write its failure record: say so when the run dir's disk is full."""
    free = free_bytes(run_dir)
    if free is None or free >= FULL_BELOW_BYTES:
        return ""
    return f" (No space left on device: {free / 1e6:.1f} MB free where the run dir is, {run_dir})"
