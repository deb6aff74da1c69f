"""`launch eval RUN_DIR [key=value ...]`: evaluate a saved model, on any gpus and strategy.

    launch eval outputs/2026-11-22/10-00-00-cifar10-ab12              its test split, where launch picks
    launch eval outputs/2026-11-22/10-00-00-cifar10-ab12 best         its best checkpoint (checkpoint.keep_best)
    launch eval outputs/.../checkpoints/last.pt gpus=[0,1] strategy=ddp

The weights are read with weights_only=True; the run is a new run dir (TIME-RECIPE-eval-ID) holding
eval.json (accuracy, loss, accuracy per class, the confusion matrix) and confusion.png. The recipe, its
model and its hyper-parameters are the checkpoint's (what built the network that was saved), and so is
`data.synthetic` (a model trained on generated data is evaluated on generated data), a network from
config (`model._target_` and its arguments), `batch_size`, `data.on_bad_file`, and `data.root` where the
run's folder is here too; the command line can change the rest (gpus, strategy, eval.batch_size, data.root,
precision). It is the same as `launch eval.checkpoint=PATH recipe=...` with the checkpoint's recipe values
spelled out.

A live run's checkpoint is held still while the workers read it (`pin`: hard links in the eval run dir), so
every rank evaluates the one checkpoint that was checked, even as the run replaces it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from launcher import integrity
from launcher.config import Config, choices, recipe_as_saved, saved_choices
from launcher.errors import LaunchError
from launcher.files import CONFUSION, EVAL, identity
from launcher.host import consent
from launcher.host.resume import WHICH, data_root_here, load_checkpoint, misspelled_which, resolve, saved_classes

log = logging.getLogger("launcher")

USAGE = ("launch eval RUN_DIR_OR_CHECKPOINT [best|last] [key=value ...] (e.g. launch eval outputs/DATE/TIME-RECIPE-ID "
         "best gpus=[0])")


def _hydra_value(value: Any) -> str:
    """A value as a Hydra override spells it (strings quoted, so nothing in them is read as syntax)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):  # (a network's argument may be a section of its own)
        return "{" + ",".join(f"{_key(k)}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    # (a saved `${...}` is text: Hydra would resolve it, reading this machine's environment; backslashes
    # before a quote or the end doubled, as Hydra's quoted strings read them)
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, consent.literal(str(value)))
    return "'" + text.replace("'", "\\'") + "'"


KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _key(key: Any) -> str:
    """A saved config's key as an override names it: a name, as launch's schemas and `+model.KEY` write
    them (anything else would be read as override syntax)."""
    if not (isinstance(key, str) and KEY.fullmatch(key)):
        raise LaunchError(f"launch eval is not valid: the checkpoint's config holds the key {str(key)[:80]!r}, not "
                          "one a launch writes; evaluate it with launch eval.checkpoint=PATH recipe=NAME")
    return key


def command_line(argv: list[str]) -> list[str]:
    """`eval PATH overrides...` -> the overrides of the launch that evaluates PATH."""
    if len(argv) < 2 or "=" in argv[1] or argv[1].startswith("-"):
        raise LaunchError(f"launch eval needs the run dir or checkpoint to evaluate: {USAGE}")
    where, overrides = argv[1], argv[2:]
    which = "last"
    if overrides and overrides[0] in WHICH:  # `launch eval RUN best`: its best checkpoint (checkpoint.keep_best)
        which, overrides = overrides[0], overrides[1:]
    bad = next((o for o in overrides if "=" not in o and not o.startswith("-")), None)
    if bad is not None:
        guess = misspelled_which(bad)
        hint = f"did you mean launch eval {where} {guess}? " if guess else ""
        raise LaunchError(f"launch eval {where} {bad} is not valid: {hint}after the run dir come best or last, then "
                          f"key=value overrides (e.g. launch eval {where} best gpus=[0])")
    path = resolve(where, setting="launch eval", which=which)
    if which == "best":
        where = str(path)  # (what the eval run and its messages name)
    state = load_checkpoint(path, f"launch eval {where}")
    consent.require(state.get("config") or {}, integrity.unproven(state), overrides, f"launch eval {where}")
    recipe = (state.get("config") or {}).get("recipe") or {}
    if not recipe.get("name"):
        raise LaunchError(f"launch eval {where}: the checkpoint does not say which recipe trained it (written by an "
                          "older launch); evaluate it with launch eval.checkpoint=PATH recipe=NAME")
    recipe = recipe_as_saved(recipe)
    mine = [f"eval.checkpoint={_hydra_value(str(path.resolve()))}", f"recipe={recipe['name']}"]
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    asked = [o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+~") == "recipe"]
    if asked and asked[-1] != recipe["name"]:  # (its recipe.* keys would be another recipe's: a wrong key named)
        raise LaunchError(f"recipe={asked[-1]} is not valid with launch eval {where}: the checkpoint was trained "
                          f"with recipe={recipe['name']}, which evaluates it (e.g. launch eval {where}, without "
                          "recipe=)")
    mine += [f"recipe.{_key(k)}={_hydra_value(v)}" for k, v in recipe.items()
             if k != "name" and f"recipe.{k}" not in given]
    config = state.get("config") or {}
    data = config.get("data") or {}
    if data.get("synthetic") and "data.synthetic" not in given:  # the data it was trained on (generated: again)
        mine.append("data.synthetic=true")
    if data.get("on_bad_file") and "data.on_bad_file" not in given:  # (files it left out: left out again)
        mine.append(f"data.on_bad_file={_hydra_value(data['on_bad_file'])}")
    root = data_root_here(data.get("root"))
    if root is not None and "data.root" not in given:
        mine.append(f"data.root={_hydra_value(root)}")  # (the run's own data, where it is here too)
    model = config.get("model") or {}
    typed_target = consent.typed_values(overrides).get("model._target_")
    if isinstance(model, dict) and model.get("_target_") and typed_target in (None, model["_target_"]):
        if typed_target is None:  # (the network that was saved, and its arguments not typed here)
            mine.append(f"model._target_={_hydra_value(model['_target_'])}")
        mine += [f"+model.{_key(k)}={_hydra_value(v)}" for k, v in model.items()
                 if k != "_target_" and not any(g == f"model.{k}" or g.startswith(f"model.{k}.") for g in given)]
    batch = config.get("batch_size")
    if isinstance(batch, int) and "batch_size" not in given:  # (what its data was checked against)
        mine.append(f"batch_size={batch}")
    return [*mine, *overrides]


def checkpoint_to_evaluate(cfg: Config) -> tuple[Path, tuple | None, tuple[str, ...] | None]:
    """The checkpoint `eval.checkpoint` names, checked: a launch checkpoint of this recipe and model. With
    it, which file was checked (`files.identity`; None where a run replaced it meanwhile), and the classes
    its network was trained on (resume.saved_classes)."""
    value = str(cfg.eval.checkpoint)
    path = resolve(value, setting="eval.checkpoint").resolve()
    before = identity(path)
    state = load_checkpoint(path, f"eval.checkpoint={value}")
    now = choices(cfg)
    for key, saved in saved_choices(state.get("config") or {}).items():
        if key != "optim" and saved not in (None, now[key]):  # (evaluating needs no optimizer)
            raise LaunchError(f"{key}={now[key]} is not valid with eval.checkpoint={value}: the checkpoint holds a "
                              f"{key}={saved} network (e.g. launch eval {value}, which takes the checkpoint's)")
    return path, (before if identity(path) == before else None), saved_classes(state)


ATTEMPTS = 3  # a live run's checkpoint replaced while it is pinned, before giving up


def pin(path: Path, checked: tuple | None, into: Path, setting: str) -> Path | None:
    """The checkpoint at `path` held still for the workers that evaluate it: hard links in `into` (the eval
    run's PINNED folder) to it and, for a sharded one, to its shard folder's files. A live run goes on
    replacing its last.pt and removing older shard folders while `launch eval` reads; through the links
    every rank reads one and the same checkpoint, whole. The linked file is checked again where it is not
    the one `checkpoint_to_evaluate` checked (`checked`). None where links cannot be made (another
    filesystem, not permitted): the workers read `path` itself, as they would without this."""
    for _ in range(ATTEMPTS):
        shutil.rmtree(into, ignore_errors=True)
        pinned = into / path.name
        try:
            into.mkdir(parents=True)
            os.link(path, pinned)
            folder = _shard_folder(pinned)
            if folder is not None:
                _link_files(path.parent / folder, into / folder)
        except FileNotFoundError:  # (replaced meanwhile, its shard folder removed: the newer one)
            continue
        except OSError as exc:
            log.debug("%s: the checkpoint is read in place (no hard links in %s: %s)", setting, into, exc)
            shutil.rmtree(into, ignore_errors=True)
            return None
        if identity(pinned) != checked:  # (a link is the same file: same identity)
            load_checkpoint(pinned, setting)  # (a newer one than was checked: its seal and shards checked too)
        return pinned
    raise LaunchError(f"{setting} failed: {path} was replaced {ATTEMPTS} times while it was read (a run writing "
                      "checkpoints quickly); try again, or evaluate it once the run ended")


def unpin(into: Path) -> None:
    """The links `pin` made, removed once the workers are done (the checkpoint itself is not touched)."""
    shutil.rmtree(into, ignore_errors=True)


def _shard_folder(path: Path) -> str | None:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - checked where it is read (load_checkpoint says what is wrong)
        return None
    folder = state.get("sharded") if isinstance(state, dict) else None
    return folder if isinstance(folder, str) and folder and "/" not in folder and folder not in (".", "..") else None


def _link_files(folder: Path, into: Path) -> None:
    into.mkdir()
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            _link_files(Path(entry.path), into / entry.name)
        else:
            os.link(entry.path, into / entry.name)


def summarize(results: dict[str, Any] | None, run_dir: Path, elapsed: float) -> None:
    results = results or {}
    acc, images = results.get("test_acc"), results.get("test_images")
    language = "test_bpb" in results or "test_ppl" in results  # (recipe=text: on bytes, or on token ids)
    if "per_class_acc" not in results and not language:  # a recipe's own figures (regression...)
        figures = {k: v for k, v in results.items() if k.startswith("test_") and isinstance(v, (int, float))}
        shown = ", ".join(f"{k.removeprefix('test_')} {v:.4g}" for k, v in figures.items()) or "no figures"
        log.info("evaluated %s in %.1fs: %s. %s", results.get("evaluated"), elapsed, shown, run_dir / EVAL)
        return
    if "per_class_acc" not in results:  # not a classifier (a language model)
        bpb, ppl = results.get("test_bpb"), results.get("test_ppl")
        per = f" ({bpb:.3f} bits/byte)" if bpb else f" (perplexity {ppl:.1f})" if ppl else ""
        log.info("evaluated %s in %.1fs: test loss %.4f%s, next-token accuracy %.2f%%. %s", results.get("evaluated"),
                 elapsed, results.get("test_loss") or 0.0, per, 100 * (acc or 0.0), run_dir / EVAL)
        return
    per_class = {k: v for k, v in (results.get("per_class_acc") or {}).items() if v is not None}
    worst = sorted(per_class.items(), key=lambda kv: kv[1])[:3]
    shown = ", ".join(f"{name} {100 * v:.1f}%" for name, v in worst)
    skipped = results.get("eval_skipped")
    left_out = f" ({skipped} unreadable, left out)" if skipped else ""
    counted = "images" if results.get("unit", "img") in ("img", "images") else "samples"  # (a Dataset's points)
    log.info("evaluated %s in %.1fs: test accuracy %.2f%% on %s %s%s (loss %.4f); lowest classes: %s. "
             "%s  %s", results.get("evaluated"), elapsed, 100 * (acc or 0.0), images, counted, left_out,
             results.get("test_loss") or 0.0, shown, run_dir / EVAL, run_dir / CONFUSION)
