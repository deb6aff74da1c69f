"""Mutants of the modules both wings share (launcher/*.py)."""

from tests.mutants import UNIT_CKPT, UNIT_COMPILE, Mutant

MUTANTS = [
    Mutant("root cause: the latest failure, not the earliest", "launcher/failures.py",
           "return min(primary or latest, key=lambda r: r.time)", "return max(primary or latest, key=lambda r: r.time)",
           ("tests/unit/test_failures.py",)),
    Mutant("a checkpoint's changed bytes pass its seal", "launcher/integrity.py",
           "    if state_digest(state) != mark[\"sha256\"]:", "    if False:", (UNIT_CKPT,)),
    Mutant("the seal leaves out the tensors' bytes", "launcher/integrity.py",
           "                parts.extend(raw[i:i + PIECE_BYTES] for i in range(0, len(raw), PIECE_BYTES))",
           "                pass", (UNIT_CKPT,)),
    Mutant("another run's checkpoint passes as this run's", "launcher/integrity.py",
           "        if here is not None and mark.get(\"run\") not in (None, here):", "        if False:", (UNIT_CKPT,)),
    Mutant("a changed shard file passes its seal", "launcher/integrity.py",
           "            if file_digest(file) != digest:", "            if False:",
           ("tests/distributed/test_fsdp.py::test_a_damaged_sharded_checkpoint_is_one_line_before_any_worker",)),
    Mutant("the data cache ignores a changed source", "launcher/datacache.py",
           'digest.update(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode())',
           'digest.update(f"{path.resolve()}".encode())', (UNIT_COMPILE,)),
]
