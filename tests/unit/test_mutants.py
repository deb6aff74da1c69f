"""The mutation check's own list stays true: every module in scope has its mutants, and every mutant's line is
still in its file (tests/mutants: a mutant whose line moved would silently test nothing)."""

from __future__ import annotations

import re
from collections import Counter

from tests.mutants import EXEMPT, MIN_PER_MODULE, REPO, all_mutants, modules_in_scope


def test_every_module_in_scope_has_its_mutants():
    counts = Counter(m.path for m in all_mutants())
    short = {path: counts[path] for path in modules_in_scope() if path not in EXEMPT and counts[path] < MIN_PER_MODULE}
    assert not short, f"modules with fewer than {MIN_PER_MODULE} mutants: {short}"
    assert set(EXEMPT) <= set(modules_in_scope()), "EXEMPT names a module that is gone"


def test_every_mutant_changes_one_line_that_is_in_its_file_once_and_names_tests_that_exist():
    names = Counter(m.name for m in all_mutants())
    assert not [n for n, k in names.items() if k > 1], "two mutants share a name"
    for m in all_mutants():
        text = (REPO / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: its line is in {m.path} {text.count(m.old)} times"
        assert m.old != m.new, m.name
        assert m.tests, m.name
        for node in m.tests:
            file, _, rest = node.partition("::")
            assert (REPO / file).exists(), f"{m.name}: {file} does not exist"
            if rest:
                func = re.split(r"[\[:]", rest.split("::")[-1])[0]
                assert re.search(rf"def {re.escape(func)}\b", (REPO / file).read_text()) or \
                    func in (REPO / file).read_text(), f"{m.name}: no {func} in {file}"
