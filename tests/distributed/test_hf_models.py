"""A Hugging Face causal LM built from its config (`model._target_` a transformers model class, its config a
section of its own) trains on recipe=text: in one process, and under fsdp on 2 gloo ranks with its decoder
layers as the units and their activations recomputed, following the one process's losses."""

import json

import pytest

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}
HF_LLAMA = ("recipe=text", "gpus=[]", "epochs=2", "recipe.context=32", "recipe.max_bytes=20000", "batch_size=32",
            "recipe.sample_bytes=16", "progress=lines", "model._target_=transformers.LlamaForCausalLM",
            "+model.config._target_=transformers.LlamaConfig", *(f"+model.config.{k}={v}" for k, v in SHAPE.items()))


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_hugging_face_llama_from_its_config_trains_sharded_on_two_ranks_as_in_one_process(launch, tmp_path):
    import torch

    data = f"data.root={tmp_path / 'text-data'}"
    one = launch(*HF_LLAMA, data, "strategy=single")
    assert one.returncode == 0, one.output
    two = launch(*HF_LLAMA, data, "strategy=fsdp", "nprocs=2", "strategy.min_unit_params=0",
                 "perf.activation_checkpointing=selective")
    assert two.returncode == 0, two.output
    assert "launch: text (transformers.LlamaForCausalLM): fsdp, gloo on CPU, 2 processes" in two.output  # (named)
    # the units: its two LlamaDecoderLayers (its _no_split_modules) and the root, each recomputed
    assert "fsdp: 3 units, 2 of 1 block" in two.output and "activation checkpointing: selective, 2 blocks" in two.output
    # transformers' model modules import torchao where it is installed, whose Enums torch's pytree calls
    # deprecated: two lines on every rank's console that no user can act on (launcher/logs.py drops them)
    assert "register_constant" not in one.output + two.output, two.output
    rows = _rows(two.run_dir())
    for a, b in zip(rows, _rows(one.run_dir()), strict=True):
        for key in ("loss", "test_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (key, a, b)
    assert rows[-1]["test_loss"] < rows[0]["test_loss"] and two.results()["ranks_agree"] is None
    # built for the data's 256 byte tokens (not LlamaConfig's default 32,000), its parameters counted
    with torch.device("meta"):
        expected = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256, **SHAPE))
    assert two.results()["parameters"] == sum(p.numel() for p in expected.parameters())
    assert two.results()["model"] == "transformers.LlamaForCausalLM" and two.results()["vocab_size"] == 256
    assert (two.run_dir() / "sample.txt").read_text().strip()  # generated from its logits
    # `launch eval` builds it again from the run's config and reads its sharded checkpoint
    evaluated = launch("eval", str(two.run_dir()), "gpus=[]")
    assert evaluated.returncode == 0, evaluated.output
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/eval.json")]
    assert report["test_loss"] == pytest.approx(rows[-1]["test_loss"], rel=1e-4)
    # `launch export` gathers the shards into a state_dict that the transformers class loads as its own
    exported = launch("export", str(two.run_dir()), str(tmp_path / "llama.pt"))
    assert exported.returncode == 0 and "model._target_=transformers.LlamaForCausalLM" in exported.stdout, \
        exported.output
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256, **SHAPE))
    plain.load_state_dict(torch.load(tmp_path / "llama.pt", weights_only=True), strict=True)


def test_a_config_vocabulary_smaller_than_the_datas_is_one_line_not_an_index_error(launch, tmp_path):
    """+model.config.vocab_size=100 on bytes (ids up to 255): refused in one line, exit 2, naming the key and the
    vocabulary that fits, where the first step raised IndexError inside the embedding (a traceback); by the
    launcher before any worker, so no run dir is left behind for it."""
    result = launch(*HF_LLAMA, f"data.root={tmp_path / 'text-data'}", "strategy=single", "+model.config.vocab_size=100",
                    timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.output
    assert "Traceback" not in result.output and "IndexError" not in result.output, result.output
    assert any("model.config.vocab_size=100 is not valid: model._target_=transformers.LlamaForCausalLM embeds 100 "
               "tokens, but the data's ids run to 255 (a vocabulary of 256)" in line for line in lines), result.stderr
    assert not list(tmp_path.glob("outputs/*/*")), "a run dir for a run refused before its workers"
