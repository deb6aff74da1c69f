"""One run of a local sweep, in a process of its own (started by launcher/host/packing.py).

    python -m launcher.host.sweep_job PAYLOAD RESULT

PAYLOAD holds what Hydra's own launchers hand to `hydra.core.utils.run_job` (the Hydra context, the
task function, the run's composed config with its GPUs set); it runs exactly that, so the run's dir,
its `.hydra/` files and any Hydra callbacks are as under any other launcher. RESULT receives the
run's exit code and one-line error as JSON; the process exits with the run's exit code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
