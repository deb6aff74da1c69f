"""bench/torchtitan.sh's check before the run (seconds, no GPU): the carried packages import beside the
device's own, the tokenizer has 128,256 ids, and torchtitan's c4_test loader reads .tt/c4_local offline."""
import importlib.metadata as md
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"


print(" ".join(f"{n} {v(n)}" for n in ["torch", "triton", "torchtitan", "datasets", "torchdata", "tyro",
                                       "tokenizers", "huggingface_hub", "fsspec", "pyarrow", "typing_extensions"]))
import datasets  # noqa: E402
import torchtitan.train  # noqa: E402,F401
from torchtitan.components.tokenizer import HuggingFaceTokenizer  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset  # noqa: E402

datasets.disable_progress_bars()
tok = HuggingFaceTokenizer(".tt/tokenizer")
assert tok.get_vocab_size() == 128256, tok.get_vocab_size()
x, y = next(iter(HuggingFaceTextDataset("c4_test", ".tt/c4_local", tok, seq_len=8192, dp_rank=0, dp_world_size=2,
                                        infinite=True)))
assert x["input"].shape == y.shape == (8192,)
print(f"check ok: datasets {datasets.__version__}, tokenizer {tok.get_vocab_size()} ids, a sample of {y.shape[0]}")
