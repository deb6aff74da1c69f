"""The launch config's schema: a dataclass per section and per config-group option, Enums for choices.

Hydra composes the config from the YAML files in conf/ (values, with comments and the command that
uses them) over these classes (types): a typo in a key or a value of the wrong type fails when the
config is composed, with one line (launcher/host/hydra_errors.py); each schema's `check` says what a
type cannot (ranges, combinations), before anything starts. Workers get the composed config as these dataclasses, frozen
(launcher/spec.py), never as a DictConfig.

Each field's docstring (the string under it) says what the key does; conf/ holds the values, BENCHMARKS.md
what the speed settings measured. The true | false | auto keys (perf.compile, perf.cuda_graph,
perf.cudnn_benchmark, strategy.reshard_after_forward) are one Enum, Toggle: YAML and the command line give true
and false as bools, which OmegaConf's Enum nodes refuse, so the composed config holds them as typed and the schema
turns them into Toggles when it is built (`__post_init__`); a value that is none of the three is check's one line.

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
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from launcher.errors import ConfigError

MISSING = "???"  # omegaconf.MISSING: a value the composed config must fill in


class Choice(Enum):
    """A value from a fixed set, typed on the command line by its name (`perf.precision=bf16`)."""

    def __str__(self) -> str:
        return self.value


def _choice(name: str, values: str) -> type[Choice]:
    """A Choice whose names are not all Python identifiers (torch's `reduce-overhead`, `raise`)."""
    return Choice(name, [(v, v) for v in values.split()], module=__name__, qualname=name)  # type: ignore[return-value]


class Toggle(Choice):
    """A true | false | auto key. Users type it as a bool (YAML, the command line), a word in any case, or
    0 / 1 (which the keys took before they were an Enum): `read` makes each a member."""

    true = "true"
    """On, where the strategy and the device allow it (the plan says what it turns off)."""
    false = "false"
    """Off."""
    auto = "auto"
    """The launcher decides, as the key's docstring says."""

    @classmethod
    def read(cls, value: object) -> Toggle | None:
        """`value` as typed (a Toggle, True/False, 0/1, or true/false/auto in any case) as a member; None for
        anything else, left for `check` to name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (bool, int, float)) and value in (0, 1):
            return cls.true if value else cls.false
        if isinstance(value, str):
            return cls.__members__.get(value.lower())
        return None

    @property
    def plain(self) -> bool | str:
        """As config.yaml, checkpoints and trackers write it: True, False or "auto" (as launch always has, so
        run dirs and checkpoints of either version read alike)."""
        return {"true": True, "false": False}.get(self.value, self.value)


if TYPE_CHECKING:
    ToggleKey = Toggle
else:
    # Any: OmegaConf holds a true | false | auto key as typed (its Enum nodes refuse bools); __post_init__ reads it.
    ToggleKey = Any


class Flip(Choice):
    """How training images are mirrored."""

    random = "random"
    """Each image mirrored or not at random, every epoch."""
    alternating = "alternating"
    """Each image the other way round every other epoch."""
    none = "none"
    """Never."""


class Recompute(Choice):
    """Which activations the backward pass recomputes instead of keeping (launcher/strategies/recompute.py)."""

    none = "none"
    """Keep every activation the backward needs (the fastest, the most memory)."""
    full = "full"
    """Keep each block's input only; its forward runs again in the backward."""
    selective = "selective"
    """Keep each block's matmul, attention and convolution outputs; recompute the rest, op by op."""


class Decay(Choice):
    """The learning rate's course after the warm-up (launcher/train/optim.py: warmup_then_decay)."""

    linear = "linear"
    """A straight line from lr down to its floor at the run's last step."""
    cosine = "cosine"
    """Half a cosine from lr down to its floor (nanoGPT's, Llama's and torchtitan's)."""


class Precision(Choice):
    """The dtype the forward and backward passes compute in (autocast)."""

    auto = "auto"
    """bf16 autocast on GPUs, fp32 on the CPU."""
    bf16 = "bf16"
    """bf16 autocast."""
    fp16 = "fp16"
    """float16 autocast with a gradient scaler (GPUs without bf16); steps that overflow are skipped."""
    fp32 = "fp32"
    """No autocast."""
    fp8 = "fp8"
    """bf16 autocast, the blocks' linear layers multiplying in float8 (torchao; GPUs of compute capability 8.9+)."""


class Placement(Choice):
    """Where a dataset held in memory lives during training."""

    auto = "auto"
    """gpu when the dataset takes at most a quarter of the GPU's free memory, else host."""
    gpu = "gpu"
    """The whole split on the GPU."""
    host = "host"
    """Pinned host memory, copied to the GPU on a side stream."""


class ProcessGroupBackend(Choice):
    """torch.distributed's backend for the ranks' collectives."""

    auto = "auto"
    """nccl on GPUs, gloo on the CPU."""
    nccl = "nccl"
    """NVIDIA's collectives (GPUs)."""
    gloo = "gloo"
    """Gloo (the CPU; GPUs too, slowly)."""


class Decode(Choice):
    """Who decodes image files (recipe=imagefolder)."""

    auto = "auto"
    """With a GPU: the workers alone, or a share for the GPU sized from their times where they fall behind."""
    cpu = "cpu"
    """DataLoader worker processes (PIL)."""
    gpu = "gpu"
    """Batched nvJPEG on the GPU, off the compute stream."""


class OnBadFile(Choice):
    """What a data file that cannot be read or decoded does to the run."""

    error = "error"
    """The run stops with one line naming the file."""
    skip = "skip"
    """The sample is left out of its batch and counted (epoch line, results.json)."""


class Progress(Choice):
    """How the console shows training progress."""

    auto = "auto"
    """A live bar when stdout is a terminal, else a line per epoch."""
    bar = "bar"
    """A live progress bar."""
    lines = "lines"
    """A line per epoch."""


# torch.compile's modes (names with dashes: a Choice built from its values)
CompileMode = _choice("CompileMode", "default reduce-overhead max-autotune max-autotune-no-cudagraphs")
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")  # the modes whose compiled code makes CUDA graphs
# A plain string checked by FaultConfig.check, not a Choice: Hydra reads `fault.kind=nan` as a float.
FAULT_KINDS = ("raise", "exit", "hang", "kill", "nan", "oom", "damage")


INT_MAX = 2**31 - 1  # no setting needs more, and every value fits the C ints torch and its libraries take


def check_int(key: str, value: object, low: int, example: str, high: int | None = None) -> None:
    """`value` is an integer in [low, high] (high: INT_MAX unless given)."""
    top = INT_MAX if high is None else high
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value > top:
        too_big = isinstance(value, int) and not isinstance(value, bool) and value > top
        bound = f"an integer from {low} to {top}" if high is not None or too_big else f"an integer >= {low}"
        raise ConfigError(key, value, f"must be {bound}", example)


def check_float(key: str, value: object, example: str, *, positive: bool = True, high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if positive else value >= 0) and (high is None or value <= high)
    if not ok:
        rule = "a finite number > 0" if positive else "a finite number >= 0"
        if high is not None:
            rule += f" and <= {high}"
        raise ConfigError(key, value, f"must be {rule}", example)


def split_endpoint(text: object, key: str = "rdzv") -> tuple[str, int]:
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

    def __setattr__(self, name: str, value: object) -> None:
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

    name: str = MISSING
    """The recipe: a built-in one (digits, cifar10, text, imagefolder) or a user's module path (my_pkg.my_recipe)."""
    model: str = MISSING
    """The network: one of the recipe's models."""
    before_keys: ClassVar[dict[str, Any]] = {}
    """Keys added to the recipe after runs were saved without them, with the value such a run had: its resume
    and `launch eval` build the network it trained (recipe_as_saved)."""
    presets: ClassVar[dict[str, dict[str, dict[str, Any]]]] = {}
    """Named values that set other keys: {key: {value: {other key: its value}}}. Where the key has such a value,
    each other key takes the named one unless the command line sets it (launcher/host/compose.py: settled)."""


@dataclass
class ImageRecipeConfig(RecipeConfig):
    """Image classification: cross-entropy over classes, augmentation on the training device."""

    label_smoothing: float = 0.0
    """Cross-entropy's label smoothing, from 0 (none) to 1."""
    augment: bool = True
    """Augment the training images (flips, shifts) on the training device."""
    flip: Flip = Flip.random
    """How training images are mirrored."""
    translate: int = 2
    """Shift each training image by up to this many pixels at random (reflect padding); 0: never."""
    image_side: ClassVar[int | None] = None
    """The images' side in pixels, where the recipe knows it (translate must stay below it)."""

    def check(self, at: str) -> None:
        check_float(f"{at}.label_smoothing", self.label_smoothing, f"{at}.label_smoothing=0.1", positive=False,
                    high=1.0)
        # reflect padding needs a shift smaller than the image (a worker checks user recipes' images)
        high = 8 if self.image_side is None else min(8, self.image_side - 1)
        check_int(f"{at}.translate", self.translate, 0, f"{at}.translate=2", high=high)


class DigitsModel(Choice):
    """recipe=digits' networks."""

    cnn = "cnn"
    """A small convolutional network."""


@dataclass
class DigitsConfig(ImageRecipeConfig):
    """The UCI handwritten digits (recipes/digits.py): 8x8 images shipped inside the package, trained offline."""

    name: str = "digits"
    """This recipe."""
    model: DigitsModel = DigitsModel.cnn
    """The network."""
    width: int = 16
    """The first convolution's channels; the next two have twice and four times as many."""
    image_side: ClassVar[int | None] = 8
    """8x8 images."""
    before_keys: ClassVar[dict[str, Any]] = {"width": 32}
    """Runs saved before recipe.width existed had 32."""

    def check(self, at: str) -> None:
        super().check(at)
        check_int(f"{at}.width", self.width, 1, f"{at}.width=16", high=1024)


class Cifar10Model(Choice):
    """recipe=cifar10's networks (recipes/cifar10.py)."""

    airbench = "airbench"
    """A fast three-block conv net in the style of Keller Jordan's CIFAR-10 speed records."""
    airbench94 = "airbench94"
    """The records' own network (recipe=cifar10_fast's): whitening stem, filter matrices for Muon."""
    resnet18 = "resnet18"
    """ResNet-18, the CIFAR variant (3x3 stem, no max-pool)."""
    mobilenetv3_small = "mobilenetv3_small"
    """MobileNetV3-Small, its stem and first block at stride 1 for 32x32 inputs."""


@dataclass
class Cifar10Config(ImageRecipeConfig):
    """CIFAR-10 (recipes/cifar10.py): downloaded and checksummed once, then held in memory."""

    name: str = "cifar10"
    """This recipe."""
    model: Cifar10Model = Cifar10Model.airbench
    """The network."""
    tta: int = 0
    """Test-time augmentation: 0 none, 1 mirror, 2 mirror and 1-pixel shifts."""
    image_side: ClassVar[int | None] = 32
    """32x32 images."""

    def check(self, at: str) -> None:
        super().check(at)
        check_int(f"{at}.tta", self.tta, 0, f"recipe=cifar10 {at}.tta=2", high=2)


@dataclass
class ImageFolderConfig(RecipeConfig):
    """A folder of images in the ImageNet layout (recipes/imagefolder.py): `data.root` holds
    train/<class>/* and val/<class>/*, decoded per sample (data.decode: cpu workers, the GPU, or both)."""

    name: str = "imagefolder"
    """This recipe."""
    model: str = "resnet50"
    """A torchvision classification model, untrained (torchvision.models.list_models())."""
    image_size: int = 224
    """The side of the square crops trained and evaluated on."""
    eval_resize: int = 0
    """Evaluation: the shorter side resized to this, then center-cropped (0: image_size*256/224)."""
    label_smoothing: float = 0.0
    """Cross-entropy's label smoothing, from 0 (none) to 1."""
    min_scale: float = 0.08
    """RandomResizedCrop's smallest share of the image's area."""

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


def check_torchvision_model(key: str, name: object) -> None:
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
    """recipe=text's networks (recipes/text.py)."""

    gpt = "gpt"
    """A decoder-only Transformer: pre-norm, scaled_dot_product_attention, tied embeddings."""
    lstm = "lstm"
    """An LSTM."""
    gru = "gru"
    """A GRU."""
    llama = "llama"
    """Llama 3's decoder: RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention (kv_heads)."""


TextSize = _choice("TextSize", "none debug 1b 3b 8b")
TextSize.__doc__ = "recipe=text's named Llama 3 shapes (TextConfig.presets)."

# Llama 3's shapes (Meta's published configurations: 3.2 1B and 3B tie the output layer to the embedding, 3.1
# 8B does not); debug is a small one for a first run. The vocabulary stays the data's (recipe.vocab_size:
# 128256 for Llama 3's tokenizer).
LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "debug": {"model": "llama", "layers": 4, "width": 256, "heads": 8, "kv_heads": 4, "ffn": 768,
              "tie_embeddings": True},
    "1b": {"model": "llama", "layers": 16, "width": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192,
           "tie_embeddings": True},
    "3b": {"model": "llama", "layers": 28, "width": 3072, "heads": 24, "kv_heads": 8, "ffn": 8192,
           "tie_embeddings": True},
    "8b": {"model": "llama", "layers": 32, "width": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
           "tie_embeddings": False},
}

def tokens_without_vocabulary(at: str, corpus: str) -> ConfigError:
    """recipe=text's corpus of token shards (.bin, .npy) with no recipe.vocab_size: the one line, from the
    schema where the corpus names its files so (a dry run says it too) and from the recipe's prepare where
    a folder holds them."""
    return ConfigError(f"{at}.vocab_size", 0, f"{at}.corpus={corpus} holds token ids, so give their tokenizer's "
                       "vocabulary size (0 means 256, for bytes; GPT-2's is 50257)", f"{at}.vocab_size=50257")


MAX_VOCAB = 1 << 22  # recipe.vocab_size: beyond any tokenizer's (GPT-2 50257, Llama 3 128256, Gemma 262144)


@dataclass
class TextConfig(RecipeConfig):
    """Next-token prediction (recipes/text.py): on bytes of text (no tokenizer to download), or on token
    shards written by nanoGPT or llm.c (.bin, .npy)."""

    name: str = "text"
    """This recipe."""
    model: TextModel = TextModel.gpt
    """The network."""
    size: TextSize = TextSize.none  # type: ignore[attr-defined]
    """A named Llama 3 shape (debug, 1b, 3b, 8b): sets model=llama and its layers, width, heads, kv_heads, ffn and
    tie_embeddings, each unless given too (none: those keys as they are)."""
    presets: ClassVar[dict[str, dict[str, dict[str, Any]]]] = {"size": LLAMA_SIZES}
    corpus: str = "stdlib"
    """stdlib (this Python's standard library sources), or a text file, folder or glob; or token shards (.bin, .npy)."""
    max_bytes: int = 0
    """Use only the corpus's first this many bytes (0: all of it; byte corpora only)."""
    vocab_size: int = 0
    """The tokens' vocabulary (0: 256 bytes; token shards: their tokenizer's, GPT-2's 50257), padded to 64s."""
    context: int = 256
    """Tokens a sample sees (and predicts)."""
    layers: int = 6
    """Transformer blocks (gpt) or recurrent layers (lstm, gru)."""
    width: int = 384
    """The embedding (gpt) or hidden state (lstm, gru)."""
    heads: int = 6
    """Attention heads (gpt, llama): width must divide by it."""
    kv_heads: int = 0
    """llama's key/value heads, each shared by heads / kv_heads query heads (0: as many as heads)."""
    ffn: int = 0
    """llama's MLP hidden width (0: Llama's rule, 8/3 x width rounded up to a multiple of 256)."""
    rope_theta: float = 500000.0
    """llama's rotary base (Llama 3's 500000)."""
    tie_embeddings: bool = True
    """llama's output layer shares the token embedding's weights (Llama 3.2 1B/3B: tied; 3.1 8B: not)."""
    dropout: float = 0.0
    """Dropout probability in training."""
    sample_bytes: int = 300
    """After training, rank 0 generates this many bytes into sample.txt (0: none)."""
    sample_prompt: str = "def "
    """The text the sample starts from."""
    temperature: float = 0.8
    """The sample's softmax temperature."""

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
        if not self.vocab_size and str(self.corpus).strip().lower().endswith((".bin", ".npy")):
            raise tokens_without_vocabulary(at, str(self.corpus))  # (a folder of shards: recipe=text's prepare)
        if self.size.value != "none" and self.model is not TextModel.llama:
            raise ConfigError(f"{at}.size", self.size.value, f"names a Llama 3 shape, for recipe.model=llama (not "
                              f"{self.model.value})", f"{at}.model=llama")
        if self.model in (TextModel.gpt, TextModel.llama) and self.width % self.heads:
            fits = max(h for h in range(1, self.heads + 1) if self.width % h == 0)
            raise ConfigError(f"{at}.heads", self.heads, f"the width ({self.width}) must be a multiple of the heads",
                              f"{at}.heads={fits}")
        check_int(f"{at}.kv_heads", self.kv_heads, 0, f"{at}.kv_heads=8", high=1024)
        check_int(f"{at}.ffn", self.ffn, 0, f"{at}.ffn=14336", high=1 << 20)
        check_float(f"{at}.rope_theta", self.rope_theta, f"{at}.rope_theta=500000", high=1e12)
        if self.model is TextModel.llama:
            if self.kv_heads and self.heads % self.kv_heads:
                fits = max(h for h in range(1, self.kv_heads + 1) if self.heads % h == 0)
                raise ConfigError(f"{at}.kv_heads", self.kv_heads, f"the {self.heads} query heads must divide evenly "
                                  "into groups, one per key/value head", f"{at}.kv_heads={fits}")
            if (self.width // self.heads) % 2:
                even = [h for h in range(1, self.heads + 1) if self.width % h == 0 and (self.width // h) % 2 == 0]
                raise ConfigError(f"{at}.heads", self.heads, f"a head's width ({self.width} / {self.heads} = "
                                  f"{self.width // self.heads}) must be even for rotary positions",
                                  f"{at}.heads={max(even)}" if even else f"{at}.width={self.width + 1}")
        if not self.sample_prompt:
            raise ConfigError(f"{at}.sample_prompt", "''", "the sample needs a prompt of at least one character",
                              f"{at}.sample_prompt='def '")


# ---- optim --------------------------------------------------------------------------------------


@dataclass
class OptimConfig(Schema):
    """Every optimizer: `lr` (top level) is its rate, with a schedule: a linear warm-up over
    `warmup_epochs`, then a linear or cosine decay (`decay`) to lr x `min_lr_ratio` at the end of the run."""

    name: str = MISSING
    """The optimizer: sgd, adamw or muon."""
    weight_decay: float = 5e-4
    """L2 weight decay."""
    warmup_epochs: float = 1.0
    """Epochs of the schedule's linear warm-up from 0 to lr (fractions of an epoch too: 0.05)."""
    decay: Decay = Decay.linear
    """After the warm-up: linear or cosine, from lr down to lr x min_lr_ratio at the run's last step."""
    min_lr_ratio: float = 0.0
    """Where the decay ends, as a fraction of lr (nanoGPT and Llama 3: 0.1)."""
    clip_grad_norm: float = 0.0
    """Scale gradients down to this global L2 norm (all parameters and ranks) when larger, each step; 0: never."""

    @property
    def state_copies(self) -> int:
        """How many tensors of a parameter's size the optimizer keeps for it (AdamW: its two moments; 2 for
        an optimizer this does not know)."""
        return 2

    def check(self, at: str) -> None:
        check_float(f"{at}.weight_decay", self.weight_decay, f"{at}.weight_decay=5e-4", positive=False)
        check_float(f"{at}.warmup_epochs", self.warmup_epochs, f"{at}.warmup_epochs=1", positive=False)
        check_float(f"{at}.clip_grad_norm", self.clip_grad_norm, f"{at}.clip_grad_norm=1.0", positive=False)
        check_float(f"{at}.min_lr_ratio", self.min_lr_ratio, f"{at}.min_lr_ratio=0.1", positive=False)
        if self.min_lr_ratio > 1:
            raise ConfigError(f"{at}.min_lr_ratio", self.min_lr_ratio, "a fraction of lr from 0 to 1 (where the "
                              "decay ends)", f"{at}.min_lr_ratio=0.1")


@dataclass
class SGDConfig(OptimConfig):
    name: str = "sgd"
    """This optimizer."""
    momentum: float = 0.9
    """SGD's momentum."""
    nesterov: bool = True
    """Nesterov momentum."""

    @property
    def state_copies(self) -> int:
        """Its momentum buffer (none without momentum)."""
        return 1 if self.momentum else 0

    def check(self, at: str) -> None:
        super().check(at)
        check_float(f"{at}.momentum", self.momentum, f"{at}.momentum=0.9", positive=False, high=1.0)


@dataclass
class AdamWConfig(OptimConfig):
    """torch.optim.AdamW over all parameters."""

    name: str = "adamw"
    """This optimizer."""
    beta1: float = 0.9
    """The first moment's decay (torch's betas[0])."""
    beta2: float = 0.999
    """The second moment's decay (torch's betas[1]; nanoGPT and most language models use 0.95)."""
    eps: float = 1e-8
    """Added to the second moment's root."""
    decay_1d: bool = True
    """Weight decay on 1-D parameters too (biases, norms' gains); false: on matrices and embeddings only, as nanoGPT."""

    def check(self, at: str) -> None:
        super().check(at)
        for key, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            check_float(f"{at}.{key}", value, f"{at}.{key}=0.95", positive=False, high=0.9999999)
        check_float(f"{at}.eps", self.eps, f"{at}.eps=1e-8")


@dataclass
class MuonConfig(OptimConfig):
    """Muon (torch.optim.Muon's update, capturable: launcher/train/optim.py) on the model's filter
    matrices, Nesterov SGD on everything else. `lr` is Muon's; the SGD groups have their own rates. The
    defaults are the CIFAR-10 speed record's (Keller Jordan, 2024), for its batch of 2000."""

    name: str = "muon"
    """This optimizer."""

    @property
    def state_copies(self) -> int:
        """A momentum buffer (Muon's, or its SGD groups')."""
        return 1
    weight_decay: float = 0.004
    """Weight decay per step at full rate, for the SGD groups only."""
    warmup_epochs: float = 0.0
    """Epochs of the schedule's linear warm-up from 0 to lr."""
    muon_momentum: float = 0.6
    """Muon's momentum (the filter matrices)."""
    momentum: float = 0.85
    """The SGD groups' Nesterov momentum."""
    sgd_lr: float = 106.0
    """Learning rate of the SGD group of BatchNorm biases and the stem's bias."""
    head_lr: float = 1340.0
    """The classifier's learning rate."""
    stem_bias_epochs: float = 3.0
    """The stem's bias trains only this many epochs."""

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
    """How the devices share the work (launcher/strategies)."""

    name: str = MISSING
    """The strategy: auto, single, dp, ddp or fsdp."""


@dataclass
class SingleConfig(StrategyConfig):
    """One process on one device."""

    name: str = "single"
    """This strategy."""


@dataclass
class DataParallelConfig(StrategyConfig):
    """nn.DataParallel: one process driving every selected GPU."""

    name: str = "dp"
    """This strategy."""


@dataclass
class DDPConfig(StrategyConfig):
    """DistributedDataParallel: one process per GPU or CPU rank."""

    name: str = "ddp"
    """This strategy."""
    backend: ProcessGroupBackend = ProcessGroupBackend.auto
    """The process group's backend."""
    timeout_s: int = 600
    """A collective that waits longer than this ends the launch instead of hanging."""
    gradient_as_bucket_view: bool = True
    """DDP's gradient_as_bucket_view: gradients are views into its all-reduce buckets."""
    static_graph: bool = False
    """DDP's static_graph (keeps DDP's reducer under perf.cuda_graph=auto)."""
    bucket_cap_mb: int = 0
    """Gradient buckets in MB, DDP's and perf.cuda_graph's own; 0: by the model's size (base.py bucket_mb)."""
    find_unused_parameters: bool = False
    """DDP's find_unused_parameters (keeps DDP's reducer under perf.cuda_graph=auto)."""

    def check(self, at: str) -> None:
        check_int(f"{at}.timeout_s", self.timeout_s, 1, f"{at}.timeout_s=600")
        check_int(f"{at}.bucket_cap_mb", self.bucket_cap_mb, 0, f"{at}.bucket_cap_mb=0")


@dataclass
class FSDPConfig(StrategyConfig):
    """PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard): weights, gradients and optimizer state
    sharded over the ranks (launcher/strategies/fsdp.py).

    Shard units (min_unit_params, torch's size-based wrapping default): consecutive blocks are gathered as
    one unit until it holds that many parameters, and what is left (all of a smaller model) is gathered
    with the root; fewer units are fewer of FSDP2's hooks, which bound a small model's step (`shard_groups`).
    meta_init: each rank's own init runs on its shards, so a model too big for one device never exists
    whole on one; without it the model is built whole (the same initial weights as ddp), then sharded."""

    name: str = "fsdp"
    """This strategy."""
    backend: ProcessGroupBackend = ProcessGroupBackend.auto
    """The process group's backend."""
    timeout_s: int = 600
    """A collective that waits longer than this ends the launch instead of hanging."""
    reshard_after_forward: ToggleKey = Toggle.auto
    """Free each unit's gathered weights after its forward (less memory, gathered again for the backward): true,
    false, or auto (false where the memory estimate has room for them all, else true). Never the last unit's or
    the root's (their backward comes first)."""
    min_unit_params: int = 100_000_000
    """The fewest parameters a shard unit holds: consecutive blocks gathered together (0: a unit per block)."""
    mixed_precision: bool = True
    """GPUs: bf16 weights in compute, gradients reduced in fp32."""
    activation_checkpointing: bool = False
    """true: the same as perf.activation_checkpointing=full (the key fsdp had before that one)."""
    meta_init: bool = False
    """Build on the meta device and materialize only each rank's shard (false: whole on the device, as ddp)."""

    def __post_init__(self) -> None:
        """reshard_after_forward as a Toggle, as PerfConfig reads its true | false | auto keys."""
        setting = Toggle.read(self.reshard_after_forward)
        if setting is not None:
            self.reshard_after_forward = setting

    def check(self, at: str) -> None:
        check_int(f"{at}.timeout_s", self.timeout_s, 1, f"{at}.timeout_s=600")
        check_int(f"{at}.min_unit_params", self.min_unit_params, 0, f"{at}.min_unit_params=0")
        if not isinstance(self.reshard_after_forward, Toggle):
            raise ConfigError(f"{at}.reshard_after_forward", self.reshard_after_forward, "choose true, false or "
                              "auto (false where the memory estimate has room for the gathered weights)",
                              f"{at}.reshard_after_forward=auto")


@dataclass
class AutoStrategyConfig(DDPConfig):
    """ddp for several devices (with these DDP options), else single; never dp."""

    name: str = "auto"
    """This strategy."""


# ---- backend ------------------------------------------------------------------------------------


@dataclass
class BackendConfig(Schema):
    """Where the workers run (launcher/host/backends)."""

    name: str = MISSING
    """The backend: local or slurm."""


@dataclass
class LocalBackendConfig(BackendConfig):
    """On this machine."""

    name: str = "local"
    """This backend."""


@dataclass
class SlurmBackendConfig(BackendConfig):
    """sbatch options (null leaves the cluster's default) and how launch follows the job."""

    name: str = "slurm"
    """This backend."""
    partition: str | None = None
    """sbatch --partition."""
    account: str | None = None
    """sbatch --account."""
    qos: str | None = None
    """sbatch --qos."""
    time_min: int = 60
    """The job's time limit in minutes."""
    mem_gb: int | None = None
    """Memory per node in GB."""
    cpus_per_task: int | None = None
    """sbatch --cpus-per-task."""
    constraint: str | None = None
    """sbatch --constraint (node features)."""
    exclude: str | None = None
    """sbatch --exclude (nodes not to use)."""
    nodes: int = 1
    """Nodes of the job: the world is nodes x tasks per node (GPUs per node under ddp)."""
    job_name: str | None = None
    """The job's name (null: launch-<recipe>)."""
    additional: dict[str, Any] = field(default_factory=dict)  # Any: sbatch's own options, passed on as typed
    """Other sbatch options, e.g. {mail-type: END}."""
    wait: bool = False
    """Follow the job until it ends; its exit status becomes launch's."""
    max_requeues: int = 3
    """After SIGUSR2 (preemption, time limit): checkpoint and requeue at most this often."""
    array_parallelism: int = 16
    """`launch -m`: one job array, at most this many of its runs at once."""

    TEXT_KEYS = ("partition", "account", "qos", "constraint", "exclude", "job_name")
    """The options written into the batch script as text: no control characters."""

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


DEFAULT_DATA_ROOT = "~/.cache/launcher/data"  # data.root where LAUNCH_DATA_ROOT is not set (`launch doctor` reads it)


@dataclass
class DataConfig(Schema):
    """Where the data lives and how it reaches the device."""

    root: str = f"${{oc.env:LAUNCH_DATA_ROOT,'{DEFAULT_DATA_ROOT}'}}"
    """Where datasets are found or downloaded to (LAUNCH_DATA_ROOT, else ~/.cache/launcher/data)."""
    download: bool = True
    """Fetch a missing dataset (checksummed); offline, an error says where to put it."""
    synthetic: bool = False
    """Generate data of the real shape for timing runs (never used unless asked for)."""
    placement: Placement = Placement.auto
    """Where a dataset held in memory lives: the GPU, or pinned host memory."""
    prefetch_depth: int = 2
    """Batches copied to the device ahead of the step that uses them (on a side stream)."""
    workers: int | None = None
    """DataLoader worker processes per rank for a recipe's Datasets (null: the rank's cores less one)."""
    worker_prefetch: int = 4
    """Batches each DataLoader worker keeps ready (its prefetch_factor)."""
    decode: Decode = Decode.auto
    """Who decodes image files (recipe=imagefolder): the DataLoader workers, the GPU, or both."""
    on_bad_file: OnBadFile = OnBadFile.error
    """What a file that cannot be read or decoded does: stop the run, or be skipped and counted."""

    def check(self, at: str) -> None:
        check_int(f"{at}.prefetch_depth", self.prefetch_depth, 1, f"{at}.prefetch_depth=2", high=64)
        if self.workers is not None:
            check_int(f"{at}.workers", self.workers, 0, f"{at}.workers=8", high=1024)
        check_int(f"{at}.worker_prefetch", self.worker_prefetch, 1, f"{at}.worker_prefetch=4", high=64)


@dataclass
class EvalConfig(Schema):
    """When and in what chunks the held-out split is scored."""

    batch_size: int = 1024
    """Samples per evaluation batch, global like batch_size."""
    every: int = 1
    """Evaluate after every N-th epoch (0: only after the last)."""
    checkpoint: str | None = None
    """Evaluate this run dir's (or checkpoint file's) weights instead of training: `launch eval RUN_DIR`."""

    def check(self, at: str) -> None:
        check_int(f"{at}.batch_size", self.batch_size, 1, f"{at}.batch_size=1024")
        check_int(f"{at}.every", self.every, 0, f"{at}.every=1")


@dataclass
class PerfConfig(Schema):
    """Settings that change the speed, not (beyond rounding) what is computed.

    perf.cuda_graph=auto tries the graph where a captured step is simple to try: GPUs with one process
    each (strategy single or ddp), the launcher's own step (a recipe's own training_step is replayed only
    with true: a replay runs none of its Python), one micro-batch a step, no fp16 scaler, no compile mode
    that makes graphs itself. There the warm-up times the step eagerly and replayed and keeps the faster,
    every rank alike, and says which in one line. Under ddp a captured step's gradients sit in flat buckets
    the launcher averages, not DDP's reducer, so strategy.static_graph and find_unused_parameters do not
    apply; ddp over several nodes, or with either of them set, keeps the reducer (launcher/strategies).
    perf.cudnn_benchmark=auto autotunes exactly when the run compiles (perf.compile=true, or auto once it
    decides to): a run long enough to compile earns the autotuning back, a short one starts sooner. What
    each setting gained: BENCHMARKS.md."""

    precision: Precision = Precision.auto
    """The dtype the passes compute in: auto (bf16 on GPUs, fp32 on the CPU), bf16, fp16, fp32 or fp8."""
    channels_last: bool = True
    """The model and image batches in channels-last memory layout (GPUs only)."""
    compile: ToggleKey = Toggle.auto
    """torch.compile the model: true, false, or auto (GPU runs long enough to earn the compile time back)."""
    compile_auto_min_s: float = 60.0
    """perf.compile=auto compiles when, after the first epoch, the epochs left would take this long uncompiled."""
    compile_mode: CompileMode = CompileMode["default"]  # type: ignore[valid-type]
    """torch.compile's mode."""
    cuda_graph: ToggleKey = Toggle.auto
    """GPUs: replay each step (augment, forward, backward, all-reduce) as one CUDA graph: true, false or auto."""
    cudnn_benchmark: ToggleKey = Toggle.auto
    """GPUs: cuDNN times its algorithms per convolution shape: true, false or auto (when the run compiles)."""
    activation_checkpointing: Recompute = Recompute.none
    """Recompute each block's activations in the backward pass: none, full or selective (less memory, more
    compute; any strategy)."""

    TOGGLES: ClassVar[dict[str, str]] = {
        "compile": "compile GPU runs long enough to earn the compile time back",
        "cudnn_benchmark": "autotune cuDNN when the run compiles",
        "cuda_graph": "replay the step as a CUDA graph where that is measured faster",
    }
    """The true | false | auto keys, and what auto does (said by the line that refuses another value)."""

    def __post_init__(self) -> None:
        """The one place a true | false | auto key becomes a Toggle, however the section was made (composed,
        derived, constructed); a value `Toggle.read` cannot read stays as typed, for `check` to name."""
        for key in self.TOGGLES:
            setting = Toggle.read(getattr(self, key))
            if setting is not None:
                setattr(self, key, setting)

    @property
    def compile_makes_graphs(self) -> bool:
        """Whether torch.compile, where it runs, makes CUDA graphs itself (these compile modes do)."""
        return self.compile_mode.value in GRAPHING_COMPILE_MODES

    def check(self, at: str) -> None:
        check_float(f"{at}.compile_auto_min_s", self.compile_auto_min_s, f"{at}.compile_auto_min_s=60", positive=False)
        for key, auto in self.TOGGLES.items():
            if not isinstance(getattr(self, key), Toggle):
                raise ConfigError(f"{at}.{key}", getattr(self, key), f"choose true, false or auto ({auto})",
                                  f"{at}.{key}=auto")
        if self.cuda_graph is Toggle.true and self.compile is not Toggle.false and self.compile_makes_graphs:
            raise ConfigError(f"{at}.compile_mode", self.compile_mode, f"{at}.cuda_graph=true captures the whole "
                              "step already and this mode would make CUDA graphs inside it; use default or "
                              f"max-autotune-no-cudagraphs, or {at}.cuda_graph=false to let torch.compile graph it",
                              f"{at}.compile_mode=default")


@dataclass
class FaultConfig(Schema):
    """Deliberate failures, to test supervision: rank `rank` fails at global step `step` with `kind`."""

    rank: int | None = None
    """The rank that fails (null: none does)."""
    step: int = 0
    """The global step it fails at, counted from 0 (30: the run's 31st step)."""
    kind: str = "raise"
    """raise, exit, hang, kill, nan (the loss from then on), oom, damage (last.pt's bytes overwritten, then raise)."""
    attempt: int = 0
    """Only on this restart attempt (-1: on every attempt)."""

    def check(self, at: str) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"{at}.kind", self.kind, "choose one of " + ", ".join(FAULT_KINDS), f"{at}.kind=raise")


class Direction(Choice):
    """Which way a sweep's objective is better."""

    auto = "auto"
    """Minimize a loss or an error (loss, mse, rmse, mae, error, bpb, ppl in its name), else maximize."""
    minimize = "minimize"
    """Smaller is better."""
    maximize = "maximize"
    """Larger is better."""


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

    parallel: int = 0
    """Most runs at once on this host (0: as many as the GPUs allow; CPU runs one at a time)."""
    objective: str = DEFAULT_OBJECTIVE
    """The figure each run returns to Hydra (Optuna): test_acc or a test_NAME (else the run's first test_NAME)."""
    direction: Direction = Direction.auto
    """Which way the objective is better (the summary's best run)."""

    def check(self, at: str) -> None:
        check_int(f"{at}.parallel", self.parallel, 0, f"{at}.parallel=2")


class Mode(Choice):
    """Which way a watched figure is better (early_stop, checkpoint.keep_best)."""

    auto = "auto"
    """min for a loss or an error (loss, mse, mae, error, bpb, ppl in its name), else max."""
    min = "min"
    """Smaller is better."""
    max = "max"
    """Larger is better."""


FIGURE_ALIASES = {"accuracy": "acc"}  # TensorBoard's tag names -> the figures' own (test/accuracy: test_acc)


def figure_key(name: object) -> str:
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


def _check_figure(key: str, value: object, example: str) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value)):
        raise ConfigError(key, value, "names a figure of the epoch line: test_NAME (or val/NAME, test/NAME) for a "
                          "held-out figure, train_NAME or loss for a training one", example)


@dataclass
class CheckpointConfig(Schema):
    """`checkpoint=false` turns checkpoints off; `checkpoint.keep_best=3 checkpoint.metric=test_acc` keeps the
    best 3 epochs' checkpoints beside last.pt (launcher/train/best.py)."""

    enabled: bool = True
    """Write checkpoints/last.pt every epoch (atomically)."""
    keep_best: int = 0
    """Also keep the best this many epochs' checkpoints (checkpoints/best.pt, best-epoch-N.pt)."""
    keep_previous: bool = True
    """Keep the checkpoint before the last (previous.pt; a sharded run's shard folder too) until the next is
    written, for a resume to fall back on where last.pt is damaged. false: one checkpoint fewer on disk (a
    sharded run's at most 2 at once, not 3), for a model whose checkpoints are large beside its disk."""
    check_disk: bool = True
    """Refuse, before any worker, a run whose checkpoints would outgrow the free space where its run dir goes
    (launcher/host/disk.py). false: start anyway (a file system whose free space reads wrong, or one you will
    free room on); a full disk is then said at the save it stops."""
    metric: str | None = None
    """The figure that ranks them (null: early_stop.metric, else sweep.objective where set, else test_acc or the
    first test_NAME)."""
    mode: Mode = Mode.auto
    """Which way the figure is better."""

    def check(self, at: str) -> None:
        check_int(f"{at}.keep_best", self.keep_best, 0, f"{at}.keep_best=3", high=1000)
        _check_figure(f"{at}.metric", self.metric, f"{at}.keep_best=3 {at}.metric=test_acc")
        if self.keep_best and not self.enabled:
            raise ConfigError(f"{at}.keep_best", self.keep_best, "keeps the best of the run's checkpoints, and "
                              f"{at}.enabled=false writes none", f"{at}.enabled=true {at}.keep_best={self.keep_best}")


@dataclass
class EarlyStopConfig(Schema):
    """Stop a run whose figure stopped improving (launcher/train/early_stop.py): the same decision on every rank."""

    metric: str | None = None
    """The figure watched (test_mse, val/mse, loss, ...); null: never stop early."""
    mode: Mode = Mode.auto
    """Which way the figure is better."""
    patience: int = 3
    """Evaluations without an improvement before the run stops."""
    min_delta: float = 0.0
    """An improvement smaller than this does not count."""

    def check(self, at: str) -> None:
        _check_figure(f"{at}.metric", self.metric, f"{at}.metric=test_loss {at}.patience=3")
        check_int(f"{at}.patience", self.patience, 1, f"{at}.patience=3")
        check_float(f"{at}.min_delta", self.min_delta, f"{at}.min_delta=0.001", positive=False)
        if self.metric is None and (self.patience != 3 or self.min_delta or str(self.mode) != "auto"):
            raise ConfigError(f"{at}.metric", None, f"names no figure to watch, so the other {at}.* settings would "
                              "do nothing: name one (test_loss, val/mse, ...)",
                              f"{at}.metric=test_loss {at}.patience={self.patience}")


class WandbMode(Choice):
    """Where W&B sends a run."""

    offline = "offline"
    """Written under the run dir only; `wandb sync DIR` sends it, if and when you choose."""
    online = "online"
    """Sent to W&B as it runs."""
    disabled = "disabled"
    """W&B's calls do nothing."""


@dataclass
class TensorBoardLog(Schema):
    """log=[tensorboard]: TensorBoard event files."""

    folder: str = "tensorboard"
    """Their folder under the run dir (tensorboard --logdir RUN_DIR)."""


@dataclass
class CsvLog(Schema):
    """log=[csv]: one CSV file."""

    file: str = "metrics.csv"
    """Its name under the run dir: one row per epoch, a column per figure."""


@dataclass
class MlflowLog(Schema):
    """log=[mlflow]: an MLflow run."""

    tracking_uri: str | None = None
    """A server's http://HOST:PORT, or file:./mlruns (null: MLFLOW_TRACKING_URI, else MLflow's local store here)."""
    experiment: str | None = None
    """The MLflow experiment (null: the recipe's name)."""
    run_name: str | None = None
    """The MLflow run's name (null: the run dir's name)."""
    tags: dict[str, Any] = field(default_factory=dict)  # Any: tag values as typed; MLflow stores them as text
    """Tags set on the MLflow run."""

    def check(self, at: str) -> None:
        if self.tracking_uri is not None and not str(self.tracking_uri).strip():
            raise ConfigError(f"{at}.tracking_uri", self.tracking_uri, "give a URI (http://HOST:5000, "
                              "sqlite:///mlflow.db, file:./mlruns) or leave it out", f"{at}.tracking_uri=http://127.0.0.1:5000")


@dataclass
class WandbLog(Schema):
    """log=[wandb]: a Weights & Biases run."""

    mode: WandbMode = WandbMode.offline
    """Where the run goes (offline: nothing leaves the machine unless you run `wandb sync`)."""
    project: str | None = None
    """The W&B project (null: launch-<recipe>)."""
    entity: str | None = None
    """The W&B entity, a user or team (null: W&B's default)."""
    tags: list[str] = field(default_factory=list)
    """Tags set on the W&B run."""


# Where the epochs' figures go besides metrics.jsonl: `log=[tensorboard,mlflow,csv]` picks several options of
# the `log` group at once (conf/log/<name>.yaml each fills its field of LogConfig); launcher/train/trackers.py
# has one class per tracker. The pip package each needs, checked before any worker starts.
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "csv": None, "mlflow": "mlflow", "wandb": "wandb"}


@dataclass
class LogConfig(Schema):
    """The trackers `log=[...]` picks (each a section, null where not picked)."""

    required: bool = True
    """A tracker not installed or not reachable stops the launch before any worker (false: a warning)."""
    tensorboard: TensorBoardLog | None = None
    """TensorBoard, where picked."""
    csv: CsvLog | None = None
    """metrics.csv, where picked."""
    mlflow: MlflowLog | None = None
    """MLflow, where picked."""
    wandb: WandbLog | None = None
    """Weights & Biases, where picked."""

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
    """The whole launch config: the sections, then the keys typed most often, at the top level.

    The four groups are typed by the option chosen: each option's YAML brings its own schema (a subclass
    of RecipeConfig, OptimConfig, StrategyConfig, BackendConfig), whose field types then hold in full; a
    base-class annotation here would keep the base's field types over the option's, hence Any.
    Several machines without SLURM (launcher/host/network.py, rendezvous.py) run the same launch on each,
    `nodes=2 node_rank=K rdzv=HOST:PORT`, HOST an address of node 0 that every node reaches."""

    recipe: Any = MISSING  # Any: the chosen option's schema (see above)
    """What is trained (the `recipe` group)."""
    optim: Any = MISSING  # Any: the chosen option's schema
    """The optimizer and its schedule (the `optim` group)."""
    strategy: Any = MISSING  # Any: the chosen option's schema
    """How the devices share the work (the `strategy` group)."""
    backend: Any = MISSING  # Any: the chosen option's schema
    """Where the workers run (the `backend` group)."""
    perf: PerfConfig = field(default_factory=PerfConfig)
    """Speed settings."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The held-out evaluation."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where the data lives and how it reaches the device."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """`launch -m` on this host."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Deliberate failures, to see supervision work."""
    log: LogConfig = field(default_factory=LogConfig)
    """The trackers, `log=[tensorboard,mlflow,csv]` (conf/log/)."""
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    """Stop a run whose figure stopped improving."""
    gpus: Any = "auto"  # Any: a list, a count or a word (launcher/host/gpus.py reads it)
    """[0,1] ids, 2 a count, all, auto (all visible, else the CPU), [] or cpu: the CPU."""
    nprocs: int | None = None
    """CPU ranks for ddp on the CPU (gpus=[]); with GPUs it is one per GPU."""
    batch_size: int = 64
    """GLOBAL: samples per optimizer step summed over all devices, for every strategy."""
    accumulate: int = 1
    """Micro-batches per step on each rank, gradients summed and averaged across ranks after the last."""
    epochs: int = 10
    """Passes over the training split."""
    lr: float = 0.1
    """The peak learning rate of the schedule."""
    seed: int = 0
    """Seeds the weights, the data order and the augmentation (the same order on any number of ranks)."""
    resume: str | None = None
    """A run dir or checkpoint file to continue from, or `latest`."""
    max_restarts: int = 0
    """Restart the worker group this many times after a failure, resuming (SLURM: requeue)."""
    nodes: int = 1
    """Machines the launch spans without SLURM, each running the same launch."""
    node_rank: int | None = None
    """This machine's place, 0 .. nodes-1 (null: assigned at the rendezvous)."""
    rdzv: str | None = None
    """HOST:PORT where node 0's launch listens for the others."""
    rdzv_timeout_s: int = 300
    """How long a node waits for all the others to join (and to rejoin after a restart)."""
    dry_run: bool = False
    """Print the plan, start nothing."""
    checkpoint: Any = field(default_factory=CheckpointConfig)  # Any: true, false or the section (__post_init__)
    """checkpoints/last.pt every epoch and the best epochs' (CheckpointConfig); true/false stand for it."""
    checkpoint_every_steps: int = 0
    """Also checkpoint every this many steps inside an epoch, resumable mid-epoch (0: at epoch ends only)."""
    model: dict[str, Any] = field(default_factory=lambda: {"_target_": None})  # Any: the network's own arguments
    """A network from config instead of the recipe's: model._target_=CLASS and +model.KEY=VALUE (launcher/models.py)."""
    profile: bool = False
    """torch.profiler over the second epoch: profile.txt and trace.json in the run dir."""
    tensorboard: bool = True
    """false: no TensorBoard even where `log` picks it (the switch from before `log`)."""
    progress: Progress = Progress.auto
    """How the console shows training progress."""
    script: str | None = None
    """Your own torchrun-style script to run instead of a recipe (launcher/host/script.py)."""
    args: dict[str, Any] = field(default_factory=dict)  # Any: the script's own options
    """The script's options: args.KEY=V becomes --KEY V."""
    script_args: list[str] = field(default_factory=list)
    """What follows `--` on the command line, added after args."""

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
        mode = self.perf.activation_checkpointing
        if getattr(self.strategy, "activation_checkpointing", False) is True and mode == Recompute.selective:
            raise ConfigError("strategy.activation_checkpointing", "true", "it is the older spelling of "
                              "perf.activation_checkpointing=full, which perf.activation_checkpointing=selective "
                              "contradicts: give perf.activation_checkpointing alone",
                              "strategy=fsdp perf.activation_checkpointing=selective")
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


def recipe_as_saved(recipe: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recipe values (its config's `recipe` section) with the value it had for each key its
    recipe gained since (RecipeConfig.before_keys), so that its resume or evaluation builds its network."""
    schema = SCHEMAS.get(("recipe", str(recipe.get("name"))))
    added = getattr(schema, "before_keys", {})
    return {**{k: v for k, v in added.items() if k not in recipe}, **recipe}


def freeze(obj: S) -> S:
    """Make a schema instance and every schema inside it read-only (attribute assignment raises)."""
    if isinstance(obj, Schema):
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            freeze(getattr(obj, f.name))
        object.__setattr__(obj, "_frozen", True)
    return obj


def derive(obj: S, **changes: object) -> S:
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
    """Plain Python data (dicts, lists, str for choices, True/False/"auto" for a Toggle), e.g. for JSON or a
    checkpoint's `config`."""
    if isinstance(obj, Schema):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
    if isinstance(obj, Toggle):
        return obj.plain
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


def choices(cfg: Config) -> dict[str, str]:
    """The recipe, model and optimizer this config trains (the keys of `saved_choices`)."""
    return {"recipe": cfg.recipe.name, "recipe.model": str(cfg.recipe.model), "optim": cfg.optim.name}


def saved_choices(config: dict[str, Any]) -> dict[str, Any]:
    """The recipe, model and optimizer a resolved config in plain data names (a checkpoint's `config`;
    launcher 0.1's layout too): what a resume cannot change."""
    recipe = config.get("recipe") or {}
    optimizer = (config.get("optim") or {}).get("name", recipe.get("optimizer"))
    return {"recipe": recipe.get("name"), "recipe.model": recipe.get("model"), "optim": optimizer}
