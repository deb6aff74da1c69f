"""`launch`: a thin Hydra entry point around launcher.host.launch.launch().

    launch [key=value ...]          one run (Hydra overrides; `launch --help` lists them)
    launch -m key=a,b,c ...         a sweep (launcher/host/sweep_launcher.py)
    launch doctor                   an environment report
    launch eval RUN_DIR [k=v ...]   evaluate a saved model (launcher/host/evaluate.py)
    launch runs [--json]            the recent runs here and their state (launcher/host/runs.py)
    launch export RUN_DIR [best] [OUT]  the trained weights as one plain state_dict file (launcher/host/export.py)
    launch --version                launch's, torch's and Hydra's versions
    launch --cfg job                the composed config, nothing started

Hydra's own error output is a traceback or a block of text; here every error a user can fix becomes
one line on stderr and exit code 2. The exit code is the worst of the command's runs: 0, 1 (a run
failed), 2 (bad input), 128+N (stopped by signal N).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.errors import LaunchError, said

if TYPE_CHECKING:
    import threading


class Invocation:
    """One `launch` command: when it started, and the exit code of every run it made or heard of.

    Its `run_job` is Hydra's task function (one run, from a composed config). launch's own sweep
    launcher reports the runs it started elsewhere through `record`.
    """

    def __init__(self, started: float):
        import socket

        self.started = started
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.codes: list[int] = []

    def record(self, exit_code: int) -> None:
        self.codes.append(exit_code)

    def run_job(self, cfg: Any) -> float | None:
        """Hydra's task function: one run. Returns its `sweep.objective`; in a sweep a failed run raises
        RunFailed, so that Hydra (and its sweeper) see the failure."""
        from launcher.lifetime import hold_ctrl_c, let_ctrl_c_through, never_lose_ctrl_c

        launch_ended = None
        if os.getpid() != self.pid:
            # A run in another Hydra launcher's process (joblib's loky worker), where nothing held Ctrl-C:
            # a terminal's Ctrl-C reaches it too, and raised inside the imports below (torch's above all) it
            # printed "Exception ignored ... KeyboardInterrupt" tracebacks. Held until torch is imported.
            hold_ctrl_c()
            never_lose_ctrl_c()
            launch_ended = self._end_with_launch()
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from launcher.host.compose import settled, typed
        from launcher.host.launch import launch
        from launcher.host.outcome import LaunchContext, Outcome, RunFailed, SweepPlanned, SweepStopped
        from launcher.host.rundir import release

        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        # The time to the first step counts from the command's start for its first run here; a run in
        # another process (a sweep's) or a later one counts from its own start.
        started = self.started if (not self.codes and os.getpid() == self.pid) else time.time()
        context = LaunchContext(started=started, overrides=tuple(hydra_cfg.overrides.task))
        try:
            # Hydra has composed and claimed. Bad values the typed config finds are said first, with
            # Ctrl-C still held: they need no torch, whose import takes seconds on some machines.
            settings = typed(settled(cfg, context.overrides))
            settings.check()
            # launch's own code from here: Ctrl-C acts at once (after torch's import, which cannot take
            # it; every run path imports torch)
            let_ctrl_c_through("torch")
            outcome = launch(settings, run_dir, context)
        except LaunchError as err:
            let_ctrl_c_through()  # (a Ctrl-C pressed meanwhile wins over the error)
            outcome = Outcome(err.exit_code, error=str(err))
        except Exception as exc:  # noqa: BLE001 - a failure of launch itself: exit 1, said in one line
            let_ctrl_c_through()  # (as above)
            if os.environ.get("LAUNCH_DEBUG"):
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            outcome = Outcome(1, error=f"launch itself failed: {type(exc).__name__}: {first} (LAUNCH_DEBUG=1 "
                                       "shows the traceback)")
        release(run_dir)  # a dry run, or input refused before anything started: leave nothing behind
        self.record(outcome.exit_code)
        if outcome.error:
            print(said(outcome.error), file=sys.stderr, flush=True)
        if launch_ended is not None and launch_ended.is_set():
            self._exit_orphan(outcome.exit_code)
        if outcome.stopped and hydra_cfg.mode == RunMode.MULTIRUN and os.getpid() == self.pid:
            raise SweepStopped(outcome.exit_code)  # (a run in this process: the basic launcher's)
        sweeper = str(hydra_cfg.sweeper.get("_target_", ""))
        if cfg.dry_run and not outcome.exit_code and hydra_cfg.mode == RunMode.MULTIRUN and sweeper and \
                not sweeper.endswith(".BasicSweeper"):
            raise SweepPlanned(sweeper.rsplit(".", 1)[-1])
        if outcome.exit_code and hydra_cfg.mode == RunMode.MULTIRUN:
            raise RunFailed(outcome.exit_code, outcome.error or f"exit code {outcome.exit_code}")
        return outcome.objective(cfg.sweep.objective)

    def exit_code(self) -> int:
        return max(self.codes, default=0)

    def _end_with_launch(self) -> threading.Event | None:
        """A run in a process that another Hydra launcher started below launch (joblib's loky worker,
        submitit_local's job) gets SIGTERM when launch ends, however it ended: it then stops its workers as
        at a `kill` and exits. Before, a `kill` or kill -9 of launch left such runs training to their end.
        None in a process launch did not start (submitit's jobs on SLURM); else an event set once it ended."""
        import socket

        from launcher.lifetime import end_with

        return end_with(self.pid) if socket.gethostname() == self.host else None

    @staticmethod
    def _exit_orphan(code: int) -> None:
        """launch has ended while this run ran in its launcher's worker: nobody is left to take the result or
        another run, and the worker would otherwise wait minutes for one (loky's idle time-out). Exit now,
        after the exit handlers (the run's temporary folders)."""
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code or 1)


def _script_args_as_override(argv: list[str]) -> list[str]:
    """`launch script=train.py ... -- --lr 0.1`: what follows `--` becomes script_args, quoted so that
    Hydra and OmegaConf hand every word back unchanged (quotes, backslashes, `${...}` included). Hydra's
    own parser would take those words for overrides."""
    if "--" not in argv:
        return argv
    cut = argv.index("--")

    def quoted(word: str) -> str:
        word = word.replace("${", "\\${")  # not an interpolation
        word = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, word)  # backslashes Hydra would read as escapes
        return "'" + word.replace("'", "\\'") + "'"

    return [*argv[:cut], "script_args=[" + ",".join(quoted(w) for w in argv[cut + 1:]) + "]"]


def _refuse_stale_world(argv: list[str]) -> None:
    """torchrun's variables left in the shell: one line and exit 2, before Hydra makes a run dir (joining
    them waited for ranks nobody starts). --help and --cfg still answer."""
    from launcher.world import refused_world

    if INFORMATIONAL & set(argv):
        return
    why = refused_world()
    if why:
        print(said(why), file=sys.stderr)
        raise SystemExit(2)


# Hydra's own command-line options (hydra/_internal/utils.py get_args_parser) and launch's -V
HYDRA_OPTIONS = frozenset({"-h", "--help", "--hydra-help", "--version", "-V", "-c", "--cfg", "--resolve", "-p",
                           "--package", "-i", "--info", "-sc", "--shell-completion", "-cp", "--config-path", "-cn",
                           "--config-name", "-cd", "--config-dir", "--experimental-rerun", "-m", "--multirun", "-r",
                           "--run"})


# Keys a recipe's training reads and a user's own script (script=) never sees: typed beside script=, they would
# do nothing in silence (the script reads its own arguments)
RECIPE_ONLY = frozenset({"epochs", "lr", "batch_size", "accumulate", "optim", "recipe", "model", "eval", "early_stop"})


def _script_of(argv: list[str]) -> str | None:
    """The script a command line runs (script=train.py), or None."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    return next((w.partition("=")[2] for w in words if w.startswith("script=") and w != "script="), None)


def _refuse_recipe_keys_for_a_script(argv: list[str]) -> None:
    """`launch script=train.py epochs=2 lr=0.3`: the script never sees epochs or lr (it reads its own
    arguments), and the run went on as if they were applied. One line naming how to pass it, exit 2."""
    script = _script_of(argv)
    if script is None:
        return
    words = argv[:argv.index("--")] if "--" in argv else argv
    for word in words:
        key, eq, value = word.lstrip("+~").partition("=")
        if eq and key.split(".")[0] in RECIPE_ONLY:
            flag = key.rsplit(".", 1)[-1]
            print(said(f"{word} does nothing for script={script}: a script reads its own arguments; give it as "
                       f"+args.{flag}={value} (the script gets --{flag} {value}), or after --: launch "
                       f"script={script} -- --{flag} {value}"), file=sys.stderr)
            raise SystemExit(2)


def _refuse_dashed_settings(argv: list[str]) -> None:
    """`launch --epochs=3` or `launch --batch-size 64` (torchrun's, Lightning's and argparse's habit): one line
    naming the key=value to type, exit 2, instead of argparse's usage block. What follows `--` (script_args)
    is the script's own."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    for i, word in enumerate(words):
        if not word.startswith("-") or word == "-" or word.partition("=")[0] in HYDRA_OPTIONS:
            continue
        name, eq, value = word.lstrip("-").partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("-") and "=" not in words[i + 1]:
            value = words[i + 1]
        from launcher.config import Config
        from launcher.host.hydra_errors import TORCHRUN_NAMES

        key = name.replace("-", "_")
        key = TORCHRUN_NAMES.get(key, key)
        typed = f"{word} {value}" if not eq and value else word
        script = _script_of(argv)
        if script is not None and key not in ("nprocs", "nodes", "node_rank", "rdzv"):
            print(said(f"{typed} is not an option of launch: a script's own arguments go after --: launch "
                       f"script={script} -- {typed}"), file=sys.stderr)
            raise SystemExit(2)
        known = "." in key or key in {f.name for f in dataclasses.fields(Config)}
        example = f"{key}={value or '...'}" if known else "recipe=cifar10 epochs=5"
        print(said(f"{typed} is not an option: settings are key=value, without dashes (e.g. launch {example}); "
                   "the options are -m (a sweep), --cfg job, --help and --version"), file=sys.stderr)
        raise SystemExit(2)


# Arguments that only print: Hydra's help, the composed config
INFORMATIONAL = frozenset({"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve"})


def _will_spawn_workers(argv: list[str]) -> bool:
    """A cheap guess from the command line: skip the worker interpreter for help, --cfg, dry runs and
    inside torchrun/srun (no spawning there). A wrong guess costs only time, never correctness."""
    from launcher.world import existing_world

    # (-m: each run of a local sweep starts in a process of its own, which has its own)
    if (INFORMATIONAL | {"-m", "--multirun"}) & set(argv) or \
            any(a.replace(" ", "").lower() in ("dry_run=true", "backend=slurm") for a in argv):
        return False  # nothing to spawn here (backend=slurm: the job's tasks do)
    return existing_world() is None


def _refuse_impossible_sweeps(argv: list[str]) -> None:
    """Another Hydra launcher runs each sweep run itself: backend=slurm there would submit a SLURM job
    from every one of them (from inside a SLURM job, under submitit_slurm); a TORCHINDUCTOR_CACHE_DIR
    that torch cannot use would fail every run. Refused before anything starts."""
    if not {"-m", "--multirun"} & set(argv):
        return  # without -m no hydra/launcher runs anything
    from launcher.data.cache import prepare_inductor_dir

    prepare_inductor_dir()  # (every run would refuse it one by one)
    values: dict[str, str] = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        values[key.lstrip("+~").removeprefix("override ").strip()] = value
    chosen = values.get("hydra/launcher")
    if chosen and chosen != "launch" and "slurm" in values.get("backend", ""):
        raise LaunchError(f"backend=slurm is not valid with hydra/launcher={chosen}: that launcher runs each sweep "
                          "run itself; use backend=slurm with launch's own launcher (drop hydra/launcher), or "
                          f"hydra/launcher={chosen} with backend=local")


def version() -> str:
    from importlib import metadata

    import launcher

    def of(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"launch {launcher.__version__} (torch {of('torch')}, hydra-core {of('hydra-core')}, "
            f"Python {sys.version.split()[0]})")


def entry() -> None:
    """The `launch` command (the console script and `python -m launcher`): main(), then out at once.

    What a launch needs done at its exit is done first (the atexit handlers: the forkserver stopped,
    temporary folders removed, logs flushed), then the console is flushed and the process ends with
    os._exit and main's exit code. The interpreter's own teardown of the modules torch and Hydra loaded,
    which changes nothing on disk and took a noticeable time after the last line on a 2-core machine
    (measured: BENCHMARKS.md section 12), is skipped. Where a thread that Python would wait for still runs,
    the exit is Python's own."""
    import atexit
    import threading

    try:
        main()
        code = None
    except SystemExit as done:
        code = done.code
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        raise SystemExit(code)
    if code is None or isinstance(code, int):
        status = int(code or 0)
    else:  # (SystemExit("text"): said on stderr, exit 1, as Python does)
        print(code, file=sys.stderr)
        status = 1
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the launch has ended: a Ctrl-C now changes nothing, says nothing)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a console already closed: `launch ... | head`)
            stream.flush()
    os._exit(status)


def _command_help(command: str) -> str:
    """`launch runs|export|eval --help`: the usage line, what it does and where the docs are (it was "runs does
    not take '--help'", exit 2)."""
    if command == "runs":
        from launcher.host.runs import USAGE

        what = ("the recent runs under outputs/ and multirun/ here, newest first: recipe, devices, epochs, swept "
                "values, best figure, state (--json: all of it; --limit N: N rows, default 20; --all)")
        where = "docs/runs.md#the-recent-runs-launch-runs"
    elif command == "export":
        from launcher.host.export import USAGE

        what = ("a run's weights as a plain state_dict (.pt) or safetensors file, loadable without launch; "
                "best: the kept best checkpoint's")
        where = "docs/runs.md#exporting-the-weights"
    else:
        from launcher.host.evaluate import USAGE

        what = "a run's checkpoint scored on its held-out data (or data.root=... another folder): eval.json"
        where = "docs/runs.md#evaluating-a-saved-model"
    return f"usage: {USAGE}\n\n{what}\n\nmore: {where}"


def main(argv: list[str] | None = None) -> None:
    """`launch`. Ctrl-C is held back from here until launch's own code takes over from Hydra's (see
    launcher.lifetime._CtrlCHold), then acted on: one line, exit code 130, never a traceback or a run
    that goes on as if no key had been pressed."""
    from launcher.lifetime import hold_ctrl_c, let_ctrl_c_through, never_lose_ctrl_c
    from launcher.logs import drop_foreign_deprecations

    hold_ctrl_c()
    never_lose_ctrl_c()
    drop_foreign_deprecations()  # (before the checks, which may import a model's package)
    try:
        try:
            _main(argv)
        finally:
            let_ctrl_c_through()  # a Ctrl-C still held (e.g. while Hydra printed --cfg or --help): now
    except KeyboardInterrupt:
        print("launch: interrupted (Ctrl-C)", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        _forget_handled_interrupts()


def _forget_handled_interrupts() -> None:
    """CPython marks a KeyboardInterrupt that leaves code run from a string (`exec(text)`, as dataclasses
    writes every __init__) as unhandled, even when a caller catches it, and at exit ends the process by
    SIGINT whatever exit code was asked for. A Ctrl-C while Hydra's dataclasses were being defined ended
    launch that way (-2 to Python, 130 from the shell but by the signal) after its one line. Each exec of
    a string clears the mark when it starts; launch has handled every interrupt it saw by now."""
    exec("None")  # noqa: S102 - a constant: only its side effect on the mark is wanted


def _main(argv: list[str] | None) -> None:
    started = time.time()
    from launcher.lifetime import let_ctrl_c_through
    from launcher.logs import survive_closed_console

    survive_closed_console()  # `launch ... | head`: the run goes on, the console goes quiet
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"]:
        let_ctrl_c_through()
        from launcher.host.doctor import main as doctor_main

        raise SystemExit(doctor_main(argv[1:]))
    if argv[:1] in (["runs"], ["export"], ["eval"]) and {"-h", "--help"} & set(argv[1:]):
        print(_command_help(argv[0]))
        raise SystemExit(0)
    if argv[:1] == ["runs"]:
        let_ctrl_c_through()
        from launcher.host.runs import main as runs_main

        raise SystemExit(runs_main(argv[1:]))
    if argv[:1] == ["export"]:
        let_ctrl_c_through()
        from launcher.host.export import main as export_main

        raise SystemExit(export_main(argv[1:]))
    if argv in (["--version"], ["-V"]):
        print(version())
        raise SystemExit(0)

    if argv[:1] == ["eval"]:  # launch eval RUN_DIR ...: the checkpoint's recipe values, then the user's
        from launcher.host.evaluate import command_line

        try:
            argv = command_line(argv)
        except LaunchError as err:
            print(said(err), file=sys.stderr)
            raise SystemExit(2) from None

    _refuse_dashed_settings(argv)
    _refuse_recipe_keys_for_a_script(argv)
    _refuse_stale_world(argv)

    from launcher.bytecode import enable as keep_bytecode
    from launcher.host.compose import allow_imports_from_cwd, one_compose_per_run, register

    note = keep_bytecode()  # before any heavy import here or in the processes started below
    if note:
        print(note, file=sys.stderr, flush=True)
    allow_imports_from_cwd()  # before the worker interpreter starts: it inherits the path
    if _will_spawn_workers(argv):
        from launcher.host.spawn import prestart_worker_interpreter
        from launcher.lifetime import private_temp_dir

        private_temp_dir()  # (before the forkserver's socket folder is made)
        prestart_worker_interpreter()  # imports torch in the background while Hydra composes
    from launcher.host.resume import is_resume

    if any(is_resume(a) for a in argv):  # resume=RUN: the run's recipe and optimizer
        from launcher.host.resume import with_saved_choices

        try:
            argv = with_saved_choices(argv)  # (the launcher's first import of torch: Ctrl-C is held)
        except LaunchError as err:
            print(said(err), file=sys.stderr)
            raise SystemExit(2) from None

    import hydra

    from launcher.host.hydra_errors import describe_hydra_error
    from launcher.host.outcome import RunFailed, SweepPlanned, SweepStopped
    from launcher.host.rundir import Refused

    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra's errors reach us; they are reworded below
    invocation = Invocation(started)
    entry = hydra.main(config_path="pkg://launcher.conf", config_name="config", version_base="1.3")(
        invocation.run_job)
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "launch", *_script_args_as_override(argv)]
    try:
        _refuse_impossible_sweeps(argv)
        register(argv)
        with one_compose_per_run(argv):
            entry()
    except Refused as refused:
        print(said(refused.error), file=sys.stderr)
        raise SystemExit(refused.error.exit_code) from None
    except KeyboardInterrupt:
        print("launch: interrupted (Ctrl-C); every run it started was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except SweepStopped as stopped:
        print(f"launch: {stopped}; the runs after it were not started", file=sys.stderr)
        raise SystemExit(stopped.exit_code) from None
    except SweepPlanned as planned:
        print(f"launch: {planned}")
        raise SystemExit(0) from None
    except Exception as exc:  # noqa: BLE001 - anything Hydra or OmegaConf raises
        if os.environ.get("LAUNCH_DEBUG"):
            raise
        failed = next((e for e in _chain(exc) if isinstance(e, RunFailed)), None)
        if failed is not None and not invocation.codes:
            # A sweep run under another hydra/launcher failed in a process of its own (it printed why
            # there); Hydra's sweeper re-raised its RunFailed here.
            print(f"launch: a sweep run failed: {str(failed).splitlines()[0]}", file=sys.stderr)
            raise SystemExit(failed.exit_code) from None
        if not any(invocation.codes):  # nothing ran, or all went well: the error is the whole story
            print(said(describe_hydra_error(exc)), file=sys.stderr)
            raise SystemExit(2) from None
        # else: runs failed and said why when they ended; the exit code below is the worst of them
    finally:
        sys.argv = saved_argv
        from launcher.host.rundir import release_unused

        release_unused()
    code = invocation.exit_code()
    if code and len(invocation.codes) > 1:
        failed_runs = sum(1 for c in invocation.codes if c)
        print(f"launch: {failed_runs} of {len(invocation.codes)} sweep runs failed", file=sys.stderr)
    raise SystemExit(code)


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


if __name__ == "__main__":
    main()
