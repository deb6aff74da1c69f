"""The `launch` Hydra launcher, where Hydra's plugin scan looks for it (the `hydra_plugins` package).

Its code is launcher/host/sweep_launcher.py; this module only gives it a name under `hydra_plugins`.
It must stay light: Hydra imports every plugin module when it starts.
"""

from launcher.host import sweep_launcher


class LaunchSweepLauncher(sweep_launcher.SweepLauncher):
    """`hydra/launcher=launch`: runs side by side on free GPUs, or SLURM job arrays."""
