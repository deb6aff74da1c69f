"""recipe=text and strategy=fsdp on GPUs (written without a GPU lent: first to run on the device machine).
What a user must see: the language model trains on CUDA past the unigram baseline with tokens/s and MFU
reported; fsdp on 2 GPUs follows ddp and holds less memory per GPU; a meta-initialized model trains."""

import json

import pytest

two_gpus = pytest.mark.two_gpus
SMALL = ("recipe=text", "recipe.max_bytes=2000000", "recipe.layers=4", "recipe.width=256", "recipe.heads=4",
         "recipe.context=256", "batch_size=32", "lr=2e-3", "epochs=2", "perf.compile=false")
# ~50M parameters of AdamW state (16 bytes each under ddp, 8 + gathered blocks under fsdp): memory shows it
WIDE = ("recipe=text", "recipe.max_bytes=1000000", "recipe.layers=4", "recipe.width=1024", "recipe.heads=8",
        "recipe.context=128", "batch_size=8", "epochs=1", "recipe.sample_bytes=0", "perf.compile=false")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_gpt_trains_on_cuda_with_tokens_per_second_and_mfu(launch, tmp_path):
    result = launch(*SMALL, "gpus=[0]", f"data.root={tmp_path / 'data'}", timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    final = r["final"]
    assert r["device_type"] == "cuda" and final["tokens_per_s"] > 0 and 0 < final["mfu"] < 1, final
    assert final["test_bpb"] < 0.8 * r["unigram_test_bpb"], (final, r["unigram_test_bpb"])
    assert (result.run_dir() / "sample.txt").read_text().startswith("def ")
    # the tied output layer and embedding, staged on the GPU and copied to the host, are one tensor in last.pt
    import torch

    weights = torch.load(result.run_dir() / "checkpoints" / "last.pt", weights_only=True)["net_state_dict"]
    head, tokens = weights["head.weight"], weights["tokens.weight"]
    assert head.untyped_storage().data_ptr() == tokens.untyped_storage().data_ptr() and torch.equal(head, tokens)


@pytest.mark.parametrize("gpus", ["[0]", pytest.param("[0,1]", marks=two_gpus)])
def test_gpt_captured_and_compiled_trains_as_the_uncaptured_compiled_run(launch, tmp_path, gpus):
    """perf.cuda_graph=true with perf.compile=true: the text windows are strided views and the graph's
    static copies dense, so the compiled forward recompiled inside the capture and the run died
    (cudaErrorStreamCaptureUnsupported). Captured (under ddp on 2 GPUs: the graph's own all-reduce),
    it trains as the uncaptured compiled run does."""
    runs = {}
    for graph in ("true", "false"):
        run_dir = tmp_path / f"graph-{graph}"
        result = launch(*SMALL[:-1], "perf.compile=true", f"perf.cuda_graph={graph}", f"gpus={gpus}", "epochs=1",
                        "recipe.sample_bytes=0", "checkpoint=false", f"data.root={tmp_path / 'data'}",
                        f"hydra.run.dir={run_dir}", timeout=600)
        assert result.returncode == 0, result.output
        runs[graph] = json.loads((run_dir / "results.json").read_text())
        assert runs[graph]["compiled"] is True and runs[graph]["final"]["tokens_per_s"] > 0
        assert runs[graph]["final"]["test_bpb"] < 0.8 * runs[graph]["unigram_test_bpb"], runs[graph]["final"]
    assert runs["true"]["cuda_graph"] is True and runs["false"]["cuda_graph"] is False
    a, b = runs["true"]["final"], runs["false"]["final"]
    assert a["test_loss"] == pytest.approx(b["test_loss"], rel=0.05), (a, b)  # bf16, as the fsdp test below


@pytest.mark.parametrize("model", ["lstm", "gru"])
def test_recurrent_models_train_on_cuda(launch, tmp_path, model):
    result = launch(*SMALL, "gpus=[0]", f"recipe.model={model}", "epochs=1", f"data.root={tmp_path / 'data'}",
                    timeout=600)
    assert result.returncode == 0, result.output
    assert result.results()["final"]["test_loss"] < result.results()["unigram_test_loss"]


def test_fsdp_compiles_its_blocks_on_one_gpu_and_follows_its_eager_run(launch, tmp_path):
    """perf.compile=true under fsdp compiles the model (results.json says compiled; this small GPT is one
    unit, so one graph) and trains as the eager fsdp run does (bf16: a loose tolerance), on CUDA; both
    write and keep their async sharded checkpoint."""
    runs = {}
    for compiled in ("true", "false"):
        run_dir = tmp_path / f"compile-{compiled}"
        result = launch(*SMALL[:-1], "epochs=1", "recipe.sample_bytes=0", "strategy=fsdp", "gpus=[0]",
                        f"perf.compile={compiled}", f"data.root={tmp_path / 'data'}", f"hydra.run.dir={run_dir}",
                        timeout=600)
        assert result.returncode == 0, result.output
        runs[compiled] = json.loads((run_dir / "results.json").read_text())
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch-1.dcp", "last.pt"]
        assert runs[compiled]["device_type"] == "cuda" and runs[compiled]["strategy"] == "fsdp"
    assert runs["true"]["compiled"] is True and runs["false"]["compiled"] is False
    a, b = runs["true"]["final"], runs["false"]["final"]
    for run in runs.values():  # both learned (the unigram baseline is ~4.6 bits/byte)
        assert run["final"]["test_bpb"] < 0.8 * run["unigram_test_bpb"], run["final"]
    # bf16, one epoch at lr 2e-3, the loss still falling fast: other kernels land elsewhere. Compiled vs eager
    # was 2.2% apart under fsdp on an H100 (0b1c648) and 5.9% on an H200 (d2da8c6, the same on two runs);
    # without fsdp (strategy=single) 0.7% and 2.8% for seeds 0 and 1 (bench/results/compile-drift-h100-fefd599.jsonl)
    assert a["test_loss"] == pytest.approx(b["test_loss"], rel=0.08), (a, b)


@two_gpus
def test_fsdp_follows_ddp_on_two_gpus_with_less_memory_per_gpu(launch, tmp_path):
    runs = {}
    for strategy in ("ddp", "fsdp"):
        result = launch(*WIDE, "gpus=[0,1]", f"strategy={strategy}", f"data.root={tmp_path / 'data'}",
                        *(("strategy.mixed_precision=false", "strategy.min_unit_params=0",
                           "strategy.reshard_after_forward=true") if strategy == "fsdp"
                          else ("perf.cuda_graph=false",)),
                        f"hydra.run.dir={strategy}", timeout=600)
        assert result.returncode == 0, result.output
        runs[strategy] = _rows(tmp_path / strategy)[-1]
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert fsdp["loss"] == pytest.approx(ddp["loss"], rel=2e-2), (ddp, fsdp)  # bf16 autocast on both: rounding
    # Issue 16's goal. Evaluation in chunks of 128 windows a rank (eval.batch_size 256) was both runs' peak:
    # 0.72x measured on 2x H200 at d2da8c6 (1083.9 vs 1505.3 MB). Chunks now follow batch_size; the one-GPU
    # probe of a 2-rank world (bench/probe/fsdp_memory.py) then reads 606 MB against ddp's 1031 (0.59x;
    # ddp's rank 0 also stages its 581 MB checkpoint on the GPU, which this peak counts: ~0.43x).
    # (sharded a block a unit: by default this 50M-parameter model would be one unit, gathered whole; each
    # unit freed after its forward, where auto would keep them all gathered: the H200 has room)
    assert fsdp["max_mem_allocated_mb"] <= 0.6 * ddp["max_mem_allocated_mb"], (ddp, fsdp)


@two_gpus
def test_fsdp_meta_init_trains_and_its_checkpoint_resumes_on_one_gpu(launch, tmp_path):
    first = launch(*SMALL, "gpus=[0,1]", "strategy=fsdp", "strategy.meta_init=true",
                   "strategy.activation_checkpointing=true", f"data.root={tmp_path / 'data'}", "hydra.run.dir=two",
                   timeout=600)
    assert first.returncode == 0, first.output
    rows = _rows(tmp_path / "two")
    assert rows[-1]["loss"] < rows[0]["loss"]
    again = launch(*SMALL[:-2], "epochs=3", "gpus=[0]", "strategy=fsdp", f"resume={tmp_path / 'two'}",
                   f"data.root={tmp_path / 'data'}", "hydra.run.dir=one", timeout=600)
    assert again.returncode == 0, again.output
    assert [r["epoch"] for r in _rows(tmp_path / "one")] == [1, 2, 3]


@pytest.mark.parametrize("how", [("gpus=[0]",), pytest.param(
    ("gpus=[0,1]", "strategy=fsdp", "strategy.meta_init=true", "strategy.min_unit_params=0",
     "perf.activation_checkpointing=selective"), marks=two_gpus)], ids=["one-gpu", "fsdp-meta-init-selective"])
def test_a_llama_trains_on_cuda_compiled_past_the_unigram_baseline(launch, tmp_path, how):
    """recipe.model=llama (rotary positions, grouped-query attention: 4 heads, 2 key/value heads) compiled in bf16
    on CUDA with the launcher's defaults otherwise; under fsdp, built on the meta device, each block a unit of its
    own, compiled around its selective checkpoint."""
    result = launch(*SMALL[:-1], "recipe.model=llama", "recipe.kv_heads=2", "perf.compile=true", *how,
                    f"data.root={tmp_path / 'data'}", timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    final = r["final"]
    assert r["device_type"] == "cuda" and r["compiled"] is True, r
    assert final["tokens_per_s"] > 0 and 0 < final["mfu"] < 1, final
    assert final["test_bpb"] < 0.8 * r["unigram_test_bpb"], (final, r["unigram_test_bpb"])
    assert (result.run_dir() / "sample.txt").read_text().startswith("def ")
    if "strategy=fsdp" in how:  # (the GPU's memory, read by NVML, has room for the gathered weights)
        assert "reshard_after_forward=false, by the memory estimate" in r["sharding"], r["sharding"]


def test_fp8_trains_a_compiled_llama_on_cuda_as_its_bf16_run_does(launch, tmp_path):
    """perf.precision=fp8 (torchao's float8 linear layers inside the blocks) on a GPU of compute capability 8.9+:
    the same run as bf16's, its held-out loss within a tenth of it and past the unigram baseline, and said
    in the log and results.json. Widths are multiples of 16, as float8's matmul needs."""
    pytest.importorskip("torchao", reason="perf.precision=fp8 needs torchao (carry its wheel to the device)")
    import torch

    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("no float8 matmuls on this GPU")
    llama = (*SMALL[:-1], "recipe.model=llama", "recipe.kv_heads=2", "perf.compile=true", "gpus=[0]",
             "recipe.sample_bytes=0", f"data.root={tmp_path / 'data'}")
    runs = {p: launch(*llama, f"perf.precision={p}", f"hydra.run.dir={p}", timeout=600) for p in ("bf16", "fp8")}
    for p, result in runs.items():
        assert result.returncode == 0, (p, result.output)
    bf16, fp8 = (runs[p].results() for p in ("bf16", "fp8"))
    assert fp8["device_type"] == "cuda" and fp8["compiled"] is True and fp8["precision"] == "fp8", fp8
    assert "precision: fp8, 24 of the model's 25 linear layers multiply in float8" in \
        (tmp_path / "fp8" / "train.log").read_text()
    assert fp8["final"]["test_bpb"] < 0.8 * fp8["unigram_test_bpb"], fp8
    # (bf16 alone drifts up to 6% between compiled and eager kernels: test_fsdp_compiles_its_blocks_... above)
    assert fp8["final"]["test_bpb"] == pytest.approx(bf16["final"]["test_bpb"], rel=0.1), (fp8, bf16)
    assert fp8["final"]["tokens_per_s"] > 0
