"""Mutants of launcher/strategies/: how devices share the work."""

from tests.mutants import UNIT_PLAN, Mutant

MUTANTS = [
    Mutant("a user's strategy.backend ignored", "launcher/strategies/ddp.py",
           "        if chosen is ProcessGroupBackend.auto:", "        if True:", (UNIT_PLAN,)),
]
