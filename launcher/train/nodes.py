"""A world that spans machines: does every rank see rank 0's run dir, and what follows from the answer.

Each node of a launch over several machines (`nodes=2 ... rdzv=HOST:PORT`, or a SLURM job over
`backend.nodes`) has a run dir of its own; rank 0's is the run's: config, metrics, checkpoints and
results are written there. Once the process group is up, `meet` has rank 0 leave a token in its run
dir and every rank look for it at the same path:

    shared       every rank sees it (a file system the nodes share): every rank reads and writes the
                 run's checkpoints there (sharded ones included), and a failing rank records its
                 failure there as well as in its own node's dir, so every node's launch names the
                 root cause
    not shared   the other nodes keep to their own dirs (their logs and failure records); on a restart
                 rank 0 reads the checkpoint and sends it to every rank (`restart.resume`); sharded
                 checkpoints, which every rank writes into one folder, are refused in one line

The first rank of every other node writes files.NODE into its own run dir: its ranks, rank 0's run
dir and whether it is shared (the launcher reads it to find the other nodes' failure records).
"""

from __future__ import annotations

import json
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from launcher.config import GROUPS, flat_keys
from launcher.errors import LaunchError
from launcher.failures import span
from launcher.files import NODE, WORLD_TOKEN, write_text_atomic
from launcher.world import WorldInfo


@dataclass(frozen=True)
class RunDirs:
    own: Path  # this node's run dir (its launcher's)
    main: Path  # rank 0's: the run's
    shared: bool  # every rank sees `main`


_met: RunDirs | None = None  # what `meet` found, for the failure handler (worker.py)


def spans_nodes(world: WorldInfo) -> bool:
    return world.world_size > world.local_world_size


# Settings each node may set for itself: where its data and devices are, how many loader processes it
# runs, how it shows progress. Every other setting must be the same on every node (`meet` checks).
PER_NODE = ("node_rank", "gpus", "nprocs", "rdzv_timeout_s", "data.root", "data.workers", "data.worker_prefetch",
            "progress", "dry_run")


def _per_node(key: str) -> bool:
    return any(key == own or key.startswith(own + ".") for own in PER_NODE)


def _shown(key: str, value: Any) -> str:
    """A setting as the user types it: a group's option by the group (recipe=text, not recipe.name=text)."""
    group = key.removesuffix(".name")
    return f"{group}={value}" if group in GROUPS and key != group else f"{key}={value}"


def _typed(key: str, typed: set[str]) -> bool:
    """`key` is what a command line set: the key or a section holding it (`data=...`), or a group's option
    (`recipe=text` sets recipe.name; the recipe's other values follow from it)."""
    group, _, rest = key.partition(".")
    if group in GROUPS and group in typed:
        return rest == "name"
    parts = key.split(".")
    return any(".".join(parts[:i]) in typed for i in range(1, len(parts) + 1))


SHOWN = 6  # differences named when none was typed (a SLURM job's nodes, launched with one command)


def differences(answers: list[tuple[Any, ...]]) -> str | None:
    """Where each node's settings differ from rank 0's node: one line, or None when they agree. It names
    first, whole, what the commands typed differently (recipe=text on one node, recipe=digits on another),
    then how many values differ only as a result (a recipe's epochs, lr, ...). Where nothing typed differs,
    the first keys that do, a group's option first. `answers`: one per node, (rank, sees, host, processes on
    the node, flat settings[, the keys its command line set]), rank 0's first."""
    first_host, first_local, first = answers[0][2], answers[0][3], answers[0][4]
    typed: set[str] = set().union(*(set(a[5]) for a in answers if len(a) > 5))
    said: dict[str, str] = {}
    for rank, _, host, local, settings, *_ in answers[1:]:
        where = f"on {first_host} (rank 0's node) but {{}} on {host} (rank {rank})"
        if local != first_local:
            said.setdefault("", f"processes per node {first_local} " + where.format(local))
        for key in sorted(first.keys() | settings.keys()):
            if not _per_node(key) and first.get(key) != settings.get(key):
                said.setdefault(key, _shown(key, first.get(key)) + " " + where.format(_shown(key, settings.get(key))))
    if not said:
        return None
    # A group's option chosen differently (recipe=text, recipe=digits) is named before the values that follow
    # from it (its epochs, lr, ...), which are then only counted.
    options = [f"{group}.name" for group in GROUPS]  # (in this order: a recipe's YAML may choose its optimizer)
    chosen = [k for k in options if k in said]
    named = [k for k in said if _typed(k, typed)] or chosen
    if named:
        named = sorted(named, key=lambda k: (options.index(k) if k in options else len(options), k))
        lines = [said[k] for k in named] + ([said[""]] if "" in said else [])
        others = len([k for k in said if k and k not in named])
        more = (f"; {others} other values differ as a result" if others > 1 else
                "; 1 other value differs as a result" if others else "")
    else:
        lines = list(said.values())
        more = "; ..." if len(lines) > SHOWN else ""
        lines = lines[:SHOWN]
    return ("the nodes were launched with different settings: " + "; ".join(lines) + more + ". Give every node "
            f"the same command: only {', '.join(PER_NODE)} may differ (nprocs in how it is written, not in the "
            "processes it makes)")


def meet(world: WorldInfo, run_dir: Path, sharded: bool, checkpoints: bool,
         settings: dict[str, Any] | None = None, typed: tuple[str, ...] = ()) -> RunDirs:
    """Rank 0's run dir and whether every rank sees it (a collective: every rank calls it). `settings`: this
    node's resolved config (plain data): where a node's differs from rank 0's (but for PER_NODE keys), every
    rank raises the same one line (exit 2), before training, naming first what the commands set (`typed`:
    the keys this node's command line set) differently."""
    global _met
    run_dir = Path(run_dir)
    if not spans_nodes(world) or not dist.is_initialized():
        return RunDirs(run_dir, run_dir, True)
    token = uuid.uuid4().hex
    if world.rank == 0:
        write_text_atomic(run_dir / WORLD_TOKEN, token + "\n")
    told: list[Any] = [str(run_dir), token] if world.rank == 0 else [None, None]
    dist.broadcast_object_list(told, src=0)
    main = Path(told[0])
    try:
        sees = (main / WORLD_TOKEN).read_text().strip() == told[1]
    except OSError:
        sees = False
    answers: list[Any] = [None] * world.world_size
    mine = flat_keys(settings or {}) if world.local_rank == 0 else None  # (one per node is enough)
    dist.all_gather_object(answers, (world.rank, sees, socket.gethostname(), world.local_world_size, mine,
                                     tuple(typed)))
    differ = differences([a for a in answers if a[4] is not None])
    if differ:
        raise LaunchError(differ)
    blind = [(rank, host) for rank, ok, host, *_ in answers if not ok]
    dirs = RunDirs(run_dir, main, not blind)
    if world.local_rank == 0 and world.rank != 0:
        record = {"ranks": [world.rank, world.rank + world.local_world_size - 1], "main_run_dir": str(main),
                  "shared": dirs.shared, "host": socket.gethostname()}
        write_text_atomic(run_dir / NODE, json.dumps(record, indent=1) + "\n")
    _met = dirs
    if blind and sharded and checkpoints:
        hosts = sorted({host for _, host in blind})
        ranks = span([rank for rank, _ in blind])
        raise LaunchError(f"a sharded strategy writes one checkpoint folder that every rank reaches, but rank 0's run "
                          f"dir {main} is not visible on {', '.join(hosts)} (ranks {ranks}): give the nodes "
                          "a file system they share and launch from it (or hydra.run.dir=/shared/path/run-NAME on "
                          "each node), or checkpoint=false")
    return dirs


def met() -> RunDirs | None:
    return _met


def from_rank0(state: dict[str, Any] | None, world: WorldInfo) -> dict[str, Any] | None:
    """Rank 0's checkpoint state, sent to every rank (the other nodes cannot read rank 0's run dir).
    Tensors travel on the CPU; each rank puts them on its device as it restores them."""
    box: list[Any] = [state if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
