"""A recipe=text llama's exported weights (`launch export RUN_DIR llama.safetensors`) as a Hugging Face
LlamaForCausalLM, whose logits are the same (tests/unit/test_llama_to_hf.py):

    python examples/llama_to_hf.py RUN_DIR/llama.safetensors hf-llama/ --heads 32 --kv-heads 8 --context 8192

The names differ (launch's `blocks.N.q` is `model.layers.N.self_attn.q_proj`), the keys and values are one
matrix (`kv`: the keys' rows, then the values'), and the rotary positions turn neighbouring pairs of a head's
dimensions (Meta's original Llama code), where transformers turns each dimension of the first half with its
twin in the second: the query and key rows are reordered to match. The sizes (layers, width, ffn, vocab) are
read from the tensors; the heads are not in them, so they are given (the run's recipe.heads and
recipe.kv_heads, in its config.yaml); the rotary base is Llama 3's 500,000 unless recipe.rope_theta said
otherwise, and transformers' Llama 3.1 rope scaling is not applied (launch has none).
"""

from __future__ import annotations

import argparse
import re

import torch


def to_hf_names(state: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """launch's llama state_dict with transformers' LlamaForCausalLM names and rotary order."""
    width = state["tokens.weight"].shape[1]
    head_width = width // heads

    def pairs_to_halves(w: torch.Tensor, count: int) -> torch.Tensor:
        # each head's rows (d0, d1), (d2, d3), ... become d0, d2, ..., d1, d3, ...
        return w.view(count, head_width // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    out = {"model.embed_tokens.weight": state["tokens.weight"], "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state.get("head.weight", state["tokens.weight"])}
    simple = {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "out": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for name, tensor in state.items():
        found = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.weight", name)
        if not found:
            continue
        layer, part = f"model.layers.{found[1]}.", found[2]
        if part in simple:
            out[f"{layer}{simple[part]}.weight"] = tensor
        elif part == "q":
            out[f"{layer}self_attn.q_proj.weight"] = pairs_to_halves(tensor, heads)
        elif part == "kv":
            k, v = tensor.chunk(2, dim=0)
            out[f"{layer}self_attn.k_proj.weight"] = pairs_to_halves(k, kv_heads)
            out[f"{layer}self_attn.v_proj.weight"] = v
    return out


def hf_config(state: dict[str, torch.Tensor], heads: int, kv_heads: int, context: int, rope_theta: float = 500000.0):
    """A transformers LlamaConfig for launch's llama `state` (its sizes read from the tensors)."""
    from transformers import LlamaConfig

    vocab, width = state["tokens.weight"].shape
    layers = 1 + max(int(n.split(".")[1]) for n in state if n.startswith("blocks."))
    return LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=state["blocks.0.gate.weight"].shape[0],
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=context, rms_norm_eps=1e-5, rope_theta=rope_theta,
                       tie_word_embeddings="head.weight" not in state, attention_bias=False, mlp_bias=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("weights", help="launch export's .safetensors (or .pt) of a recipe.model=llama run")
    parser.add_argument("out", help="a folder for transformers' save_pretrained")
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    args = parser.parse_args()
    if args.weights.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(args.weights)
    else:
        state = torch.load(args.weights, map_location="cpu", weights_only=True)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config(state, args.heads, args.kv_heads, args.context, args.rope_theta))
    model.load_state_dict(to_hf_names(state, args.heads, args.kv_heads), strict=True)
    model.save_pretrained(args.out)
    print(f"saved {args.out}: LlamaForCausalLM, {sum(p.numel() for p in model.parameters()):,} parameters")


if __name__ == "__main__":
    main()
