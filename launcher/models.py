"""Networks from config: `model._target_=torchvision.models.resnet50 +model.KEY=VALUE`, as Hydra instantiates.

    launch recipe=imagefolder model._target_=torchvision.models.resnet50
    launch recipe=cifar10 model._target_=timm.create_model +model.model_name=resnet18 +model.pretrained=false

The `model` section of the config, when it names a `_target_`, replaces the recipe's own network
(`recipe.model`): Hydra's `instantiate` calls it with the section's other keys as arguments, in each
worker (the launcher process never builds a network). Where the recipe knows its classes (or a token
stream its vocabulary) and the callable takes `num_classes` (torchvision's and timm's constructors do),
that is passed too, unless the section gives it. A Hugging Face model is built from its class and its
config class, a section of its own that Hydra builds first:

    launch recipe=text model._target_=transformers.LlamaForCausalLM +model.config._target_=transformers.LlamaConfig
        +model.config.hidden_size=256 +model.config.num_hidden_layers=4 ...

where the config section names no `vocab_size`, the recipe's vocabulary (as for `num_classes`) is given to
it; the recipes score the `logits` of the ModelOutput such a model returns (recipes/__init__.py: logits_of),
and fsdp shards it by its `_no_split_modules` (launcher/strategies/recompute.py: shard_units).

`check(spec)` runs in the launcher before any worker starts: the target must import and be callable
(one line otherwise). It imports the target's module, and so torch; this module itself imports neither.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from launcher.errors import ConfigError

EXAMPLE = "model._target_=torchvision.models.resnet18"


def _target(spec: dict[str, Any]) -> str:
    target = spec.get("_target_")
    if not target or not isinstance(target, str):
        keys = ", ".join(sorted(spec)) or "none"
        raise ConfigError("model._target_", target, f"the model section needs the dotted path of a class or "
                          f"function that builds the network (it has: {keys})", EXAMPLE)
    return target


def locate(spec: dict[str, Any]) -> Any:
    """The callable `model._target_` names, or a ConfigError saying what is wrong with it."""
    import difflib
    import importlib

    target = _target(spec)
    parts = target.split(".")
    found: Any = None
    reason = f"{target} names no module"
    hint = f"is {parts[0]} installed?"
    # the longest importable module prefix, then attributes (as Hydra's own lookup does; it also logs its
    # failures, which would put more lines before launch's one)
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and not ".".join(parts[:cut]).startswith(exc.name):
                reason = f"importing {'.'.join(parts[:cut])} failed: {exc}"  # (its own import is missing)
                break
            reason = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - the module itself failed while imported
            reason = f"importing {'.'.join(parts[:cut])} failed: {type(exc).__name__}: {exc}"
            found = None
            break
        for i, name in enumerate(parts[cut:]):
            if not hasattr(found, name):
                reason = f"{'.'.join(parts[:cut + i])} has no attribute {name}"
                close = difflib.get_close_matches(name, [n for n in dir(found) if not n.startswith("_")], n=3)
                hint = f"did you mean {', '.join('.'.join([*parts[:cut + i], c]) for c in close)}?" if close else \
                    f"{'.'.join(parts[:cut + i])} is installed, but holds no {name}"
                found = None
                break
            found = getattr(found, name)
        break
    if found is None and reason == f"No module named '{parts[0]}'":  # (a typo in the package's name?)
        import pkgutil

        known = {"timm": "timm", "transformers": "transformers", "torchvision": "torchvision",
                 "segmentation_models_pytorch": "segmentation-models-pytorch", "open_clip": "open_clip_torch"}
        close = difflib.get_close_matches(parts[0], sorted({m.name for m in pkgutil.iter_modules()}), n=1)
        if parts[0] in known:  # (a model library not installed: timm's create_model was "timeit.create_model?")
            hint = f"{parts[0]} is not installed here: pip install {known[parts[0]]}"
        elif close:
            hint = f"did you mean {'.'.join([close[0], *parts[1:]])}?"
    if found is None or not callable(found):
        if found is not None:
            reason = f"{target} is a {type(found).__name__}, not a class or function"
        first = reason.strip().splitlines()[0][:200] if reason.strip() else "not found"
        raise ConfigError("model._target_", target, f"cannot be used ({first}); give the dotted path of a class or "
                          f"function in an installed package ({hint})", EXAMPLE)
    return found


def configured(spec: dict[str, Any] | None) -> bool:
    """Whether the config names a network (`model._target_`); else the recipe builds its own."""
    return bool((spec or {}).get("_target_"))


def check(spec: dict[str, Any] | None) -> None:
    """In the launcher, before any worker: `model._target_` imports and is callable, and the model section gives
    every argument it cannot do without (num_classes aside: the data gives it). A Hugging Face model class
    without its config failed in the workers, after the run dir was made."""
    if not configured(spec):
        return
    fn = locate(spec)
    _check_hf_config(spec)
    if "_args_" in spec or spec.get("_partial_"):  # (positional arguments, or a partial: called later)
        return
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.kind in named
               and p.name not in spec and p.name != "num_classes"]
    if not missing:
        return
    target = str(spec["_target_"])
    if missing == ["config"] and target.startswith("transformers."):
        base = re.sub(r"(ForCausalLM|LMHeadModel|ForMaskedLM|ForSequenceClassification|Model)$", "",
                      target.rsplit(".", 1)[-1])
        example = f"model._target_={target} +model.config._target_=transformers.{base}Config"
    else:
        example = f"+model.{missing[0]}=..."
    raise ConfigError("model._target_", target, f"it needs {', '.join(missing)}, which the model section does not "
                      "give", example)


def _check_hf_config(spec: dict[str, Any]) -> None:
    """A Hugging Face model's config section (`model.config._target_=transformers.XConfig`), built here, in
    the launcher: a setting the config refuses (hidden_size not a multiple of the heads) is one line with its
    reason, and a key it does not know is one line naming the nearest it does. transformers keeps an unknown
    keyword as an attribute of its own: `+model.config.hiden_size=64` trained a model of the default width
    (4096) without a word."""
    inner = spec.get("config")
    if not (isinstance(inner, dict) and configured(inner) and str(inner["_target_"]).startswith("transformers.")):
        return
    import difflib

    from hydra.utils import instantiate

    cls = locate(inner)
    target = str(inner["_target_"])
    try:
        built = instantiate(dict(inner))
    except Exception as exc:  # noqa: BLE001 - the config class's own validation, as one line
        raise ConfigError("model.config._target_", target, f"building it from the model.config keys failed: "
                          f"{_reason(exc)}") from None
    try:
        default = cls()  # (its keys: the settings it knows beyond its signature's)
    except Exception:  # noqa: BLE001 - a class that needs arguments: its keys cannot be known, none refused
        return
    try:
        named = set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        named = set()
    known = named | set(default.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    kept = built.to_dict()  # (a legacy key the class converts, rope_theta in rope_parameters, is not kept apart)
    for key in inner:
        if key.startswith("_") or key in known or key not in kept:
            continue
        near = difflib.get_close_matches(key, sorted(k for k in known if not k.startswith("_")), n=1)
        raise ConfigError(f"model.config.{key}", inner[key], f"{target.rsplit('.', 1)[-1]} has no setting {key} "
                          "(transformers would keep it unused and build its default)",
                          f"+model.config.{near[0]}={inner[key]}" if near else None)


def _reason(exc: BaseException) -> str:
    """An exception's message as one line: its first line, and the next where the first only leads into it
    (transformers' "Class validation error for validator ...:" before the actual reason)."""
    cause = exc.__cause__ or exc
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    if not lines:
        return type(cause).__name__
    text = lines[0] + (" " + lines[1] if lines[0].endswith(":") and len(lines) > 1 else "")
    return f"{type(cause).__name__}: {text[:300]}"


def takes(fn: Any, name: str) -> bool:
    """Whether `fn` accepts a keyword argument `name` (or any keyword)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def from_config(spec: dict[str, Any], num_classes: int | None) -> Any:
    """The network `spec` describes (Hydra's instantiate), with `num_classes` where the callable takes it and
    the section does not give it."""
    from hydra.utils import instantiate

    fn = locate(spec)
    extra: dict[str, Any] = {}
    if num_classes and "num_classes" not in spec and takes(fn, "num_classes"):
        extra["num_classes"] = num_classes
    inner = spec.get("config")
    if (num_classes and not extra and isinstance(inner, dict) and configured(inner) and "vocab_size" not in inner
            and takes(locate(inner), "vocab_size")):  # (a Hugging Face config: the vocabulary the data has)
        spec = {**spec, "config": {**inner, "vocab_size": num_classes}}
    try:
        model = instantiate(dict(spec), **extra)
    except Exception as exc:  # noqa: BLE001 - the constructor's own error, as one line
        example = None if str(spec["_target_"]).startswith("transformers.") else EXAMPLE
        raise ConfigError("model._target_", spec["_target_"], f"building it failed: {_reason(exc)}", example) \
            from None
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model._target_", spec["_target_"], f"returned a {type(model).__name__}, not a "
                          "torch.nn.Module", EXAMPLE)
    settings = getattr(model, "config", None)
    if getattr(settings, "use_cache", False):
        # A Hugging Face causal LM keeps a key/value cache by default: built anew in every training forward for
        # nothing, and one that a block recomputed in the backward pass (perf.activation_checkpointing) finds
        # grown, which breaks the recompute. Its own gradient checkpointing turns the cache off the same way.
        settings.use_cache = False
    return model


def lazy_modules(model: Any) -> list[Any]:
    """The modules of `model` whose parameters or buffers wait for a first input (nn.LazyLinear, ...)."""
    from torch.nn.modules.lazy import LazyModuleMixin

    return [m for m in model.modules() if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]


def materialize_lazy(model: Any, forward: Any, device: Any) -> list[str]:
    """Give lazy layers their shapes: `forward()` (one forward of `model` on a first batch), without
    gradients, before a strategy wraps the model (its gradient buckets, its shards and the optimizers need
    every parameter's shape). Returns the names of the lazy layers the forward did not reach (still
    without shapes).

    Every rank draws their initial values from the same random state (the seed, then the same model
    built), so the ranks start alike without a broadcast; the random state is put back after, and so are
    the running statistics that forward changed (a BatchNorm's, and a lazy one's: as if just built)."""
    import torch
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.parameter import UninitializedBuffer

    lazy = {id(m) for m in lazy_modules(model)}
    if not lazy:
        return []
    kept = {name: b.detach().clone() for name, b in model.named_buffers() if not isinstance(b, UninitializedBuffer)}
    devices = [device] if getattr(device, "type", None) == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        forward()
        for name, buffer in model.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])
        for module in model.modules():
            if id(module) in lazy and isinstance(module, _NormBase) and module.track_running_stats:
                module.reset_running_stats()
    left = {id(m) for m in lazy_modules(model)}
    return [name or type(m).__name__ for name, m in model.named_modules() if id(m) in left]
