"""A network that does not take its recipe's batches: one line naming the key that chose it, not the
worker's traceback.

A network from config (`model._target_=torchvision.models.resnet18`) or a built-in recipe's `recipe.model`
can be one whose layers do not fit the data (three input channels for digits' one, a kernel larger than a
small image, fewer outputs than classes). Torch says so at the first step, deep in the model's forward (or
in torch.compile's tracing of it). The loop (launcher/train/loop.py) runs its steps through `FirstSteps`
until one has run: a failure there that is such a shape mismatch becomes a ConfigError (exit 2) naming the
key, the value, the batch's shapes and torch's own sentence. A user's own recipe with its own network keeps
its traceback: there the error is in the user's code, and their frame is what they need.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from launcher.errors import ConfigError

# torch's sentences for a tensor that does not fit a layer (or the loss), as eager ops and compile's fake
# tensors raise them
SHAPE_ERRORS = (
    r"mat1 and mat2 shapes cannot be multiplied[^\n']*",
    r"Given groups=\d+, weight of size [^\n']*",
    r"Calculated padded input size per channel[^\n']*",
    r"Expected \dD \(unbatched\) or \dD \(batched\) input[^\n']*",
    r"The size of tensor a \(\d+\) must match the size of tensor b[^\n']*",
    r"shape '\[[^\]]*\]' is invalid for input of size \d+",
    r"Given input size: [^\n']*Output size is too small",
    r"Target -?\d+ is out of bounds\.?",
    r"Expected input batch_size \(\d+\) to match target batch_size \(\d+\)\.?",
    r"input image \([^)]*\) smaller than kernel size[^\n']*",
)


def shape_error(exc: BaseException) -> str | None:
    """torch's sentence, where `exc` (or what it wraps) says a tensor does not fit a layer; else None."""
    if isinstance(exc, torch.OutOfMemoryError):
        return None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (RuntimeError, ValueError, IndexError)):
            text = str(exc)
            for pattern in SHAPE_ERRORS:
                found = re.search(pattern, text)
                if found:
                    return found.group(0).strip()
        exc = exc.__cause__ or exc.__context__
    return None


def describe(batch: Any) -> str:
    """A batch's tensors as a user would picture them: '64x1x8x8 float32, 64 int64'."""
    tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return ", ".join(f"{'x'.join(str(d) for d in t.shape) or 'scalar'} {str(t.dtype).removeprefix('torch.')}"
                     for t in tensors[:4]) + (", ..." if len(tensors) > 4 else "")


def chooses_network(cfg: Any, builtin: bool) -> tuple[str, str] | None:
    """(key, value) of the setting that chose the network: model._target_, or a built-in recipe's
    recipe.model; None for a user's recipe with its own network (its traceback is the user's)."""
    target = (cfg.model or {}).get("_target_")
    if target:
        return "model._target_", str(target)
    if builtin and getattr(cfg.recipe, "model", None):
        return "recipe.model", str(cfg.recipe.model)
    return None


def does_not_take(cfg: Any, builtin: bool, batch: Any, exc: BaseException) -> ConfigError | None:
    """The one line for a network that does not take the recipe's batches, or None where `exc` is not that
    (or the network is the user's own recipe's)."""
    reason = shape_error(exc)
    chosen = chooses_network(cfg, builtin)
    if reason is None or chosen is None:
        return None
    key, value = chosen
    name = cfg.recipe.name
    reason = reason.rstrip(".")
    if re.match(r"Target -?\d+ is out of bounds", reason):  # (fewer outputs than the data has classes)
        given = "num_classes" in (cfg.model or {})
        fix = ("drop +model.num_classes (launch passes the recipe's count of classes)" if given else
               "give the network one output per class (+model.num_classes=N, or its own argument for it)")
        return ConfigError(key, value, f"the network has fewer outputs than recipe={name}'s data has classes "
                           f"({reason}): {fix}", f"recipe={name} {key}={value}")
    other = ("leave model._target_ out to train the recipe's own network" if key == "model._target_" else
             "pick another recipe.model or recipe.image_size")
    return ConfigError(key, value, f"the network does not take recipe={name}'s batches ({describe(batch)}): "
                       f"{reason}; use a network made for such inputs, or {other}", f"recipe={name}")


class FirstSteps:
    """Until a step has run: a network (from config, or a built-in recipe's choice) whose layers do not take
    the batch is one line naming the key that chose it (`does_not_take`); after that a step's error is its own.
    `builtin`: the recipe is one of launch's own (its `recipe.model` chose the network)."""

    def __init__(self, cfg: Any, builtin: bool):
        self.cfg, self.builtin = cfg, builtin
        self.stepped = False  # a training step has run

    @contextlib.contextmanager
    def __call__(self, batch: Any) -> Iterator[None]:
        if self.stepped:
            yield
            return
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - only a shape mismatch is turned into the one line
            line = does_not_take(self.cfg, self.builtin, batch, exc)
            if line is None:
                raise
            raise line from None
        self.stepped = True


def nothing_to_train(cfg: Any, builtin: bool) -> ConfigError:
    """A network without a parameter that takes gradients (torch.nn.Flatten as model._target_): the optimizer
    would refuse it with a traceback."""
    key, value = chooses_network(cfg, builtin) or ("recipe", cfg.recipe.name)
    return ConfigError(key, value, "the network has no parameters to train (none with requires_grad): give a "
                       "network with layers that learn", f"recipe={cfg.recipe.name}")


def no_outputs(model: torch.nn.Module, classes: int, dataset: Any, recipe: str) -> ConfigError | None:
    """A recipe's `build_model(num_classes)` given 0 classes (its training Dataset names no `classes`, as a
    `random_split` of a TensorDataset does not) that built a layer of no outputs: the first step would fail in
    the loss ("Target 2 is out of bounds"). The refusal, or None (a network that does not use num_classes)."""
    if classes:
        return None
    empty = next(((name, tuple(p.shape)) for name, p in model.named_parameters() if p.numel() == 0), None)
    if empty is None:
        return None
    kind = type(dataset).__name__ if dataset is not None else "Dataset"
    return ConfigError("recipe", recipe, f"its network has a layer with no outputs ({empty[0]}, of shape "
                       f"{list(empty[1])}): build_model was given num_classes=0, since its training Dataset "
                       f"({kind}) names no `classes`: give that Dataset a `classes` list, or define "
                       "num_classes(self, train) in the recipe", None)


def lazy_unreached(cfg: Any, builtin: bool, names: list[str]) -> ConfigError:
    """Lazy layers (nn.LazyLinear, ...) that one forward on a first batch left without shapes (a branch
    that batch did not take): nothing could size, shard or optimize their weights."""
    key, value = chooses_network(cfg, builtin) or ("recipe", cfg.recipe.name)
    layers = f"lazy layer{'s' if len(names) > 1 else ''} {', '.join(names[:5])}"
    return ConfigError(key, value, f"a forward on the first batch left its {layers} without shapes (the launcher "
                       "sets them so before training): build those layers with their input sizes "
                       "(nn.Linear instead of nn.LazyLinear)", f"recipe={cfg.recipe.name}")


def surplus_outputs(model: torch.nn.Module, classes: int | None, target: str | None, recipe: str) -> str | None:
    """A network whose last linear layer gives more outputs than the recipe has classes: a config network
    (model._target_ `target`) whose constructor did not take `num_classes`, or a recipe's own (`target`
    None) whose build_model did not use the number it was given. It trains, but the outputs beyond the
    classes are never a target. One warning's text, or None. (Fewer outputs fail at the first step:
    `does_not_take`.)"""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            last = (name, module)
    if not classes or last is None or last[1].out_features <= classes:
        return None
    name, layer = last
    who = f"model._target_={target}" if target else f"recipe={recipe}'s network"
    fix = (f"(+model.num_classes={classes}, or its constructor's own argument)" if target else
           f"(its build_model(num_classes) is given {classes}: build the last layer with it)")
    return (f"{who}: its last layer ({name}) gives {layer.out_features} outputs for the {classes} classes of "
            f"recipe={recipe}; the {layer.out_features - classes} beyond them are never a target (they train and cost "
            f"for nothing): build it with {classes} outputs {fix}")


def short_vocabulary(model: torch.nn.Module, vocab: int | None, target: str) -> ConfigError | None:
    """A config network (model._target_) trained on token ids whose input embedding holds fewer rows than the
    data has tokens (a Hugging Face config given a smaller vocab_size): the first step would fail with an
    IndexError inside the embedding. The refusal, or None."""
    embed = getattr(model, "get_input_embeddings", None)
    layer = embed() if callable(embed) else None
    rows = getattr(layer, "num_embeddings", None)
    if not vocab or rows is None or rows >= vocab:
        return None
    return vocabulary_refusal(rows, vocab, target)


def vocabulary_refusal(rows: int, vocab: int, target: str) -> ConfigError:
    """The one line for a config network that embeds `rows` tokens where the data has `vocab`: said by the
    worker of the network built (short_vocabulary), and before any worker by a recipe that knows both from
    the config alone (recipe=text's prepare)."""
    return ConfigError("model.config.vocab_size", rows, f"model._target_={target} embeds {rows} tokens, but the data's "
                       f"ids run to {vocab - 1} (a vocabulary of {vocab}): leave vocab_size out (the data's is given) "
                       f"or give at least {vocab}", f"+model.config.vocab_size={vocab}")
