"""What a launch is given besides its config (LaunchContext), and what it gives back (Outcome)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.config import DEFAULT_OBJECTIVE
from launcher.spec import RequeuePolicy


@dataclass(frozen=True)
class LaunchContext:
    started: float  # time.time() when the command started: the time to the first step counts from it
    overrides: tuple[str, ...] = ()  # the command line's overrides, as typed (recorded with the run)
    requeue: RequeuePolicy | None = None  # inside a SLURM job that requeues itself on preemption


@dataclass
class Outcome:
    exit_code: int  # 0, 1 (a run failed), 2 (bad input), 128+N (stopped by signal N)
    results: dict[str, Any] | None = None  # rank 0's results.json, when this process has it
    error: str | None = None  # what to print, already formatted
    node_ranks: list[int] | None = None  # a node without rank 0 of a launch over several machines: its ranks
    stopped: bool = False  # the launch itself was stopped by a signal (Ctrl-C, SIGTERM): not a run's failure

    def objective(self, key: str) -> float | None:
        """The value a sweeper optimizes (sweep.objective), when the run has it."""
        return objective_of(self.results or {}, key)


def effective_objective(results: dict[str, Any], key: str) -> str:
    """The figure `sweep.objective=key` means for this run: key, except the default (test_acc) for a run
    without accuracy, which ranks by its own first held-out figure (results.json's `objective`)."""
    chosen = results.get("objective")
    if key == DEFAULT_OBJECTIVE and results.get(key) is None and isinstance(chosen, str) and chosen:
        return chosen
    return key


def objective_of(results: dict[str, Any], key: str) -> float | None:
    """`key` of a run's results.json (or of its final epoch's row) as a number, or None."""
    key = effective_objective(results, key)
    value = results.get(key, (results.get("final") or {}).get(key))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def signal_exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(exit_code: int) -> str | None:
    """The signal an exit code of 128+N names (SIGINT for 130), or None."""
    import signal

    number = exit_code - 128
    return signal.Signals(number).name if number > 0 and number in signal.valid_signals() else None


class SweepStopped(BaseException):  # noqa: N818 - not an Exception: Hydra records those and starts the next run
    """Ctrl-C or SIGTERM stopped a sweep's run that ran in the `launch` process itself (Hydra's basic
    launcher, which runs them one after another there): the whole sweep ends, as under launch's own
    sweep launcher. (A RunFailed let the basic launcher start the next run.)"""

    def __init__(self, exit_code: int):
        super().__init__(f"the sweep was stopped by {signal_name(exit_code) or exit_code}")
        self.exit_code = exit_code


class SweepPlanned(BaseException):  # noqa: N818 - not an Exception: it ends the sweep, as SweepStopped does
    """A dry run of a sweep whose sweeper picks each run from the results of the ones before (Optuna): the
    first run's plan is shown, and the sweep ends there with exit 0 (a dry run has no results to give it,
    and an invented one would enter the sweeper's study, which may be a database the user keeps)."""

    def __init__(self, sweeper: str):
        super().__init__(f"dry run of a sweep: the first run is planned above; {sweeper} picks each next run "
                         "from the results of the ones before, which a dry run does not produce, so it ends here")


class RunFailed(Exception):
    """A sweep run failed: what Hydra records as the job's result (and its sweeper re-raises). It
    travels back from the process that ran it (joblib's, submitit's), so it pickles whole."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):
        return (RunFailed, (self.exit_code, str(self)))
