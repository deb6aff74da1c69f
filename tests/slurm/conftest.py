"""A real two-node SLURM cluster for this test session (slurm/testcluster), or a skip saying why not."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "slurm" / "testcluster"


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of a started cluster; its daemons are stopped by their pid files afterwards."""
    if os.geteuid() != 0:
        pytest.skip("the test cluster's daemons start as root (CI runs as root)")
    missing = [d for d in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sbatch", "sacct", "ip", "nsenter",
                           "unshare")
               if not (shutil.which(d) or Path("/usr/sbin", d).exists())]
    if missing:
        pytest.skip(f"SLURM packages not installed ({', '.join(missing)} missing; .ci/run installs them)")
    # Not under pytest's tmp dir: that is private to root (0700) and MariaDB runs as user mysql.
    state = Path(tempfile.mkdtemp(prefix="launch-slurm-", dir="/tmp"))
    state.chmod(0o755)
    try:
        # two nodes, each slurmd in network and UTS namespaces of its own (lnode1, lnode2)
        subprocess.run(["bash", str(SCRIPTS / "start.sh"), str(state), "2"], check=True, timeout=120,
                       capture_output=True, text=True)
    except subprocess.CalledProcessError as err:
        subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(state)], timeout=60)
        pytest.fail(f"the test cluster did not start: {err.stderr or err.stdout}")
    try:
        yield str(state / "slurm.conf")
    finally:
        subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(state)], timeout=60)
        shutil.rmtree(state, ignore_errors=True)
