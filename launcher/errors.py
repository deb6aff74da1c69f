"""Reword what Hydra and OmegaConf raise at compose time into one line: what was wrong, what is
allowed, what to type. Their own messages are several lines of context meant for config authors.
"""

from __future__ import annotations

import difflib
import re

from launcher.config import TOP_LEVEL_KEYS


def _chain(exc: BaseException) -> list[BaseException]:
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return text.strip()


def _known_keys(full_key: str) -> list[str]:
    from launcher.config import Config  # the schema dataclasses are the source of truth for key names

    parts = full_key.split(".")
    node = Config
    for part in parts[:-1]:
        field = getattr(node, "__dataclass_fields__", {}).get(part)
        if field is None:
            return []
        node = field.default_factory if callable(field.default_factory) else None  # type: ignore[misc]
        if node is None:
            return []
    return list(getattr(node, "__dataclass_fields__", {}))


def _unknown_key(full_key: str) -> str:
    known = _known_keys(full_key)
    leaf = full_key.split(".")[-1]
    prefix = full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""
    guess = difflib.get_close_matches(leaf, known, n=1)
    hint = f"did you mean {prefix}{guess[0]}? " if guess else ""
    listing = ", ".join(prefix + k for k in known) if known else ", ".join(TOP_LEVEL_KEYS)
    return f"unknown key '{full_key}': {hint}known keys: {listing}"


def describe_hydra_error(exc: BaseException) -> str:
    chain = _chain(exc)
    text = "\n".join(str(e) for e in chain)
    names = [type(e).__name__ for e in chain]

    # `launch foo` or `launch gpus=[0,1`: not a key=value override.
    unparsed = next((e for e in chain if type(e).__name__ == "OverrideParseException"), None)
    if unparsed is not None:
        bad = getattr(unparsed, "override", "") or ""
        if bad and "=" not in bad:
            return (f"'{bad}' is not a command or a key=value override; commands: doctor; "
                    f"overrides look like: launch recipe=cifar10 gpus=[0,1] epochs=5")
        detail = _first_line(getattr(unparsed, "message", "") or str(unparsed))
        return (f"cannot parse '{bad}' ({detail}): lists are written gpus=[0,1], text with commas or "
                "brackets is quoted: key='a,b'")

    m = re.search(r"Ambiguous value for argument '([^']*)'", text)
    if m:
        key, _, value = m.group(1).partition("=")
        return (f"{key}={value} is ambiguous: write {key}=[{value}] for a list, or add -m to sweep over "
                f"{key}={value}")

    m = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if m:
        group, option = m.group(1), m.group(2)
        options = re.findall(r"^\t(\S+)$", text.split("Available options", 1)[-1], flags=re.M)
        if not options:
            return f"{group}={option} is not valid: see launch --help for the options of {group}"
        return f"{group}={option} is not valid: choose one of {', '.join(options)} (e.g. launch {group}={options[0]})"

    m = re.search(r"full_key: (\S+)", text)
    full_key = m.group(1) if m else None
    if any(n in ("ConfigKeyError", "ConfigAttributeError") for n in names):
        overridden = re.search(r"Could not override '([^']+)'", text)
        missing = re.search(r"Key '([^']+)' (?:is )?not in", text)
        key = overridden.group(1) if overridden else full_key or (missing.group(1) if missing else None)
        if key:
            return _unknown_key(key)
    if full_key and "ValidationError" in names:
        m2 = re.search(r"Value '([^']*)' of type '(\w+)' could not be converted to (\w+)", text)
        if m2:
            value, _, target = m2.groups()
            kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(target, target)
            return f"{full_key}={value} is not valid: must be {kind}"
        m3 = re.search(r"Non optional field cannot be assigned None", text)
        if m3:
            return f"{full_key}=null is not valid: {full_key} needs a value"
        return f"{full_key}: {_first_line(str(chain[-1]))}"
    if "MissingMandatoryValue" in names and full_key:
        return f"{full_key} has no value: set it on the command line, e.g. launch {full_key}=..."
    return _first_line(str(chain[-1] if len(chain) > 1 and str(chain[-1]).strip() else exc))
