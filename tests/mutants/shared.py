"""Mutants of the modules both wings share (launcher/*.py)."""

from tests.mutants import UNIT_CKPT, UNIT_COMPILE, Mutant

MUTANTS = [
    Mutant("root cause: the latest failure, not the earliest", "launcher/failures.py",
           "return min(primary or latest, key=lambda r: r.time)", "return max(primary or latest, key=lambda r: r.time)",
           ("tests/unit/test_failures.py",)),
    Mutant("a checkpoint's changed bytes pass its seal", "launcher/integrity.py",
           "    if state_digest(state) != mark[DIGEST]:", "    if False:", (UNIT_CKPT,)),
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
    # --- h1 ---
    Mutant("h1 consent: a plain digest passes for the user's mark", 'launcher/integrity.py',
           '        return "its seal carries no mark of a user\'s key (written by an older launch, or resealed)"',
           '        return None',
           ('tests/unit/test_checkpoint_trust.py::test_a_checkpoint_from_elsewhere_naming_code_is_refused_in_one_line_until_the_user_types_it',)),
    Mutant('h1 seal: non-tensor values left out of the digest', 'launcher/integrity.py',
           '            parts.append(f"{path}\\0{type(obj).__name__}\\0{obj!r}\\n".encode())',
           '            parts.append(f"{path}\\0{type(obj).__name__}\\n".encode())',
           ('tests/unit/test_checkpoint_trust.py::test_a_changed_non_tensor_value_in_a_sealed_checkpoint_breaks_its_seal',)),
    Mutant('h1 seal: a set digested in the order it iterates', 'launcher/integrity.py',
           '            for i, value in enumerate(sorted(obj, key=repr)):',
           '            for i, value in enumerate(obj):',
           ('tests/unit/test_checkpoint_trust.py::test_a_set_in_a_checkpoint_keeps_its_seal_whatever_order_it_iterates_in',)),
    # --- h3 ---
    Mutant("a step's figure is filed under a doubled prefix (test_test_mse)", 'launcher/figures.py',
           '        if bare is not None:',
           '        if False:',
           ('tests/unit/test_figures.py',)),
    Mutant("a recipe's own acc is shown as the accuracy", 'launcher/figures.py',
           '        if name == ACCURACY and not isinstance(figures, LauncherFigures):',
           '        if False:',
           ('tests/unit/test_figures.py',)),
]
