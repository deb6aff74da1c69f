"""Where a worker's first training step spends its time: `launch recipe=digits gpus=[0] epochs=1`
run in-process (as a rank of an already started world, so no worker processes) under cProfile.

    python bench/probe/first_step_profile.py [overrides...]     # prints the top of the profile
"""
import cProfile
import os
import pstats
import sys
import tempfile

os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
os.chdir(tempfile.mkdtemp(prefix="first-step-"))
from launcher.host import cli  # noqa: E402

profile = cProfile.Profile()
try:
    profile.runcall(cli.main, ["recipe=digits", "gpus=[0]", "epochs=1", *sys.argv[1:]])
except SystemExit:
    pass
stats = pstats.Stats(profile).sort_stats("cumulative")
stats.print_stats(45)
stats.print_callees("_train_epoch")
stats.print_callees(r"step.py:\d+\(__call__\)")
