"""Bad input: one clear line on stderr (what was wrong, what is allowed, what to type), exit code 2,
no traceback, and no run dir left behind. These start the CLI but never a worker."""

import pytest

CASES = [
    ("epochs=0", "epochs=0 is not valid: must be an integer >= 1"),
    ("epochs=abc", "epochs=abc is not valid: must be an integer"),
    ("strategy=fsdp strategy.min_unit_params=1e8", "strategy.min_unit_params=100000000.0 is not valid: must be an "
                                                  "integer, written whole (e.g. launch strategy.min_unit_params="
                                                  "100000000)"),
    ("epoch=3", "unknown key 'epoch': did you mean epochs?"),
    # a leading + on a key no schema has: Hydra takes it, the typed config would drop it and train the defaults
    ("+epoch=3", "+epoch=... is not valid: there is no key epoch to add (did you mean epochs?"),
    ("+recipe.hiden=3", "there is no key recipe.hiden to add (known keys: recipe.name"),
    ("recipe.modle=cnn", "did you mean recipe.model?"),
    ("recipe=imagenet", "recipe=imagenet is not valid: choose one of cifar10, cifar10_fast, digits"),
    ("recipe=digts", "(did you mean recipe=digits?)"),
    ("compile=false", "unknown key 'compile': did you mean perf.compile?"),  # (a section's key without it)
    ("recipe=text width=64", "unknown key 'width': did you mean recipe.width?"),
    ("decay=cosine", "unknown key 'decay': did you mean optim.decay?"),  # (a key of a group's options)
    # a section's exact key comes before a top-level look-alike (it said args, gpus, batch_size, epochs)
    ("recipe=text layers=2", "unknown key 'layers': did you mean recipe.layers?"),
    ("recipe=text vocab_size=100", "unknown key 'vocab_size': did you mean recipe.vocab_size?"),
    ("warmup_epochs=1", "unknown key 'warmup_epochs': did you mean optim.warmup_epochs?"),
    ("optim.lr=0.1", "unknown key 'optim.lr': did you mean lr?"),  # (a top-level key under a section)
    ("recipe=text n_layer=2", "unknown key 'n_layer': did you mean recipe.layers?"),  # (nanoGPT's names)
    ("recipe=text model=llama", "model=llama is not valid: `model` is a network from config, its keys under it "
                                "(e.g. launch model._target_=torchvision.models.resnet18); the recipe's own network is "
                                "recipe.model (did you mean recipe.model=llama?)"),
    ("max_iters=5000", "unknown key 'max_iters': did you mean epochs (launch counts epochs, not iterations)?"),
    ("recipe=my_recipe.py", "recipe=my_recipe.py is not valid: a recipe is named as a module, without .py: "
                            "recipe=my_recipe imports my_recipe.py"),
    ("optim=adamm", "optim=adamm is not valid: choose one of adamw, muon, sgd (did you mean optim=adamw?)"),
    ("strategy=fast", "strategy=fast is not valid: choose one of auto, ddp, dp, fsdp, single"),
    ("gpus=[0]", "gpus=[0] is not valid: GPU 0 does not exist: no GPU is visible"),
    ("gpus=2", "gpus=2 is not valid: asks for 2 GPUs but no GPU is visible"),
    ("gpus=all", "gpus=all is not valid: no GPU is visible"),
    ("gpus=[-1]", "ids cannot be negative"),
    ("gpus=0", "ambiguous: write gpus=[0] for GPU 0 or gpus=[] for CPU"),
    ("gpus=[a]", "ids must be integers"),
    ("gpus=0,1", "gpus=0,1 is ambiguous: write gpus=[0,1] for a list"),
    ("gpus=[0,1", "cannot parse 'gpus=[0,1'"),
    ("recipe=imagefolder data.root=~/x", "a path starting with ~ is quoted: data.root='~/x' (launch expands ~)"),
    ("lr=-1", "lr=-1.0 is not valid: must be a finite number > 0"),
    ("strategy=dp gpus=[]", "DataParallel needs GPUs"),
    ("gpus=[] strategy=ddp nprocs=2 batch_size=63", "must split evenly over 2 ranks (e.g. launch batch_size=62)"),
    ("recipe.model=vgg", "recipe.model=vgg is not valid: choose one of cnn (e.g. launch recipe.model=cnn)"),
    ("recipe=cifar10 recipe.model=vgg", "recipe.model=vgg is not valid: choose one of airbench, airbench94, resnet18"),
    ("resume=/no/such/run", "resume=/no/such/run is not valid"),
    ("eval /no/such/run", "launch: eval /no/such/run is not valid: /no/such/run does not exist; "
     "give a run dir that holds checkpoints/last.pt, a .pt file, or latest (e.g. launch eval latest)"),
    ("eval latest", "launch: eval latest is not valid: no checkpoint under"),  # (was "launch eval=latest")
    ("recipe=cifar10 data.download=false data.root=/no/data", "CIFAR-10 not found: put cifar-10-python.tar.gz"),
    ("train", "'train' is not a command or a key=value override"),
    # a key and its value apart, or with dashes (torchrun's and argparse's habit): the key=value to type
    ("epochs 3", "'epochs' is not a command or a key=value override (e.g. launch epochs=3); commands: doctor, runs, "
     "eval RUN_DIR, export RUN_DIR"),
    ("--epochs=3", "--epochs=3 is not an option: settings are key=value, without dashes (e.g. launch epochs=3)"),
    ("--batch-size 64", "--batch-size 64 is not an option: settings are key=value, without dashes (e.g. launch "
     "batch_size=64)"),  # (was argparse's usage block)
    # a Hugging Face model class without its config: refused before any worker (was a worker's TypeError, its run
    # dir left behind, and an example naming a torchvision model)
    ("recipe=text model._target_=transformers.LlamaForCausalLM", "model._target_=transformers.LlamaForCausalLM is not "
     "valid: it needs config, which the model section does not give (e.g. launch "
     "model._target_=transformers.LlamaForCausalLM +model.config._target_=transformers.LlamaConfig)"),
    # a torchrun user's habits: the script first, its flags, a recipe's key beside a script (it did nothing)
    ("train.py", "'train.py' is not a command or a key=value override (e.g. launch script=train.py)"),
    ("--nproc-per-node=2", "--nproc-per-node=2 is not an option: settings are key=value, without dashes (e.g. launch "
     "nprocs=2)"),
    ("nproc_per_node=2", "unknown key 'nproc_per_node': did you mean nprocs?"),
    ("script=train.py gpus=[] epochs=2", "epochs=2 does nothing for script=train.py: a script reads its own "
     "arguments; give it as +args.epochs=2 (the script gets --epochs 2), or after --: launch script=train.py -- "
     "--epochs 2"),
    ("script=train.py --epochs 2", "--epochs 2 is not an option of launch: a script's own arguments go after --: "
     "launch script=train.py -- --epochs 2"),
    ("data.placement=gpu gpus=[]", "data.placement=gpu is not valid: this run trains on the CPU"),
    ("data.placement=disk", "data.placement=disk is not valid: choose one of auto, gpu, host"),
    ("recipe=cifar10 recipe.tta=3", "recipe.tta=3 is not valid: must be an integer from 0 to 2"),
    ("recipe.tta=1", "unknown key 'recipe.tta'"),  # digits has no test-time augmentation
    ("recipe.flip=sometimes", "recipe.flip=sometimes is not valid: choose one of random, alternating, none"),
    ("optim=lion", "optim=lion is not valid: choose one of adamw, muon, sgd"),
    ("optim=adamw optim.momentum=0.5", "unknown key 'optim.momentum': it is an option of optim=muon or optim=sgd, "
     "not of optim=adamw; choose one"),
    ("optim=muon", "optim=muon is not valid: recipe=digits's model cnn does not say which of its parameters are "
     "filter matrices"),  # (was found by the worker, after the run dir was made)
    ("recipe=cifar10 recipe.model=resnet18 optim=muon", "recipe=cifar10's model resnet18 does not say"),
    ("strategy=single strategy.timeout_s=5", "unknown key 'strategy.timeout_s'"),
    ("script=train.py args.lr=0.1", "args.* keys are your own; add a new one with a leading + (e.g. launch +args.lr="),
    ("nodes=2", "nodes=2 is not valid: several machines meet at a rendezvous: add rdzv=HOST:PORT"),
    ("strategy=ddp strategy.bucket_cap=5", "did you mean strategy.bucket_cap_mb?"),
    # another option of the group has the key: say which, not the nearest spelling of this option's keys
    ("strategy.min_unit_params=0", "unknown key 'strategy.min_unit_params': it is an option of strategy=fsdp, not "
     "of strategy=auto; choose it (e.g. launch strategy=fsdp strategy.min_unit_params=...)"),
    # a tracker's section is there only when log picks it: its keys are still known, and a section's name too
    ("log=[mlflow] log.mlflow.trackng_uri=x", "unknown key 'log.mlflow.trackng_uri': did you mean "
     "log.mlflow.tracking_uri? known keys: log.mlflow.tracking_uri, log.mlflow.experiment"),
    ("log=[mlflow] log.mlflw.tracking_uri=x", "unknown key 'log.mlflw.tracking_uri': did you mean "
     "log.mlflow.tracking_uri?"),
    ("progress=bars", "progress=bars is not valid: choose one of auto, bar, lines (did you mean progress=bar?)"),
    # a short value one character off is still a guess; YAML's true is said as typed, not as Python's True
    ("recipe=text recipe.size=9b", "recipe.size=9b is not valid: choose one of none, debug, 1b, 3b, 8b (did you "
     "mean recipe.size=8b?)"),
    ("perf.activation_checkpointing=true", "perf.activation_checkpointing=true is not valid: choose one of none, "
     "full, selective (did you mean perf.activation_checkpointing=full?)"),  # (it offered none: checkpointing off)
    ("recipe=text recipe.width=256 recipe.heads=6", "recipe.heads=6 is not valid: the width (256) must be a multiple "
     "of the heads (e.g. launch recipe.heads=4)"),
    ("perf.cuda_graph=yes", "perf.cuda_graph=yes is not valid: choose true, false or auto (replay the step as a CUDA "
     "graph where that is measured faster) (e.g. launch perf.cuda_graph=auto)"),
    ("evl.every=2", "unknown key 'evl.every': did you mean eval.every?"),  # (listed Config's keys as evl.*)
    ("perf.precision=fp4", "perf.precision=fp4 is not valid: choose one of auto, bf16, fp16, fp32, fp8"),
    # a list for a choice: said as the choices (was OmegaConf's template, "Value $VALUE ($VALUE_TYPE) ...")
    ("perf.precision=[fp8]", "perf.precision=[fp8] is not valid: give one of auto, bf16, fp16, fp32, fp8, a single "
     "word (e.g. launch perf.precision=auto)"),
    ("perf.precision=fp8", "perf.precision=fp8 is not valid: float8 matmuls run on GPUs (compute capability 8.9 or "
     "later: H100, H200, L4, L40S, B200); this run trains on the CPU (e.g. launch perf.precision=auto)"),
    ("gpus=ALL", "gpus=ALL is not valid: no GPU is visible"),
    ("gpus=cpu strategy=dp", "DataParallel needs GPUs"),
    ("fault.kind=explode", "fault.kind=explode is not valid: choose one of raise, exit, hang, kill, nan, oom"),
    ("script=", "script= is not valid: give the path of your script, or leave script out"),  # not: train digits
    ("seed=18446744073709551615", "seed=18446744073709551615 is not valid: must be an integer from 0 to 2147483647"),
    ("epochs=99999999999999999999", "must be an integer from 1 to 2147483647"),
    ("strategy=ddp strategy.timeout_s=99999999999999999", "strategy.timeout_s=99999999999999999 is not valid"),
    ("eval.every=99999999999999999999", "eval.every=99999999999999999999 is not valid"),
    ("recipe.translate=20", "recipe.translate=20 is not valid: must be an integer from 0 to 7"),  # digits: 8 px
    ("recipe.translate=8", "recipe.translate=8 is not valid: must be an integer from 0 to 7"),  # was a traceback
    ("recipe=nowhere.my_recipe", "recipe=nowhere.my_recipe is not valid: choose one of cifar10, cifar10_fast, digits, "
     "imagefolder, text, or a module"),
    # a figure the recipe cannot have: refused before any worker (was found after the first epoch had trained)
    ("early_stop.metric=test_mse", "early_stop.metric=test_mse is not valid: names no figure of this run's epochs"),
    # fsdp's older key for full checkpointing beside a mode that is not full (it ran selective, unsaid)
    ("recipe=text strategy=fsdp strategy.activation_checkpointing=true perf.activation_checkpointing=selective",
     "strategy.activation_checkpointing=true is not valid: it is the older spelling of "
     "perf.activation_checkpointing=full, which perf.activation_checkpointing=selective contradicts"),
    # a model whose weights, gradients and AdamW state alone outgrow the machine: refused before any worker
    ("recipe=text recipe.size=8b recipe.layers=320 gpus=[]", "recipe=text: the model's 69.80B parameters need "
     "~1040 GiB a rank for their weights, gradients and adamw's 2 state tensors in fp32 (16 bytes a parameter), "
     "before any activation; this machine has"),
]


@pytest.mark.parametrize("args, expected", CASES, ids=[c[0] for c in CASES])
def test_one_clear_line_and_exit_2(launch, args, expected):
    result = launch(*args.split(), timeout=60)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("launch: ") and expected in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert not list(result.cwd.glob("outputs/*/*")), "a refused launch must not leave a run dir"


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_an_inductor_cache_dir_torch_cannot_use_is_one_line_before_any_process_imports_torch(launch, tmp_path,
                                                                                             sweep):
    """torch fails to import its compiler (a traceback from the forkserver, then EOFError) when
    TORCHINDUCTOR_CACHE_DIR cannot be made; launch says so first. A sweep refuses once, not per run."""
    from tests.conftest import clean_env

    (tmp_path / "not-a-folder").write_text("x")
    env = {**clean_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "not-a-folder")}
    args = ("-m", "gpus=[]", "lr=0.1,0.2") if sweep else ("gpus=[]",)
    result = launch(*args, timeout=60, env=env)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("launch: TORCHINDUCTOR_CACHE_DIR="), result.output
    assert "it is a file, not a folder" in lines[0] and "unset TORCHINDUCTOR_CACHE_DIR" in lines[0]
    assert "Traceback" not in result.output and "EOFError" not in result.output
    assert not list(result.cwd.glob("multirun/*/*")) and not list(result.cwd.glob("outputs/*/*"))


def test_doctor_rejects_arguments(launch):
    result = launch("doctor", "--verbose")
    assert result.returncode == 2 and "doctor takes no arguments" in result.stderr


def test_the_launch_command_is_installed():
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    beside = Path(sys.executable).parent / "launch"  # where pip puts scripts of this interpreter's packages
    exe = str(beside) if beside.exists() else shutil.which("launch")
    assert exe, "`pip install -e .` should put `launch` on PATH"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "launch recipe=cifar10 gpus=[0,1]" in out.stdout
    assert "strategy: auto, ddp, dp, fsdp, single" in out.stdout and "schema/" not in out.stdout


def test_version_names_launch_and_torch(launch):
    import launcher

    result = launch("--version", timeout=60)
    assert result.returncode == 0 and result.stdout.startswith(f"launch {launcher.__version__} (torch ")


def test_python_dash_m_launcher_is_the_launch_command(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "launcher", "--help"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0 and "launch: train a PyTorch recipe" in out.stdout


def test_help_on_a_users_recipe_shows_its_keys_without_running_its_module(launch, tmp_path):
    """Importing a module runs it: `--help` reads the recipe's schema from its source instead."""
    import shutil
    from pathlib import Path

    shutil.copytree(Path(__file__).parents[2] / "examples" / "my_pkg", tmp_path / "my_pkg")
    with open(tmp_path / "my_pkg" / "my_recipe.py", "a") as f:
        f.write("\nopen('MODULE_RAN', 'w').write('imported')\n")
    result = launch("recipe=my_pkg.my_recipe", "recipe.hidden=8", "--help", timeout=60)
    assert result.returncode == 0, result.output
    assert "  name: my_pkg.my_recipe\n  model: mlp\n  hidden: 8" in result.stdout
    assert not (tmp_path / "MODULE_RAN").exists()
    ran = launch("recipe=my_pkg.my_recipe", "--cfg", "job", timeout=60)  # composing for real imports it
    assert ran.returncode == 0 and (tmp_path / "MODULE_RAN").exists()


def test_a_shared_checkpoint_naming_code_is_refused_by_eval_and_resume_until_the_user_types_it(launch, tmp_path):
    """A checkpoint from elsewhere (its seal removed) whose config builds the network with
    shutil.copyfile(bait, victim): `launch eval` and `resume=` overwrote the victim before the 'not an
    nn.Module' check. Now one line, exit 2, before any worker, the victim untouched (typed, it goes ahead:
    tests/unit/test_checkpoint_trust.py)."""
    import torch

    victim, bait = tmp_path / "victim.txt", tmp_path / "bait.txt"
    victim.write_text("mine")
    bait.write_text("theirs")
    run = tmp_path / "shared-run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"net_state_dict": {}, "epoch": 1, "history": [],
                "config": {"recipe": {"name": "digits", "model": "cnn"}, "optim": {"name": "sgd"},
                           "model": {"_target_": "shutil.copyfile", "src": str(bait), "dst": str(victim)}}},
               run / "checkpoints" / "last.pt")
    for args in (("eval", str(run), "gpus=[]"), (f"resume={run}", "gpus=[]", "epochs=3")):
        result = launch(*args, timeout=120)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1, result.output
        assert lines[0] == (f"launch: {'eval ' if args[0] == 'eval' else 'resume='}{run}'s "
                            "checkpoint names model._target_=shutil.copyfile, code that launch runs only with your "
                            "consent: it was not written by a run of yours (it carries no seal); to run it, add "
                            "model._target_=shutil.copyfile"), lines[0]
        assert victim.read_text() == "mine" and not list(tmp_path.glob("outputs/*/*"))


def test_a_sweep_objective_that_names_no_figure_of_its_runs_is_one_line_before_any_run(launch, tmp_path):
    """`launch -m ... sweep.objective=test_rmsee` (a typo) trained every run and exited 0 with an empty column
    and no best run: regression.py lists its figures, so the sweep is refused before it starts."""
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).parents[2] / "examples" / "regression.py", tmp_path)
    result = launch("-m", "recipe=regression", "recipe.hidden=8,16", "gpus=[]", "epochs=1", "data.workers=0",
                    "sweep.objective=test_rmsee", timeout=240)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("launch: sweep.objective=test_rmsee is not valid: names no figure "
                                                   "of this run's epochs; they are loss, test_mse, test_rmse"), lines
    assert "(e.g. launch sweep.objective=test_rmse)" in lines[0] and "Traceback" not in result.output
    assert not list(tmp_path.glob("multirun/**/results.json")) and "epoch 1/1" not in result.output


def test_a_sweep_with_an_fp8_run_on_the_cpu_is_one_line_before_any_run(launch, tmp_path):
    """`launch -m perf.precision=fp8,bf16 gpus=[]`: the fp8 run cannot run on the CPU, so the sweep is refused
    before its first run (the bf16 run trained on while the fp8 run failed inside the sweep)."""
    result = launch("-m", "perf.precision=fp8,bf16", "gpus=[]", "epochs=1", timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("launch: perf.precision=fp8 is not valid: float8 matmuls run on GPUs"), lines
    assert "[sweep run 0: perf.precision=fp8 gpus=[] epochs=1]" in lines[0], lines
    assert "sweep: job" not in result.output and not list(tmp_path.glob("multirun/**/results.json"))
