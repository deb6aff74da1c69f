"""strategy=fsdp: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`), one process per GPU (or CPU rank).

Each rank holds 1/world of every weight, gradient and optimizer moment; a unit's weights are gathered
for its forward and backward, and its gradients reduce-scattered. Between the two the gathered weights
are freed (`reshard_after_forward`, less memory) or kept (one all-gather fewer a unit a step); auto keeps
them where the memory estimate before the workers has room for them (`fit_memory`), and the ranks agree
on it in `wrap`. The last unit and the root are never freed: their backward comes first.

The units (`shard_groups`): the model's blocks (its `shard_units()` if it has one, else the modules of its
ModuleLists, a Transformer's blocks, else its direct children with parameters), consecutive blocks taken
together until a unit holds `strategy.min_unit_params` parameters (1e8 by default, the threshold of torch's
size-based wrapping policy); the blocks left over, all of a smaller model, are gathered with the root, which
is sharded last. On GPUs a mixed-precision policy computes in bf16 and reduces gradients in fp32.

Why units of a size and not a block each: FSDP2's hooks cost the host work for every unit and every
parameter in it, and at a block a unit a small model's step is the host's, not the GPU's (GPT-2 124M ran at
about half the speed of the model as one unit; BENCHMARKS.md section 5). A unit gathered whole costs memory
only while it is gathered (its bf16 weights and gradients and the fp32 gradients reduced, ~8 bytes a
parameter: 0.8 GB for 1e8), so a model big enough to need sharding still gathers a block or a few at a
time.

With `meta_init` the model is built on the meta device and each rank materializes only its shards,
initialized by the model's `init_weights()` (or every submodule's `reset_parameters()`), so a model
that does not fit one GPU never exists whole on one. Without it the model is built whole on the device
(the same initial weights as ddp) and then sharded.

Checkpoints are sharded: every rank writes its shards through torch.distributed.checkpoint
(launcher/train/checkpoint.py `save_sharded`; by a process beside each rank while the next epoch trains,
launcher/train/shard_writer.py), and a resume reads them into whatever sharding the resuming run has
(another number of ranks or units, or ddp/single). Epoch ends are not overlapped with the next epoch
(the loop asks `overlaps_epoch_ends`).

Compiling (`compile`): each block in a unit of its own or with others has its forward compiled in place, as
torchtitan compiles per block, FSDP2's gathers and reduce-scatters running in the units' hooks outside the
compiled code; the root's forward is compiled around them (dynamo stops at each unit's hooks and resumes
after them, so the embeddings, the head and the loss are compiled where the model calls its blocks from a
method of their own, recipe=text's GPT.trunk). Blocks gathered with the root have no hooks: the root's
forward is then one graph. perf.compile=auto decides after the first epoch as under the other strategies
(compiling paid both with a block a unit and with the model one unit: BENCHMARKS.md section 5). CUDA-graph
capture is off (perf.cuda_graph, and the compile modes that make CUDA graphs): a replayed graph cannot
follow the weights FSDP2 gathers and frees.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from launcher.config import CompileMode, FSDPConfig, PerfConfig, Toggle, derive
from launcher.strategies.base import Nets
from launcher.strategies.ddp import DDP
from launcher.strategies.recompute import shard_units

if TYPE_CHECKING:
    import torch
    from torch import nn


class FSDP(DDP):
    name = "fsdp"
    options: FSDPConfig  # type: ignore[assignment]
    sharded = True
    overlaps_epoch_ends = False
    lockstep_eval = True
    _layout: str | None = None  # (wrap's units, said in one line: `layout`)
    _plain: tuple[Callable[[], nn.Module], Any] | None = None  # (meta_init: the model's build and the seed's state)
    keep_gathered: bool | None = None  # (reshard_after_forward=auto: this host's verdict, `fit_memory`; None: none)

    @classmethod
    def adjust_perf(cls, perf: PerfConfig) -> tuple[PerfConfig, str | None]:
        notes, mode = [], perf.compile_mode.value
        if perf.cuda_graph is not Toggle.false:
            notes.append("perf.cuda_graph is off under strategy=fsdp (a replayed graph cannot follow the weights "
                         "FSDP2 gathers and frees)")
        if perf.compile is not Toggle.false and perf.compile_makes_graphs:
            mode = "default" if mode == "reduce-overhead" else "max-autotune-no-cudagraphs"
            notes.append(f"perf.compile_mode={perf.compile_mode.value} makes CUDA graphs, which strategy=fsdp cannot "
                         f"replay: {mode} instead")
        return (derive(perf, cuda_graph=Toggle.false, compile_mode=CompileMode[mode]),
                "; ".join(notes) or None)

    def compile(self, nets: Nets, compiled: Callable[[Callable], Callable]) -> Nets:
        """Each block sharded in a unit of its own or with others has its forward compiled in place, and
        the root's forward around them; FSDP2's hooks stay eager (they stop the root's graph, which
        resumes after the call that runs the units). Blocks gathered with the root have no hooks: the
        root's graph takes them in (a model smaller than strategy.min_unit_params is one graph). A block
        under activation checkpointing has its checkpointed forward compiled (as torchtitan compiles), so
        the compiler traces the checkpoint and plans the backward with selective's policy."""
        from torch.distributed.fsdp import FSDPModule

        root = nets.module
        for block in shard_units(root):
            if isinstance(block, FSDPModule) or hasattr(block, "_recomputed_forward"):
                block.forward = compiled(block.forward)
        root.forward = compiled(root.forward)
        return nets

    @property
    def gradient_sync(self) -> str:
        return "FSDP2 reduce-scatter"

    def build_model(self, build: Callable[[], nn.Module], device: torch.device) -> nn.Module:
        import torch

        if self.options.meta_init:
            self._plain = (build, torch.get_rng_state())  # (what a plain build would draw: `wrap`, CPU meshes)
            with torch.device("meta"):
                return build()
        return build().to(device)

    def wrap(self, model: nn.Module, device: torch.device) -> Nets:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        o = self.options
        mesh = init_device_mesh(device.type, (self.world_size,))
        policy = MixedPrecisionPolicy()
        if device.type == "cuda" and o.mixed_precision:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        groups = shard_groups(model, o.min_unit_params)
        reshard = self._reshard_after_forward(device)
        for i, unit in enumerate(groups):  # (the last unit's backward comes first: freeing it would only regather it)
            fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard and i < len(groups) - 1)
        self._layout = describe_units(model, groups, o.min_unit_params)
        if len(groups) > 1:
            auto = ", by the memory estimate" if o.reshard_after_forward is Toggle.auto else ""
            self._layout += (f"; reshard_after_forward={str(reshard).lower()}{auto}: " +
                             ("each unit but the last and the root gathered again for its backward" if reshard else
                              "each unit's gathered weights kept from its forward to its backward"))
        # (the root never: its head's backward comes first. None is torch's own choice, which keeps the root
        # gathered; an explicit true freed it, and an explicit false aborted gloo ranks at exit now and then)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=None)
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device=device)
            if not (device.type == "cpu" and self._plain is not None and copy_plain_build(model, *self._plain)):
                initialize(model)
        return Nets(model, model, model)

    @property
    def layout(self) -> str | None:
        return self._layout

    def fit_memory(self, spare_bytes: int | None, parameters: int) -> str | None:
        """reshard_after_forward=auto: keep the units' gathered weights (the whole model, in the dtype it
        computes in) from each forward to its backward where they fit in what the estimate leaves spare;
        that saves an all-gather a unit a step. Elsewhere, or without an estimate, free them."""
        if self.options.reshard_after_forward is not Toggle.auto:
            return None
        gathered = parameters * (2 if self.devices.on_gpu and self.options.mixed_precision else 4)
        self.keep_gathered = spare_bytes is not None and parameters > 0 and gathered <= spare_bytes
        size = f"~{gathered / 2**30:.1f} GiB"
        if self.keep_gathered:
            return (f"strategy.reshard_after_forward=auto: false (the gathered weights, {size}, fit beside the "
                    "estimate: kept from each unit's forward to its backward)")
        why = "no estimate" if spare_bytes is None or not parameters else f"the gathered weights, {size}, do not fit " \
                                                                            "beside the estimate"
        return f"strategy.reshard_after_forward=auto: true ({why})"

    def _reshard_after_forward(self, device: torch.device) -> bool:
        """The setting, or under auto what the hosts' estimates say, agreed by every rank (a rank whose
        units were not freed would skip the all-gathers its peers' backward waits in): kept gathered only
        where a host judged it and none found it too big; a host that did not judge (torchrun's ranks
        other than a node's first) has no say."""
        import torch
        import torch.distributed as dist

        setting = self.options.reshard_after_forward
        if setting is not Toggle.auto:
            return setting is Toggle.true
        votes = torch.tensor([self.keep_gathered is not None, self.keep_gathered is False], dtype=torch.int32,
                             device=device)
        dist.all_reduce(votes)
        judged, against = votes.tolist()
        return judged == 0 or against > 0

    @contextlib.contextmanager
    def no_sync(self, nets: Nets) -> Iterator[None]:
        """No reduce-scatter in this backward pass: the gradients accumulate unsharded until the last micro-batch."""
        nets.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            nets.module.set_requires_gradient_sync(True)

    def state_dict(self, nets: Nets) -> dict[str, Any]:
        """The whole model, gathered (every rank takes part) into rank 0's host memory; {} elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(nets.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, nets: Nets, state: dict[str, Any]) -> None:
        """A whole model's state (every rank holds it) into the shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(nets.module, state, options=StateDictOptions(full_state_dict=True))

    def weights_digest(self, nets: Nets) -> str:
        """One model, sharded: each rank digests the shards it holds, and every rank reports the SHA-256 of
        all ranks' digests in rank order. No rank gathers the model: at 8B parameters rank 0 gathering it
        whole into host memory and digesting it took minutes at the end of every run (and a larger model
        would not fit a host). So the digest tells the same weights apart among runs of the same world
        size and units; the same weights sharded otherwise digest differently."""
        import hashlib

        import torch.distributed as dist

        every: list[str | None] = [None] * self.world_size
        dist.all_gather_object(every, shards_sha256(nets.module))
        return hashlib.sha256("".join(str(d) for d in every).encode()).hexdigest()


def shards_sha256(model: nn.Module) -> str:
    """SHA-256 of the names and the bytes of this rank's shards (and of any unsharded tensor) of `model`'s state,
    as they are held (no conversion: the bits are the weights')."""
    import hashlib

    import torch
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        h.update(name.encode())
        h.update(str(local.dtype).encode())
        if local.numel():
            h.update(local.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def shard_groups(model: nn.Module, min_params: int) -> list[list[nn.Module]]:
    """The units sharded before the root, each one or more consecutive blocks (`shard_units`) holding
    at least `min_params` parameters together; blocks left over (fewer than that in all) are gathered
    with the root. Each unit is one all-gather before its forward and one reduce-scatter after its
    backward, and FSDP2's hooks on the host for each: for a small model those hooks, not the GPU, set
    the step's pace (BENCHMARKS.md section 5)."""
    groups: list[list[nn.Module]] = []
    unit: list[nn.Module] = []
    held = 0
    for block in shard_units(model):
        unit.append(block)
        held += sum(p.numel() for p in block.parameters())
        if held >= min_params:
            groups.append(unit)
            unit, held = [], 0
    return groups


def describe_units(model: nn.Module, groups: list[list[nn.Module]], min_params: int) -> str:
    """The units in one line: how many, of how many blocks and parameters, and what the root gathers."""
    def count(modules: list[nn.Module]) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    def millions(n: int) -> str:
        return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"

    total, blocks = count([model]), shard_units(model)
    if not groups:
        why = (f"its {len(blocks)} blocks hold {millions(count(blocks))} together, fewer than "
               f"strategy.min_unit_params={min_params}" if blocks else "it has no blocks to shard apart")
        return (f"fsdp: one unit, the root, gathered whole for each forward and backward "
                f"({millions(total)} parameters; {why})")
    lengths, sizes = sorted({len(g) for g in groups}), [count(g) for g in groups]
    per = f"{lengths[0]}" if len(lengths) == 1 else f"{lengths[0]}-{lengths[-1]}"
    held = millions(sizes[0]) if min(sizes) == max(sizes) else f"{millions(min(sizes))}-{millions(max(sizes))}"
    left = len(blocks) - sum(len(g) for g in groups)
    rest = f", with {left} block{'s' if left > 1 else ''} left over" if left else ""
    return (f"fsdp: {len(groups) + 1} units, {len(groups)} of {per} block{'s' if lengths[-1] > 1 else ''} "
            f"({held} parameters{' each' if len(groups) > 1 else ''}) and the root "
            f"({millions(total - sum(sizes))}{rest}); strategy.min_unit_params={min_params}")


def copy_plain_build(model: nn.Module, build: Callable[[], nn.Module], rng_state: Any) -> bool:
    """Meta init on a CPU mesh (gloo ranks): each rank's shards, and every buffer, copied from the network a
    plain build draws from the run's seed (`rng_state`, taken before the build on the meta device), so the run
    starts from the weights it would have had without strategy.meta_init, and the generator goes on from where
    that build left it, as it would have. DTensor cannot draw a shard as its part of a whole tensor on a CPU
    mesh (`_own_draws_on_a_cpu_mesh`). The plain network exists whole in each rank's host memory while its
    shards are copied: done only where its weights take under a quarter of the memory available (CPU ranks
    train small networks); else False, and the ranks draw their shards apart. FSDP2 shards dim 0 as
    torch.chunk splits it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    entries = model.state_dict()
    need = sum(t.numel() * t.element_size() for t in entries.values())
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return False
    if need > available // 4:
        return False
    torch.set_rng_state(rng_state)
    whole = build().state_dict()
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = {}
    for name, tensor in entries.items():
        source = whole.get(name)
        if source is None:
            return False
        if isinstance(tensor, DTensor):
            chunks = source.chunk(world, dim=0)
            source = chunks[rank] if rank < len(chunks) else source[:0]
            tensor = tensor.to_local()
        if tensor.shape != source.shape:
            return False
        pieces[name] = (tensor, source)
    with torch.no_grad():
        for tensor, source in pieces.values():
            tensor.copy_(source)
    return True


def initialize(model: nn.Module) -> None:
    """Weights materialized from the meta device get the model's own initialization."""
    import torch

    with torch.no_grad(), _own_draws_on_a_cpu_mesh(model):
        if callable(getattr(model, "init_weights", None)):
            model.init_weights()
            return
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()


@contextlib.contextmanager
def _own_draws_on_a_cpu_mesh(model: nn.Module) -> Iterator[None]:
    """On GPUs, DTensor's random ops draw each shard as its part of the whole tensor (its RNG tracker). On a
    CPU mesh (gloo ranks) it has no tracker and draws each rank's shard from the rank's own generator, which
    the run's seed has put in the same state on every rank: every rank's shard of a weight got the same
    values (rows repeated across ranks), as torch warns ("may not have complete support on cpu device
    mesh"). There each rank draws from a generator seeded apart for the initialization only (independent
    draws of the same distribution, not a plain build's values), and the warning, answered, is not shown;
    the common generator state the ranks share is restored after."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None or mesh.device_type != "cpu" or mesh.size() < 2:
        yield
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DTensor random operators may not have complete support on cpu",
                                UserWarning)
        torch.manual_seed(torch.initial_seed() + 7919 * (dist.get_rank() + 1))
        yield
