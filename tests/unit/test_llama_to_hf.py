"""examples/llama_to_hf.py: a recipe=text llama's weights as transformers' LlamaForCausalLM give its logits."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


def _example():
    path = Path(__file__).resolve().parents[2] / "examples" / "llama_to_hf.py"
    spec = importlib.util.spec_from_file_location("llama_to_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_llamas_weights_under_transformers_names_give_its_logits(tied):
    """Grouped-query attention (4 heads, 2 key/value heads), the rotary pairs reordered, the fused keys and
    values split: transformers' model computes what launch's did, token for token."""
    from transformers import LlamaForCausalLM

    from recipes.text_models import Llama

    torch.manual_seed(0)
    ours = Llama(vocab=61, context=16, layers=2, width=32, heads=4, kv_heads=2, ffn=48, tie_embeddings=tied).eval()
    for p in ours.parameters():  # (norms at 1 would hide a norm put in the wrong place)
        torch.nn.init.normal_(p, std=0.3)
    example = _example()
    state = ours.state_dict()
    if tied:
        state.pop("head.weight")  # (launch export writes a tied weight once, under its first name)
    theirs = LlamaForCausalLM(example.hf_config(state, heads=4, kv_heads=2, context=16)).eval()
    theirs.load_state_dict(example.to_hf_names(state, heads=4, kv_heads=2), strict=True)
    tokens = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        want, got = ours(tokens), theirs(tokens).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
