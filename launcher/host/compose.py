"""What Hydra needs before it composes a launch config, and the typed config it hands back.

- `register(argv)`: the schemas (launcher/config.py) into Hydra's ConfigStore, the resolvers the YAML
  uses, `hydra/launcher=launch` (launcher/host/sweep_launcher.py), and a user's own recipe named
  on the command line (`recipe=my_pkg.my_recipe`: its module is imported and its schema registered as
  an option of the `recipe` group, so Hydra composes it like a built-in one).
- `typed(cfg)`: the composed DictConfig as the schema's dataclasses, frozen. Everything after
  composition (validation, the plan, the workers) reads this, never the DictConfig.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import secrets
import sys
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, read_write

from launcher.config import GROUPS, SCHEMAS, Config, Schema, freeze, to_plain
from launcher.errors import LaunchError
from launcher.world import existing_world, joined_run_id

SCHEMA_GROUP = "schema"  # ConfigStore: schema/<group>/<option>, named by conf/<group>/<option>.yaml
# launch's Hydra launcher: its class lives where Hydra's plugin scan looks, under `hydra_plugins`.
SWEEP_LAUNCHER = "hydra_plugins.launcher_sweep.LaunchSweepLauncher"
PLUGIN_FOLDER = Path(__file__).parent / "hydra_plugins"


@dataclass
class LaunchLauncherConf:
    _target_: str = SWEEP_LAUNCHER


def allow_imports_from_cwd() -> None:
    """A user's recipe or script package in the directory `launch` runs in is importable, as under
    `python -m` (the `launch` entry point alone would only see site-packages). Workers inherit it."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def register(argv: list[str]) -> None:
    """Everything Hydra must know before composing `argv`. Idempotent."""
    import hydra_plugins
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="launch_schema", node=Config)
    for (group, option), schema in SCHEMAS.items():
        store.store(group=f"{SCHEMA_GROUP}/{group}", name=option, node=schema)
    # Hydra lists the folders of the `hydra_plugins` namespace package to find launchers. An editable
    # install (`pip install -e .`) maps ours through setuptools' import hook, which that listing cannot
    # see; a regular install puts it in site-packages/hydra_plugins, where this folder does not exist.
    if (PLUGIN_FOLDER / "launcher_sweep").is_dir() and str(PLUGIN_FOLDER) not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(str(PLUGIN_FOLDER))
    store.store(group="hydra/launcher", name="launch", node=LaunchLauncherConf, provider="launcher")
    _register_resolvers()
    help_only = bool({"--help", "-h", "--hydra-help"} & set(argv))
    for module_path in user_recipes_named(argv):
        register_user_recipe(module_path, run_module=not help_only)


def user_recipes_named(argv: list[str]) -> list[str]:
    """Module paths among the `recipe=` values of the command line (a sweep may name several): dotted
    ones (`my_pkg.my_recipe`), and plain names that are no built-in option but a file in the directory
    `launch` runs in (`recipe=my_recipe`: ./my_recipe.py)."""
    found: list[str] = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") != "recipe":
            continue
        for word in re.findall(r"[A-Za-z_][\w.]*", value):
            plain_file = "." not in word and not _builtin_option(word) and Path(f"{word}.py").is_file()
            if ("." in word or plain_file) and word not in found:
                found.append(word)
    return found


def _builtin_option(name: str) -> bool:
    return resources.files("launcher.conf").joinpath("recipe", f"{name}.yaml").is_file()


def register_user_recipe(module_path: str, run_module: bool = True) -> None:
    """`recipe=my_pkg.my_recipe`: its Recipe class's schema becomes the option `recipe/my_pkg.my_recipe`.

    run_module=False (`launch --help`): the module is not imported, which would run its code; its
    schema is read from its source instead (see schema_from_source)."""
    from hydra.core.config_store import ConfigStore

    from launcher.config import MISSING

    allow_imports_from_cwd()
    if run_module:
        from launcher.recipes import recipe_class

        cls = recipe_class(module_path)  # a LaunchError naming the problem when it is not a recipe
        schema, models = cls.Config, cls.models
    else:
        schema, models = schema_from_source(module_path)
    defaults = {"name": module_path}
    if getattr(schema, "model", MISSING) == MISSING:
        defaults["model"] = models[0] if models else "default"
    ConfigStore.instance().store(group="recipe", name=module_path, node=schema(**defaults))


def module_file(module_path: str) -> Path | None:
    """Where `import module_path` would find its source, found without importing anything."""
    parts = module_path.split(".")
    for root in [Path(p or ".") for p in sys.path]:
        for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return candidate
    return None


def schema_from_source(module_path: str) -> tuple[type, tuple[str, ...]]:
    """A user recipe's Config dataclass, read from its source without running it: the fields of the
    module's @dataclass subclassing RecipeConfig whose defaults are literals. Anything it cannot read
    statically is left out (the run itself imports the module and gets the real schema). Also the
    Recipe class's `models`, when they are a literal."""
    import ast
    import dataclasses
    from typing import Any

    from launcher.config import RecipeConfig

    path = module_file(module_path)
    if path is None:
        return RecipeConfig, ()
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return RecipeConfig, ()
    types: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool}
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    models: tuple[str, ...] = ()
    for node in classes:
        for item in node.body:
            if isinstance(item, ast.Assign) and [getattr(t, "id", "") for t in item.targets] == ["models"]:
                with contextlib.suppress(ValueError):
                    models = tuple(str(m) for m in ast.literal_eval(item.value))
    schema: type = RecipeConfig
    for node in classes:
        if "RecipeConfig" not in [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]:
            continue
        fields = []
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            try:
                default = ast.literal_eval(item.value) if item.value is not None else dataclasses.MISSING
            except ValueError:
                continue
            kind = types.get(getattr(item.annotation, "id", ""), Any)
            if isinstance(default, (list, dict)):
                continue  # (a mutable default needs a factory; not worth guessing for --help)
            fields.append((item.target.id, kind, dataclasses.field(default=default)))
        schema = dataclasses.make_dataclass(node.name, fields, bases=(RecipeConfig,))
        break
    return schema, models


@contextlib.contextmanager
def one_compose_per_run(argv: list[str]):
    """Hydra composes a command's config twice: once to read `hydra.mode` (Hydra.get_mode, which answers
    None when no config sets it, and on any error), then for the run. launch's configs never set it (a test
    reads every YAML under conf/), so where nothing else can (the configs come from launch's conf/, Hydra's
    own and the ConfigStore alone, and no override names hydra.mode or hydra.searchpath) the first compose
    is answered None without composing: what it would have answered. Elsewhere Hydra asks as it always did."""
    try:
        from hydra._internal.hydra import Hydra
    except ImportError:  # (another Hydra: it composes twice)
        yield
        return
    asks = getattr(Hydra, "get_mode", None)
    if asks is None:
        yield
        return
    # (a search path given with -cd/--config-dir, or a primary config with -cp, shows in the sources below;
    # one given as an override does not yet when Hydra asks)
    touched = any("hydra.mode" in a or "hydra.searchpath" in a for a in argv)

    def get_mode(self, config_name, overrides):
        paths = self.config_loader.get_sources() if hasattr(self.config_loader, "get_sources") else None
        ours = paths is not None and all((s.provider, s.path) in _OWN_SOURCES for s in paths)
        return None if ours and not touched else asks(self, config_name, overrides)

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = asks


_OWN_SOURCES = {("hydra", "hydra.conf"), ("main", "launcher.conf"), ("schema", "")}


def typed(cfg: DictConfig) -> Config:
    """The composed config (without its `hydra` part) as frozen dataclasses, or a LaunchError."""
    from launcher.host.hydra_errors import describe_hydra_error

    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:  # noqa: BLE001 - OmegaConf's errors for a missing or unresolvable value
        raise LaunchError(describe_hydra_error(exc)) from None
    if not isinstance(obj, Config):
        raise LaunchError("the composed config is not launch's (it lacks `launch_schema` in its defaults list)")
    unknown = appended_unknown_key(cfg)
    if unknown is not None:
        raise LaunchError(unknown)
    for group in GROUPS:
        if not isinstance(getattr(obj, group), Schema):
            raise LaunchError(f"{group}: the chosen option's YAML names no schema in its defaults list "
                              f"(e.g. `- /{SCHEMA_GROUP}/{group}/<option>@_here_`); see launcher/config.py")
    root = obj.data.root
    if isinstance(root, str) and root and not root.startswith("~") and not os.path.isabs(root):
        # (from where launch was typed: the run's config.yaml and checkpoints say where its data was, so a
        # resume or an eval typed from another folder finds it)
        obj.data.root = os.path.abspath(root)
    return freeze(obj)


def appended_unknown_key(cfg: DictConfig, at: str = "") -> str | None:
    """A key added with a leading + (`+epoch=3`) where a schema has no such field: Hydra takes it and the
    typed config would drop it, so the run would go on as if it had not been typed. One line saying so,
    as for a key typed without + (free-form sections, `args` or `model`'s arguments, take any key)."""
    import dataclasses
    import difflib

    kind = OmegaConf.get_type(cfg)
    fields = [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else None
    for key in cfg.keys():
        full = f"{at}{key}"
        if fields is not None and key not in fields:
            guess = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {at}{guess[0]}? " if guess else ""
            return (f"+{full}=... is not valid: there is no key {full} to add ({hint}known keys: "
                    f"{', '.join(at + f for f in fields)}); a leading + adds keys only to sections that take keys "
                    f"of your own (args, model's arguments)")
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            found = appended_unknown_key(node, f"{full}.")
            if found is not None:
                return found
    return None


def settled(cfg: DictConfig, overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """The composed config as the run takes it: a checkpoint's settings where `resume=` names one
    (launcher/host/resume.py: carry_settings), then the recipe's named presets (RecipeConfig.presets: a
    `recipe.size=8b` sets the keys it names, each unless the command line sets it). A resumed run's preset
    was applied when the run started, and the checkpoint carries its outcome (`recipe.size=debug
    recipe.layers=2` trained 2 layers): it applies again only where this command line names a preset."""
    from launcher.host.resume import carry_settings, typed_keys

    whole_and_parts(overrides, "checkpoint")
    spelled_as_booleans(cfg, overrides)
    carried = carry_settings(cfg, overrides)
    resumed, cfg = carried is not cfg, carried
    recipe = cfg.get("recipe") if isinstance(cfg, DictConfig) else None
    presets = getattr(OmegaConf.get_type(recipe), "presets", None) if isinstance(recipe, DictConfig) else None
    if not presets:
        return cfg
    given = typed_keys(overrides)
    named = {}
    for key, values in presets.items():
        if resumed and f"recipe.{key}" not in given:
            continue
        named.update(values.get(str(OmegaConf.select(cfg, f"recipe.{key}")), {}))
    if not named:
        return cfg
    cfg = copy.deepcopy(cfg)
    with read_write(cfg):
        for key, value in named.items():
            if f"recipe.{key}" not in given:  # (`recipe=text` chooses the recipe: it sets no key of it)
                OmegaConf.update(cfg, f"recipe.{key}", value, merge=False)
    return cfg


def whole_and_parts(overrides: list[str] | tuple[str, ...], section: str) -> None:
    """Refuse (LaunchError, one line) `section=VALUE` beside `section.KEY=...` on one command line: the first
    stands for the whole section (checkpoint=false), so whichever comes last would undo the other, silently
    where the section comes last (`checkpoint.keep_best=2 checkpoint=false` dropped keep_best)."""
    from launcher.host.resume import typed_keys

    keys = [(override, next(iter(typed_keys([override])), "")) for override in overrides]
    whole = [override for override, key in keys if key == section]
    parts = [(override, key) for override, key in keys if key.startswith(f"{section}.")]
    if whole and parts:
        (part, key), value = parts[0], whole[-1].partition("=")[2].strip() or "false"
        raise LaunchError(f"{whole[-1]} and {part} on one command line: {section}=true/false stands for the whole "
                          f"section, so the later would undo the earlier; write {section}.enabled={value} beside "
                          f"{key} instead, or leave one out")


BOOLEAN_WORDS = ("true", "false", "1", "0")  # (any case: what a true | false | auto key takes, but auto)


def spelled_as_booleans(cfg: DictConfig, overrides: list[str] | tuple[str, ...]) -> None:
    """Refuse (LaunchError, one line) a true/false key given anything but true, false, 1 or 0 on the command
    line, as a true | false | auto key is: OmegaConf reads any other number, and yes, on or y, as true, and
    no, off or n as false (`checkpoint.keep_previous=2` kept previous.pt), so what the user meant may not be
    what runs; the line says what it would have read. A sweep's
    list (`a=true,false`) is checked run by run, as each sweep run is composed before any starts."""
    from omegaconf.nodes import BooleanNode

    for override in overrides:
        key, given, value = override.partition("=")
        key, value = key.strip().lstrip("+~").partition("@")[0], value.strip().strip("'\"").strip()
        if not given or not key or key.startswith("hydra") or any(c in value for c in ",()[]{}*"):
            continue
        parent, _, leaf = key.rpartition(".")
        section = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        node = section._get_node(leaf) if isinstance(section, DictConfig) and leaf in section else None
        if isinstance(node, BooleanNode) and value.lower() not in BOOLEAN_WORDS:
            read = str(node._value()).lower()  # (what OmegaConf made of it)
            raise LaunchError(f"{key}={value} is not valid: must be true or false (or 1 or 0; OmegaConf would "
                              f"read {value} as {read}) (e.g. launch {key}={read})")


def compose(overrides: list[str]) -> DictConfig:
    """The config `launch` composes for `overrides` (Hydra's compose API: nothing starts, no run dir),
    with a checkpoint's settings where `resume=` names one (launcher/host/resume.py)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from launcher.host.resume import with_saved_choices

    overrides = with_saved_choices(overrides)
    register(overrides)
    with initialize_config_module(config_module="launcher.conf", version_base="1.3"):
        return settled(hydra_compose(config_name="config", overrides=overrides), overrides)


def config_for(*overrides: str) -> Config:
    """The typed, frozen, checked config a launch with `overrides` runs with: for scripts, notebooks, tests.

        from launcher.host.compose import config_for
        cfg = config_for("recipe=cifar10", "epochs=3")
    """
    cfg = typed(compose(list(overrides)))
    cfg.check()
    return cfg


def to_yaml(cfg: Config) -> str:
    """The typed config as YAML (a run dir's config.yaml): what ran, every value resolved (a true | false |
    auto key as true, false or auto, as YAML reads it back)."""
    return OmegaConf.to_yaml(to_plain(cfg))


# ---- resolvers used by conf/config.yaml -----------------------------------------------------------


def _run_name(recipe: str, script: str | None, evaluated: str | None = None) -> str:
    """The run dir's name under outputs/ (or multirun/): DATE/TIME-WHAT-ID, WHAT the recipe or the
    script; inside torchrun/srun one name every rank agrees on, so they share one run dir."""
    if existing_world() is not None:
        return joined_run_id(os.environ)
    what = Path(str(script)).stem if script else recipe + ("-eval" if evaluated else "")
    now = datetime.now()
    # The random suffix keeps two launches started in the same second in separate run dirs.
    return f"{now:%Y-%m-%d}/{now:%H-%M-%S}-{what}-{secrets.token_hex(2)}"


def _output_subdir() -> str | None:
    """Hydra's own files (.hydra/) are written by one process: inside torchrun/srun, rank 0."""
    world = existing_world()
    return ".hydra" if world is None or world.rank == 0 else None


def _groups() -> str:
    """The groups and their options, for `launch --help` (Hydra's own list would show the schemas too)."""
    conf = resources.files("launcher.conf")
    lines = []
    for group in GROUPS:
        options = sorted(p.name[:-5] for p in conf.joinpath(group).iterdir() if p.name.endswith(".yaml"))
        extra = (", or your own recipe: a file here (recipe=my_recipe for ./my_recipe.py) or a module path "
                 "(recipe=my_pkg.my_recipe)") if group == "recipe" else ""
        lines.append(f"  {group}: {', '.join(options)}{extra}")
    trackers = sorted(p.name[:-5] for p in conf.joinpath("log").iterdir() if p.name.endswith(".yaml"))
    lines.append(f"  log: {', '.join(trackers)} (several at once: log=[tensorboard,mlflow,csv]; log=[] for none)")
    return "\n".join(lines)


def _register_resolvers() -> None:
    resolvers = {"launch_run_name": (_run_name, True), "launch_output_subdir": (_output_subdir, True),
                 "launch_groups": (_groups, False)}
    for name, (fn, cache) in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=cache)
