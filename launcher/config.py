"""Config schemas (Hydra structured configs) and the checks that turn bad values into one clear line.

The schema makes a typo in a key or a wrong type fail when Hydra composes the config; `validate`
then checks ranges and combinations that a type cannot express. Every failure is a `ConfigError`
whose message names the key, the bad value, what is allowed and what to type instead.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf


class LaunchError(Exception):
    """Something the user can fix (a value, a missing file). `str(err)` is the whole one-line message; exit 2."""

    exit_code = 2


class ConfigError(LaunchError, ValueError):
    """A bad value a user typed, with the key, what is allowed and an example."""

    def __init__(self, key: str, value: Any, allowed: str, example: str | None = None):
        shown = _show(value)
        text = f"{key}={shown} is not valid: {allowed}"
        if example:
            text += f" (e.g. launch {example})"
        super().__init__(text)
        self.key = key
        self.value = value


def _show(value: Any) -> str:
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value)


@dataclass
class RecipeConfig:
    """What is trained and how: each recipe's YAML fills these; `recipe.model` picks among its models."""

    name: str = MISSING
    model: str = MISSING
    optimizer: str = "sgd"  # sgd (Nesterov momentum) | adamw | muon (see launcher/optim.py)
    momentum: float = 0.9  # SGD's momentum (under muon: of the SGD groups)
    nesterov: bool = True
    weight_decay: float = 5e-4  # under muon: decay per step at full LR of the SGD groups
    label_smoothing: float = 0.0
    warmup_epochs: float = 1.0  # triangular schedule: linear warm-up to `lr`, then linear decay to 0
    # muon only: `lr` is Muon's; these are the SGD groups' (linear decay to 0, no warm-up)
    muon_momentum: float = 0.6
    sgd_lr: float = 0.05  # BatchNorm biases and the stem's bias
    head_lr: float = 0.5  # the classifier
    stem_bias_epochs: float = 3.0  # the stem's bias trains only this long
    # augmentation on the training device (recipes that augment read these)
    augment: bool = True
    flip: str = "random"  # random | alternating (each image the other way round every other epoch) | none
    translate: int = 2  # random shift by up to this many pixels (reflect padding)
    tta: int = 0  # test-time augmentation: 0 none | 1 mirror | 2 mirror + 1-pixel shifts
    eval_batch_size: int = 1024  # global, like batch_size
    eval_every: int = 1  # evaluate after every N-th epoch (0: only after the last)
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU | bf16 | fp32
    channels_last: bool = True  # GPU only
    compile: bool = False  # torch.compile the model; compile warm-up runs before the clock starts
    compile_mode: str = "default"  # torch.compile's mode: default | reduce-overhead | max-autotune | ...
    # GPU: capture each step (augment, forward, backward, gradient all-reduce) as one CUDA graph and
    # replay it. Under ddp the gradients are then averaged in flat buckets by the launcher instead of
    # DDP's reducer (launcher/step_graph.py), so strategy.static_graph/find_unused_parameters do not apply.
    cuda_graph: bool = False
    # GPU: let cuDNN time its algorithms for each convolution shape on first use (torch.backends.cudnn
    # .benchmark). Pays off for large convolutions; for tiny ones it only delays the first step (digits'
    # 8x8 net: first step 1.2-3.3 s with it, 0.4-0.5 s without, later steps equal; BENCHMARKS.md).
    cudnn_benchmark: bool = True


@dataclass
class StrategyConfig:
    """How devices share the work. Options that do not apply to the chosen strategy are ignored."""

    name: str = "auto"  # auto | single | dp | ddp
    # ddp: process-group backend (auto: nccl on GPUs, gloo on CPU) and DistributedDataParallel options
    backend: str = "auto"
    timeout_s: int = 600  # a collective that waits longer than this ends the launch instead of hanging
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False


@dataclass
class BackendConfig:
    """Where the workers run. `local` spawns them on this host; `slurm` submits a job through submitit
    (launcher/slurm.py), whose tasks then run the same launch inside the allocation."""

    name: str = "local"  # local | slurm
    # slurm only (sbatch options; null leaves the cluster's default)
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


@dataclass
class DataConfig:
    root: str = "${oc.env:LAUNCH_DATA_ROOT,'~/.cache/launcher/data'}"
    download: bool = True  # fetch a missing dataset (checksummed); offline, an error says where to put it
    synthetic: bool = False  # generate data of the real shape for timing runs; never used unless asked for
    placement: str = "auto"  # gpu: whole split on the GPU | host: pinned host memory + side-stream prefetch | auto
    prefetch_depth: int = 2  # placement=host: batches copied ahead of the step that uses them


@dataclass
class FaultConfig:
    """Deliberate failures, to test supervision: rank `rank` fails at global step `step` with `kind`."""

    rank: int | None = None
    step: int = 0
    kind: str = "raise"  # raise | exit | hang | kill | nan (the loss becomes NaN from that step on) | oom
    attempt: int = 0  # only on this restart attempt (-1: on every attempt)


@dataclass
class SweepConfig:
    """`launch -m` on this host (launcher/sweep.py)."""

    parallel: int = 0  # most runs at once; 0: as many as the GPUs allow (CPU runs one at a time)


@dataclass
class Config:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    data: DataConfig = field(default_factory=DataConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    # The keys people type most sit at the top level.
    gpus: Any = "auto"  # [0,1] ids | 2 a count | all | auto (all visible, else CPU) | [] CPU
    nprocs: int | None = None  # CPU ranks for ddp on CPU (gpus=[]); with GPUs it is one per GPU
    batch_size: int = 64  # GLOBAL: samples per optimizer step summed over all devices, for every strategy
    epochs: int = 10
    lr: float = 0.1
    seed: int = 0
    resume: str | None = None  # a run dir or checkpoint file to continue from, or `latest`
    max_restarts: int = 0  # restart the worker group this many times after a failure; it resumes
    dry_run: bool = False  # print the plan, start nothing
    checkpoint: bool = True  # write checkpoints/last.pt every epoch (atomically)
    profile: bool = False  # torch.profiler over the second epoch: profile.txt and trace.json in the run dir
    tensorboard: bool = True  # scalars every epoch into <run dir>/tensorboard (tensorboard --logdir <run dir>)
    progress: str = "auto"  # auto: a live bar when stdout is a terminal, else a line per epoch | bar | lines
    # Your own torchrun-style script instead of a recipe (launcher/script.py): `args.KEY=V` become
    # `--KEY V`; script_args holds what followed `--` on the command line.
    script: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    script_args: list[str] = field(default_factory=list)


TOP_LEVEL_KEYS = [f for f in Config.__dataclass_fields__]
STRATEGIES = ("auto", "single", "dp", "ddp")
PRECISIONS = ("auto", "bf16", "fp32")
OPTIMIZERS = ("sgd", "adamw", "muon")
FLIPS = ("random", "alternating", "none")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
FAULT_KINDS = ("raise", "exit", "hang", "kill", "nan", "oom")
BACKENDS = ("local", "slurm")


def register() -> None:
    """Register the schema with Hydra's ConfigStore and the resolvers the YAML uses. Idempotent."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="launch_schema", node=Config)
    if not OmegaConf.has_resolver("launch_uid"):
        # A short random suffix keeps two launches started in the same second in separate run dirs.
        OmegaConf.register_new_resolver("launch_uid", lambda: secrets.token_hex(2), use_cache=True)


def _check_int(key: str, value: Any, low: int, example: str, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise ConfigError(key, value, f"must be {bound}", example)


def _check_float(key: str, value: Any, example: str, *, positive: bool = True, high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if positive else value >= 0) and (high is None or value <= high)
    if not ok:
        rule = "a finite number > 0" if positive else "a finite number >= 0"
        if high is not None:
            rule += f" and <= {high}"
        raise ConfigError(key, value, f"must be {rule}", example)


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, value, "choose one of " + ", ".join(choices), f"{key}={choices[0]}")


def validate(cfg: DictConfig) -> None:
    """Range and combination checks that the schema's types cannot express. Raises ConfigError."""
    _check_int("epochs", cfg.epochs, 1, "epochs=10")
    _check_int("batch_size", cfg.batch_size, 1, "batch_size=256")
    _check_float("lr", cfg.lr, "lr=0.1")
    _check_int("seed", cfg.seed, 0, "seed=0")
    _check_int("max_restarts", cfg.max_restarts, 0, "max_restarts=2", high=100)
    if cfg.nprocs is not None:
        _check_int("nprocs", cfg.nprocs, 1, "gpus=[] strategy=ddp nprocs=2", high=os.cpu_count() or 1024)
    _check_choice("strategy", cfg.strategy.name, STRATEGIES)
    _check_int("strategy.timeout_s", cfg.strategy.timeout_s, 1, "strategy.timeout_s=600")
    _check_int("strategy.bucket_cap_mb", cfg.strategy.bucket_cap_mb, 1, "strategy.bucket_cap_mb=25")
    _check_choice("strategy.backend", cfg.strategy.backend, ("auto", "nccl", "gloo"))
    r = cfg.recipe
    _check_choice("recipe.optimizer", r.optimizer, OPTIMIZERS)
    _check_choice("recipe.precision", r.precision, PRECISIONS)
    _check_float("recipe.momentum", r.momentum, "recipe.momentum=0.9", positive=False, high=1.0)
    _check_float("recipe.weight_decay", r.weight_decay, "recipe.weight_decay=5e-4", positive=False)
    _check_float("recipe.label_smoothing", r.label_smoothing, "recipe.label_smoothing=0.1", positive=False, high=1.0)
    _check_float("recipe.warmup_epochs", r.warmup_epochs, "recipe.warmup_epochs=1", positive=False)
    _check_int("recipe.eval_batch_size", r.eval_batch_size, 1, "recipe.eval_batch_size=1024")
    _check_int("recipe.eval_every", r.eval_every, 0, "recipe.eval_every=1")
    _check_choice("recipe.flip", r.flip, FLIPS)
    _check_int("recipe.translate", r.translate, 0, "recipe.translate=2", high=8)
    _check_int("recipe.tta", r.tta, 0, "recipe.tta=2", high=2)
    _check_choice("recipe.compile_mode", r.compile_mode, COMPILE_MODES)
    if r.cuda_graph and r.compile and r.compile_mode in ("reduce-overhead", "max-autotune"):
        raise ConfigError("recipe.compile_mode", r.compile_mode, "recipe.cuda_graph=true captures the whole step "
                          "already and this mode would make CUDA graphs inside it; use default or "
                          "max-autotune-no-cudagraphs, or recipe.cuda_graph=false to let torch.compile graph it",
                          "recipe.compile_mode=default")
    _check_float("recipe.muon_momentum", r.muon_momentum, "recipe.muon_momentum=0.6", positive=False, high=1.0)
    _check_float("recipe.sgd_lr", r.sgd_lr, "recipe.sgd_lr=0.05")
    _check_float("recipe.head_lr", r.head_lr, "recipe.head_lr=0.5")
    _check_float("recipe.stem_bias_epochs", r.stem_bias_epochs, "recipe.stem_bias_epochs=3", positive=False)
    _check_choice("data.placement", cfg.data.placement, ("auto", "gpu", "host"))
    _check_int("data.prefetch_depth", cfg.data.prefetch_depth, 1, "data.prefetch_depth=2", high=64)
    _check_choice("fault.kind", cfg.fault.kind, FAULT_KINDS)
    _check_choice("backend.name", cfg.backend.name, BACKENDS)
    _check_int("sweep.parallel", cfg.sweep.parallel, 0, "sweep.parallel=2")
    _check_choice("progress", cfg.progress, ("auto", "bar", "lines"))
    if cfg.backend.name == "slurm":
        _check_slurm(cfg.backend)
    if cfg.resume is not None and str(cfg.resume).strip().lower() in ("", "true", "false", "none"):
        raise ConfigError("resume", cfg.resume, "give a run dir or checkpoint file, or `latest`", "resume=latest")


SLURM_TEXT_KEYS = ("partition", "account", "qos", "constraint", "exclude", "job_name")


def _check_slurm(b: DictConfig) -> None:
    """sbatch options end up as lines of a batch script: no value may start a new line of it."""
    _check_int("backend.time_min", b.time_min, 1, "backend.time_min=120")
    _check_int("backend.nodes", b.nodes, 1, "backend.nodes=2")
    _check_int("backend.max_requeues", b.max_requeues, 0, "backend.max_requeues=3")
    _check_int("backend.array_parallelism", b.array_parallelism, 1, "backend.array_parallelism=4")
    for key in ("mem_gb", "cpus_per_task"):
        if b[key] is not None:
            _check_int(f"backend.{key}", b[key], 1, f"backend.{key}=8")
    texts = {f"backend.{k}": b[k] for k in SLURM_TEXT_KEYS if b[k] is not None}
    for key, value in (b.additional or {}).items():
        if not isinstance(key, str) or not key or not all(c.isalnum() or c in "-_" for c in key):
            raise ConfigError("backend.additional", key, "sbatch option names are letters, digits, - and _",
                              "'backend.additional={mail-type: END}'")
        texts[f"backend.additional.{key}"] = value
    for key, value in texts.items():
        if any(ord(c) < 32 or ord(c) == 127 for c in str(value)):
            raise ConfigError(key, repr(str(value)), "control characters (a newline would start a new line of the "
                              "batch script) are not allowed", f"{key}=gpu")

