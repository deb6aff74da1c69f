"""Training recipes: what is trained, as a class with a small typed interface (`Recipe`).

A recipe says what the data is, what the model is, how a batch is augmented, how the loss and the
evaluation are computed, and which hyper-parameters it takes (its `Config`, a dataclass: typed, shown
by `launch --help` and `--cfg job`, set as `recipe.KEY=VALUE`). The shared loop (launcher/train/loop.py)
does the rest: strategy, data placement, batching, optimizer, metrics, checkpoints.

Your own recipe is a module anywhere on the path or in the directory `launch` runs in, defining one
subclass of Recipe; `launch recipe=my_pkg.my_recipe` imports it (tests/distributed/data/my_pkg/my_recipe.py
is a complete one):

    @dataclass
    class MyConfig(RecipeConfig):        # the recipe's own hyper-parameters
        hidden: int = 32

    class MyRecipe(Recipe):
        Config = MyConfig
        models = ("mlp",)               # what recipe.model may name; the first is the default
        def load(self) -> Splits: ...
        def build_model(self, num_classes): ...   # self.hp.hidden is typed

`load` returns `Splits` (images and labels held in memory: classification) or `TokenSplits` (token
streams, e.g. memory-mapped files: next-token prediction, where a sample is a window of tokens and the
loop counts its tokens as targets; recipes/text.py). `report` adds derived figures to each epoch's row
and `finish` leaves something after training (a generated sample).

Built-in recipes keep their schema in launcher/config.py (so `launch --help` needs no torch) and their
values in conf/recipe/<name>.yaml.

Where each hook runs: `prepare` in the launcher process, once, before any worker starts (it must not
touch CUDA); everything else in every worker. Keep heavy imports (torch) where they are used or at the
top of the module as you like: a built-in recipe's module is imported only where it runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from launcher.config import Config as LaunchConfig
from launcher.config import RecipeConfig
from launcher.data.hooks import DataHooks, Splits, TokenSplits  # (what `load` returns: there for users)
from launcher.errors import ConfigError, LaunchError
from launcher.figures import LauncherFigures, named_settings, side, unknown
from launcher.lifetime import sigint_deferred

if TYPE_CHECKING:
    import torch

BUILTIN = {"digits": "launcher.recipes.digits", "cifar10": "launcher.recipes.cifar10", "text": "launcher.recipes.text",
           "imagefolder": "launcher.recipes.imagefolder"}

# augment(x, generator, *, indices, epoch) -> x: a batch's augmentation on its own device; `indices` are
# the batch's rows in the training set (same device), `epoch` a Python int or a 0-dim tensor.
Augment = Callable[..., "torch.Tensor"]


def _pair(batch: Any, recipe: Recipe, hook: str) -> tuple[Any, Any]:
    """(inputs, labels) of a batch, as the default hooks take it; any other batch is one clear error naming
    the hook to write."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    what = (f"a dict with keys {', '.join(map(str, batch))}" if isinstance(batch, dict)
            else f"a {type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    name = getattr(getattr(getattr(recipe, "cfg", None), "recipe", None), "name", type(recipe).__name__)
    raise ConfigError("recipe", name, f"its batches are {what}, and the default {hook} takes (inputs, labels) "
                      f"pairs: define {hook}(self, model, batch) in {type(recipe).__name__} (docs/own-code.md, "
                      "\"The recipe interface\")")


class Recipe(DataHooks):
    """The interface the training loop calls. Override `load` and `build_model`; the rest is optional
    (`collate` and `on_after_batch_transfer`, for a recipe's own Datasets: launcher/data/hooks.py)."""

    Config: ClassVar[type[RecipeConfig]] = RecipeConfig
    models: ClassVar[tuple[str, ...]] = ()  # a user recipe's model names (built-ins type recipe.model instead)
    # shown by `launch eval` (else the evaluation Dataset's `classes`, else the class indices)
    class_names: ClassVar[tuple[str, ...]] = ()
    # Training images `prepare_model` sees, normalized (a whitening layer, say).
    prepare_model_sample: ClassVar[int] = 5000
    # Whether the predictions are classes (`launch eval` then shows accuracy per class and a confusion matrix).
    classifies: ClassVar[bool] = True
    # Every figure this recipe's epochs may have, by its key (loss, train_NAME, test_NAME, and what `report`
    # adds): an early_stop.metric, checkpoint.metric or sweep.objective naming another is then refused
    # before any worker starts. None: known up front only where the default steps make them (and `report`
    # is not overridden); otherwise a named figure is checked at the first epoch that can have it.
    figures: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg  # the whole (frozen) config: data.root, seed, ...
        self.hp: Any = cfg.recipe  # this recipe's own section, an instance of `Config`

    # What throughput counts for a recipe whose `load` hands over Datasets: `<unit>_per_s` per epoch.
    unit: ClassVar[str] = "samples"

    def prepare(self) -> None:
        """In the launcher, once: download or check the data. Must not touch CUDA."""

    def data_classes(self) -> tuple[str, ...]:
        """In the launcher, after `prepare`: the class names of the data here, in label order, or () where
        they are not known before the data loads. A checkpoint trained on other classes is refused before
        any worker starts (`resume=`, `launch eval`). By default `class_names`."""
        return tuple(self.class_names)

    def load(self) -> Splits | TokenSplits | tuple[Any, Any]:
        """In every worker: the whole dataset as uint8/int64 CPU tensors (Splits), a token stream
        (TokenSplits), or `(train, eval)`: any two torch Datasets (map-style, or IterableDataset), whose
        samples are tensors, tuples, dicts or any nesting of them (launcher/data/loader.py batches them)."""
        raise NotImplementedError

    # ---- the step: what a batch is trained and scored on (Lightning's names) ------------------------
    def training_step(self, model: torch.nn.Module, batch: Any) -> Any:
        """The training loss of one batch (as the data path delivers it, on the device: for Splits an
        `(images, labels)` pair already augmented and normalized, for TokenSplits `(inputs, targets)`,
        for Datasets what the collate made of the samples). Return the loss (a 0-dim tensor, a mean over
        the batch), or `(loss, figures)`: figures are named tensors, each a 0-dim batch mean or one
        value per sample (or per element), averaged over the epoch exactly; they appear as `train_NAME`
        (name one for what it is: `mae`, not `train_mae`; not `loss`, nor `acc`, the launcher's accuracy).
        No host sync here (.item(), printing a tensor): the step may be captured as a CUDA graph.
        The default: cross-entropy of `model(inputs)` against the labels (`loss()`), and accuracy."""
        x, y = _pair(batch, self, "training_step")
        logits = logits_of(model(x))
        loss = self._loss_fn(logits, y)
        return loss, LauncherFigures(acc=_correct(logits, y))

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Named figures of one evaluation batch (the model in eval mode, no gradients): each a 0-dim
        batch mean or one value per sample (or per element). The launcher averages each over the whole
        evaluation set, every rank's shard counted once, so the figure is exact for any world size and
        batch; they appear as `test_NAME` (epoch lines, metrics.jsonl, TensorBoard, results.json,
        `launch eval`, and `sweep.objective=test_NAME`). Name a figure for what it is (`mse`, not `test_mse`);
        `acc` is the launcher's accuracy, which only the default computes (launcher/figures.py). Derive
        figures that are not means (an RMSE from the MSE) in `report`. The default: cross-entropy and
        accuracy of `predict`."""
        import torch.nn.functional as F

        x, y = _pair(batch, self, "eval_step")
        logits = self.predict(model, x)
        logits, y = logits.flatten(0, -2), y.flatten()  # (a window's tokens count as its samples)
        return LauncherFigures(loss=F.cross_entropy(logits.float(), y, reduction="none"), acc=logits.argmax(-1) == y)

    def num_classes(self, train: Any) -> int | None:
        """What a classifier's head needs (passed to `build_model` and to a config model that takes
        `num_classes`): by default the Dataset's `classes` (torchvision's ImageFolder has them), looked for
        through what wraps a Dataset (`random_split`'s Subsets, a ConcatDataset's parts)."""
        classes = classes_of(train)
        return len(classes) if classes is not None else None

    def build_model(self, num_classes: int) -> torch.nn.Module:
        """The network; `self.hp.model` picks among the recipe's models. `num_classes`: the classes, or
        the vocabulary of a token stream."""
        raise NotImplementedError

    def model_to_size(self) -> torch.nn.Module | None:
        """In the launcher, before any worker: the network as the run will build it, on the meta device
        (no memory), for the estimate of what a device must hold (launcher/host/memory.py); None (the
        default) where it cannot be built before the data is read."""
        return None

    def batch_to_size(self, size: int) -> Any:
        """In the launcher, beside `model_to_size`: a training batch of `size` samples as `training_step` takes
        it, on the meta device, for the estimate of the activations a rank keeps; None (the default) where the
        recipe cannot say before its data."""
        return None

    def eval_chunk_limit(self) -> int | None:
        """The most samples one evaluation forward takes on a rank, whatever eval.batch_size's share (None, the
        default: that share alone)."""
        return None

    def augmentation(self) -> Augment | None:
        """The training augmentation, called once; None for none."""
        return None

    def prepare_model(self, model: torch.nn.Module, sample: torch.Tensor) -> None:
        """Set the model up from data before training (`sample`: normalized training images)."""

    def loss(self) -> torch.nn.Module:
        """The training loss of (logits, labels) that the default `training_step` uses."""
        import torch

        return torch.nn.CrossEntropyLoss()

    @property
    def _loss_fn(self) -> torch.nn.Module:
        fn = self.__dict__.get("_loss_module")
        if fn is None:
            fn = self.__dict__["_loss_module"] = self.loss()
        return fn

    def predict(self, net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The evaluation forward pass (e.g. with test-time augmentation)."""
        return logits_of(net(x))

    def report(self, row: dict[str, Any], device: torch.device, world_size: int) -> None:
        """Add figures derived from an epoch's row (bits per byte, MFU, ...) to it, under names of their own
        (the row's figures are read, never changed). Called on every rank, each with the same figures, so
        early stopping and the best checkpoints can watch a derived figure alike on all of them."""

    def finish(self, model: torch.nn.Module, run_dir: Path, device: torch.device, main: bool) -> dict[str, Any]:
        """After training, with the trained weights: anything to leave in the run dir (a generated sample,
        say; written where `main`). Returns facts for results.json. Called on rank 0, and on every rank
        when the model is sharded (its forward then takes all of them)."""
        return {}


def logits_of(output: Any) -> Any:
    """A network's output as the default hooks score it: the output itself, or where the network returns a
    record of outputs (a Hugging Face model's ModelOutput: `.logits`, beside `.loss` and caches) its logits."""
    logits = getattr(output, "logits", None)
    return output if logits is None else logits


def _correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per target: whether the arg-max class is the label (labels of any shape: a window's tokens too)."""
    return logits.argmax(-1) == labels


def recipe_class(name: str) -> type[Recipe]:
    """The Recipe class for `recipe.name`: a built-in name, or a module path defining one Recipe subclass."""
    module_name = BUILTIN.get(name, name)
    try:
        with sigint_deferred():  # (the first import of torch in the launcher, through the recipe)
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name) and name.endswith(".py"):  # (a file, as script= takes)
            module = name.removesuffix(".py").lstrip("./").replace("/", ".")
            raise ConfigError("recipe", name, f"a recipe is named as a module, without .py: recipe={module} imports "
                              f"{module.replace('.', '/')}.py from the folder launch runs in (or the path)",
                              f"recipe={module}") from None
        if exc.name and module_name.startswith(exc.name):
            raise ConfigError("recipe", name, "choose one of " + ", ".join(sorted([*BUILTIN, "cifar10_fast"])) +
                              f", or a module on the path or in this directory (no module named {exc.name})",
                              "recipe=digits") from None
        raise _broken(name, module_name, exc) from exc
    except Exception as exc:  # noqa: BLE001 - the user's module failed while it was imported
        raise _broken(name, module_name, exc) from exc
    found = [obj for _, obj in inspect.getmembers(module, inspect.isclass)
             if issubclass(obj, Recipe) and obj is not Recipe and obj.__module__ == module.__name__]
    if len(found) != 1:
        what = "defines no subclass of launcher.recipes.Recipe" if not found else \
            f"defines {len(found)} Recipe classes ({', '.join(c.__name__ for c in found)}); keep one per module"
        raise LaunchError(f"recipe={name} is not valid: {module_name} {what} (see launcher/recipes/__init__.py)")
    schema = found[0].Config
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema) and issubclass(schema, RecipeConfig)):
        raise LaunchError(f"recipe={name} is not valid: {found[0].__name__}.Config must be a @dataclass subclassing "
                          "launcher.recipes.RecipeConfig (see launcher/recipes/__init__.py)")
    return found[0]


def _broken(name: str, module_name: str, exc: BaseException) -> LaunchError:
    where = ""
    tb = exc.__traceback__
    while tb is not None:  # the deepest frame of the failure that is the user's module's
        if tb.tb_frame.f_globals.get("__name__") == module_name:
            where = f" (line {tb.tb_lineno})"
        tb = tb.tb_next
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return LaunchError(f"recipe={name} is not valid: importing {module_name} failed{where}: "
                       f"{type(exc).__name__}: {first}")


def check_model(cls: type[Recipe], cfg: LaunchConfig) -> None:
    """A recipe that lists its models gets `recipe.model` checked before any worker starts; so does a
    model's fitness for the optimizer (optim=muon needs one that names its filter matrices), on the
    model built on the meta device (no memory, no data, any size). A model that cannot be built there
    (a user's build_model that reads data or moves tensors) is left to the worker's own check."""
    if cls.models and str(cfg.recipe.model) not in cls.models:
        raise ConfigError("recipe.model", cfg.recipe.model, f"{cfg.recipe.name} has: {', '.join(cls.models)}",
                          f"recipe={cfg.recipe.name} recipe.model={cls.models[0]}")
    if cfg.optim.name != "muon":
        return
    import torch

    from launcher.train.optim import parameter_roles

    try:
        with torch.device("meta"):
            model = cls(cfg).build_model(10)
    except Exception:  # noqa: BLE001 - not buildable here; the worker checks the real one
        return
    parameter_roles(model, cfg)


def known_figures(cls: type[Recipe]) -> dict[str, frozenset[str] | None]:
    """The figures a recipe's epochs have, as far as they are known before it runs, for each side
    (launcher/figures.py `side`): "train" (loss, train_NAME) and "test" (test_NAME); None where unknown.
    Its declared `figures`, else the default steps' where a side runs them and `report` adds nothing."""
    if cls.figures is not None:
        return {where: frozenset(k for k in cls.figures if side(k) == where) for where in ("train", "test")}
    plain = cls.report is Recipe.report
    return {"train": frozenset({"loss", "train_acc"}) if plain and cls.training_step is Recipe.training_step else None,
            "test": frozenset({"test_loss", "test_acc"}) if plain and cls.eval_step is Recipe.eval_step else None}


def check_figures(cls: type[Recipe], cfg: LaunchConfig) -> None:
    """Before any worker starts: every setting that names a figure (early_stop.metric, checkpoint.metric,
    sweep.objective) names one the recipe's epochs have, where that is known up front (`known_figures`);
    one line otherwise. What cannot be known here is checked at the first epoch that can have it."""
    known = known_figures(cls)
    for setting, typed, key in named_settings(cfg):
        where = side(key)
        have = known.get(where) if where is not None else None
        if have is not None and key not in have:
            listed = [k for w in ("train", "test") for k in sorted(known[w] or (), key=lambda k: (k != "loss", k))]
            raise unknown(setting, typed, key, listed)


def classes_of(dataset: Any) -> Any:
    """A Dataset's `classes`, or those of the Dataset it wraps: a `Subset` (what `random_split` returns) holds
    its Dataset as `.dataset`, a `ConcatDataset` its parts as `.datasets` (the first that has them). None where
    none has them."""
    seen = 0
    while dataset is not None and seen < 8:
        classes = getattr(dataset, "classes", None)
        if classes is not None:
            return classes
        parts = getattr(dataset, "datasets", None)
        if isinstance(parts, (list, tuple)) and parts:
            return next((c for c in map(classes_of, parts) if c is not None), None)
        dataset, seen = getattr(dataset, "dataset", None), seen + 1
    return None
