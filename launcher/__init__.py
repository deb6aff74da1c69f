"""launcher: train PyTorch recipes on a GPU list (single, DataParallel or DDP), locally or on SLURM.

The `launch` command is launcher.cli:main; launcher.run.run(cfg, run_dir) is the same thing as a function.
"""

__version__ = "0.1.0"
