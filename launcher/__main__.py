"""`launch` (the console script) and `python -m launcher ...`.

Ctrl-C is held from the first line (launcher/lifetime.py's _CtrlCHold), before the command's own imports: a
Ctrl-C pressed while they run is one line and exit code 130 once the command's code takes over, not a
KeyboardInterrupt traceback from inside an import."""

from launcher.lifetime import hold_ctrl_c

hold_ctrl_c()
from launcher.host.cli import entry  # noqa: E402  (after the hold)

if __name__ == "__main__":
    entry()
