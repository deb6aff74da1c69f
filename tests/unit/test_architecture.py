"""The house rules of docs/ARCHITECTURE.md, checked on the source:

- the host wing (and what it shares with workers) never imports torch when it is imported, so the
  launcher never starts CUDA and `launch --help`, bad input and dry runs stay fast;
- no import circles among launcher's modules (imports inside functions and for types counted);
- the strategies import nothing from the training wing;
- the wings meet only where the map says: the host starts the training wing through its entry point
  (launcher.train.worker), the training wing never imports the host wing;
- the data wing (launcher/data) imports nothing from the training wing, the host wing or the recipes (the
  loop, the recipes and the host use it, never the other way); the host reaches into it only for the parts
  it needs before any worker (the cache's folders), and what of it the launcher imports imports no torch;
- no strategy-name comparisons outside launcher/strategies: the loop and the host ask the strategy;
- a true | false | auto key (perf.compile, ...) is read against Toggle's members, never as a truth value
  (Toggle.false is truthy) nor compared with a string or a bool;
- fsdp's checkpoint writer process arms its parent-death signal before it imports torch.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import launcher

PACKAGE = Path(launcher.__file__).parent
RECIPES = PACKAGE.parent / "recipes"  # installed as launcher.recipes
SHARED = ["launcher", "launcher.config", "launcher.errors", "launcher.figures", "launcher.files", "launcher.integrity",
          "launcher.world", "launcher.spec", "launcher.logs", "launcher.failures", "launcher.bytecode", "launcher.heap",
          "launcher.strategies", "launcher.strategies.base", "launcher.strategies.single", "launcher.strategies.dp",
          "launcher.strategies.ddp"]
# Where the host wing may reach into the training wing: the workers' entry point, run in-process when
# launch joins a world torchrun or srun started, or handed to torch.distributed.elastic.
HOST_TO_TRAIN = {("launcher.host.spawn", "launcher.train.worker"), ("launcher.host.run_here", "launcher.train.worker")}
# What of the data wing the host imports: where the caches go (`launch doctor`, the inductor cache set up
# before any process imports torch).
HOST_TO_DATA = {"launcher.data", "launcher.data.cache"}
# The data wing's modules the launcher imports before any worker, itself or through the recipes' base and
# a recipe's `prepare` (the cache, the recipe interface's types, the checks of a folder, a corpus, token
# shards): no torch when imported.
DATA_WITHOUT_TORCH = ["launcher.data", "launcher.data.cache", "launcher.data.hooks", "launcher.data.folders",
                      "launcher.data.corpus", "launcher.data.token_shards"]


def _module_files() -> dict[str, Path]:
    files = {}
    for root, prefix in ((PACKAGE, "launcher"), (RECIPES, "launcher.recipes")):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if "hydra_plugins" in parts:
                continue
            files[".".join([prefix, *parts])] = path
    return files


MODULES = _module_files()


def host_modules() -> list[str]:
    return sorted(m for m in MODULES if m.startswith("launcher.host"))


def test_importing_the_host_wing_imports_no_torch():
    names = [*SHARED, *host_modules(), *DATA_WITHOUT_TORCH, "hydra_plugins.launcher_sweep"]
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], \
        "a host, shared or torch-free data module imports torch at import time"
    assert len(names) > 25  # the walk found the wing


def _imports(module: str, path: Path) -> set[str]:
    """launcher modules `module` imports anywhere in its body: inside functions and under TYPE_CHECKING too
    (an import made late, or for types only, still ties the two modules together)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_the_shard_writer_process_imports_torch_only_after_it_dies_with_its_rank():
    """fsdp's checkpoint writer process imports launcher.train.shard_writer to find `_serve`, which arms
    its parent-death signal and then imports torch: torch imported with the module (seconds) left a
    writer, and the resource tracker it holds, running that long after a kill of its rank."""
    code = ("import json, sys\nimport launcher.train.shard_writer\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    source = (PACKAGE / "train" / "shard_writer.py").read_text()
    serve = source[source.index("def _serve("):]
    assert serve.index("die_with_parent(signal.SIGKILL, parent)") < serve.index("import torch")


def test_no_import_circles():
    """Tarjan's strongly connected components; a package importing its own submodules is not a circle
    unless a submodule imports the package back."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w in _ancestors(v):
                continue  # `from launcher.x import y` inside launcher.x.z loads launcher.x first, by design
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_the_strategies_import_nothing_from_the_training_wing():
    """The training wing asks the strategies (for types, and for everything that depends on how devices
    share the work); the strategies never reach back: gradient sync is theirs (strategies/gradients.py),
    the compile function is handed in."""
    back = sorted((m, i) for m, deps in GRAPH.items() if m.startswith("launcher.strategies") for i in deps
                  if i.startswith("launcher.train"))
    assert not back, f"strategies importing the training wing: {back}"


def test_the_wings_meet_only_at_the_workers_entry_point():
    train_to_host = [(m, i) for m, deps in GRAPH.items() if m.startswith("launcher.train") for i in deps
                     if i.startswith("launcher.host")]
    assert not train_to_host, f"the training wing imports the host wing: {train_to_host}"
    host_to_train = {(m, i) for m, deps in GRAPH.items() if m.startswith("launcher.host") for i in deps
                     if i.startswith("launcher.train")}
    assert host_to_train <= HOST_TO_TRAIN, f"undeclared crossings: {host_to_train - HOST_TO_TRAIN}"
    shared_to_wings = [(m, i) for m in SHARED for i in GRAPH[m] if i.startswith("launcher.host")]
    assert not shared_to_wings, shared_to_wings


def test_the_data_wing_imports_nothing_from_the_training_wing_the_host_or_the_recipes():
    """launcher/data is what feeds a step for any recipe: the loop, the recipes and the host use it. A data
    module reaching back (a recipe's constant, the loop's timer) would tie a new data kind to one recipe."""
    back = sorted((m, i) for m, deps in GRAPH.items() if m.startswith("launcher.data") for i in deps
                  if i.startswith(("launcher.train", "launcher.host", "launcher.recipes")))
    assert not back, f"the data wing importing the training wing, the host or the recipes: {back}"
    assert "launcher.data.loader" in GRAPH and "launcher.data.placement" in GRAPH  # (the walk found the wing)


def test_the_host_imports_of_the_data_wing_only_what_it_needs_before_any_worker():
    reached = {i for m, deps in GRAPH.items() if m.startswith("launcher.host") for i in deps
               if i.startswith("launcher.data")}
    assert reached <= HOST_TO_DATA, f"the host imports more of the data wing: {sorted(reached - HOST_TO_DATA)}"
    assert set(HOST_TO_DATA) <= set(DATA_WITHOUT_TORCH)


def test_true_false_auto_keys_are_compared_with_toggles_only():
    """`if perf.cuda_graph:` held for False before the keys were an Enum; with Toggle it holds for every value."""
    from launcher.config import PerfConfig

    keys = set(PerfConfig.TOGGLES)

    def toggle_key(node: ast.AST) -> bool:  # perf.KEY, cfg.perf.KEY, self.cfg.perf.KEY
        owner = getattr(node, "value", None)
        return (isinstance(node, ast.Attribute) and node.attr in keys
                and (getattr(owner, "attr", None) == "perf" or getattr(owner, "id", None) == "perf"))

    found = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                wrong = any(toggle_key(o) for o in operands) and any(isinstance(o, (ast.Constant, ast.Tuple))
                                                                     for o in operands)
            else:  # as a truth value
                tested = {ast.If: "test", ast.IfExp: "test", ast.While: "test", ast.Assert: "test",
                          ast.UnaryOp: "operand", ast.BoolOp: "values", ast.Call: "args"}.get(type(node))
                value = getattr(node, tested, None) if tested else None
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) != "bool":
                    value = None
                wrong = any(toggle_key(v) for v in (value if isinstance(value, list) else [value]))
            if wrong:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_no_strategy_name_is_compared_outside_the_strategies():
    """`if strategy == "ddp"` scattered over the code is what made adding a strategy touch ten files."""
    names = {"single", "dp", "ddp"}  # ("auto" is also a word of gpus= and data.placement=)
    found = []
    for module, path in MODULES.items():
        if module.startswith("launcher.strategies"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            literals = {c.value for o in operands for c in ast.walk(o)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if literals & names:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_loop_reads_in_one_sitting():
    """launcher/train/loop.py wires the parts, top to bottom (setup -> resume -> warm-up -> epochs -> results);
    each responsibility lives in a module named for it (docs/ARCHITECTURE.md). A loop past this length has
    taken one back in: move it out to its module instead."""
    lines = (PACKAGE / "train" / "loop.py").read_text().count("\n")
    assert lines < 550, f"launcher/train/loop.py has {lines} lines; move a responsibility out to its own module"
