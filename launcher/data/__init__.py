"""The data wing: what feeds a step, whatever the recipe (docs/ARCHITECTURE.md has the map).

    hooks.py        what the data path takes from a recipe: what `load` returns (Splits, TokenSplits, or
                    Datasets) and its data hooks (collate, on_after_batch_transfer; Recipe inherits them)
    placement.py    the epoch's order, each rank's shard, a split where it trains (on the GPU, streamed from
                    the host, token windows): Data
    loader.py       a recipe's own (train, eval) Datasets through DataLoader workers (DatasetSplit); feeds a
                    Dataset's decode trial the batches' times and the steps' pace
    prefetch.py     host -> device copies on a side CUDA stream, a recipe's on_after_batch_transfer there
    pace.py         the training steps' own times (StepPace), which the loop's StepClock fills
    slots.py        page-locked buffers shared with the DataLoader workers, for large batches
    augment.py      batched augmentation on the training device
    cache.py        decoded datasets kept under ~/.cache/launcher; where inductor's caches go (no torch)
    folders.py      a folder of classes (the ImageNet layout), scanned and checked before any worker (no torch)
    images.py       crops drawn per sample, decoded on the CPU or handed over for the GPU; the Dataset
                    (ImageFolderSplit) and its collate
    gpu_decode.py   JPEGs decoded on the GPU (nvImageCodec, nvJPEG), the batch cropped, resized, normalized
    image_kernels.py one Triton kernel: a batch's crops resized, flipped and normalized on the GPU
    decode_trial.py workers or GPU, per sample (SharedDecode), and data.decode=auto's measured choice (DecodeTrial)
    corpus.py       a text corpus as two byte streams, built once and memory-mapped (numpy only)
    token_shards.py nanoGPT / llm.c token shards, read in place (numpy only)

Imports nothing from launcher.train, launcher.host or launcher.recipes (tests/unit/test_architecture.py).
"""
