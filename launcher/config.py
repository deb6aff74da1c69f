"""The launch config's schema: a dataclass per section and per config-group option, Enums for choices.

Hydra composes the config from the YAML files in conf/ (values, with comments and the command that
uses them) over these classes (types): a typo in a key or a value of the wrong type fails when the
config is composed, with one line (launcher/host/hydra_errors.py); each schema's `check` says what a
type cannot (ranges, combinations), before anything starts. Workers get the composed config as these dataclasses, frozen
(launcher/spec.py), never as a DictConfig.

Sections, by who reads them:
    recipe     what is trained: the recipe's name, its model and its own hyper-parameters
    optim      the optimizer and its schedule (a group: sgd, adamw, muon)
    perf       how fast it runs, not what it computes: precision, compile, CUDA graphs, cuDNN, layout
    eval       when and in what chunks the test set is scored
    data       where the data lives and how it reaches the device
    strategy   how devices share the work (a group: auto, single, dp, ddp, fsdp; launcher/strategies)
    backend    where the workers run (a group: local, slurm; launcher/host/backends)
    sweep      `launch -m` on this host
    fault      deliberate failures, to see supervision work
    log        the trackers the epochs' figures go to (a group whose options are picked several at once:
               log=[tensorboard,mlflow,csv]; launcher/train/trackers.py)
    early_stop stop a run whose figure stopped improving
    checkpoint last.pt every epoch, and the best epochs' (keep_best)
and the keys typed most often (gpus, batch_size, epochs, lr, ...) at the top.

To add an option to a group (a strategy, a backend, an optimizer, a recipe): its schema class here
(a subclass of the group's base class), its line in SCHEMAS, and conf/<group>/<option>.yaml, whose
defaults list names the schema. A user's own recipe declares its schema in its own module
(launcher/recipes/__init__.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, TypeVar

from launcher.errors import ConfigError

MISSING = "???"  # omegaconf.MISSING: a value the composed config must fill in


class Choice(Enum):
    """A value from a fixed set, typed on the command line by its name (`perf.precision=bf16`)."""

    def __str__(self) -> str:
        return self.value


def _choice(name: str, values: str) -> type[Choice]:
    """A Choice whose names are not all Python identifiers (torch's `reduce-overhead`, `raise`)."""
    return Choice(name, [(v, v) for v in values.split()], module=__name__, qualname=name)  # type: ignore[return-value]


class Flip(Choice):
    random = "random"
    alternating = "alternating"  # each image the other way round every other epoch
    none = "none"


class Precision(Choice):
    auto = "auto"  # bf16 autocast on GPUs, fp32 on the CPU
    bf16 = "bf16"
    fp16 = "fp16"  # autocast to float16 with a gradient scaler (GPUs without bf16); steps that overflow are skipped
    fp32 = "fp32"


class Placement(Choice):
    auto = "auto"  # gpu when the dataset takes at most a quarter of the GPU's free memory, else host
    gpu = "gpu"  # the whole split on the GPU
    host = "host"  # pinned host memory, copied on a side stream


class ProcessGroupBackend(Choice):
    auto = "auto"  # nccl on GPUs, gloo on the CPU
    nccl = "nccl"
    gloo = "gloo"


class Decode(Choice):
    auto = "auto"  # with a GPU: the workers alone, or a split sized from their times where they fall behind (measured)
    cpu = "cpu"  # DataLoader worker processes decode (PIL)
    gpu = "gpu"  # batched nvJPEG on the GPU, off the compute stream


class OnBadFile(Choice):
    error = "error"  # the run stops with one line naming the file
    skip = "skip"  # the sample is left out of its batch and counted (epoch line, results.json)


class Progress(Choice):
    auto = "auto"  # a live bar when stdout is a terminal, else a line per epoch
    bar = "bar"
    lines = "lines"


CompileMode = _choice("CompileMode", "default reduce-overhead max-autotune max-autotune-no-cudagraphs")
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")  # the modes whose compiled code makes CUDA graphs
# A plain string checked by FaultConfig.check, not a Choice: Hydra reads `fault.kind=nan` as a float.
FAULT_KINDS = ("raise", "exit", "hang", "kill", "nan", "oom", "damage")


INT_MAX = 2**31 - 1  # no setting needs more, and every value fits the C ints torch and its libraries take


def check_int(key: str, value: Any, low: int, example: str, high: int | None = None) -> None:
    """`value` is an integer in [low, high] (high: INT_MAX unless given)."""
    top = INT_MAX if high is None else high
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value > top:
        too_big = isinstance(value, int) and not isinstance(value, bool) and value > top
        bound = f"an integer from {low} to {top}" if high is not None or too_big else f"an integer >= {low}"
        raise ConfigError(key, value, f"must be {bound}", example)


def check_float(key: str, value: Any, example: str, *, positive: bool = True, high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if positive else value >= 0) and (high is None or value <= high)
    if not ok:
        rule = "a finite number > 0" if positive else "a finite number >= 0"
        if high is not None:
            rule += f" and <= {high}"
        raise ConfigError(key, value, f"must be {rule}", example)


def split_endpoint(text: Any, key: str = "rdzv") -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 address in brackets: `[fd00::1]:29400`) -> (host, port), or a ConfigError."""
    example = "nodes=2 node_rank=0 rdzv=10.0.0.1:29400"
    value = str(text).strip()
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in value):
        raise ConfigError(key, text, "must be HOST:PORT: an address (or name) of node 0 that every node reaches, "
                          "and a port from 1 to 65535", example)
    return host, int(port)


class Schema:
    """Base of every schema class: mutable while Hydra builds it, read-only once `freeze`d, and able to
    check the ranges its types cannot express (`check`, called before anything starts)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(f"cannot assign to {type(self).__name__}.{name}: the config "
                                                  "is frozen once composed; derive a changed copy with derive()")
        object.__setattr__(self, name, value)

    def check(self, at: str) -> None:
        """Raise a ConfigError naming `at`.key for a value out of range. `at` is this section's path."""


# ---- recipe -------------------------------------------------------------------------------------


@dataclass
class RecipeConfig(Schema):
    """What is trained. Each recipe's schema subclasses this with its own hyper-parameters."""

    name: str = MISSING  # a built-in recipe (digits, cifar10) or a user's module path (my_pkg.my_recipe)
    model: str = MISSING  # one of the recipe's models


@dataclass
class ImageRecipeConfig(RecipeConfig):
    """Image classification: cross-entropy over classes, augmentation on the training device."""

    label_smoothing: float = 0.0
    augment: bool = True
    flip: Flip = Flip.random
    translate: int = 2  # random shift by up to this many pixels (reflect padding)
    image_side: ClassVar[int | None] = None  # the images' side in pixels, when the recipe knows it

    def check(self, at: str) -> None:
        check_float(f"{at}.label_smoothing", self.label_smoothing, f"{at}.label_smoothing=0.1", positive=False,
                    high=1.0)
        # reflect padding needs a shift smaller than the image (a worker checks user recipes' images)
        high = 8 if self.image_side is None else min(8, self.image_side - 1)
        check_int(f"{at}.translate", self.translate, 0, f"{at}.translate=2", high=high)


class DigitsModel(Choice):
    cnn = "cnn"


@dataclass
class DigitsConfig(ImageRecipeConfig):
    name: str = "digits"
    model: DigitsModel = DigitsModel.cnn
    image_side: ClassVar[int | None] = 8


class Cifar10Model(Choice):
    airbench = "airbench"
    airbench94 = "airbench94"
    resnet18 = "resnet18"
    mobilenetv3_small = "mobilenetv3_small"


@dataclass
class Cifar10Config(ImageRecipeConfig):
    name: str = "cifar10"
    model: Cifar10Model = Cifar10Model.airbench
    tta: int = 0  # test-time augmentation: 0 none | 1 mirror | 2 mirror + 1-pixel shifts
    image_side: ClassVar[int | None] = 32

    def check(self, at: str) -> None:
        super().check(at)
        check_int(f"{at}.tta", self.tta, 0, f"recipe=cifar10 {at}.tta=2", high=2)


@dataclass
class ImageFolderConfig(RecipeConfig):
    """A folder of images in the ImageNet layout (recipes/imagefolder.py): `data.root` holds
    train/<class>/* and val/<class>/*, decoded per sample (data.decode: cpu workers, the GPU, or both)."""

    name: str = "imagefolder"
    model: str = "resnet50"  # any torchvision classification model (torchvision.models.list_models()), untrained
    image_size: int = 224  # the side of the square crops trained and evaluated on
    eval_resize: int = 0  # evaluation: shorter side resized to this, then center-cropped (0: image_size*256/224)
    label_smoothing: float = 0.0
    min_scale: float = 0.08  # RandomResizedCrop's smallest share of the image's area

    @property
    def eval_side(self) -> int:
        """The shorter side evaluation images are resized to before their center crop."""
        return self.eval_resize or round(self.image_size * 256 / 224)

    def check(self, at: str) -> None:
        check_int(f"{at}.image_size", self.image_size, 8, f"{at}.image_size=224", high=4096)
        check_int(f"{at}.eval_resize", self.eval_resize, 0, f"{at}.eval_resize=256", high=8192)
        if self.eval_resize and self.eval_resize < self.image_size:
            raise ConfigError(f"{at}.eval_resize", self.eval_resize, f"must be 0 (image_size*256/224) or at least "
                              f"{at}.image_size ({self.image_size}): the center crop is taken from the resized image",
                              f"{at}.eval_resize=0")
        check_float(f"{at}.label_smoothing", self.label_smoothing, f"{at}.label_smoothing=0.1", positive=False,
                    high=1.0)
        check_float(f"{at}.min_scale", self.min_scale, f"{at}.min_scale=0.08", high=1.0)
        check_torchvision_model(f"{at}.model", self.model)


def check_torchvision_model(key: str, name: Any) -> None:
    """`name` is one of torchvision's classification models. Imports torchvision (and torch) when called:
    the recipe that takes it is imported on the host right after the config is checked anyway."""
    from launcher.lifetime import sigint_deferred

    try:
        with sigint_deferred():
            import torchvision.models
    except ImportError:
        raise ConfigError(key, name, "recipe=imagefolder builds torchvision's models and torchvision is not "
                          "installed here: pip install torchvision (the build matching your torch)") from None
    known = torchvision.models.list_models(module=torchvision.models)
    if str(name) not in known:
        close = [m for m in known if str(name).lower().replace("-", "_") in m][:4]
        few = close or ["resnet50", "resnet18", "convnext_tiny", "vit_b_16", "efficientnet_b0"]
        raise ConfigError(key, name, f"a torchvision classification model, e.g. {', '.join(few)} (all "
                          f"{len(known)}: python -c \"import torchvision; "
                          "print(torchvision.models.list_models(module=torchvision.models))\")",
                          "recipe=imagefolder recipe.model=resnet50")


class TextModel(Choice):
    gpt = "gpt"  # decoder-only Transformer: pre-norm, scaled_dot_product_attention, tied embeddings
    lstm = "lstm"
    gru = "gru"


MAX_VOCAB = 1 << 22  # recipe.vocab_size: beyond any tokenizer's (GPT-2 50257, Llama 3 128256, Gemma 262144)


@dataclass
class TextConfig(RecipeConfig):
    """Next-token prediction (recipes/text.py): on bytes of text (no tokenizer to download), or on token
    shards written by nanoGPT or llm.c (.bin, .npy)."""

    name: str = "text"
    model: TextModel = TextModel.gpt
    # stdlib: this Python's own standard library sources (PSF licence, on every machine with Python);
    # or the path of a text file, a folder or a glob of text files (bytes); or of token shards (.bin, .npy)
    corpus: str = "stdlib"
    max_bytes: int = 0  # use only the corpus's first this many bytes (0: all of it; byte corpora only)
    # the tokens' vocabulary: 0 = 256 (bytes); token shards need their tokenizer's (GPT-2: 50257). The
    # model's embedding and output layer are padded to a multiple of 64 (50257 -> 50304).
    vocab_size: int = 0
    context: int = 256  # bytes a sample sees (and predicts)
    layers: int = 6
    width: int = 384  # the embedding (gpt) or hidden state (lstm, gru)
    heads: int = 6  # gpt only: width must divide by it
    dropout: float = 0.0
    sample_bytes: int = 300  # after training, rank 0 generates this many bytes into sample.txt (0: none)
    sample_prompt: str = "def "
    temperature: float = 0.8

    def check(self, at: str) -> None:
        check_int(f"{at}.max_bytes", self.max_bytes, 0, f"{at}.max_bytes=1000000", high=2**62)
        check_int(f"{at}.context", self.context, 2, f"{at}.context=256", high=65536)
        check_int(f"{at}.vocab_size", self.vocab_size, 0, f"{at}.vocab_size=50257", high=MAX_VOCAB)
        if self.vocab_size == 1:
            raise ConfigError(f"{at}.vocab_size", 1, "a vocabulary needs at least 2 tokens (0: 256, for bytes)",
                              f"{at}.vocab_size=50257")
        check_int(f"{at}.layers", self.layers, 1, f"{at}.layers=6", high=1024)
        check_int(f"{at}.width", self.width, 1, f"{at}.width=384", high=65536)
        check_int(f"{at}.heads", self.heads, 1, f"{at}.heads=6", high=1024)
        check_float(f"{at}.dropout", self.dropout, f"{at}.dropout=0.1", positive=False, high=0.99)
        check_int(f"{at}.sample_bytes", self.sample_bytes, 0, f"{at}.sample_bytes=300", high=100_000)
        check_float(f"{at}.temperature", self.temperature, f"{at}.temperature=0.8")
        if not str(self.corpus).strip():
            raise ConfigError(f"{at}.corpus", self.corpus, "give stdlib or the path of a text file or folder",
                              f"{at}.corpus=stdlib")
        if self.model is TextModel.gpt and self.width % self.heads:
            fits = max(h for h in range(1, self.heads + 1) if self.width % h == 0)
            raise ConfigError(f"{at}.heads", self.heads, f"the width ({self.width}) must divide evenly into heads",
                              f"{at}.heads={fits}")
        if not self.sample_prompt:
            raise ConfigError(f"{at}.sample_prompt", "''", "the sample needs a prompt of at least one character",
                              f"{at}.sample_prompt='def '")


# ---- optim --------------------------------------------------------------------------------------


@dataclass
class OptimConfig(Schema):
    """Every optimizer: `lr` (top level) is its rate, with a triangular schedule (a linear warm-up
    over `warmup_epochs`, then a linear decay to 0 at the end of the run)."""

    name: str = MISSING
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    # Gradients scaled down to this global L2 norm before every step when their norm is larger (over all
    # parameters and ranks, after accumulation); 0: never.
    clip_grad_norm: float = 0.0

    def check(self, at: str) -> None:
        check_float(f"{at}.weight_decay", self.weight_decay, f"{at}.weight_decay=5e-4", positive=False)
        check_float(f"{at}.warmup_epochs", self.warmup_epochs, f"{at}.warmup_epochs=1", positive=False)
        check_float(f"{at}.clip_grad_norm", self.clip_grad_norm, f"{at}.clip_grad_norm=1.0", positive=False)


@dataclass
class SGDConfig(OptimConfig):
    name: str = "sgd"
    momentum: float = 0.9
    nesterov: bool = True

    def check(self, at: str) -> None:
        super().check(at)
        check_float(f"{at}.momentum", self.momentum, f"{at}.momentum=0.9", positive=False, high=1.0)


@dataclass
class AdamWConfig(OptimConfig):
    name: str = "adamw"


@dataclass
class MuonConfig(OptimConfig):
    """Muon (torch.optim.Muon's update, capturable: launcher/train/optim.py) on the model's filter
    matrices, Nesterov SGD on everything else. `lr` is Muon's; the SGD groups have their own rates. The
    defaults are the CIFAR-10 speed record's (Keller Jordan, 2024), for its batch of 2000."""

    name: str = "muon"
    weight_decay: float = 0.004  # per step at full LR, SGD groups only
    warmup_epochs: float = 0.0
    muon_momentum: float = 0.6
    momentum: float = 0.85  # the SGD groups'
    sgd_lr: float = 106.0  # BatchNorm biases and the stem's bias
    head_lr: float = 1340.0  # the classifier
    stem_bias_epochs: float = 3.0  # the stem's bias trains only this long

    def check(self, at: str) -> None:
        super().check(at)
        check_float(f"{at}.momentum", self.momentum, f"{at}.momentum=0.85", positive=False, high=1.0)
        check_float(f"{at}.muon_momentum", self.muon_momentum, f"{at}.muon_momentum=0.6", positive=False, high=1.0)
        check_float(f"{at}.sgd_lr", self.sgd_lr, f"{at}.sgd_lr=0.05")
        check_float(f"{at}.head_lr", self.head_lr, f"{at}.head_lr=0.5")
        check_float(f"{at}.stem_bias_epochs", self.stem_bias_epochs, f"{at}.stem_bias_epochs=3", positive=False)


# ---- strategy -----------------------------------------------------------------------------------


@dataclass
class StrategyConfig(Schema):
    name: str = MISSING


@dataclass
class SingleConfig(StrategyConfig):
    name: str = "single"


@dataclass
class DataParallelConfig(StrategyConfig):
    name: str = "dp"


@dataclass
class DDPConfig(StrategyConfig):
    name: str = "ddp"
    backend: ProcessGroupBackend = ProcessGroupBackend.auto
    timeout_s: int = 600  # a collective that waits longer than this ends the launch instead of hanging
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    # DDP's gradient buckets in MB, also those of perf.cuda_graph's own all-reduce; 0: by the model's size
    # (a fifth of its gradients, from torch's 25 to 100; launcher/strategies/base.py bucket_mb)
    bucket_cap_mb: int = 0
    find_unused_parameters: bool = False

    def check(self, at: str) -> None:
        check_int(f"{at}.timeout_s", self.timeout_s, 1, f"{at}.timeout_s=600")
        check_int(f"{at}.bucket_cap_mb", self.bucket_cap_mb, 0, f"{at}.bucket_cap_mb=0")


@dataclass
class FSDPConfig(StrategyConfig):
    """PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard): weights, gradients and optimizer state
    sharded over the ranks (launcher/strategies/fsdp.py)."""

    name: str = "fsdp"
    backend: ProcessGroupBackend = ProcessGroupBackend.auto
    timeout_s: int = 600
    reshard_after_forward: bool = True  # free each unit's gathered weights after its forward (less memory)
    # The fewest parameters a shard unit holds (torch's size-based wrapping default): consecutive blocks
    # are gathered as one unit until it holds this many, and what is left (all of a smaller model) is
    # gathered with the root. 0: every block a unit of its own. Fewer units are fewer of FSDP2's hooks,
    # which bound a small model's step (launcher/strategies/fsdp.py `shard_groups`).
    min_unit_params: int = 100_000_000
    mixed_precision: bool = True  # GPUs: bf16 weights in compute, gradients reduced in fp32
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass
    # Build the model on the meta device and materialize only each rank's shard (its own init runs on
    # the shards): a model too big for one device never exists whole on one. false: built whole on the
    # device (same initial weights as ddp), then sharded.
    meta_init: bool = False

    def check(self, at: str) -> None:
        check_int(f"{at}.timeout_s", self.timeout_s, 1, f"{at}.timeout_s=600")
        check_int(f"{at}.min_unit_params", self.min_unit_params, 0, f"{at}.min_unit_params=0")


@dataclass
class AutoStrategyConfig(DDPConfig):
    """ddp for several devices (with these DDP options), else single; never dp."""

    name: str = "auto"


# ---- backend ------------------------------------------------------------------------------------


@dataclass
class BackendConfig(Schema):
    name: str = MISSING


@dataclass
class LocalBackendConfig(BackendConfig):
    name: str = "local"


@dataclass
class SlurmBackendConfig(BackendConfig):
    """sbatch options (null leaves the cluster's default) and how launch follows the job."""

    name: str = "slurm"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60  # the job's time limit, minutes
    mem_gb: int | None = None  # memory per node
    cpus_per_task: int | None = None
    constraint: str | None = None
    exclude: str | None = None
    nodes: int = 1  # world = nodes x tasks per node (GPUs per node under ddp)
    job_name: str | None = None  # default: launch-<recipe>
    additional: dict[str, Any] = field(default_factory=dict)  # any other sbatch option, e.g. {mail-type: END}
    wait: bool = False  # follow the job until it ends; the exit status becomes launch's
    max_requeues: int = 3  # after SIGUSR2 (preemption, time limit): checkpoint and requeue at most this often
    array_parallelism: int = 16  # `launch -m`: a job array, at most this many of its runs at once

    TEXT_KEYS = ("partition", "account", "qos", "constraint", "exclude", "job_name")

    def check(self, at: str) -> None:
        """sbatch options end up as lines of a batch script: no value may start a new line of it."""
        check_int(f"{at}.time_min", self.time_min, 1, f"{at}.time_min=120")
        check_int(f"{at}.nodes", self.nodes, 1, f"{at}.nodes=2")
        check_int(f"{at}.max_requeues", self.max_requeues, 0, f"{at}.max_requeues=3")
        check_int(f"{at}.array_parallelism", self.array_parallelism, 1, f"{at}.array_parallelism=4")
        for key in ("mem_gb", "cpus_per_task"):
            if getattr(self, key) is not None:
                check_int(f"{at}.{key}", getattr(self, key), 1, f"{at}.{key}=8")
        texts = {f"{at}.{k}": getattr(self, k) for k in self.TEXT_KEYS if getattr(self, k) is not None}
        for key, value in (self.additional or {}).items():
            if not isinstance(key, str) or not key or not all(c.isalnum() or c in "-_" for c in key):
                raise ConfigError(f"{at}.additional", key, "sbatch option names are letters, digits, - and _",
                                  f"'{at}.additional={{mail-type: END}}'")
            texts[f"{at}.additional.{key}"] = value
        for key, value in texts.items():
            if any(ord(c) < 32 or ord(c) == 127 for c in str(value)):
                raise ConfigError(key, repr(str(value)), "control characters (a newline would start a new line of "
                                  "the batch script) are not allowed", f"{key}=gpu")


# ---- the other sections -------------------------------------------------------------------------


@dataclass
class DataConfig(Schema):
    root: str = "${oc.env:LAUNCH_DATA_ROOT,'~/.cache/launcher/data'}"
    download: bool = True  # fetch a missing dataset (checksummed); offline, an error says where to put it
    synthetic: bool = False  # generate data of the real shape for timing runs; never used unless asked for
    placement: Placement = Placement.auto
    prefetch_depth: int = 2  # batches copied to the device ahead of the step that uses them (side stream)
    # A recipe that hands over Datasets (launcher/train/loader.py): DataLoader worker processes per rank
    # (null: the cores this rank may use, less one for the training loop), and the batches each one
    # keeps ready (DataLoader's prefetch_factor)
    workers: int | None = None
    worker_prefetch: int = 4
    decode: Decode = Decode.auto  # image recipes that decode files (recipe=imagefolder): where
    on_bad_file: OnBadFile = OnBadFile.error  # a file that cannot be read or decoded

    def check(self, at: str) -> None:
        check_int(f"{at}.prefetch_depth", self.prefetch_depth, 1, f"{at}.prefetch_depth=2", high=64)
        if self.workers is not None:
            check_int(f"{at}.workers", self.workers, 0, f"{at}.workers=8", high=1024)
        check_int(f"{at}.worker_prefetch", self.worker_prefetch, 1, f"{at}.worker_prefetch=4", high=64)


@dataclass
class EvalConfig(Schema):
    batch_size: int = 1024  # global, like batch_size
    every: int = 1  # evaluate after every N-th epoch (0: only after the last)
    # Evaluate this run dir's (or checkpoint file's) weights instead of training: `launch eval RUN_DIR`
    checkpoint: str | None = None

    def check(self, at: str) -> None:
        check_int(f"{at}.batch_size", self.batch_size, 1, f"{at}.batch_size=1024")
        check_int(f"{at}.every", self.every, 0, f"{at}.every=1")


def _true_false_auto(value: Any) -> Any:
    """A true | false | auto setting as True, False or "auto" (YAML and the command line may give strings);
    anything else comes back as it was, for the check to name."""
    if isinstance(value, str) and value.lower() in ("true", "false", "auto"):
        return {"true": True, "false": False}.get(value.lower(), "auto")
    return value


@dataclass
class PerfConfig(Schema):
    """Settings that change the speed, not (beyond rounding) what is computed."""

    precision: Precision = Precision.auto
    channels_last: bool = True  # GPU only
    # torch.compile the model (its warm-up runs before any clock starts): true | false | auto, which
    # compiles GPU runs long enough to earn the compile time back (launcher/train/compiling.py)
    compile: Any = "auto"
    # perf.compile=auto compiles when, after the first epoch, the epochs left would take this long uncompiled
    compile_auto_min_s: float = 60.0
    compile_mode: CompileMode = CompileMode["default"]  # type: ignore[valid-type]
    # GPUs: capture each step (augment, forward, backward, gradient all-reduce) as one CUDA graph and
    # replay it (true | false | auto). Under ddp the gradients then sit in flat buckets averaged by the
    # launcher instead of DDP's reducer (launcher/train/step.py), so DDP's static_graph/find_unused_parameters
    # do not apply. auto: on GPUs, one process each (strategy single or ddp), where the step is the
    # launcher's own (a recipe with no training_step of its own), the warm-up times the step eagerly and
    # replayed and keeps the faster (under ddp every rank alike, both ways with flat buckets), said in one
    # line: a small network's step, paced by the host's kernel launches, replays about 2x faster (a
    # ResNet-18 at batch 512 on an H200: 2.2-2.5x, BENCHMARKS.md); a large one on one GPU gains nothing.
    # ddp over several nodes, or with strategy.find_unused_parameters or static_graph set, keeps DDP's reducer.
    # A recipe's own training_step is replayed only with true (a replay runs none of its Python: no
    # .item(), no counters kept in Python).
    cuda_graph: Any = "auto"
    # GPUs: let cuDNN time its algorithms for each convolution shape on first use (true | false | auto).
    # On the CIFAR networks it made steps ~3.5% shorter and the first step 4-7 s later (BENCHMARKS.md), so
    # auto autotunes exactly when the run compiles (perf.compile=true, or auto once it decides to compile):
    # a run long enough to compile earns it back, a short one starts sooner.
    cudnn_benchmark: Any = "auto"

    @property
    def compile_setting(self) -> bool | str:
        """perf.compile as True, False or "auto" (a YAML or command line may give it as a string)."""
        return _true_false_auto(self.compile)

    @property
    def cudnn_benchmark_setting(self) -> bool | str:
        """perf.cudnn_benchmark as True, False or "auto"."""
        return _true_false_auto(self.cudnn_benchmark)

    @property
    def cuda_graph_setting(self) -> bool | str:
        """perf.cuda_graph as True, False or "auto"."""
        return _true_false_auto(self.cuda_graph)

    @property
    def compile_makes_graphs(self) -> bool:
        """Whether torch.compile, where it runs, makes CUDA graphs itself (these compile modes do)."""
        return self.compile_mode.value in GRAPHING_COMPILE_MODES

    def check(self, at: str) -> None:
        check_float(f"{at}.compile_auto_min_s", self.compile_auto_min_s, f"{at}.compile_auto_min_s=60", positive=False)
        if self.compile_setting not in (True, False, "auto"):
            raise ConfigError(f"{at}.compile", self.compile, "choose true, false or auto (compile GPU runs long "
                              "enough to earn the compile time back)", f"{at}.compile=auto")
        if self.cudnn_benchmark_setting not in (True, False, "auto"):
            raise ConfigError(f"{at}.cudnn_benchmark", self.cudnn_benchmark, "choose true, false or auto "
                              "(autotune cuDNN when the run compiles)", f"{at}.cudnn_benchmark=auto")
        if self.cuda_graph_setting not in (True, False, "auto"):
            raise ConfigError(f"{at}.cuda_graph", self.cuda_graph, "choose true, false or auto (replay the step as a "
                              "CUDA graph where that is measured faster)", f"{at}.cuda_graph=auto")
        if self.cuda_graph_setting is True and self.compile_setting is not False and self.compile_makes_graphs:
            raise ConfigError(f"{at}.compile_mode", self.compile_mode, f"{at}.cuda_graph=true captures the whole "
                              "step already and this mode would make CUDA graphs inside it; use default or "
                              f"max-autotune-no-cudagraphs, or {at}.cuda_graph=false to let torch.compile graph it",
                              f"{at}.compile_mode=default")


@dataclass
class FaultConfig(Schema):
    """Deliberate failures, to test supervision: rank `rank` fails at global step `step` with `kind`."""

    rank: int | None = None
    step: int = 0
    kind: str = "raise"  # raise | exit | hang | kill | nan (the loss becomes NaN from that step on) | oom |
    # damage (bytes of the run's checkpoints/last.pt overwritten in place, as a failing disk would, then raise)
    attempt: int = 0  # only on this restart attempt (-1: on every attempt)

    def check(self, at: str) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"{at}.kind", self.kind, "choose one of " + ", ".join(FAULT_KINDS), f"{at}.kind=raise")


class Direction(Choice):
    auto = "auto"  # minimize a loss or an error (loss, mse, rmse, mae, error, bpb, ppl in its name), else maximize
    minimize = "minimize"
    maximize = "maximize"


MINIMIZED_WORDS = ("loss", "mse", "rmse", "mae", "err", "bpb", "ppl", "perplexity", "nll", "distance")


DEFAULT_OBJECTIVE = "test_acc"


def minimized(name: str, direction: Direction | str = "auto") -> bool:
    """Whether a smaller value of the figure `name` is better (sweep.direction, or its name when auto)."""
    if str(direction) != "auto":
        return str(direction) == "minimize"
    return any(word in name.lower() for word in MINIMIZED_WORDS)


@dataclass
class SweepConfig(Schema):
    """`launch -m` (launcher/host/sweep.py)."""

    parallel: int = 0  # on this host, most runs at once; 0: as many as the GPUs allow (CPU runs one at a time)
    # the results.json value each run returns to Hydra (e.g. for the Optuna sweeper): test_acc, or any figure
    # a recipe's eval_step names, as test_NAME (test_rmse, test_loss)
    objective: str = DEFAULT_OBJECTIVE  # (where a run has no accuracy: its first test_NAME figure)
    direction: Direction = Direction.auto  # which way the objective is better: the summary's best run

    def check(self, at: str) -> None:
        check_int(f"{at}.parallel", self.parallel, 0, f"{at}.parallel=2")


class Mode(Choice):
    auto = "auto"  # min for a loss or an error (loss, mse, mae, error, bpb, ppl in its name), else max
    min = "min"
    max = "max"


FIGURE_ALIASES = {"accuracy": "acc"}  # TensorBoard's tag names -> the figures' own (test/accuracy: test_acc)


def figure_key(name: Any) -> str:
    """A figure as typed (`val/mse`, `test/mse`, `test_mse`, `train/loss`, `loss`, `test/accuracy`) -> its key in
    an epoch's row (metrics.jsonl, results.json): the held-out split's figures are test_NAME (val/ and eval/
    name them too), the training ones train_NAME, the training loss `loss`."""
    text = str(name).strip()
    for prefixes, to in ((("val/", "val_", "valid/", "eval/", "test/"), "test_"), (("train/",), "train_")):
        for prefix in prefixes:
            if text.startswith(prefix) and len(text) > len(prefix):
                rest = text[len(prefix):]
                rest = FIGURE_ALIASES.get(rest, rest)
                return "loss" if (to, rest) == ("train_", "loss") else to + rest
    return text


def smaller_is_better(key: str, mode: Mode | str) -> bool:
    """Whether a smaller value of the figure `key` is better: as `mode` says, or by its name when auto."""
    return minimized(key, "auto") if str(mode) == "auto" else str(mode) == "min"


def _check_figure(key: str, value: Any, example: str) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value)):
        raise ConfigError(key, value, "names a figure of the epoch line: test_NAME (or val/NAME, test/NAME) for a "
                          "held-out figure, train_NAME or loss for a training one", example)


@dataclass
class CheckpointConfig(Schema):
    """`checkpoint=false` turns checkpoints off; `checkpoint.keep_best=3 checkpoint.metric=test_acc` keeps the
    best 3 epochs' checkpoints beside last.pt (launcher/train/best.py)."""

    enabled: bool = True  # checkpoints/last.pt every epoch (atomically)
    keep_best: int = 0  # also keep the best this many epochs' checkpoints (checkpoints/best.pt, best-epoch-N.pt)
    # the figure that ranks them (default: early_stop.metric, else test_acc or the first test_NAME)
    metric: str | None = None
    mode: Mode = Mode.auto  # min | max | auto

    def check(self, at: str) -> None:
        check_int(f"{at}.keep_best", self.keep_best, 0, f"{at}.keep_best=3", high=1000)
        _check_figure(f"{at}.metric", self.metric, f"{at}.keep_best=3 {at}.metric=test_acc")
        if self.keep_best and not self.enabled:
            raise ConfigError(f"{at}.keep_best", self.keep_best, "keeps the best of the run's checkpoints, and "
                              f"{at}.enabled=false writes none", f"{at}.enabled=true {at}.keep_best={self.keep_best}")


@dataclass
class EarlyStopConfig(Schema):
    """Stop a run whose figure stopped improving (launcher/train/early_stop.py): the same decision on every rank."""

    metric: str | None = None  # the figure watched (test_mse, val/mse, loss, ...); null: never stop early
    mode: Mode = Mode.auto  # min | max | auto
    patience: int = 3  # evaluations without an improvement before the run stops
    min_delta: float = 0.0  # an improvement smaller than this does not count

    def check(self, at: str) -> None:
        _check_figure(f"{at}.metric", self.metric, f"{at}.metric=test_loss {at}.patience=3")
        check_int(f"{at}.patience", self.patience, 1, f"{at}.patience=3")
        check_float(f"{at}.min_delta", self.min_delta, f"{at}.min_delta=0.001", positive=False)
        if self.metric is None and (self.patience != 3 or self.min_delta or str(self.mode) != "auto"):
            raise ConfigError(f"{at}.metric", None, f"names no figure to watch, so the other {at}.* settings would "
                              "do nothing: name one (test_loss, val/mse, ...)",
                              f"{at}.metric=test_loss {at}.patience={self.patience}")


class WandbMode(Choice):
    offline = "offline"  # written under the run dir only; `wandb sync DIR` sends it, if and when you choose
    online = "online"
    disabled = "disabled"


@dataclass
class TensorBoardLog(Schema):
    folder: str = "tensorboard"  # under the run dir: tensorboard --logdir RUN_DIR


@dataclass
class CsvLog(Schema):
    file: str = "metrics.csv"  # under the run dir: one row per epoch, a column per figure


@dataclass
class MlflowLog(Schema):
    # null: MLFLOW_TRACKING_URI, else MLflow's own local store in the folder launch runs in (MLflow 3:
    # sqlite:///mlflow.db, which `mlflow ui` there shows); a server's http://HOST:PORT, or file:./mlruns
    tracking_uri: str | None = None
    experiment: str | None = None  # default: the recipe's name
    run_name: str | None = None  # default: the run dir's name
    tags: dict[str, Any] = field(default_factory=dict)

    def check(self, at: str) -> None:
        if self.tracking_uri is not None and not str(self.tracking_uri).strip():
            raise ConfigError(f"{at}.tracking_uri", self.tracking_uri, "give a URI (http://HOST:5000, "
                              "sqlite:///mlflow.db, file:./mlruns) or leave it out", f"{at}.tracking_uri=http://127.0.0.1:5000")


@dataclass
class WandbLog(Schema):
    mode: WandbMode = WandbMode.offline  # offline: nothing leaves the machine unless you run `wandb sync`
    project: str | None = None  # default: launch-<recipe>
    entity: str | None = None
    tags: list[str] = field(default_factory=list)


# Where the epochs' figures go besides metrics.jsonl: `log=[tensorboard,mlflow,csv]` picks several options of
# the `log` group at once (conf/log/<name>.yaml each fills its field of LogConfig); launcher/train/trackers.py
# has one class per tracker. The pip package each needs, checked before any worker starts.
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "csv": None, "mlflow": "mlflow", "wandb": "wandb"}


@dataclass
class LogConfig(Schema):
    # a tracker not installed or not reachable stops the launch before any worker (false: a warning; it goes on)
    required: bool = True
    tensorboard: TensorBoardLog | None = None
    csv: CsvLog | None = None
    mlflow: MlflowLog | None = None
    wandb: WandbLog | None = None

    @property
    def chosen(self) -> list[str]:
        """The trackers picked (`log=[...]`), in a fixed order."""
        return [name for name in TRACKER_PACKAGES if getattr(self, name) is not None]

    def check(self, at: str) -> None:
        for name in self.chosen:
            section = getattr(self, name)
            if isinstance(section, Schema):
                section.check(f"{at}.{name}")


@dataclass
class Config(Schema):
    # The four groups are typed by the option chosen: each option's YAML brings its own schema (a
    # subclass of RecipeConfig, OptimConfig, StrategyConfig, BackendConfig), whose field types then hold
    # in full (a base-class annotation here would keep the base's field types over the option's).
    recipe: Any = MISSING
    optim: Any = MISSING
    strategy: Any = MISSING
    backend: Any = MISSING
    perf: PerfConfig = field(default_factory=PerfConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    log: LogConfig = field(default_factory=LogConfig)  # `log=[tensorboard,mlflow,csv]`: the trackers (conf/log/)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    # The keys typed most often sit at the top level.
    gpus: Any = "auto"  # [0,1] ids | 2 a count | all | auto (all visible, else CPU) | [] or cpu: the CPU
    nprocs: int | None = None  # CPU ranks for ddp on the CPU (gpus=[]); with GPUs it is one per GPU
    batch_size: int = 64  # GLOBAL: samples per optimizer step summed over all devices, for every strategy
    # Gradient accumulation: each rank's share of a step runs as this many micro-batches, gradients
    # summed, averaged across ranks only after the last one (batch_size stays the global step's)
    accumulate: int = 1
    epochs: int = 10
    lr: float = 0.1
    seed: int = 0
    resume: str | None = None  # a run dir or checkpoint file to continue from, or `latest`
    max_restarts: int = 0  # restart the worker group this many times after a failure; it resumes (SLURM: requeue)
    # Several machines without SLURM (launcher/host/network.py, rendezvous.py): the same launch on each,
    # `nodes=2 node_rank=K rdzv=HOST:PORT`; HOST is an address of node 0 that every node reaches.
    nodes: int = 1
    node_rank: int | None = None  # this machine's place, 0 .. nodes-1 (null: assigned at the rendezvous)
    rdzv: str | None = None  # HOST:PORT where node 0's launch listens for the others
    rdzv_timeout_s: int = 300  # how long a node waits for all the others to join (and to rejoin after a restart)
    dry_run: bool = False  # print the plan, start nothing
    # checkpoints/last.pt every epoch, atomically (`checkpoint=false`: none); `checkpoint.keep_best=3
    # checkpoint.metric=test_acc` keeps the best epochs' too (a section: CheckpointConfig; true/false stand for it)
    checkpoint: Any = field(default_factory=CheckpointConfig)
    # also every this many steps inside an epoch (0: at epoch ends only): a restart or resume then continues the
    # epoch's global order from the next step, on any number of ranks
    checkpoint_every_steps: int = 0
    # The network from config instead of the recipe's: `model._target_=torchvision.models.resnet50`, its
    # arguments as `+model.KEY=VALUE` (Hydra's instantiate, in each worker; launcher/models.py). Empty: the
    # recipe's own (recipe.model).
    model: dict[str, Any] = field(default_factory=lambda: {"_target_": None})
    profile: bool = False  # torch.profiler over the second epoch: profile.txt and trace.json in the run dir
    tensorboard: bool = True  # false: no TensorBoard even where `log` picks it (the switch before `log` existed)
    progress: Progress = Progress.auto
    # Your own torchrun-style script instead of a recipe (launcher/host/script.py): `args.KEY=V` become
    # `--KEY V`; what follows `--` on the command line is added after them.
    script: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    script_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint, bool):  # (`checkpoint=false`, as before the section existed)
            self.checkpoint = CheckpointConfig(enabled=self.checkpoint)
        elif isinstance(self.checkpoint, dict):
            self.checkpoint = CheckpointConfig(**self.checkpoint)

    @property
    def saves(self) -> bool:
        """Whether the run writes checkpoints (checkpoint.enabled)."""
        return bool(self.checkpoint.enabled)

    def check(self, at: str = "") -> None:
        """Every range and combination a type cannot express, section by section. Raises ConfigError."""
        if not isinstance(self.checkpoint, CheckpointConfig):
            raise ConfigError("checkpoint", self.checkpoint, "is true, false, or a section (checkpoint.keep_best=3 "
                              "checkpoint.metric=test_acc)", "checkpoint=true")
        check_int("epochs", self.epochs, 1, "epochs=10")
        check_int("batch_size", self.batch_size, 1, "batch_size=256")
        check_int("accumulate", self.accumulate, 1, "accumulate=2", high=self.batch_size)
        check_float("lr", self.lr, "lr=0.1")
        check_int("seed", self.seed, 0, "seed=0")
        check_int("max_restarts", self.max_restarts, 0, "max_restarts=2", high=100)
        check_int("checkpoint_every_steps", self.checkpoint_every_steps, 0, "checkpoint_every_steps=500")
        extra = sorted(k for k in (self.model or {}) if k != "_target_")
        if extra and not (self.model or {}).get("_target_"):
            raise ConfigError(f"model.{extra[0]}", self.model[extra[0]], "sets an argument of a network from config, "
                              "but model._target_ names none", "model._target_=torchvision.models.resnet18")
        self._check_nodes()
        if self.nprocs is not None:
            # (more ranks than cores run, slowly, as under torchrun: 4 per core at most, a typo's guard)
            check_int("nprocs", self.nprocs, 1, "gpus=[] strategy=ddp nprocs=2", high=4 * (os.cpu_count() or 256))
        watched = figure_key(self.early_stop.metric) if self.early_stop.metric else ""
        if watched.startswith("test_") and self.eval.every == 0 and self.epochs > 1:
            raise ConfigError("early_stop.metric", self.early_stop.metric, "watches a held-out figure, and "
                              "eval.every=0 evaluates only after the last epoch: early stopping could never stop the "
                              "run",
                              f"eval.every=1 early_stop.metric={self.early_stop.metric}")
        if self.eval.checkpoint is not None and (self.resume is not None or self.script):
            raise ConfigError("eval.checkpoint", self.eval.checkpoint, "evaluates a saved model; it does not go "
                              "with resume or script", f"eval.checkpoint={self.eval.checkpoint}")
        if self.script is not None and not str(self.script).strip():
            raise ConfigError("script", self.script, "give the path of your script, or leave script out to train "
                              "a recipe", "script=train.py gpus=[0,1]")
        if self.resume is not None and str(self.resume).strip().lower() in ("", "true", "false", "none"):
            raise ConfigError("resume", self.resume, "give a run dir or checkpoint file, or `latest`", "resume=latest")
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if isinstance(section, Schema):
                section.check(f.name)

    def _check_nodes(self) -> None:
        """nodes / node_rank / rdzv: a multi-machine launch names where the machines meet."""
        example = "nodes=2 node_rank=0 rdzv=10.0.0.1:29400"
        check_int("nodes", self.nodes, 1, example, high=4096)
        check_int("rdzv_timeout_s", self.rdzv_timeout_s, 1, "rdzv_timeout_s=600", high=86400)
        if self.nodes == 1:
            for key in ("node_rank", "rdzv"):
                if getattr(self, key) is not None:
                    raise ConfigError(key, getattr(self, key), "is for a launch over several machines: give nodes too "
                                      "(the same launch runs on each)", example)
            return
        if self.node_rank is not None:
            check_int("node_rank", self.node_rank, 0, f"nodes={self.nodes} node_rank=0 rdzv=10.0.0.1:29400",
                      high=self.nodes - 1)
        if self.rdzv is None:
            raise ConfigError("nodes", self.nodes, "several machines meet at a rendezvous: add rdzv=HOST:PORT, an "
                              "address of node 0 that every node reaches and a free port", example)
        split_endpoint(self.rdzv)
        if self.script is None and self.eval.checkpoint is not None:
            raise ConfigError("nodes", self.nodes, "launch eval runs on one machine", "eval.checkpoint=RUN_DIR")
        if getattr(self.backend, "name", "local") != "local":
            raise ConfigError("nodes", self.nodes, f"is for launches you start on each machine yourself; with "
                              f"backend={self.backend.name} the cluster starts the nodes: use backend.nodes",
                              f"backend={self.backend.name} backend.nodes={self.nodes}")


# The config groups: `recipe=text` chooses an option (conf/recipe/text.yaml), whose values fill the section;
# the section's `name` is the option chosen.
GROUPS = ("recipe", "optim", "strategy", "backend")

# Schema of each config-group option: conf/<group>/<option>.yaml names `/schema/<group>/<option>` in its
# defaults list. Several options may share one schema (recipe=cifar10 and recipe=cifar10_fast).
SCHEMAS: dict[tuple[str, str], type[Schema]] = {
    ("recipe", "digits"): DigitsConfig,
    ("recipe", "cifar10"): Cifar10Config,
    ("recipe", "text"): TextConfig,
    ("recipe", "imagefolder"): ImageFolderConfig,
    ("optim", "sgd"): SGDConfig,
    ("optim", "adamw"): AdamWConfig,
    ("optim", "muon"): MuonConfig,
    ("strategy", "auto"): AutoStrategyConfig,
    ("strategy", "single"): SingleConfig,
    ("strategy", "dp"): DataParallelConfig,
    ("strategy", "ddp"): DDPConfig,
    ("strategy", "fsdp"): FSDPConfig,
    ("backend", "local"): LocalBackendConfig,
    ("backend", "slurm"): SlurmBackendConfig,
}

S = TypeVar("S", bound=Schema)


def freeze(obj: S) -> S:
    """Make a schema instance and every schema inside it read-only (attribute assignment raises)."""
    if isinstance(obj, Schema):
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            freeze(getattr(obj, f.name))
        object.__setattr__(obj, "_frozen", True)
    return obj


def derive(obj: S, **changes: Any) -> S:
    """A frozen copy of `obj` with `changes` (dataclasses.replace for frozen configs)."""
    return freeze(dataclasses.replace(obj, **changes))  # type: ignore[type-var]


def flat_keys(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Plain nested data (`to_plain`'s) as {dotted.key: value}."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flat_keys(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def to_plain(obj: Any) -> Any:
    """Plain Python data (dicts, lists, str for choices), e.g. for JSON or a checkpoint's `config`."""
    if isinstance(obj, Schema):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def model_name(cfg: Config) -> str:
    """The network a config trains, as results and logs name it: the config model's `_target_`, else the
    recipe's model."""
    target = (cfg.model or {}).get("_target_")
    return str(target) if target else str(cfg.recipe.model)


def choices(cfg: Config) -> dict[str, Any]:
    """The recipe, model and optimizer this config trains (the keys of `saved_choices`)."""
    return {"recipe": cfg.recipe.name, "recipe.model": str(cfg.recipe.model), "optim": cfg.optim.name}


def saved_choices(config: dict[str, Any]) -> dict[str, Any]:
    """The recipe, model and optimizer a resolved config in plain data names (a checkpoint's `config`;
    launcher 0.1's layout too): what a resume cannot change."""
    recipe = config.get("recipe") or {}
    optimizer = (config.get("optim") or {}).get("name", recipe.get("optimizer"))
    return {"recipe": recipe.get("name"), "recipe.model": recipe.get("model"), "optim": optimizer}
