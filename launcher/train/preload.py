"""Modules the forkserver imports before any worker exists, so that no worker pays for them
(the worker's entry point and trainer, torch's lazily imported parts, the built-in recipes, TensorBoard),
and those its starter names in LAUNCH_FORKSERVER_ALSO (a local sweep's runs: launcher/host/packing.py).

torch imports some of its heaviest parts lazily, on first use inside a worker: the first optimizer
call and DDP's constructor import torch._dynamo (and with it sympy and the inductor's modules),
which took seconds of each worker's start-up on the H200 hosts, less on 2 CPU cores (measured:
BENCHMARKS.md section 12). Imported here, in the forkserver that `launch` starts in parallel with
composing its config, the workers inherit them already loaded. Nothing here touches CUDA (the forkserver
must never initialize it).
"""

import gc
import importlib
import os
import signal

from launcher.lifetime import die_with_parent

# First, before the seconds of imports below: the forkserver notices that the launcher is gone only
# between requests, so a launcher killed while this imports torch left it (and multiprocessing's
# resource tracker, whose pipe it holds) running for those seconds, writing to the launcher's console.
# Its parent is the launcher's main thread, which lives as long as the launcher does; the launcher
# wrote its pid down (host/spawn.py), so one killed before this line is noticed too.
_LAUNCHER = os.environ.get("LAUNCH_FORKSERVER_PARENT", "")
die_with_parent(signal.SIGKILL, int(_LAUNCHER) if _LAUNCHER.isdigit() else None)
# Ctrl-C reaches this process with the launcher (one process group): during these imports it printed a
# KeyboardInterrupt traceback from deep in torch, and from this interpreter's start-up before this line,
# which the launcher covers by starting it with SIGINT blocked (host/spawn.py). The launcher answers
# Ctrl-C and ends this process; the disposition is put back at the end, since the forkserver hands it
# on to the workers it forks.
_SIGINT = signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (the launcher starts this process with it blocked)

from launcher import bytecode  # noqa: E402

bytecode.write_in_this_process()  # before the imports below; see launcher/bytecode.py

import torch._dynamo  # noqa: E402, F401
import torch.nn.parallel.distributed  # noqa: E402, F401
import torch.optim  # noqa: E402, F401

import launcher.train.loop  # noqa: E402, F401
import launcher.train.worker  # noqa: E402, F401
from launcher.recipes import BUILTIN  # noqa: E402

for _module in BUILTIN.values():  # the built-in recipes and their models
    importlib.import_module(_module)

try:  # rank 0's curves.png at the run's end (train/reporting.py): matplotlib's import and its font list, here
    import matplotlib.backends.backend_agg  # noqa: E402, F401
    import matplotlib.figure  # noqa: E402, F401
except ImportError:
    pass

try:  # rank 0's TensorBoard writer (train/reporting.py): its import (its files read from disk on a fresh
    # machine) paid here, beside the launcher's own start, rather than beside a run's warm-up
    import torch.utils.tensorboard  # noqa: E402, F401
except ImportError:  # (a dependency, but an environment may lack it: the run then says so once)
    pass

# What the process that started this one also needs in the processes it will fork from here: a local
# sweep's runs are forks of this process (launcher/host/packing.py), which need the launch command's
# own modules (Hydra, the CLI). Imported while Ctrl-C is still ignored here.
for _module in filter(None, os.environ.get("LAUNCH_FORKSERVER_ALSO", "").split(",")):
    importlib.import_module(_module)

signal.signal(signal.SIGINT, _SIGINT)

# What was imported above is frozen (gc.freeze): no collection in a worker walks these few hundred thousand
# objects again (a full one was a noticeable part of each rank's start and end on 2 CPU cores; measured:
# BENCHMARKS.md section 12), and a collection does not write into the pages the workers share with this
# process. launcher/heap.py's release leaves it frozen.
gc.freeze()
