"""The data wing: what feeds a step, whatever the recipe (docs/ARCHITECTURE.md has the map).

    placement.py    the epoch's order, each rank's shard, a split where it trains (on the GPU, streamed from
                    the host, token windows), the data path a recipe's `load` picks (Data)
    loader.py       a recipe's own (train, eval) Datasets through DataLoader workers (DatasetSplit)
    prefetch.py     host -> device copies on a side CUDA stream, a recipe's on_after_batch_transfer there
    slots.py        page-locked buffers shared with the DataLoader workers, for large batches
    augment.py      batched augmentation on the training device
    cache.py        decoded datasets kept under ~/.cache/launcher; where inductor's caches go (no torch)
    token_shards.py nanoGPT / llm.c token shards, read in place (numpy only)
    image_kernels.py one Triton kernel: a batch's crops resized, flipped and normalized on the GPU

Imports nothing from launcher.train, launcher.host or launcher.recipes (tests/unit/test_architecture.py).
"""
