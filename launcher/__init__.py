"""launcher: train PyTorch recipes on a GPU list (single process, DataParallel or DDP), locally or on SLURM.

Two wings and the data wing they share (docs/ARCHITECTURE.md has the map):

    launcher/host/     the `launch` command: config, plan, GPUs, process supervision, SLURM, sweeps.
                       Never imports torch at import time, so the launcher never starts CUDA.
    launcher/train/    what each worker process runs: the training loop and its parts.
    launcher/data/     what feeds a step, whatever the recipe: placement, loaders, prefetch, decoding, corpora.

and what both read: config.py (the typed schema), strategies/ (how devices share the work), spec.py
(what travels from the host to its workers), world.py, files.py, errors.py, failures.py, logs.py.
"""

__version__ = "0.2.0"
