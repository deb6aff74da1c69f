"""Errors both wings raise, with the message a user reads.

A `LaunchError` is something the user can fix (a value, a missing file): `str(err)` is the whole
one-line message and the exit code is 2, before any worker starts when the launcher can tell, else as
soon as a worker finds out. An `ExplainedStop` is a training run ending on purpose with a message that
already names the cause and the way on (a NaN loss, CUDA out of memory, a stuck peer): the launcher
prints that message instead of a traceback, exit code 1.
"""

from __future__ import annotations

from typing import Any


def said(message: object) -> str:
    """A message as the console prints it: "launch: " and the message, whose own leading "launch " (a message
    naming the command typed: "launch eval RUN is not valid: ...") is not said twice."""
    text = str(message)
    return f"launch: {text[len('launch '):] if text.startswith('launch ') else text}"


class LaunchError(Exception):
    """Something the user can fix. `str(err)` is the whole one-line message; exit 2."""

    exit_code = 2


class ConfigError(LaunchError, ValueError):
    """A bad value a user typed: the key, the value, what is allowed and an example command."""

    def __init__(self, key: str, value: Any, allowed: str, example: str | None = None):
        text = f"{key}={show(value)} is not valid: {allowed}"
        if example:
            text += f" (e.g. launch {example})"
        super().__init__(text)
        self.key = key
        self.value = value


class ExplainedStop(RuntimeError):
    """A run stopped on purpose; the message says why and what to do, so no traceback is shown."""


def show(value: Any) -> str:
    """A value as a user would type it on the command line."""
    from enum import Enum

    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    if isinstance(value, Enum):
        return str(value.value)
    if value is None:
        return "null"
    return str(value)
