"""`launch -m` on this host: the sweep's runs side by side, each on GPUs of its own.

Hydra's basic launcher runs a sweep's runs one after another, and submitit's local executor hands
every run the same first GPUs. Here each run starts as its own process (launcher/host/sweep_job.py, which
runs it through Hydra's run_job like any launcher) once the GPUs it needs are free, with `gpus` set
to those GPUs: on a 2-GPU host two 1-GPU runs train at once.

Each run's process is a fork of one run server that the sweep starts with its first run: multiprocessing's
forkserver, which has imported torch, Hydra, the launch command and the training modules once and run no
torch operation. A run then starts at once, instead of importing all of that again and starting a
forkserver of its own for its workers; its workers are forks of the run, which has everything imported.
With LAUNCH_START_METHOD=spawn each run is a fresh `python -m launcher.host.sweep_job` instead; with
LAUNCH_START_METHOD=fork a fork of the sweep's own launch process (no run server).

What a run needs comes from the one reading of `gpus` (launcher/host/gpus.py): named GPUs wait for exactly
those; a count or `all`/`auto` take any free ones; CPU runs go one at a time unless `sweep.parallel` allows
more. Every run's needs are checked against this host before the first starts, so a run that cannot fit
fails the sweep at once (exit 2) instead of waiting forever.

Each run's output goes to `launch.out` in its run dir; one line per run start and end is printed here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import open_dict, read_write

from launcher import strategies
from launcher.config import DEFAULT_OBJECTIVE
from launcher.errors import LaunchError
from launcher.files import SWEEP_OUTPUT, read_json
from launcher.host.gpus import GpuRequest, physical_gpu_count, visible_devices
from launcher.host.outcome import effective_objective, objective_of, signal_exit_code, signal_name
from launcher.host.sweep import SweepJob
from launcher.lifetime import die_with_parent
from launcher.world import available_cores


@dataclass(frozen=True)
class Need:
    count: int  # GPUs (0: a CPU run)
    ids: tuple[int, ...] | None = None  # exactly these (the user named them), else any `count` free ones


def need_of(job: SweepJob, visible: list[str]) -> Need:
    """What `job` needs of this host, read as its plan will read it; a ConfigError if it cannot fit."""
    request = GpuRequest.parse(job.cfg.gpus)
    try:
        ids = request.select(visible, one_device=strategies.one_device(job.cfg.strategy))
    except LaunchError as err:
        raise LaunchError(f"{err} [sweep run {job.num}: {' '.join(job.overrides)}]") from None
    return Need(len(ids), tuple(ids) if request.explicit else None)


class GpuPool:
    """Which visible GPUs (by the index users type) are held by running runs, and how many CPU runs run."""

    def __init__(self, visible: int, cpu_slots: int = 1):
        self.free = list(range(visible))
        self.cpu_slots = cpu_slots
        self.cpu_running = 0

    def take(self, need: Need) -> list[int] | None:
        """GPU ids for the run ([] for a CPU run), or None if it must wait."""
        if need.count == 0:
            if self.cpu_running >= self.cpu_slots:
                return None
            self.cpu_running += 1
            return []
        if need.ids is not None:
            if not all(i in self.free for i in need.ids):
                return None
            self.free = [i for i in self.free if i not in need.ids]
            return list(need.ids)
        if len(self.free) < need.count:
            return None
        taken, self.free = self.free[:need.count], self.free[need.count:]
        return taken

    def give_back(self, ids: list[int]) -> None:
        if not ids:
            self.cpu_running -= 1
            return
        self.free = sorted(set(self.free) | set(ids))


def _die_with_parent() -> None:
    """Child preexec: SIGTERM when the sweep's launcher dies, even by SIGKILL; the run's launcher then
    stops its workers as on any SIGTERM."""
    die_with_parent(signal.SIGTERM)


class _ForkedRun:
    """A run forked by the sweep's run server, used as a subprocess.Popen is here: poll, send_signal, wait,
    kill. Its exit status comes from the server (its parent); a run killed by a signal reads -N, as Popen's."""

    def __init__(self, process) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"sweep run {self.process.pid}", timeout)
        return self.process.exitcode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forked_runs() -> bool:
    """Whether runs are forks of the run server (the default) or fresh interpreters (LAUNCH_START_METHOD=spawn)."""
    from launcher.host.spawn import start_method

    return start_method() != "spawn"


@dataclass
class _Running:
    job: SweepJob
    process: subprocess.Popen | _ForkedRun
    result: Path
    started: float


class SideBySide:
    """Runs a batch of sweep runs on this host, as many at once as the GPUs (and sweep.parallel) allow."""

    def __init__(self, hydra_context, task_function, parallel: int):
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.limit = parallel if parallel > 0 else None
        self.cpu_slots = max(1, parallel)
        self.scratch = Path(tempfile.mkdtemp(prefix="launch-sweep-"))  # each run's payload and result
        self.running: list[_Running] = []

    def run(self, jobs: list[SweepJob]) -> None:
        visible = visible_devices(os.environ, physical_gpu_count())
        needs = [need_of(job, visible) for job in jobs]  # every run fits, or nothing starts
        pool = GpuPool(len(visible), self.cpu_slots)
        try:
            for job, need in zip(jobs, needs, strict=True):
                while True:
                    if self.limit is None or len(self.running) < self.limit:
                        taken = pool.take(need)
                        if taken is not None:
                            break
                    self._wait_for_one(pool)
                self._start(job, taken)
            while self.running:
                self._wait_for_one(pool)
        except BaseException:
            self.stop()
            raise
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _start(self, job: SweepJob, gpus: list[int]) -> None:
        import cloudpickle

        job.gpus = gpus
        job.started = True
        config = job.config
        with read_write(config), open_dict(config):
            config.gpus = list(gpus)  # this run's share of the host, as its plan will read it
        payload = self.scratch / f"job{job.num}.pkl"
        result = self.scratch / f"job{job.num}.json"
        payload.write_bytes(cloudpickle.dumps((self.hydra_context, self.task_function, config)))
        job.run_dir.mkdir(parents=True, exist_ok=True)
        if _forked_runs():
            process = self._fork(job, payload, result, self._child_env(gpus))
        else:
            with open(job.run_dir / SWEEP_OUTPUT, "w") as out:  # the child keeps its own copy of the file
                process = subprocess.Popen([sys.executable, "-m", "launcher.host.sweep_job", str(payload),
                                            str(result)], stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                           env=self._child_env(gpus))
        self.running.append(_Running(job, process, result, time.monotonic()))
        where = f"GPU{'s' if len(gpus) > 1 else ''} {gpus}" if gpus else "CPU"
        print(f"sweep: job {job.num} started on {where}: {' '.join(job.overrides) or '(defaults)'}", flush=True)

    @staticmethod
    def _fork(job: SweepJob, payload: Path, result: Path, env: dict[str, str]) -> _ForkedRun:
        """The run as a fork of the run server, started here with the first run (launcher/host/spawn.py's
        forkserver, with sweep_job's imports beside the workers'); it ends with this process. Under
        LAUNCH_START_METHOD=fork, the start method a launch's workers then use too, a fork of this process."""
        import multiprocessing

        from launcher.host import sweep_job
        from launcher.host.spawn import start_forkserver, start_method

        method = start_method()
        if method == "forkserver":
            start_forkserver(also=sweep_job.PRELOAD)
        process = multiprocessing.get_context(method).Process(
            target=sweep_job.forked, name=f"sweep job {job.num}",
            args=(str(payload), str(result), str(job.run_dir / SWEEP_OUTPUT), env, f"launch-job-{job.num}"))
        process.start()
        return _ForkedRun(process)

    def _child_env(self, gpus: list[int]) -> dict[str, str]:
        """CPU runs side by side split the cores between them (each would otherwise size its threads
        to the whole machine and they would crawl); the user's OMP_NUM_THREADS wins."""
        env = dict(os.environ)
        if not gpus and self.cpu_slots > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, available_cores(env) // self.cpu_slots))
        return env

    def _wait_for_one(self, pool: GpuPool) -> None:
        """Until a running run ends (something runs whenever a run waits: with all free it would fit)."""
        while True:
            for entry in list(self.running):
                code = entry.process.poll()
                if code is not None:
                    self.running.remove(entry)
                    pool.give_back(entry.job.gpus)
                    self._finished(entry, code)
                    return
            time.sleep(0.2)

    def _finished(self, entry: _Running, returncode: int, said: bool = True) -> None:
        """Record how the run ended: as it reported itself (its result file), else as its process ended.
        `said`: print a line for it (not for the runs `stop` ends: launch says why it stopped them)."""
        job = entry.job
        seconds = time.monotonic() - entry.started
        reported = read_json(entry.result)
        if "exit_code" in reported:
            job.finished(reported["exit_code"], reported.get("error"), seconds)
        else:  # it died without a word (killed): say how, and what it printed last
            code = signal_exit_code(returncode) or 1
            how = f"killed by {signal_name(code)}" if signal_name(code) else f"exited with code {code}"
            job.finished(code, f"the run {how} before reporting ({_last_words(job)})", seconds)
        if not said:
            return
        if job.exit_code:
            print(f"sweep: job {job.num} FAILED (exit {job.exit_code}) in {seconds:.1f}s: {job.error} "
                  f"(output: {job.run_dir / SWEEP_OUTPUT})", file=sys.stderr, flush=True)
            return
        print(f"sweep: job {job.num} done in {seconds:.1f}s: {finished_line(job)}", flush=True)

    def stop(self) -> None:
        """SIGTERM the running runs (a Ctrl-C or a SIGTERM of launch) and wait for them; each is recorded as
        it reported itself, stopped by SIGTERM after so many seconds, as its outcome.json says. Before, the
        summary gave such a run exit 130 and 0.0 s."""
        for entry in self.running:
            if entry.process.poll() is None:
                entry.process.send_signal(signal.SIGTERM)
        for entry in list(self.running):
            try:
                code = entry.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                entry.process.kill()
                code = entry.process.wait()
            self.running.remove(entry)
            self._finished(entry, code, said=False)


def finished_line(job: SweepJob) -> str:
    """What a finished run's line says: its sweep.objective (the accuracy as a percentage; a recipe's own
    figure, test_rmse say, by its name) and its throughput."""
    key = effective_objective(job.results, job.cfg.sweep.objective)
    value = objective_of(job.results, job.cfg.sweep.objective)
    if value is None:
        said = f"no {key}"
    else:
        said = f"test acc {100 * value:.2f}%" if key == DEFAULT_OBJECTIVE else f"{key} {value:.4g}"
    final = job.results.get("final") or {}
    for unit in ("img", "images", "tokens", "samples"):  # (images: recipe=imagefolder's)
        if final.get(f"{unit}_per_s"):
            said += f", {final[f'{unit}_per_s']:,.0f} {unit}/s"
    return said


def _last_words(job: SweepJob) -> str:
    out = job.run_dir / SWEEP_OUTPUT
    lines = out.read_text(errors="replace").splitlines() if out.exists() else []
    said = [line[len("launch: "):] for line in lines if line.startswith("launch: ")]
    return said[-1] if said else (lines[-1] if lines else "no output")
