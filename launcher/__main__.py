"""`launch` (the console script) and `python -m launcher ...`.

Ctrl-C is held from the first line, before any import but `signal`: `_note_early` notes it until
launcher.lifetime's _CtrlCHold takes over (with what was noted), then holds it through the command's
imports (Hydra, OmegaConf, torch). A Ctrl-C pressed meanwhile is one line and exit code 130 once the
command's code takes over, not a KeyboardInterrupt traceback from inside an import."""

import signal

_pressed: list = []


def _note_early(signum, frame) -> None:
    _pressed.append(signum)


if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (a SIGINT ignored stays ignored)
    try:
        signal.signal(signal.SIGINT, _note_early)
    except ValueError:  # (imported from a thread other than the main one: nothing to hold)
        pass
from launcher.lifetime import hold_ctrl_c  # noqa: E402  (after the hold)

hold_ctrl_c(taking_over=_note_early, pressed=_pressed)
from launcher.host.cli import entry  # noqa: E402  (after the hold)

if __name__ == "__main__":
    entry()
