"""What a checkpoint's saved config may make launch import or call, and whose word that takes.

A checkpoint carries the config its run trained with, and `resume=` and `launch eval` build their run from
it (host/resume.py `with_saved_choices`, `carry_settings`; host/evaluate.py `command_line`). Most of it is
values: numbers, names of built-in options, paths. Some of it names code, which launch would import or call
before any check could look at what it returns:

    model._target_, and a `_target_` anywhere in the model section's arguments (Hydra's instantiate calls
        each, with the arguments beside it)
    recipe=NAME where NAME is not a built-in recipe: a module path, or a file in the folder launch runs in
        (importing it runs it)

Loading the checkpoint with weights_only=True keeps its pickle from running code; these would run code
anyway. So each is used only with the user's consent: the user typed it on this command line (the same
value), or the checkpoint's seal carries the mark of this user's key (integrity.unproven: a run of theirs
wrote it; a digest alone proves nothing, anyone can recompute one). Otherwise one line (exit 2), before
anything from the saved config is imported. Interpolations (`${...}`) in a saved config are never resolved:
launch writes configs resolved, so the carriers pass saved strings on as literal text.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

from launcher.errors import LaunchError

TARGET = "_target_"


def builtin_recipe(name: str) -> bool:
    """`recipe=name` is one of launch's own options (conf/recipe/NAME.yaml), which imports nothing of the user's."""
    return "/" not in name and resources.files("launcher.conf").joinpath("recipe", f"{name}.yaml").is_file()


def code_named(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, value) for each value of a saved config (plain data) that launch would import or call: every
    `_target_` (dotted key) and a recipe that is not built in, in the order a reader meets them."""
    found: list[tuple[str, str]] = []
    recipe = (config.get("recipe") or {}).get("name") if isinstance(config.get("recipe"), dict) else None
    if isinstance(recipe, str) and recipe and not builtin_recipe(recipe):
        found.append(("recipe", recipe))

    def walk(node: Any, at: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                here = f"{at}.{key}" if at else str(key)
                if key == TARGET and value is not None:
                    found.append((here, str(value)))
                else:
                    walk(value, here)
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{at}.{i}")

    walk(config, "")
    return found


def typed_values(overrides: list[str] | tuple[str, ...]) -> dict[str, str]:
    """key -> value as the command line gives it (`+model._target_='a.b'` -> model._target_: a.b; the last
    one wins)."""
    values = {}
    for override in overrides:
        key, equals, value = override.partition("=")
        key = key.strip().lstrip("+~")
        if equals and key:
            values[key] = value.strip().strip("'\"")
    return values


def require(config: dict[str, Any], unproven: str | None, overrides: list[str] | tuple[str, ...],
            what: str) -> None:
    """A LaunchError naming the first value of the saved `config` that would run code without consent:
    neither typed in `overrides` (the same value: consent; another: the saved one is not used) nor vouched
    for by the checkpoint's seal (`unproven` None: integrity.unproven found this user's mark). `what`: the
    checkpoint as the user named it."""
    if unproven is None:
        return
    typed = typed_values(overrides)
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    # another network typed: none of the saved model section is used (nor its arguments' targets)
    replaced = typed.get(f"model.{TARGET}") not in (None, model.get(TARGET))
    for key, value in code_named(config):
        if key in typed or (replaced and key.startswith("model.")):
            continue  # (this command line's value is used: the same one, consented to, or its own)
        add = f"{key}={value}" if key in ("recipe", f"model.{TARGET}") else f"+{key}={value}"
        raise LaunchError(f"{what}'s checkpoint names {key}={value}, code that launch runs only with your consent: "
                          f"it was not written by a run of yours ({unproven}); to run it, add {add}")


def literal(text: str) -> str:
    """`text` as OmegaConf reads it back unchanged: each `${` escaped (`\\${`), and backslashes right before
    one doubled, which would otherwise escape the escape (`a\\${oc.env:HOME}` read this machine's HOME)."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
