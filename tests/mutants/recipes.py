"""Mutants of recipes/: what is trained."""

from tests.mutants import UNIT_COMPILE, Mutant

MUTANTS = [
    Mutant("fast net's global max back to torch.amax", "recipes/vision_models.py",
           "x = x.flatten(2).max(dim=2).values", "x = torch.amax(x, dim=(2, 3))",
           (UNIT_COMPILE + "::test_the_fast_net_compiled_by_inductor_under_bf16_keeps_finite_gradients",)),
]
