#!/usr/bin/env bash
# torchtitan itself (v0.2.2, the release that pins a torch 2.11 nightly) on Llama 3.1 8B, for issue 60's
# comparison with bench/llama.sh 8b: run on the device machine (2 GPUs of one host) from the repository root,
# with .tt carried; COMMIT=<short hash> names the result file.
#
#   COMMIT=abc1234 bash bench/torchtitan.sh 8b    # torchtitan's "8B" flavor (32 x 4096, 32 heads, 8 kv heads,
#                                                  # FFN 14,336, vocabulary 128,256 untied, rope theta 500,000),
#                                                  # FSDP2 over 2 GPUs, torch.compile (model and loss), op-level
#                                                  # selective checkpointing, 2 x 8,192 tokens a GPU, bf16 params /
#                                                  # fp32 reduce, fused AdamW, 15 steps, tps and memory every step
#
# .tt (ignored by git: echo /.tt/ >> .git/info/exclude) is built here, once, from the repository root:
#   python3 bench/torchtitan/make_assets.py .tt      # tokenizer/: a byte-level BPE of exactly 128,256 ids (Llama
#                                                    # 3's is gated; only its size matters); c4_local/data.json:
#                                                    # random words, read by torchtitan's `c4_test` loader
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .tt/whl torchtitan==0.2.2 \
#       datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchdata==0.11.0 tyro==1.0.17 \
#       docstring-parser==0.18.0 typeguard==4.6.1           # what the device's image lacks (installed --no-deps)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .tt/whl-alt datasets==4.8.5
# The job is bench/torchtitan/llama3_8b_2gpu.toml; bench/torchtitan/check.py runs once after the install
# (versions, imports, the tokenizer, one sample); datasets 4.8.5 replaces 5.2.0 only if that check fails.
# Nothing is fetched: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE. The losses say nothing; only speed and memory do.
# The same allocator setting as bench/llama.sh (expandable segments, as torchtitan's run_train.sh sets it).
# Extra arguments after the size go to torchtitan's command line (e.g. --training.steps 20). Its Float8, as
# BENCHMARKS.md ran it beside perf.precision=fp8 (torchao from .whl installed into /tmp/tt-site first):
#   --model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
size=${1:-8b}
shift || true
[ "$size" = 8b ] || { echo "usage: COMMIT=<hash> bash bench/torchtitan.sh 8b [torchtitan args]" >&2; exit 2; }
log=$OUT/torchtitan-$size-2xh200-$commit.txt
warmup=${WARMUP:-5}  # steps left out of the median (the first holds the compile)

export PYTHONPATH=/tmp/tt-site PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=/tmp/tt-hf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device's rule: no multicast
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tt-site "$@"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
if [ ! -e /tmp/tt-site/.carried ]; then
    pipi .tt/whl/*.whl || exit 1
    # bench/torchtitan/check.py: versions, imports, the tokenizer, one sample through its loader (seconds, no GPU).
    # datasets 5.2.0 wants pyarrow >= 24 and huggingface_hub >= 1.31: should it fail beside the image's own
    # packages, datasets 4.8.5 (.tt/whl-alt) instead
    if ! python3 bench/torchtitan/check.py 2>&1 | tee -a "$log"; then
        echo "datasets 5.2.0 failed the check: trying 4.8.5" | tee -a "$log"
        rm -rf /tmp/tt-site/datasets /tmp/tt-site/datasets-*.dist-info
        pipi .tt/whl-alt/*.whl || exit 1
        python3 bench/torchtitan/check.py 2>&1 | tee -a "$log" || exit 1
    fi
    touch /tmp/tt-site/.carried
fi

rm -rf /tmp/tt-out
start=$(date +%s)
# --role rank --tee 3: every line of each rank prefixed [rank0]: / [rank1]:
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node=2 --role rank --tee 3 \
    -m torchtitan.train --job.config_file bench/torchtitan/llama3_8b_2gpu.toml "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "torchtitan exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"

# One JSON line from the log: per rank, the median over the steps after the warm-up of torchtitan's own tps
# (tokens/s a GPU), its peak reserved memory (GiB, the log line's figure) and its MFU (against 989 TFLOP/s for an
# H200, torchtitan's figure; its FLOPs count attention over the full 8,192 positions, not half). The slower
# rank's tps; peak_mem_gib the largest reserved over the timed steps; max active from TensorBoard where present.
python3 - "$log" "$rc" "$warmup" <<'EOF' | tee -a "$log"
import glob, json, re, statistics, sys
log, rc, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pat = re.compile(r"\[rank(\d+)\]:.*step:\s*(\d+)\s+loss:\s*([\d.naif+-]+).*memory:\s*([\d.]+)GiB\(([\d.]+)%\)"
                 r".*tps:\s*([\d,]+).*tflops:\s*([\d.,]+).*mfu:\s*([\d.]+)%")
steps = {}
for line in open(log, errors="replace"):
    m = pat.search(line)
    if m:
        r, s = int(m[1]), int(m[2])
        steps.setdefault(r, {})[s] = dict(loss=float(m[3]), mem=float(m[4]), tps=float(m[6].replace(",", "")),
                                          tflops=float(m[7].replace(",", "")), mfu=float(m[8]))
out = {"what": "torchtitan", "version": "0.2.2", "exit": rc, "warmup_steps": warmup}
text = open(log, errors="replace").read()
for key, rx, conv in [("model", r"\[rank0\]:.*Model (\S+ \S+) size: ([\d,]+) total parameters", None),
                      ("local_batch", r"\[rank0\]:.*local batch size (\d+)", int),
                      ("global_batch", r"\[rank0\]:.*global batch size (\d+)", int),
                      ("seq_len", r"\[rank0\]:.*sequence length (\d+)", int)]:
    m = re.search(rx, text)
    if m and key == "model":
        out.update(model=m[1], params=int(m[2].replace(",", "")))
    elif m:
        out[key] = conv(m[1])
per_rank = {}
for r, d in sorted(steps.items()):
    timed = [d[s] for s in sorted(d) if s > warmup]
    if timed:
        per_rank[r] = dict(steps=len(timed), tps=statistics.median(x["tps"] for x in timed),
                           mfu=statistics.median(x["mfu"] for x in timed) / 100,
                           mem=max(x["mem"] for x in timed), last_loss=timed[-1]["loss"])
if per_rank:
    slow = min(per_rank.values(), key=lambda v: v["tps"])
    out.update(tokens_per_s_per_gpu=round(slow["tps"]), mfu=round(slow["mfu"], 4),
               peak_mem_gib=max(v["mem"] for v in per_rank.values()), timed_steps=slow["steps"],
               per_rank={str(r): {k: (round(v, 4) if isinstance(v, float) else v) for k, v in pr.items()}
                         for r, pr in per_rank.items()},
               first_steps_tps=[round(steps[0][s]["tps"]) for s in sorted(steps.get(0, {}))][:warmup])
    try:  # max active (allocated) GiB, rank 0, from torchtitan's TensorBoard scalars
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(glob.glob("/tmp/tt-out/tb/*")[0]); acc.Reload()
        ev = [e for e in acc.Scalars("memory/max_active(GiB)") if e.step > warmup]
        out["peak_active_gib_rank0"] = round(max(e.value for e in ev), 2)
    except Exception as e:  # noqa: BLE001
        out["peak_active_gib_rank0"] = f"n/a: {type(e).__name__}"
else:
    out["error"] = "no step lines after the warm-up in the log"
print(json.dumps(out))
EOF
exit "$rc"
