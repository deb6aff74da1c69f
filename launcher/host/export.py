"""`launch export RUN_DIR [best|last] [OUT]`: a run's trained weights as one file that loads without the launcher.

The checkpoint's model weights (checkpoints/last.pt; under strategy=fsdp its torch.distributed.checkpoint
folder, whose model entries `dcp.load` reads whole into host memory in this one process) are written as a
plain state_dict: `torch.load(OUT)` reads it into the recipe's network (`model.load_state_dict`). OUT ending in
.safetensors writes safetensors instead, a tensor at a time (`write_safetensors`: host memory holds the weights
once, as read; the safetensors package reads the file, and is not needed to write it). Default OUT:
RUN_DIR/model.pt (`best`: the run's best checkpoint, checkpoint.keep_best, to RUN_DIR/model-best.pt); OUT a
folder: OUT/model.pt. An existing file is never overwritten. Tied weights (GPT's output layer and embedding)
are stored once, as the network holds them (`tie_equal`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from launcher.errors import LaunchError, said
from launcher.files import disk_full, identity
from launcher.host.resume import WHICH, load_checkpoint, misspelled_which, resolve, saved_classes

USAGE = "launch export RUN_DIR [best|last] [OUT.pt | OUT.safetensors]"
WRITES = (".pt", ".pth", ".bin", ".safetensors")  # torch.save's usual names, and safetensors


def weights(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The model's state_dict from a checkpoint (read at `path`), whole, on the CPU. A sharded one's model
    entries only are read from its shards, straight into host tensors (not its optimizer state, and nothing
    written to a temporary file: for the models fsdp is for, both are several times the weights)."""
    import torch

    if "sharded" not in state:
        return {k: v.contiguous() for k, v in state["net_state_dict"].items()}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = path.parent / state["sharded"]
    if not (folder / ".metadata").is_file():
        raise LaunchError(f"export is not valid: {folder} (the checkpoint's shards) is missing or incomplete")
    reader = dcp.FileSystemReader(folder)
    metadata = reader.read_metadata()
    # Each model entry's place (DCP stores nested entries flattened; planner_data is the way back), a host
    # tensor for each tensor, a placeholder for each object, which the load puts in its place.
    places = {fqn: place for fqn, place in metadata.planner_data.items() if place[0] == "model"}
    empty = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata)
             else None for fqn, meta in metadata.state_dict_metadata.items() if fqn in places}
    target = unflatten_state_dict(empty, places)
    with warnings.catch_warnings():  # (one process reading shards is what no_dist is for: torch says so anyway)
        warnings.filterwarnings("ignore", "torch.distributed is (disabled|unavailable)", UserWarning)
        dcp.load(target, storage_reader=reader, no_dist=True)
    return target.get("model", {})


def tie_equal(model: dict[str, Any]) -> list[tuple[str, str]]:
    """Tied weights (GPT's output layer and its embedding: one parameter under two names) reach the file as
    two copies from a sharded checkpoint (torch.distributed.checkpoint stores each name apart) and from the
    plain last.pt of an earlier launcher (a plain checkpoint now holds them once). A tensor
    of two or more dimensions equal to an earlier one, in shape, dtype and every value, becomes that one
    here, so torch.save stores it once and `load_state_dict` fills both names alike. Returns (name, the
    earlier name) pairs."""
    import torch

    seen: dict[tuple, list[str]] = {}
    tied = []
    for name, tensor in model.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            continue
        flat = tensor.reshape(-1)  # (64 values spread over it: only tensors alike in these are compared whole)
        sample = flat[:: max(1, flat.numel() // 64)][:64].contiguous().view(torch.uint8).numpy().tobytes()
        same = seen.setdefault((tuple(tensor.shape), tensor.dtype, sample), [])
        first = next((f for f in same if torch.equal(model[f], tensor)), None)
        if first is None:
            same.append(name)
        else:
            model[name] = model[first]
            tied.append((name, first))
    return tied


ATTEMPTS = 3  # reads of a live run's checkpoint that it replaced meanwhile, before giving up


def _read(path: Path, value: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint at `path` and its weights. A live run may replace its checkpoint while it is read
    (a sharded one's folder is removed once the next epoch's is whole): then the newer one is read."""
    for _ in range(ATTEMPTS):
        before = identity(path)
        try:
            state = load_checkpoint(path, f"export {value}")
            return state, weights(path, state)
        except Exception as exc:  # noqa: BLE001 - whatever a read cut short raises, if the file changed
            if identity(path) == before:
                if isinstance(exc, LaunchError):
                    raise
                raise LaunchError(f"export failed: {path} could not be read ({type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''})") from None
    raise LaunchError(f"export failed: {path} was replaced {ATTEMPTS} times while it was read (a run writing "
                      "checkpoints quickly); try again, or export once the run ended")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_OUR_TEMPORARY = re.compile(r"^\..+\.(pt|safetensors)\.[a-z0-9_]{8}\.tmp-(\d+)$")  # (mkstemp: 8 characters)


def _remove_dead_exports_temporaries(folder: Path) -> None:
    """The temporary files of exports into `folder` that were killed outright (kill -9: no handler ran), each
    named by its writer's pid: removed where that process is gone and the file was not written to in the last
    minute. Nothing else in the folder is touched, nor another user's file."""
    import time

    from launcher.lifetime import process_alive

    for tmp in folder.glob(".*.tmp-*"):
        match = _OUR_TEMPORARY.match(tmp.name)
        try:
            if not match or process_alive(int(match.group(2))):
                continue
            found = tmp.lstat()
            if found.st_uid == os.getuid() and tmp.is_file() and not tmp.is_symlink() \
                    and time.time() - found.st_mtime > 60:
                tmp.unlink()
        except OSError:
            continue


def export(value: str, out: str | None = None, which: str = "last") -> Path:
    path = resolve(value, setting="launch export", which=which).resolve()
    default = path.parent.parent / ("model-best.pt" if which == "best" else "model.pt")
    target = Path(out).expanduser() if out else default
    if out and (target.is_dir() or out.endswith("/")):  # a folder: the file goes in it, as cp would put it
        target = target / "model.pt"
    def exists() -> LaunchError:
        other = target.with_name(f"{target.stem}-2{target.suffix}")
        return LaunchError(f"export is not valid: {target} exists and is not overwritten; give another file (e.g. "
                           f"launch export {value}{' best' if which == 'best' else ''} {other})")

    if target.suffix.lower() not in WRITES:  # (x.onnx got a torch pickle under that name)
        raise LaunchError(f"export is not valid: {target.name}: launch export writes a state_dict as .pt (torch.save) "
                          f"or .safetensors; give one of those (e.g. launch export {value} "
                          f"{target.with_suffix('.pt')}; for ONNX, torch.onnx.export the network with its weights)")
    if os.path.lexists(target):  # (a symbolic link too, even one pointing nowhere)
        raise exists()
    folder = target.parent
    if not folder.is_dir():
        what = "is not a folder" if os.path.lexists(folder) else "does not exist"
        raise LaunchError(f"export is not valid: {folder} {what}; create it first (mkdir -p {folder}) or "
                          f"give a file in an existing folder")
    state, model = _read(path, value)
    classes = saved_classes(state)  # (what its outputs are, in order: an image folder's class folders)
    tied = tie_equal(model)
    _remove_dead_exports_temporaries(folder)
    try:
        # Written under a name nobody can guess or plant a link at beforehand, then placed at `target`; the
        # name ends in the writer's pid, so that the next export here removes it if this one is killed outright.
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp-{os.getpid()}", dir=folder)
    except OSError as exc:
        raise LaunchError(f"export could not write in {folder}: {exc.strerror}; give a file in a folder you "
                          f"can write (e.g. {USAGE.split(' [')[0].replace('RUN_DIR', value)} ~/model.pt)") from None
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # (mkstemp makes it 0600: the weights get a new file's usual mode)
        with os.fdopen(fd, "wb") as f:
            if target.suffix.lower() == ".safetensors":
                write_safetensors(model, f, {"classes": json.dumps(list(classes))} if classes else None)
            else:
                import torch

                torch.save(model, f)
        if not place_new(tmp, target):
            raise exists()
    except (OSError, RuntimeError) as exc:  # (torch.save's zip writer does not always say ENOSPC)
        if isinstance(exc.__context__, KeyboardInterrupt):  # (Ctrl-C inside torch.save: its writer's close
            raise KeyboardInterrupt from None               # then fails, which would hide the interrupt)
        if disk_full(folder, exc):  # (asked while the partial file still holds its space)
            raise LaunchError(f"export failed: no space left on the device of {folder} ({target} was not written); "
                              "free some space or give a file on another disk") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    config = state.get("config") or {}
    recipe = config.get("recipe") or {}
    target_class = (config.get("model") or {}).get("_target_")  # (a network from config: named by its class)
    network = f"model._target_={target_class}" if target_class else f"recipe.model={recipe.get('model')}"
    # The values the file holds: a tied tensor once in a .pt (as in the network's parameters); safetensors,
    # which has no shared tensors, stores each name apart.
    apart = target.suffix.lower() == ".safetensors"
    values = sum(v.numel() for v in (model.values() if apart else {id(v): v for v in model.values()}.values()))
    tie = "{} stored apart from {}, its tied weight" if apart else "{} tied to {}"
    ties = "".join("; " + tie.format(name, first) for name, first in tied)
    reader = "safetensors.torch.load_file" if apart else "torch.load"
    shown = ", ".join(classes[:10]) + (f" ... ({len(classes)} in all)" if len(classes) > 10 else "") \
        if classes else ""
    outputs = (f"; its {_outputs_of(model, classes)} are the classes {shown}, in that order" +
               (" (in the file's metadata too: \"classes\", a JSON list)" if apart else "")) if classes else ""
    print(f"launch: exported {len(model)} tensors ({values:,} values{ties}) of recipe={recipe.get('name')} "
          f"{network} after epoch {state.get('epoch')} to {target}; "
          f"load it with model.load_state_dict({reader}('{target}')) (a plain state_dict){outputs}"
          f"{_vocabulary(model) if not target_class else ''}")
    return target


def _outputs_of(model: dict[str, Any], classes: tuple[str, ...]) -> str:
    """"outputs", or which of them are the classes where the network's last layer gives more outputs than
    the checkpoint names classes (a network built with too many: the outputs beyond them were never a
    target). The last layer: the last 2-D weight, a linear layer's (rows: its outputs)."""
    last = next((name for name in reversed(list(model)) if name.endswith("weight")
                 and getattr(model[name], "ndim", 0) == 2), None)
    rows = model[last].shape[0] if last is not None else None
    if rows is None or rows <= len(classes):
        return "outputs"
    return (f"last layer ({last.removesuffix('.weight')}) gives {rows} outputs for {len(classes)} classes (the "
            f"{rows - len(classes)} beyond them were never a target); its first {len(classes)} outputs")


def _vocabulary(model: dict[str, Any]) -> str:
    """For recipe=text's own networks: the vocabulary to build one with (its embedding's rows, the padded
    vocabulary), which an interrupted run has in no results.json; "" for any other network."""
    for name in ("tokens.weight", "embed.weight"):  # (GPT and Llama; LSTM and GRU: recipes/text_models.py)
        weight = model.get(name)
        if weight is not None and getattr(weight, "ndim", 0) == 2:
            return f"; build the network with vocab={weight.shape[0]} (its embedding's rows, the padded vocabulary)"
    return ""


# safetensors' dtype names (its format's specification: github.com/huggingface/safetensors, "Format")
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
    "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}


def write_safetensors(model: dict[str, Any], f: Any, metadata: dict[str, str] | None = None) -> None:
    """`model` written to the open file `f` in the safetensors format, one tensor at a time from its own memory:
    an 8-byte little-endian header length, the JSON header (each name's dtype, shape and byte range, padded
    with spaces to 8 bytes), then each tensor's bytes in that order. The widest elements first, so that every
    tensor starts aligned to its element size, as safetensors' own writer orders them. safetensors.torch.save
    builds the whole file in memory, from copies (shared tensors must be cloned apart first): for an 8B model
    that was three copies of its weights in host memory where this holds one. Tied weights are written once
    under each name (safetensors has no shared tensors). `metadata`: text the header's __metadata__ holds
    beside "format" (safetensors' safe_open(...).metadata() reads it)."""
    import struct

    import torch

    other = next((k for k, v in model.items() if not isinstance(v, torch.Tensor)), None)
    if other is not None:
        raise LaunchError(f"export to safetensors is not valid: {other} is a {type(model[other]).__name__}, not a "
                          "tensor, which safetensors does not store; export to a .pt file instead")
    tensors = sorted(model.items(), key=lambda kv: -kv[1].element_size())  # (stable: the state_dict's order)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, tensor in tensors:
        dtype = SAFETENSORS_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise LaunchError(f"export to safetensors is not valid: {name} is {tensor.dtype}, which safetensors does "
                              "not store; export to a .pt file instead")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for _, tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)  # (a copy only of a tensor not laid out whole)
        if flat.numel():
            f.write(memoryview(flat.view(torch.uint8).numpy()))


def place_new(written: Path, target: Path) -> bool:
    """`written` (a finished file beside `target`) becomes `target` only if nothing is there, whatever
    appeared since it was checked (a file, a link): a hard link, which fails rather than replace; where the
    file system has none, an exclusive create and a copy. Flushed to disk. False: `target` exists."""
    import shutil

    with open(written, "rb") as f:
        os.fsync(f.fileno())
    try:
        os.link(written, target)
    except FileExistsError:
        return False
    except OSError:  # (no hard links on this file system)
        try:
            out = open(target, "xb")
        except FileExistsError:
            return False
        try:
            with out, open(written, "rb") as src:
                shutil.copyfileobj(src, out)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:  # (a full disk, an interrupt: no partial file is left under the new name)
            target.unlink(missing_ok=True)
            raise
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return True


def main(argv: list[str]) -> int:
    which = "last"
    if len(argv) > 1 and argv[1] in WHICH:  # (a file named so: ./best)
        which, argv = argv[1], [argv[0], *argv[2:]]
    if not argv or len(argv) > 2 or argv[0].startswith("-"):
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    meant = misspelled_which(argv[1]) if len(argv) > 1 and not Path(argv[1]).suffix else None
    if meant and not Path(argv[1]).exists():  # (`launch export RUN bset` would write the weights to a file bset)
        print(said(f"launch export {argv[0]} {argv[1]} is not valid: did you mean launch export {argv[0]} {meant}? "
                   f"(an OUT file needs a name like model.pt: {USAGE})"), file=sys.stderr)
        return 2
    try:
        export(argv[0], argv[1] if len(argv) > 1 else None, which=which)
    except LaunchError as err:
        print(said(err), file=sys.stderr)
        return err.exit_code
    return 0
