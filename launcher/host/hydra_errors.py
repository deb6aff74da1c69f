"""Reword what Hydra and OmegaConf raise at compose time into one line: what was wrong, what is
allowed, what to type. Their own messages are several lines of context meant for config authors.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path

from launcher import config
from launcher.errors import LaunchError

# torchrun's names for launch's keys (`nproc_per_node=2`, `--nproc-per-node=2`: nprocs)
TORCHRUN_NAMES = {"nproc_per_node": "nprocs", "nnodes": "nodes", "rdzv_endpoint": "rdzv"}
# What torchrun's and nanoGPT's users type, and launch's key for it (the hint of `unknown_key`).
OTHER_NAMES = {
    **TORCHRUN_NAMES,
    "n_layer": "recipe.layers", "n_head": "recipe.heads", "n_embd": "recipe.width", "n_kv_head": "recipe.kv_heads",
    "block_size": "recipe.context", "learning_rate": "lr", "gradient_accumulation_steps": "accumulate",
    "grad_clip": "optim.clip_grad_norm", "decay_lr": "optim.decay", "min_lr": "optim.min_lr_ratio (a fraction of lr)",
    "warmup_iters": "optim.warmup_epochs (epochs, fractions too: 0.05)",
    "lr_decay_iters": "optim.decay (the decay ends with the run)",
    "max_iters": "epochs (launch counts epochs, not iterations)", "device": "gpus (gpus=[] for the CPU)",
    "dtype": "perf.precision", "init_from": "resume (resume=RUN_DIR)", "out_dir": "hydra.run.dir",
    "eval_interval": "eval.every",
}


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


def _schema_named(name: str) -> type | None:
    """The schema class called `name` (a group option's, or a user recipe's), from the error's text."""
    todo, seen = [config.Schema], set()
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        seen.add(cls)
        todo += [c for c in cls.__subclasses__() if c not in seen]
    return None


def _known_keys(full_key: str, schema_name: str | None) -> list[str] | None:
    """The keys beside the leaf of `full_key`: by walking Config's typed sections (`log.mlflow.*`), else from
    the group option's schema the error names (`optim.*`, `recipe.*`: typed by the option chosen).
    None: the leaf's section is a free-form dict (`args`, `backend.additional`), whose keys are the user's."""
    parts = full_key.split(".")[:-1]
    walked = _walk(config.Config, parts)
    schema = _schema_named(schema_name) if schema_name else None
    if walked == [] and schema is not None and schema is not config.Config:
        # a group option's schema: the walk starts below the group's name
        return _walk(schema, parts[1:])
    return walked


def _walk(node: type | None, parts: list[str]) -> list[str] | None:
    for part in parts:
        if not dataclasses.is_dataclass(node):
            return None
        node = _section(node, part)
        if node is None:
            return []
    if not dataclasses.is_dataclass(node):
        return None
    return [f.name for f in dataclasses.fields(node)]


def _section(node: type, name: str) -> type | None:
    """The schema of `node`'s section `name`: its default's type, or, for a section that is there only when
    chosen (`log.mlflow`: MlflowLog | None), the schema its annotation names."""
    import typing

    field = {f.name: f for f in dataclasses.fields(node)}.get(name)
    if field is None:
        return None
    if isinstance(field.default_factory, type):
        return field.default_factory
    try:
        hint = typing.get_type_hints(node).get(name)
    except Exception:  # (an annotation that does not resolve here)
        return None
    return next((t for t in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(t)), None)


def _misspelled_section(full_key: str) -> str | None:
    """`full_key` with the first section Config does not have replaced by the nearest one it has, where the
    rest then names a key there (`log.mlflw.tracking_uri` -> log.mlflow.tracking_uri); else None."""
    parts = full_key.split(".")
    node: type | None = config.Config
    for i, part in enumerate(parts[:-1]):
        if not dataclasses.is_dataclass(node):
            return None
        below = _section(node, part)
        if below is None:
            sections = [f.name for f in dataclasses.fields(node) if _section(node, f.name) is not None]
            for guess in difflib.get_close_matches(part, sections, n=3):
                fixed = ".".join([*parts[:i], guess, *parts[i + 1:]])
                if parts[-1] in (_walk(config.Config, fixed.split(".")[:-1]) or []):
                    return fixed
            return None
        node = below
    return None


def unknown_key(full_key: str, schema_name: str | None) -> str:
    known = _known_keys(full_key, schema_name)
    leaf = full_key.split(".")[-1]
    if known is None:  # a key of the user's own in a dict section: Hydra adds new keys with a leading +
        return (f"unknown key '{full_key}': {full_key.rsplit('.', 1)[0]}.* keys are your own; add a new one with a "
                f"leading + (e.g. launch +{full_key}=VALUE)")
    if not known:
        fixed = _misspelled_section(full_key)
        if fixed is not None:
            return f"unknown key '{full_key}': did you mean {fixed}?"
        return (f"unknown key '{full_key}': `launch --help` lists every key (one of your own in a free-form section "
                f"such as args or backend.additional takes a leading +: launch +{full_key}=VALUE)")
    prefix = full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""
    if full_key.startswith("checkpoint.") and leaf in known:  # (`checkpoint=false` left no section to set it in)
        return (f"{full_key} is not valid beside checkpoint=true/false, which stands for the whole section: write "
                f"checkpoint.enabled=false (or true) beside {full_key} instead")
    owners = _options_with_key(full_key)
    if owners:  # (another option of the group has it: strategy.min_unit_params without strategy=fsdp)
        group = full_key.split(".")[0]
        chosen = next((opt for (g, opt), cls in config.SCHEMAS.items() if g == group and cls.__name__ == schema_name),
                      None)
        choices = " or ".join(f"{group}={o}" for o in owners)
        this = f"{group}={chosen}" if chosen else f"this run's {group}"
        return (f"unknown key '{full_key}': it is an option of {choices}, not of {this}; choose "
                f"{'it' if len(owners) == 1 else 'one'} (e.g. launch {group}={owners[0]} {full_key}=...)")
    top = {f.name for f in dataclasses.fields(config.Config)}
    owner = _section_with(leaf) if not prefix else None  # (a section's key typed without it: compile=false)
    if leaf in OTHER_NAMES:  # (torchrun's and nanoGPT's names: n_layer, max_iters)
        guess = [OTHER_NAMES[leaf]]
    elif prefix and leaf in top:  # (a top-level key under a section: optim.lr)
        guess = [leaf]
    elif owner:  # (its exact name in a section comes before a look-alike here: layers=2 is not args)
        guess = [f"{owner}.{leaf}"]
    else:
        guess = [prefix + k for k in difflib.get_close_matches(leaf, known, n=1)]
    hint = f"did you mean {guess[0]}? " if guess else ""
    listing = ", ".join(prefix + k for k in known)
    return f"unknown key '{full_key}': {hint}known keys: {listing}"


def _section_with(leaf: str) -> str | None:
    """The section whose key `leaf` is, for a key typed without its section: a typed section of Config
    (`compile` -> perf), else the recipe this command line names (or the default), its own schema
    (`width` of recipe=text, `hidden` of a user's recipe), else a group whose option has it (`decay` ->
    optim, `min_unit_params` -> strategy); None where none holds it."""
    import sys

    for field in dataclasses.fields(config.Config):
        node = _section(config.Config, field.name)
        if dataclasses.is_dataclass(node) and leaf in {f.name for f in dataclasses.fields(node)}:
            return field.name
    named = [a.partition("=")[2] for a in sys.argv[1:] if a.partition("=")[0].lstrip("+") == "recipe"]
    chosen = named[-1] if named and "," not in named[-1] else "digits"  # (conf/config.yaml's default)
    schema = config.SCHEMAS.get(("recipe", chosen))
    if schema is None:  # a user's recipe module (imported already: compose.register_user_recipe, before Hydra)
        try:
            from launcher.recipes import recipe_class

            schema = recipe_class(chosen).Config
        except Exception:  # noqa: BLE001 - not a recipe after all: no hint rather than another error
            schema = None
    if dataclasses.is_dataclass(schema) and leaf in {f.name for f in dataclasses.fields(schema)}:
        return "recipe"
    for (group, _), option in config.SCHEMAS.items():  # (an option's key of a group: optim.decay, strategy.timeout_s)
        if group != "recipe" and leaf != "name" and leaf in {f.name for f in dataclasses.fields(option)}:
            return group
    return None


def _options_with_key(full_key: str) -> list[str]:
    """The options of a config group whose schema has `full_key` (GROUP.KEY), e.g. ['fsdp'] for
    strategy.min_unit_params."""
    parts = full_key.split(".")
    if len(parts) != 2:
        return []
    group, leaf = parts
    return sorted(opt for (g, opt), cls in config.SCHEMAS.items()
                  if g == group and leaf in {f.name for f in dataclasses.fields(cls)})


def describe_hydra_error(exc: BaseException) -> str:
    chain = _chain(exc)
    ours = next((e for e in chain if isinstance(e, LaunchError)), None)
    if ours is not None:  # raised by launch itself (a callback, a recipe's registration): already one line
        return str(ours)
    text = "\n".join(str(e) for e in chain)
    names = [type(e).__name__ for e in chain]

    # `launch foo` or `launch gpus=[0,1`: not a key=value override.
    unparsed = next((e for e in chain if type(e).__name__ == "OverrideParseException"), None)
    if unparsed is not None:
        bad = getattr(unparsed, "override", "") or ""
        if bad and "=" not in bad:
            import sys

            from launcher.config import Config

            args = sys.argv[1:]
            after = args[args.index(bad) + 1] if bad in args[:-1] else None
            known = {f.name for f in dataclasses.fields(Config)}
            example = (f"{bad}={after}" if bad in known and after is not None and "=" not in after
                       else f"script={bad}" if bad.endswith(".py")  # (torchrun's habit: the script first)
                       else "recipe=cifar10 gpus=[0,1] epochs=5")
            return (f"'{bad}' is not a command or a key=value override (e.g. launch {example}); commands: doctor, "
                    "runs, eval RUN_DIR, export RUN_DIR")
        detail = _first_line(getattr(unparsed, "message", "") or str(unparsed))
        key, _, value = bad.partition("=")
        if value.startswith("~"):  # (Hydra's grammar reads ~ as a deletion; the shell left it unexpanded)
            return (f"cannot parse '{bad}': a path starting with ~ is quoted: {key}='{value}' (launch expands ~), "
                    f"or give it whole: {key}=$HOME{value[1:]}")
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
        own = (f", or your own recipe: a file {option}.py in this directory, or a module path (my_pkg.my_recipe)"
               if group == "recipe" else "")
        # (a recipe of your own in this directory counts as an option too)
        pool = [*options, *(sorted(f.stem for f in Path.cwd().glob("*.py")) if group == "recipe" else [])]
        close = difflib.get_close_matches(option, pool, n=1)
        example = f"did you mean {group}={close[0]}?" if close else f"e.g. launch {group}={options[0]}"
        return f"{group}={option} is not valid: choose one of {', '.join(options)}{own} ({example})"

    if "Unexpected type for root: NoneType" in text:  # (a key of a tracker that log=[...] does not pick)
        import sys

        from launcher.config import TRACKER_PACKAGES

        for arg in sys.argv[1:]:
            key = arg.partition("=")[0].lstrip("+~")
            parts = key.split(".")
            if len(parts) > 2 and parts[0] == "log" and parts[1] in TRACKER_PACKAGES:
                return (f"{key} sets the {parts[1]} tracker, which log does not pick: add it, e.g. launch "
                        f"log=[tensorboard,{parts[1]}] {arg}")

    m = re.search(r"Could not load '(log)/([^']+)'", text)  # (a group whose options are picked several at once)
    if m:
        from importlib import resources

        group, option = m.group(1), m.group(2)
        options = sorted(p.name[:-5] for p in resources.files("launcher.conf").joinpath(group).iterdir()
                         if p.name.endswith(".yaml"))
        close = difflib.get_close_matches(option, options, n=1)
        example = f"did you mean {close[0]}?" if close else f"e.g. launch {group}=[{','.join(options[:2])}]"
        return (f"{group}: {option} is not valid: choose any of {', '.join(options)}, several at once "
                f"({group}=[tensorboard,mlflow]; {group}=[] for none) ({example})")

    m = re.search(r"full_key: (\S+)", text)
    full_key = m.group(1) if m else None
    if any(n in ("ConfigKeyError", "ConfigAttributeError") for n in names):
        overridden = re.search(r"Could not override '([^']+)'", text)
        missing = re.search(r"Key '([^']+)' (?:is )?not in", text)
        key = overridden.group(1) if overridden else full_key or (missing.group(1) if missing else None)
        schema = re.search(r"not in '(\w+)'", text)
        if key:
            return unknown_key(key, schema.group(1) if schema else None)
    if full_key == "model" and "Cannot assign" in text:  # (model=llama: the recipe's own network is recipe.model)
        import sys

        given = next((a.partition("=")[2] for a in sys.argv[1:] if a.lstrip("+~").partition("=")[0] == "model"),
                     "...")
        return (f"model={given} is not valid: `model` is a network from config, its keys under it (e.g. launch "
                f"model._target_=torchvision.models.resnet18); the recipe's own network is recipe.model (did you "
                f"mean recipe.model={given}?)")
    if full_key and "ValidationError" in names:
        choice = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", text)
        if choice:
            value, options = choice.group(1), [o.strip() for o in choice.group(2).split(",")]
            value = value.lower() if value in ("True", "False") else value  # (YAML's true, as typed)
            close = difflib.get_close_matches(value.lower(), options, n=1, cutoff=0.5 if len(value) <= 3 else 0.6)
            switch = {"true": ("full", "on", "all"), "false": ("none", "off")}.get(value, ())  # (a yes/no typed)
            close = close or [o for o in options if o in switch][:1]
            example = f"did you mean {full_key}={close[0]}?" if close else f"e.g. launch {full_key}={options[0]}"
            return f"{full_key}={value} is not valid: choose one of {', '.join(options)} ({example})"
        m2 = re.search(r"Value '([^']*)' of type '(\w+)' could not be converted to (\w+)", text)
        if m2:
            value, _, target = m2.groups()
            kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(target, target)
            try:
                whole = target == "Integer" and float(value).is_integer() and abs(float(value)) < 1e18
            except ValueError:
                whole = False
            if whole:  # (1e8: the command line reads it as a float)
                return (f"{full_key}={value} is not valid: must be an integer, written whole (e.g. launch "
                        f"{full_key}={int(float(value))})")
            return f"{full_key}={value} is not valid: must be {kind}"
        m4 = re.search(r"Value '([^']*)' is not a valid bool", text)
        if m4:
            return f"{full_key}={m4.group(1)} is not valid: must be true or false (e.g. launch {full_key}=true)"
        m5 = re.search(r"is not a valid input for <enum '(\w+)'>", text)  # (a list or a mapping for a choice)
        if m5:
            import sys

            from launcher import config

            kind = getattr(config, m5.group(1), None)
            options = [str(o.value) for o in kind] if kind is not None else []
            given = next((a.partition("=")[2] for a in sys.argv[1:] if a.lstrip("+~").partition("=")[0] == full_key),
                         "that")
            return (f"{full_key}={given} is not valid: give one of {', '.join(options)}, a single word (e.g. launch "
                    f"{full_key}={options[0] if options else '...'})")
        m3 = re.search(r"Non optional field cannot be assigned None", text)
        if m3:
            return f"{full_key}=null is not valid: {full_key} needs a value"
        return f"{full_key}: {_first_line(str(chain[-1]))}"
    if "MissingMandatoryValue" in names and full_key:
        return f"{full_key} has no value: set it on the command line, e.g. launch {full_key}=..."
    return _first_line(str(chain[-1] if len(chain) > 1 and str(chain[-1]).strip() else exc))
