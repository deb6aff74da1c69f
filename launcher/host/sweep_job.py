"""One run of a local sweep, in a process of its own (started by launcher/host/packing.py): a fork of the
sweep's run server (`forked`), or with LAUNCH_START_METHOD=spawn a fresh interpreter:

    python -m launcher.host.sweep_job PAYLOAD RESULT

PAYLOAD holds what Hydra's own launchers hand to `hydra.core.utils.run_job` (the Hydra context, the
task function, the run's composed config with its GPUs set); it runs exactly that, so the run's dir,
its `.hydra/` files and any Hydra callbacks are as under any other launcher. RESULT receives the
run's exit code and one-line error as JSON; the process exits with the run's exit code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# What the run server imports for its runs, beside the workers' own imports (launcher/train/preload.py):
# everything `main` and a run's launch import before their first worker.
PRELOAD = ("cloudpickle", "hydra.core.utils", "launcher.host.cli", "launcher.host.compose", "launcher.host.sweep",
           "launcher.host.run_here", "launcher.host.spawn", "launcher.host.plan", "launcher.host.outcome",
           "torch.distributed.elastic.agent.server", "torch.distributed.elastic.multiprocessing")


def forked(payload: str, result: str, output: str, env: dict[str, str], name: str) -> None:
    """The run, in a fork of the sweep's run server (a multiprocessing forkserver that has imported torch,
    Hydra and the training modules, and run no torch operation): its console to `output`, its environment
    `env`, its workers forks of this process (they need nothing imported again). Exits as `python -m
    launcher.host.sweep_job` would: its atexit handlers run, then the run's exit code."""
    import atexit
    import signal

    from launcher.lifetime import die_with_parent, name_this_process

    die_with_parent(signal.SIGTERM)  # the server ends with the sweep's launcher; the run's launch then
    # stops its workers as on any SIGTERM
    name_this_process(name)  # ps and top show which run this is (its command line is the server's) and its
    # workers, forks of it
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    opened = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in (1, 2):
        os.dup2(opened, fd)
    os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    os.environ["LAUNCH_START_METHOD"] = "fork"  # (launcher/host/spawn.py: a fork of a preloaded process)
    try:
        code = main([payload, result])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    except KeyboardInterrupt:  # (a Ctrl-C before the run's own hold: as the run would say it)
        print("launch: interrupted (Ctrl-C)", file=sys.stderr)
        code = 130
    finally:
        atexit._run_exitfuncs()
    raise SystemExit(code)


def main(argv: list[str]) -> int:
    payload, result = (Path(a) for a in argv)
    from launcher.bytecode import enable as keep_bytecode

    keep_bytecode()  # the launcher already said so, if it applies
    from launcher.host.spawn import prestart_worker_interpreter
    from launcher.lifetime import private_temp_dir

    private_temp_dir()
    prestart_worker_interpreter()  # imports torch for the workers while this process unpickles the run
    import cloudpickle
    from hydra.core.utils import JobStatus

    from launcher.files import write_text_atomic
    from launcher.host.compose import allow_imports_from_cwd, register
    from launcher.host.outcome import RunFailed
    from launcher.host.sweep import run_sweep_job

    allow_imports_from_cwd()
    register([])  # the resolvers the config's interpolations use
    hydra_context, task_function, config = cloudpickle.loads(payload.read_bytes())
    ret = run_sweep_job(hydra_context, task_function, config)
    if ret.status == JobStatus.COMPLETED:
        code, error = 0, None
    else:
        failure = ret._return_value
        code = failure.exit_code if isinstance(failure, RunFailed) else 1
        error = str(failure) if isinstance(failure, RunFailed) else f"{type(failure).__name__}: {failure}"
        if not isinstance(failure, RunFailed):
            print(f"launch: {error}", file=sys.stderr, flush=True)
    write_text_atomic(result, json.dumps({"exit_code": code, "error": error}))
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
