"""What a figure is called, and which names a recipe's figures may take.

An epoch's row (metrics.jsonl, the epoch line, results.json) holds the launcher's own keys (ROW_KEYS), the
training loss `loss`, the training_step's figures as train_NAME, the eval_step's as test_NAME, and what a
recipe's `report` derives. A name the launcher gives a meaning of its own is never a recipe's to reuse:
a figure that would be filed under a doubled prefix (test_test_mse), summed into the loss, written over by
one of the launcher's keys (train_s), or shown as an accuracy it is not (`acc`, a percentage in the epoch
line, "test accuracy" at the end) is refused in one line (exit 2) where it is first seen, and a `report`
that changes a figure the launcher computed, or adds one under such a name, likewise. Nothing is renamed.

The settings that name a figure (early_stop.metric, checkpoint.metric, sweep.objective) are checked
against the figures a run's epochs have: before any worker starts where the recipe's figures are known
up front (recipes/__init__.py `check_figures`), else at the first epoch that can have them, on every rank
alike (launcher/train/loop.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from launcher.config import DEFAULT_OBJECTIVE, Config, figure_key
from launcher.errors import ConfigError, LaunchError

ACCURACY = "acc"  # the launcher's accuracy: train_acc / test_acc, shown as a percentage
# The prefixes the launcher files figures under (and reads as its own: val_NAME means test_NAME)
PREFIXES = ("train_", "test_", "val_")
# The keys the launcher itself writes into an epoch's row, beside the loss and the steps' figures
# (`<unit>_per_s` for a recipe's own `unit` too)
ROW_KEYS = frozenset({
    "epoch", "started_unix", "resumed_at_step", "host_issue_s", "lr", "loss", "train_s", "img_per_s", "tokens_per_s",
    "samples_per_s", "input_stall", "skipped", "eval_skipped", "overflow_steps", "eval_s", "max_mem_allocated_mb",
    "max_mem_reserved_mb", "epoch_s", "checkpoint_wait_s", "checkpoint_write_s", "stopped_early",
})
HOOK_PREFIX = {"training_step": "train_", "eval_step": "test_"}


class LauncherFigures(dict):
    """Figures the launcher's own steps compute (Recipe's default training_step and eval_step, a built-in
    recipe's accuracy): the only ones that may be named `acc`, which every report shows as an accuracy. A
    recipe's step that returns the dict its default step returned (super().eval_step(...), added to or
    not) keeps it."""


def check_step_names(hook: str, figures: Mapping[Any, Any]) -> None:
    """The names of a training_step's or an eval_step's figures (`hook`), or one line (exit 2) for the first
    that would not appear as itself."""
    prefix = HOOK_PREFIX[hook]
    shows = "test_NAME (val/NAME)" if prefix == "test_" else "train_NAME"
    for name in figures:
        if not isinstance(name, str) or not name.strip() or any(c.isspace() or c == "/" for c in name):
            raise _bad(hook, name, f"a figure's name is a word ({hook}'s figures appear as {shows})", "'mse'")
        bare = next((name[len(p):] for p in PREFIXES if name.startswith(p) and len(name) > len(p)), None)
        if bare is not None:
            raise _bad(hook, name, f"{hook}'s figures appear as {prefix}NAME, so this one would be "
                       f"{prefix}{name}", f"{bare!r} (it appears as {prefix}{bare})")
        if prefix == "train_" and name == "loss":
            raise _bad(hook, name, "the loss is the step's first value, reported as loss; its figures are others",
                       "(loss, {'mae': ...})")
        if prefix + name in ROW_KEYS:
            raise _bad(hook, name, f"{prefix}{name} is one of the launcher's own keys of an epoch's row",
                       f"a name of its own ('{name}_value')")
        if name == ACCURACY and not isinstance(figures, LauncherFigures):
            raise _bad(hook, name, f"{prefix}acc is the launcher's accuracy (shown as a percentage, and as the test "
                       "accuracy), which its default steps compute (return super()." + hook + "(model, batch) for it)",
                       "the figure's own name ('mse', 'top1')")


def _bad(hook: str, name: Any, why: str, instead: str) -> LaunchError:
    return LaunchError(f"{hook}'s figure {name!r} is not valid: {why}; return it as {instead}")


def check_report(before: Mapping[str, Any], row: Mapping[str, Any], steps: Iterable[str]) -> None:
    """After a recipe's `report`: it changed no key of the row it was given (`before`), and added none under
    a name the launcher keeps (its own keys, the accuracy, and the train_NAME / test_NAME of the steps'
    figures, `steps`), else one line (exit 2)."""
    for key, value in before.items():
        if key not in row or (row[key] is not value and row[key] != value):
            raise LaunchError(f"report's figure {key!r} is not valid: {key} is a figure the launcher computed, which "
                              "report may read but not change or remove; add what it derives under a name of its "
                              f"own (row['{_derived(key)}'] = ...)")
    kept = ROW_KEYS | {f"{p}{ACCURACY}" for p in ("train_", "test_")} | set(steps)
    for key in row:
        if key not in before and key in kept:
            raise LaunchError(f"report's figure {key!r} is not valid: {key} is the launcher's own name (its keys, "
                              "its accuracy, the steps' figures); add what report derives under a name of its own "
                              f"(row['{_derived(key)}'] = ...)")


def _derived(key: str) -> str:
    prefix = next((p for p in ("train_", "test_") if key.startswith(p)), "")
    return f"{prefix}{key[len(prefix):]}_derived" if prefix else f"{key}_derived"


def side(key: str) -> str | None:
    """Which epochs have the figure `key`: "test" (evaluated ones: test_NAME), "train" (every one: loss,
    train_NAME), None (another value of a row or of results.json: known only where it is written)."""
    if key.startswith("test_"):
        return "test"
    if key == "loss" or key.startswith("train_"):
        return "train"
    return None


def named_settings(cfg: Config) -> list[tuple[str, str, str]]:
    """The settings that name a figure, as (setting, value as typed, key in a row): early_stop.metric,
    checkpoint.metric (with checkpoint.keep_best), sweep.objective (unless the default, which falls back
    to the run's first held-out figure where it has no accuracy)."""
    named = []
    if cfg.early_stop.metric is not None:
        named.append(("early_stop.metric", str(cfg.early_stop.metric), figure_key(cfg.early_stop.metric)))
    if cfg.checkpoint.keep_best and cfg.checkpoint.metric is not None:
        named.append(("checkpoint.metric", str(cfg.checkpoint.metric), figure_key(cfg.checkpoint.metric)))
    if cfg.sweep.objective != DEFAULT_OBJECTIVE:  # (a value of results.json, by its key there)
        named.append(("sweep.objective", str(cfg.sweep.objective), str(cfg.sweep.objective)))
    return named


def row_figures(row: Mapping[str, Any]) -> list[str]:
    """The figures of an epoch's row that a setting may name: loss, train_NAME, test_NAME (numbers)."""
    return [k for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and side(k) is not None and k != "train_s"]


def unknown(setting: str, typed: str, key: str, known: Iterable[str]) -> ConfigError:
    """One line for `setting`=`typed` naming no figure of the run's epochs, naming those it has."""
    known = list(known)
    close = difflib.get_close_matches(key, known, n=1)
    example = close[0] if close else next((k for k in known if k.startswith("test_")), "loss")
    return ConfigError(setting, typed, f"names no figure of this run's epochs; they are {', '.join(known)} (val/NAME "
                       "and test/NAME name test_NAME)", f"{setting}={example}")


class NamedFigures:
    """The settings that name a figure, each checked at the first epoch row that can have it (a held-out
    figure: the first evaluated epoch), on every rank alike (their rows are the same). A sweep.objective
    that is no figure of a row (worker_s, say) is checked against results.json (`check_results`)."""

    def __init__(self, cfg: Config, declared: tuple[str, ...] | None = None, recipe: str = ""):
        self.pending = [s for s in named_settings(cfg) if side(s[2]) is not None]
        self.objective = next((s for s in named_settings(cfg) if s[0] == "sweep.objective" and side(s[2]) is None),
                              None)
        self.declared, self.recipe = declared, recipe

    def check(self, row: Mapping[str, Any]) -> None:
        evaluated = any(side(k) == "test" for k in row_figures(row))
        if evaluated and self.declared is not None:  # (once: a recipe's figures up front are what its rows have)
            undeclared = [k for k in row_figures(row) if k not in self.declared]
            if undeclared:
                raise LaunchError(f"recipe={self.recipe} is not valid: its `figures` ({', '.join(self.declared)}) "
                                  f"leave out {', '.join(undeclared)}, which its epochs have; list every figure its "
                                  "epochs have (or figures = None)")
            self.declared = None
        for setting in list(self.pending):
            name, typed, key = setting
            if side(key) == "test" and not evaluated:
                continue
            if key not in row:
                raise unknown(name, typed, key, row_figures(row))
            self.pending.remove(setting)

    def check_results(self, results: Mapping[str, Any]) -> None:
        """At the end: a sweep.objective that names no figure names a number of results.json (or of its
        last epoch's row), else one line."""
        if self.objective is None:
            return
        _, typed, key = self.objective
        final = results.get("final") or {}
        if key not in results and key not in final:
            numbers = [k for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            raise unknown("sweep.objective", typed, key, [*row_figures(final), *numbers])
