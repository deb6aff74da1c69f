"""`resume=`: which checkpoint, whether it is a launch checkpoint at all, and what this launch changes
of the run it continues. Checked in the launcher, before any worker starts.

The rule (docs/runs.md, "Resuming"): a resume continues the run as it was. The training *state* comes from
the checkpoint (weights, optimizer moments, the RNG, the metrics so far, the epochs done), and so does
every training *setting* this command line does not give: the recipe and its values, the optimizer and
its hyper-parameters, lr, epochs, batch size, accumulation, seed, evaluation, precision
(`carry_settings`, after Hydra composed the config; the recipe and optimizer choices are added to
the command line before it composes: `with_saved_choices`). Typed keys win (`resume=RUN epochs=60
lr=0.01`: the schedule is laid over the new total and continues at the epoch reached). Where the run
runs, its speed settings and what concerns this launch only are never taken from the checkpoint
(`NOT_CARRIED`): gpus, nprocs, strategy, backend, nodes, data.placement, perf.* but precision,
checkpoint, fault, ...; data.root is the run's own where that folder is on this machine too (an image
folder resumed where it trained), else this command line's or the default. So `launch resume=latest`
after a crash or a Ctrl-C trains on to the epochs the run was started with. What differs from the
checkpoint's run is logged and written to the new run's plan.json
(`resume.changed`), and config.yaml records the values used.

What the state cannot carry over is refused in one line: a file that is not a launch checkpoint;
another recipe, model or optimizer (recipe.name, recipe.model, optim); epochs not above the epochs
already trained (evaluate it instead: `launch eval RUN_DIR`). A network of another shape (a recipe
hyper-parameter that changes a layer) is refused too where the recipe builds its model before its data
(`check_network`); else a worker finds it when it loads the weights: one line too.
"""

from __future__ import annotations

import functools
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher import integrity
from launcher.config import Config, choices, flat_keys, recipe_as_saved, saved_choices, to_plain
from launcher.errors import LaunchError
from launcher.files import (
    BEST_CHECKPOINT,
    CHECKPOINTS,
    LAST_CHECKPOINT,
    METRICS,
    PREVIOUS_CHECKPOINT,
    last_checkpoint,
    read_json_lines,
)

# Settings a resumed run may differ in without it meaning anything for the training (not reported).
_NOT_SETTINGS = {"resume", "dry_run", "progress", "tensorboard", "profile", "fault", "log", "checkpoint"}

# Keys (and sections) a resume takes from this command line or the defaults, never from the checkpoint:
# where the run runs (the machine may be another one; batch_size is global, so the training is the same
# on any number of ranks), the speed settings (perf.*: the checkpoint holds them as the plan fitted them
# to its machine and strategy, e.g. channels_last off on the CPU) and what concerns this launch only.
NOT_CARRIED = ("resume", "dry_run", "max_restarts", "checkpoint", "progress", "tensorboard", "profile", "fault",
               "log", "early_stop",
               "sweep", "script", "args", "script_args", "gpus", "nprocs", "nodes", "node_rank", "rdzv",
               "rdzv_timeout_s", "strategy", "backend", "eval.checkpoint", "data.root", "data.download",
               "data.placement", "perf")
CARRIED_ANYWAY = ("perf.precision",)  # (inside a section above, but it changes what is computed)
# Config groups whose option a resume takes from the checkpoint (their option names are its values).
CARRIED_GROUPS = ("recipe", "optim")
# a config option or a module path (recipe=my_pkg.my_recipe)
CHOICE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NOT_CARRIED = frozenset(NOT_CARRIED)
_GROUP_NAMES = frozenset(f"{group}.name" for group in CARRIED_GROUPS)


@dataclass(frozen=True)
class Resume:
    path: Path  # the checkpoint file
    epoch: int  # epochs it has trained
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (checkpoint's, this launch's)
    classes: tuple[str, ...] | None = None  # the class names its network was trained on (saved_classes)
    step: int | None = None  # steps of the next epoch it holds (checkpoint_every_steps), else None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)  # its weights' (saved_shapes)

    @property
    def where(self) -> str:
        return f"at step {self.step + 1} of epoch {self.epoch + 1}" if self.step else f"after epoch {self.epoch}"

    def record(self) -> dict[str, Any]:
        return {"from": str(self.path), "epoch": self.epoch,
                "changed": {k: list(v) for k, v in self.changed.items()}}

    def describe(self) -> str:
        if not self.changed:
            return f"resuming {self.path} {self.where}, every setting as it was"
        def said(value: Any) -> Any:  # (nprocs 2 -> (not set): Python's None and False mean nothing to a user)
            return "(not set)" if value is None else str(value).lower() if isinstance(value, bool) else value

        shown = ", ".join(f"{k} {said(old)} -> {said(new)}" for k, (old, new) in self.changed.items())
        return f"resuming {self.path} {self.where} with its settings; changed here: {shown}"


WHICH = ("best", "last")  # a run's checkpoints `launch eval` and `launch export` name: best.pt or last.pt


def misspelled_which(word: str) -> str | None:
    """`best` or `last` where `word` is a near miss of one (`bset`, `lats`), else None."""
    import difflib

    close = difflib.get_close_matches(word.lower(), WHICH, n=1, cutoff=0.6)
    return close[0] if close and word not in WHICH else None


def resolve(value: str, search_root: Path = Path("outputs"), setting: str = "resume", which: str = "last") -> Path:
    """`resume` (or `setting`) -> the checkpoint file: a .pt file, a run dir holding checkpoints/last.pt,
    or `latest` (the newest under outputs/). `setting` is a key (resume) or a command (`launch eval`),
    which the messages spell as typed: resume=VALUE, launch eval VALUE. which="best" (`launch eval RUN best`):
    the run's checkpoints/best.pt instead (checkpoint.keep_best)."""
    if which == "best":
        return _best(value, search_root, setting)

    def typed(v: str) -> str:
        return f"{setting} {v}" if " " in setting else f"{setting}={v}"

    def example(v: str) -> str:
        return typed(v) if setting.startswith("launch ") else f"launch {typed(v)}"

    if value == "latest":
        newest = latest(search_root)
        if newest is None:
            raise LaunchError(f"{typed('latest')} is not valid: no checkpoint under {search_root.resolve()}/ "
                              f"(e.g. {example('outputs/DATE/TIME-RECIPE-ID')})")
        return newest
    path = Path(os.path.expanduser(value))
    if path.is_dir():
        path = last_checkpoint(path)
    if not path.is_file():
        raise LaunchError(f"{typed(value)} is not valid: {path} does not exist; give a run dir that holds "
                          f"checkpoints/last.pt, a .pt file, or latest (e.g. {example('latest')})")
    return path


def latest(search_root: Path = Path("outputs")) -> Path | None:
    """What `latest` means (resume=latest, launch eval latest, and the run `launch runs` marks): the
    checkpoints/last.pt under `search_root` written last, by its time, not by its run dir's name (a run
    started earlier that is still training, or was resumed in place by a restart, wrote the newest one)."""
    newest: tuple[int, str] | None = None
    for path in search_root.glob(f"**/{CHECKPOINTS}/{LAST_CHECKPOINT}"):
        try:
            when = (path.stat().st_mtime_ns, str(path))
        except OSError:  # (replaced or removed meanwhile)
            continue
        newest = max(newest, when) if newest else when
    return Path(newest[1]) if newest else None


def _best(value: str, search_root: Path, setting: str) -> Path:
    """The best checkpoint of the run `value` names (its dir, a checkpoint file in its checkpoints/, latest)."""
    last = resolve(value, search_root, setting) if value == "latest" else Path(os.path.expanduser(value))
    folder = last / CHECKPOINTS if last.is_dir() else last.parent
    best = folder / BEST_CHECKPOINT
    if best.is_file():
        return best
    run = folder.parent if folder.name == CHECKPOINTS else folder
    if not folder.is_dir():
        raise LaunchError(f"{setting} {value} best is not valid: {run} is not a run dir (give the run dir, e.g. "
                          f"{setting} outputs/DATE/TIME-RECIPE-ID best)")
    raise LaunchError(f"{setting} {value} best is not valid: {run} kept no best checkpoint (it was trained without "
                      f"checkpoint.keep_best); use its last one ({setting} {value}), or train with "
                      "checkpoint.keep_best=3")


def _pickle_start(path: Path) -> bool:
    """Whether the file starts as a pickle of protocol 2 or later does (torch.save's old format)."""
    with open(path, "rb") as f:
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def sharded_damage(path: Path, folder_name: Any) -> str | None:
    """What is wrong with the torch.distributed.checkpoint folder a sharded last.pt names, read without
    loading a tensor: the folder, its .metadata (read as DCP reads it), and every byte range the metadata
    places in a shard file (a missing or truncated file). None: whole, as far as sizes tell."""
    if not isinstance(folder_name, str) or not folder_name or "/" in folder_name or folder_name in (".", ".."):
        return f"it names its shards' folder as {str(folder_name)[:80]!r}, not a folder beside it"
    folder = path.parent / folder_name
    if not folder.is_dir():
        return f"its shards' folder {folder} is missing"
    if not (folder / ".metadata").is_file():
        return f"{folder} has no .metadata (the index torch.distributed.checkpoint writes last)"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(folder)).read_metadata()
        placed = dict(metadata.storage_data or {})
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler raises on a damaged index
        return f"{folder / '.metadata'} is damaged ({type(exc).__name__})"
    ends: dict[str, int] = {}
    for where in placed.values():
        name = str(getattr(where, "relative_path", ""))
        end = int(getattr(where, "offset", 0)) + int(getattr(where, "length", 0))
        ends[name] = max(ends.get(name, 0), end)
    for name, end in sorted(ends.items()):
        shard = folder / name
        if not shard.is_file():
            return f"its shard file {shard} is missing"
        if shard.stat().st_size < end:
            return f"its shard file {shard} is truncated ({shard.stat().st_size} bytes; its index places {end})"
    return None


def saved_position(path: Path) -> tuple[int, int | None] | None:
    """Where the checkpoint at `path` stands: (epochs it has trained, steps of the next epoch it holds where it
    was written inside one (checkpoint_every_steps), else None), where it reads as a launch checkpoint and
    (sharded) all its shards are there by size; None otherwise. Tensors memory-mapped and nothing digested:
    said as a run stops, which must not wait for a read of its weights."""
    try:
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception:  # noqa: BLE001 - missing, half-written or not a checkpoint: no epoch to name
        return None
    epoch = state.get("epoch") if isinstance(state, dict) else None
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        return None
    whole = "sharded" not in state or sharded_damage(path, state["sharded"]) is None
    return (epoch, _step_in_epoch(state)) if whole else None


def _step_in_epoch(state: dict[str, Any]) -> int | None:
    """The steps of its next epoch a checkpoint written inside an epoch holds, else None (an epoch's end)."""
    step = state.get("step_in_epoch")
    return step if isinstance(step, int) and not isinstance(step, bool) and step > 0 else None


def what_a_resume_finds(run_dir: Path) -> str:
    """For the line a stopped run ends with: which epoch `launch resume=RUN_DIR` goes on from, and the
    logged epochs after it whose checkpoints were not finished (written in the background: an epoch's
    line comes before its checkpoint is whole); "" where the run logged no epoch and saved nothing."""
    epoch, step = saved_position(last_checkpoint(run_dir)) or (None, None)
    logged = _last_logged_epoch(run_dir)
    unfinished = logged if logged and logged > (epoch or 0) else None
    if epoch is not None:
        where = "".join(f" {o}" for o in _where_it_ran(run_dir))
        at = f"epoch {epoch + 1} after its step {step}" if step else f"epoch {epoch}"
        return f"launch resume={run_dir}{where} goes on from its checkpoint ({at}" + \
            (f"; epoch {unfinished}'s checkpoint was not finished)" if unfinished else ")")
    return f"epoch {unfinished}'s checkpoint was not finished: no checkpoint to resume from" if unfinished else ""


def _where_it_ran(run_dir: Path) -> list[str]:
    """The overrides of the run's command line (.hydra/overrides.yaml) that say where and how it runs (gpus,
    nprocs, strategy.*, backend.*, perf.*, data.placement), which a resume takes from its own command line, not
    the checkpoint (perf.precision, which it carries, repeated as typed changes nothing):
    the resume line repeats them, so that a CPU run on 2 ranks goes on as one, not on every GPU there is."""
    import shlex

    import yaml

    try:
        typed = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        return []
    layout = ("gpus", "nprocs", "strategy", "backend", "perf")

    def where(override: str) -> bool:
        key = override.partition("=")[0].lstrip("+~")
        return key.split(".")[0] in layout or key == "data.placement"

    kept = [o for o in typed if isinstance(o, str) and where(o)]
    return [o if re.fullmatch(r"[\w.+~=\[\],:/@-]+", o) else shlex.quote(o) for o in kept]


def _last_logged_epoch(run_dir: Path) -> int | None:
    """The last epoch metrics.jsonl records (rank 0 appends a row per epoch as it logs its line)."""
    rows = read_json_lines(run_dir / METRICS)
    epoch = rows[-1].get("epoch") if rows else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


_checked: dict[tuple[str, int, int, int], str | None] = {}  # a file's identity -> what its seal said


def _whole_previous(path: Path) -> Path | None:
    """previous.pt beside a damaged last.pt, where it is whole (the run keeps the checkpoint before its last)."""
    previous = path.with_name(PREVIOUS_CHECKPOINT)
    if path.name != LAST_CHECKPOINT or not previous.is_file():
        return None
    try:
        import torch

        state = torch.load(previous, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - unreadable: not offered
        return None
    return previous if isinstance(state, dict) and _broken_seal(state, previous) is None else None


def _broken_seal(state: dict[str, Any], path: Path) -> str | None:
    """integrity.broken_seal, once per file as it is now (one launch reads its checkpoint several times)."""
    found = path.stat()
    key = (str(path.resolve()), found.st_ino, found.st_size, found.st_mtime_ns)
    if key not in _checked:
        _checked[key] = integrity.broken_seal(state, path)
    return _checked[key]


def load_checkpoint(path: Path, setting: str) -> dict[str, Any]:
    """A launch checkpoint read with weights_only=True (tensors memory-mapped, not read), or one line
    saying what the file is instead."""
    import pickle

    import torch

    def refuse(what: str) -> LaunchError:
        earlier = _whole_previous(path)  # (a run's last.pt damaged past reading: the one before it may be whole)
        hint = (f"the checkpoint before it, {earlier}, is whole: give that path instead" if earlier else
                "give the run dir of a launch run, or its checkpoints/last.pt")
        return LaunchError(f"{setting} is not valid: {path} is not a launch checkpoint ({what}); {hint}")

    if path.stat().st_size == 0:
        raise refuse("the file is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # noqa: BLE001 - whatever torch's unpickler raises on a file that is not one
        # (UnpicklingError, RuntimeError, EOFError, ValueError, BadZipFile; torch 2.13's IndexError on text)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not zipfile.is_zipfile(path) and not _pickle_start(path):
            what = "not written by torch.save: neither the zip archive nor the pickle it writes"
        elif "central directory" in first or "zip archive" in first or isinstance(exc, EOFError):
            what = "truncated, or not written by torch.save"
        elif isinstance(exc, pickle.UnpicklingError):
            what = "not written by torch.save, or it holds objects that weights_only=True does not load"
        else:
            what = f"it does not load with weights_only=True: {first[:160]}"
        raise refuse(what) from None
    if isinstance(state, torch.Tensor):
        raise refuse("it holds a single tensor")
    if not isinstance(state, dict):
        raise refuse(f"it holds a {type(state).__name__}")
    if ("net_state_dict" not in state and "sharded" not in state) or "epoch" not in state:
        tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
        what = ("a plain state_dict: weights only, no optimizer, epoch or config" if tensors and tensors == len(state)
                else f"a dict without net_state_dict and epoch (keys: {', '.join(map(str, list(state)[:5]))})")
        raise refuse(what)
    if not isinstance(state["epoch"], int) or isinstance(state["epoch"], bool) or state["epoch"] < 0:
        raise refuse(f"its epoch is {state['epoch']!r}, not a count of epochs")
    if "sharded" in state:
        damaged = sharded_damage(path, state["sharded"])
        if damaged:
            raise LaunchError(f"{setting} is not valid: the sharded checkpoint {path} cannot be read whole: {damaged}; "
                              f"give an earlier run's checkpoint, or train afresh")
    config = state.get("config")
    if config is not None and not (isinstance(config, dict) and all(
            isinstance(config.get(section), (dict, type(None))) for section in ("recipe", "optim"))):
        raise refuse("its config is not the settings a launch writes")
    for group in CARRIED_GROUPS:  # (a resume adds them to the command line: names, never other overrides)
        name = ((config or {}).get(group) or {}).get("name")
        if name is not None and not (isinstance(name, str) and CHOICE_NAME.fullmatch(name)):
            raise refuse(f"its {group} is {str(name)[:80]!r}, not a {group} name")
    broken = _broken_seal(state, path)
    if broken:
        earlier = _whole_previous(path)
        hint = (f"the checkpoint before it, {earlier}, is whole: give that path instead" if earlier else
                "give an earlier checkpoint or the run it belongs to, or train afresh")
        raise LaunchError(f"{setting} is not valid: the checkpoint {path} cannot be trusted: {broken}; {hint}")
    return state


def inspect(value: str, cfg: Config, search_root: Path = Path("outputs")) -> Resume:
    """The checkpoint `resume=value` names, checked against this launch's config (a LaunchError if it
    cannot continue under it)."""
    found = named_checkpoint(value, search_root)
    epoch = found.epoch
    now = choices(cfg)
    which = f"the checkpoint ({found.path})" if value == "latest" else "the checkpoint"  # (latest: which run's)
    for key, was in saved_choices(found.config).items():
        if was not in (None, now[key]):
            raise LaunchError(f"{key}={now[key]} is not valid with resume={value}: {which} was trained with "
                              f"{key}={was}, and its weights and optimizer state only continue under it (e.g. "
                              f"launch {key}={was} resume={value})")
    from launcher.strategies import STRATEGIES

    strategy = STRATEGIES.get(type(cfg.strategy))
    if strategy is not None and strategy.sharded and not found.sharded:
        raise LaunchError(f"strategy={cfg.strategy.name} is not valid with resume={value}: a checkpoint of an "
                          "unsharded run resumes under an unsharded strategy, ddp or single (sharded runs' checkpoints "
                          f"resume under any), e.g. launch strategy=ddp resume={value}")
    if cfg.epochs <= epoch:
        raise LaunchError(f"epochs={cfg.epochs} is not valid with resume={value}: {which} has trained {epoch} "
                          f"epoch{'s' if epoch != 1 else ''} already; give more (e.g. launch resume={value} "
                          f"epochs={epoch + max(1, epoch)}), or evaluate it: launch eval {value}")
    changed = _differences(flat_keys(found.config), flat_keys(to_plain(cfg)))
    return Resume(found.path, epoch, changed, found.classes, found.step, found.shapes)


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    if not saved:
        return {}
    return {k: (saved.get(k), v) for k, v in now.items()
            if k.split(".")[0] not in _NOT_SETTINGS and k not in _NOT_SETTINGS and k in saved and saved[k] != v}


def typed_keys(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The config keys a list of Hydra overrides sets (`lr=0.1` -> lr, `+a.b=1` -> a.b, `optim=adamw` -> optim)."""
    keys = set()
    for override in overrides:
        key = override.partition("=")[0].strip().lstrip("+~").partition("@")[0]
        if key and not key.startswith("hydra"):
            keys.add(key)
    return keys


def _given(key: str, typed: set[str]) -> bool:
    """`key` (or a section holding it) is set on the command line, or is never carried. Choosing a
    carried group's option (`optim=sgd`) sets none of its values: a resume must choose the checkpoint's."""
    if key in _GROUP_NAMES:
        return True  # (the option chosen, not a value to set in it)
    parts = key.split(".")
    prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    if prefixes & (typed - set(CARRIED_GROUPS)):
        return True
    return key not in CARRIED_ANYWAY and bool(prefixes & _NOT_CARRIED)


def _single_value(value: str) -> bool:
    """A resume value that may name one checkpoint: not a sweep's list, range or glob, and not a value
    Config.check refuses in its own words (true, false, none, empty)."""
    value = value.strip().strip("'\"").strip()
    return (value.lower() not in ("", "true", "false", "none", "null") and "," not in value
            and not value.startswith(("choice(", "range(", "glob(", "interval(", "[")))


def is_resume(override: str) -> bool:
    """`resume=...` (or `+resume=...`) on a command line."""
    return override.partition("=")[0].strip().lstrip("+") == "resume" and "=" in override


@dataclass(frozen=True)
class Saved:
    """What the launcher reads of the checkpoint `resume=` names, before any worker starts."""
    path: Path  # the checkpoint file, resolved
    config: dict[str, Any]  # the config it was trained with ({} where it holds none)
    epoch: int  # epochs it has trained
    sharded: bool  # written by a sharded strategy (fsdp)
    unproven: str | None  # why it is not proven a run of this user's wrote it (integrity.unproven), else None
    classes: tuple[str, ...] | None  # the class names its network was trained on (saved_classes)
    step: int | None  # steps of the next epoch it holds (checkpoint_every_steps), else None
    shapes: dict[str, tuple[int, ...]]  # the shape of each weight and buffer of its network (saved_shapes)


@functools.lru_cache(maxsize=4)
def _read(path: Path, version: tuple[int, int], setting: str) -> Saved:
    """Saved for the checkpoint at `path`: read once per launch (cached by path, mtime and size) whoever asks,
    the command line, each composed run, the check before the workers."""
    state = load_checkpoint(path, setting)
    return Saved(path, state.get("config") or {}, state["epoch"], "sharded" in state, integrity.unproven(state),
                 saved_classes(state), _step_in_epoch(state), saved_shapes(state, path))


def saved_classes(state: dict[str, Any]) -> tuple[str, ...] | None:
    """The class names a checkpoint's network was trained on, in the order of its outputs (`classes`,
    written where the data named them: an image folder's class folders); None where it holds none."""
    classes = state.get("classes")
    if isinstance(classes, (list, tuple)) and classes and all(isinstance(c, str) for c in classes):
        return tuple(classes)
    return None


def saved_shapes(state: dict[str, Any], path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of each weight and buffer of a checkpoint's network, by its state_dict name: a whole
    checkpoint's net_state_dict (memory-mapped: nothing read), a sharded one's from its folder's metadata
    (the whole tensors' shapes, however many ranks wrote them); {} where neither can be read."""
    import torch

    weights = state.get("net_state_dict")
    if isinstance(weights, dict):
        return {str(k): tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    if not isinstance(state.get("sharded"), str):
        return {}
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(path.parent / state["sharded"])).read_metadata()
    except Exception:  # noqa: BLE001 - unreadable metadata: the workers' load says what is wrong
        return {}
    return {key.removeprefix("model."): tuple(item.size) for key, item in metadata.state_dict_metadata.items()
            if key.startswith("model.") and hasattr(item, "size")}


def misfit(saved: dict[str, tuple[int, ...]], model: Any) -> str | None:
    """Where a checkpoint's weights (`saved`: saved_shapes) do not fit `model` (the network this config
    builds, on the meta device): the first weight of another shape, said with both shapes, or the weights
    one holds and the other lacks (another number of layers); None where they are the same weights."""
    here = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, shape in saved.items():
        if name in here and here[name] != shape:
            return f"its {name} is {list(shape)}, the network here has {list(here[name])}"

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    lacking, extra = sorted(set(here) - set(saved)), sorted(set(saved) - set(here))
    if lacking:
        return f"the network here has {some(lacking)}, which the checkpoint does not hold"
    if extra:
        return f"the checkpoint holds {some(extra)}, which the network here does not have"
    return None


def check_network(recipe: Any, resume: Resume, value: str) -> None:
    """A LaunchError before any worker where the checkpoint's weights do not fit the network this config
    builds (a resume typing another recipe.size, recipe.layers or recipe.width): the recipe's model is built
    on the meta device (Recipe.model_to_size, in a child: launcher/host/memory.py in_child) and compared by
    shape. Before, a worker found it when it loaded the weights, and the launch left a failed run dir.
    Nothing where the recipe cannot build its model before its data (the workers' load still says it)."""
    if not resume.shapes:
        return
    from launcher.host.memory import in_child

    why = in_child(_network_misfit, recipe, resume.shapes)
    if why is None:
        return
    typed = [f"{k}={old}" for k, (old, _) in resume.changed.items() if k.startswith(("recipe.", "model."))]
    hint = f"it was trained with {' '.join(typed)}" if typed else "the network's layers differ"
    raise LaunchError(f"resume={value} is not valid: the checkpoint does not fit the network this config builds "
                      f"({hint}: {why}) (e.g. launch {' '.join(typed) or 'recipe.model=...'} resume={value})")


def _network_misfit(recipe: Any, shapes: dict[str, tuple[int, ...]]) -> str | None:
    from launcher.models import configured

    if configured(recipe.cfg.model):  # (a network from config is built in the workers only: launcher/models.py)
        return None
    model = recipe.model_to_size()
    return None if model is None else misfit(shapes, model)


def check_classes(saved: tuple[str, ...] | None, here: tuple[str, ...], setting: str, root: Any) -> None:
    """A LaunchError where the data here names other classes than the checkpoint's network was trained on
    (output i means the checkpoint's class i: on a folder whose classes differ, or sort otherwise, its
    accuracy and a resumed training would be nonsense without a word). Nothing where either side names none."""
    if not saved or not here or tuple(saved) == tuple(here):
        return

    def listed(names: list[str] | tuple[str, ...]) -> str:
        return ", ".join(names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")

    missing = [c for c in saved if c not in here]
    new = [c for c in here if c not in saved]
    what = "; ".join(([f"missing here: {listed(missing)}"] if missing else []) +
                     ([f"not in the checkpoint: {listed(new)}"] if new else [])) or \
        f"the same names in another order ({listed(here)})"
    raise LaunchError(f"{setting} is not valid with data.root={root}: its network's outputs are the {len(saved)} "
                      f"classes it was trained on ({listed(saved)}, in that order), but the data here holds "
                      f"{len(here)} ({what}): give data.root a folder with the class folders it was trained on")


def named_checkpoint(value: str, search_root: Path = Path("outputs")) -> Saved:
    """The checkpoint `resume=value` names, read (a LaunchError if it is not a launch checkpoint)."""
    path = resolve(value, search_root).resolve()
    stat = path.stat()
    return _read(path, (stat.st_mtime_ns, stat.st_size), f"resume={value}")


def saved_config(value: str, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The config the checkpoint `resume=value` was trained with, once the user consented to any code it
    names (launcher/host/consent.py: typed in `overrides`, or a seal of this user's key); else a LaunchError,
    before anything of it is imported."""
    from launcher.host import consent

    found = named_checkpoint(value)
    consent.require(found.config, found.unproven, overrides, f"resume={value}")
    return found.config


def with_saved_choices(overrides: list[str]) -> list[str]:
    """`overrides` with the recipe and optimizer of the checkpoint `resume=` names added,
    where the command line names none: Hydra then composes that recipe's and optimizer's config
    (`launch resume=latest` after a cifar10 run is a cifar10 run). Unchanged without resume=, or for a
    sweep over several resume values (each run's recipe must then be given)."""
    values = [o.partition("=")[2] for o in overrides if is_resume(o)]
    if len(values) != 1 or not _single_value(values[0]):
        return overrides
    config = saved_config(values[0].strip().strip("'\""), overrides)
    typed = typed_keys(overrides)
    added = []
    for group in CARRIED_GROUPS:
        name = (config.get(group) or {}).get("name")
        if name and group not in typed:
            added.append(f"{group}={name}")
    # beside resume=: Hydra's parser takes the overrides as one run of words between its flags (-m, --cfg job)
    at = next(i for i, o in enumerate(overrides) if is_resume(o)) + 1
    return [*overrides[:at], *added, *overrides[at:]]


def _follows(cfg: Any, key: str, saved_value: Any, saved: dict[str, Any]) -> bool:
    """`key` is `${other}` in this config and held other's value in the checkpoint too (recipe=text's
    eval.batch_size: its batch_size): it keeps following other, carried or typed, rather than the saved
    number, so `resume=RUN batch_size=8` also evaluates in chunks of 8."""
    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not OmegaConf.is_dict(node) or leaf not in node or not OmegaConf.is_interpolation(node, leaf):
        return False
    raw = OmegaConf.to_container(node, resolve=False).get(leaf)
    match = re.fullmatch(r"\$\{([A-Za-z_][\w.]*)\}", raw) if isinstance(raw, str) else None
    return match is not None and match.group(1) in saved and saved[match.group(1)] == saved_value


def _literal(value: Any) -> Any:
    """A saved value as the text it is: launch writes configs resolved, so a `${...}` in one is not an
    interpolation to resolve here (a checkpoint from elsewhere would read this machine's environment
    into the run's config with `${oc.env:...}`)."""
    if isinstance(value, str):
        from launcher.host.consent import literal

        return literal(value)
    if isinstance(value, (list, tuple)):
        return [_literal(v) for v in value]
    if isinstance(value, dict):  # (a list's dicts: flat_keys leaves them whole)
        return {k: _literal(v) for k, v in value.items()}
    return value


def carry_settings(cfg: Any, overrides: list[str] | tuple[str, ...]) -> Any:
    """The composed config (a DictConfig without `hydra`) with every training setting of the checkpoint
    `cfg.resume` names that `overrides` do not set (see NOT_CARRIED): a copy; `cfg` itself if there is
    no resume. Keys this launch's config no longer has, or whose saved value it no longer accepts, keep
    their defaults (the start-up line and plan.json name every difference)."""
    import copy

    from omegaconf import OmegaConf, read_write
    from omegaconf.errors import OmegaConfBaseException

    value = OmegaConf.select(cfg, "resume")
    if value is None or not _single_value(str(value)):
        return cfg
    config = saved_config(str(value), overrides)
    typed = typed_keys(overrides)
    _refuse_another_network(cfg, config, str(value), typed)
    if isinstance(config.get("recipe"), dict):
        config = {**config, "recipe": recipe_as_saved(config["recipe"])}
    saved = flat_keys(config)
    absent = object()
    cfg = copy.deepcopy(cfg)
    with read_write(cfg):
        for key, saved_value in saved.items():
            if (_given(key, typed) or OmegaConf.select(cfg, key, default=absent) is absent
                    or _follows(cfg, key, saved_value, saved)):
                continue
            try:
                OmegaConf.update(cfg, key, _literal(saved_value), merge=False)
            except (OmegaConfBaseException, ValueError):
                continue
        root = data_root_here(saved.get("data.root"))
        if root is not None and not ({"data", "data.root"} & typed) and "data" in cfg:
            cfg.data.root = _literal(root)  # (the run's own data, where that folder is on this machine too)
        _carry_network_arguments(cfg, config.get("model"))
    return cfg


def _refuse_another_network(cfg: Any, config: dict[str, Any], value: str, typed: set[str]) -> None:
    """A model typed beside resume= that is not the checkpoint's (`recipe.model=gpt` for a llama run) is
    refused here, in inspect()'s words, before the checkpoint's other keys are carried: carried, they were
    refused for the model typed instead (`recipe.size=debug is not valid: names a Llama 3 shape`), which
    blamed a key the user had not typed."""
    from omegaconf import OmegaConf

    from launcher.config import saved_choices

    key, saved = "recipe.model", saved_choices(config).get("recipe.model")
    now = OmegaConf.select(cfg, key, default=None)
    if _given(key, typed) and saved is not None and now is not None and str(now) != str(saved):
        raise LaunchError(f"{key}={now} is not valid with resume={value}: the checkpoint was trained with "
                          f"{key}={saved}, and its weights and optimizer state only continue under it (e.g. "
                          f"launch {key}={saved} resume={value}, or train {key}={now} from the start without "
                          "resume=)")


def _carry_network_arguments(cfg: Any, model: Any) -> None:
    """A network from config (`model._target_`) resumes with the arguments it was built with (`+model.KEY`,
    keys the composed config does not have), where this launch builds the same target; arguments typed
    here win. Another target typed here takes none of them."""
    from omegaconf import open_dict

    if not (isinstance(model, dict) and model.get("_target_") and "model" in cfg
            and cfg.model.get("_target_") == model["_target_"]):
        return
    with open_dict(cfg.model):
        for key, value in model.items():
            if key not in cfg.model:
                cfg.model[key] = _literal(value)


def data_root_here(root: Any) -> str | None:
    """A checkpoint's data.root, where that folder is on this machine too (a resume and `launch eval` train
    or score on the run's own data there; elsewhere this command line's or the default), else None."""
    return root if isinstance(root, str) and root and Path(root).expanduser().is_dir() else None
