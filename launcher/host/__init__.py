"""The host wing: everything the `launch` process does before, around and after the workers.

    cli.py          the `launch` command (Hydra entry point) and its exit code
    compose.py      what Hydra needs before composing (schemas, resolvers, a user's recipe); typed config
    hydra_errors.py Hydra's and OmegaConf's errors as one line
    launch.py       one launch: check the config, hand it to its backend
    backends/       where the workers run: local (run_here.py) or slurm (submitit)
    run_here.py     one launch on this host: plan, spawn or join, report
    gpus.py         THE reading of `gpus=`, NVML
    plan.py         config -> Plan (devices, strategy, worker env)
    spawn.py        workers on torch.distributed.elastic, root-cause reports
    script.py       script=: a user's torchrun-style script, supervised
    sweep*.py, packing.py, hydra_plugins/   `launch -m`: launch's Hydra launcher, runs side by side, summary
    doctor.py       `launch doctor`

No module here imports torch when it is imported (tests/unit/test_architecture.py checks it): the
launcher never starts CUDA, and `launch --help`, bad input and dry runs stay fast. Functions that need
torch (the elastic agent, a recipe's data preparation) import it when they run.
"""
