"""Builds torchtitan's offline inputs for bench/torchtitan.sh in .tt/ (run here from the repository root):
- tokenizer/tokenizer.json + tokenizer_config.json: a byte-level BPE of exactly 128,256 ids laid out like Llama 3's
  (128,000 ordinary tokens: the 256 byte symbols, all 65,536 two-symbol pairs, then 62,208 three-symbol tokens;
  then 256 special tokens, <|begin_of_text|> = 128000 and <|end_of_text|> = 128001), so nothing about the model
  changes; the merges are synthetic, the text it gives means nothing. Only speed is measured.
- c4_local/data.json: JSON lines {"text": ...} of random words, read by torchtitan's `c4_test` loader
  (datasets' json builder on a local folder), re-looped as training needs.
"""
import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

out = sys.argv[1] if len(sys.argv) > 1 else ".tt"
alphabet = pre_tokenizers.ByteLevel.alphabet()
alphabet.sort(key=lambda c: ord(c))
assert len(alphabet) == 256
vocab = {c: i for i, c in enumerate(alphabet)}
merges = []
for a in alphabet:
    for b in alphabet:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
pairs = [a + b for a in alphabet for b in alphabet]
for p in pairs:
    for c in alphabet:
        if len(vocab) == 128000:
            break
        vocab[p + c] = len(vocab)
        merges.append((p, c))
    if len(vocab) == 128000:
        break
assert len(vocab) == 128000
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
tok.add_special_tokens(specials)
assert tok.get_vocab_size() == 128256, tok.get_vocab_size()
assert tok.token_to_id("<|begin_of_text|>") == 128000 and tok.token_to_id("<|end_of_text|>") == 128001
os.makedirs(f"{out}/tokenizer", exist_ok=True)
tok.save(f"{out}/tokenizer/tokenizer.json")
with open(f"{out}/tokenizer/tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
               "add_eos_token": True, "model_max_length": 131072,
               "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)

rng = random.Random(0)
letters = "abcdefghijklmnopqrstuvwxyz"
words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(5000)]
os.makedirs(f"{out}/c4_local", exist_ok=True)
with open(f"{out}/c4_local/data.json", "w") as f:
    for _ in range(400):  # ~400 documents of ~450 words: ~1 MB
        text = " ".join(rng.choice(words) for _ in range(rng.randint(300, 600))) + "."
        f.write(json.dumps({"text": text}) + "\n")
