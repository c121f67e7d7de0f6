"""The package's import graph: no cycles (function-level imports included), and the model files stay pure.

Every `import`/`from ... import` statement anywhere in a module (top level, functions, methods)
is an edge; so is an import through a string: `importlib.import_module("engram.x")` / `__import__`, and any
"engram.x.y:Name" target (what `importlib` or an entry-point-style registry resolves). Importing
`engram.pkg.mod` from outside `pkg` also runs `engram/pkg/__init__.py`, so it is an edge to the subpackage too
(the root package `engram` is left out: every module lives under it).
"""

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "engram"
ROOTS = (SRC, SRC.parent / "engram_experiments")  # the library, and its experiments beside it
TOP = ("engram", "engram_experiments")


def _module_name(path: Path) -> str:
    root = next(r for r in ROOTS if path.is_relative_to(r))
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def _sources() -> dict[str, tuple[str, bool]]:
    """{module name: (its source, whether it is a package's __init__)} of both packages."""
    return {_module_name(p): (p.read_text(), p.name == "__init__.py") for r in ROOTS for p in r.rglob("*.py")}


TARGET = re.compile(r"engram(_experiments)?(\.\w+)*:\w+")  # "engram.pkg.mod:Name", "engram_experiments.mod:Name"


def _ours(name: str) -> bool:
    return name.split(".")[0] in TOP


def _string_imports(tree: ast.AST) -> list[str]:
    """Modules a tree imports through strings: `import_module("engram...")`, `__import__("engram...")` and
    "engram.mod:Name" targets."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            arg = node.args[0].value
            if fname in ("import_module", "__import__") and isinstance(arg, str) and _ours(arg):
                out.append(arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and TARGET.fullmatch(node.value):
            out.append(node.value.split(":")[0])
    return out


def _imports(name: str, tree: ast.AST, is_package: bool) -> list[tuple[str, str | None, int]]:
    """(module path, imported name or None, line) of every import in a module's tree, relative ones resolved."""
    package = name if is_package else name.rpartition(".")[0]
    out = [(t, None, 0) for t in _string_imports(tree)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if _ours(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and _ours(node.module):
                mod = node.module
            else:
                continue
            out += [(mod, a.name, node.lineno) for a in node.names]
    return out


def _graph(sources: dict[str, tuple[str, bool]] | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports (anywhere in it: top level, functions, strings), parent packages included."""
    sources = _sources() if sources is None else sources
    graph: dict[str, set[str]] = {m: set() for m in sources}

    def add(src: str, target: str) -> None:
        while target and target not in sources:  # `from pkg import name`: name is an attribute, not a module
            target = target.rpartition(".")[0]
        if not target or target == src:
            return
        graph[src].add(target)
        parent = target.rpartition(".")[0]
        while parent and parent not in TOP:  # another subpackage's __init__ runs first (our own already runs)
            if parent != src and not src.startswith(parent + "."):
                graph[src].add(parent)
            parent = parent.rpartition(".")[0]
        top = target.split(".")[0]
        if top != src.split(".")[0] and top in sources:  # another top-level package: its __init__ runs first
            graph[src].add(top)

    for name, (text, is_package) in sources.items():
        for mod, attr, _ in _imports(name, ast.parse(text), is_package):
            add(name, f"{mod}.{attr}" if attr else mod)
    return graph


# the flat core: what every package may use (`engram.hashing` is the core's one subpackage)
CORE_MODULES = {"config", "model_config", "tokenizer", "hashing", "memory", "hyper", "model", "cache", "persist",
                "errors", "utils", "deprecation", "jit", "table", "placement"}


def package_of(module: str) -> str:
    """The package a module belongs to for the layering rules: `engram.tables.rows` -> `engram.tables`; the flat
    core's modules (`engram.model`, `engram.hashing.engine`) -> `engram`; another top-level module is a node of its
    own; every experiment module -> `engram_experiments`; the root `engram/__init__.py`, which re-exports every
    package's public names, is a node of its own too."""
    parts = module.split(".")
    if parts[0] == "engram_experiments":
        return "engram_experiments"
    if module == "engram":
        return "engram/__init__"
    if parts[1] in CORE_MODULES or parts[1].startswith("_"):  # a private top-level module serves the core
        return "engram"
    return ".".join(parts[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        pm = package_of(m)
        out.setdefault(pm, set()).update(package_of(t) for t in targets if package_of(t) != pm)
    return out


def _private_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """`from engram.x import _name` (or a private module) where the importer sits in another package."""
    out = []
    for name, (text, is_package) in sources.items():
        for mod, attr, line in _imports(name, ast.parse(text), is_package):
            target = f"{mod}.{attr}" if attr else mod
            private = any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[1:])
            if private and package_of(mod) != package_of(name):
                out.append(f"{name}:{line} imports {target}")
    return out


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_graph_sees_function_level_imports():
    g = _graph()
    assert "engram.model" in g["engram"]  # imported inside `__getattr__` only
    assert "engram.tables.base" in g["engram.tables.trainable"] and "engram.tables" in g["engram.training.optim"]


def test_graph_sees_string_imports():
    """A registry of "module:Class" strings or an import_module call is a dependency like an import statement (the
    core's hash-family table named the integrations that way, unseen by this test)."""
    src = ('FAMILIES = {"qwen4_exp": "engram.integrations.qwen4_exp:Qwen4ExpFamily"}\n'
           'def f():\n    import importlib\n    return importlib.import_module("engram.integrations.longcat")\n'
           'DOC = "see engram.integrations for more"\nX = "engram_experiments.cli:add_commands"\n')
    assert sorted(_string_imports(ast.parse(src))) == ["engram.integrations.longcat", "engram.integrations.qwen4_exp",
                                                       "engram_experiments.cli"]


def test_no_import_cycles():
    g = _graph()
    cycles = sorted(m for m in g if m in _closure(g, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


def _package_cycles(graph: dict[str, set[str]]) -> list[str]:
    pg = _package_graph(graph)
    return sorted(p for p in pg if p in _closure(pg, p))


def test_no_package_loops():
    """Packages form layers: no two packages reach each other, function-level imports included (a loop between
    packages hides inside functions where a module-level cycle check cannot see it)."""
    loops = _package_cycles(_graph())
    assert not loops, f"packages on an import loop: {loops}"


def test_package_loop_check_sees_a_function_level_import():
    """The check above fails on a loop whose back edge is an import inside a function."""
    sources = {"engram": ("", True), "engram.serving": ("", True), "engram.integrations": ("", True),
               "engram.serving.engine": ("from ..integrations import vllm\n", False),
               "engram.integrations.vllm": ("def f():\n    from ..serving.engine import load\n", False)}
    assert _package_cycles(_graph(sources)) == ["engram.integrations", "engram.serving"]


def _library_importing_experiments(graph: dict[str, set[str]]) -> list[str]:
    """Library modules (`engram`, `engram.*`) with an edge to `engram_experiments` (strings and functions included)."""
    return sorted({m for m in graph if m == "engram" or m.startswith("engram.")
                   for t in graph[m] if t.split(".")[0] == "engram_experiments"})


def test_library_imports_nothing_of_the_experiments():
    """The library stands alone: `engram_experiments` uses it, never the reverse (strings and functions included);
    `engram experiment` reaches the experiments through the `engram.cli` entry point."""
    bad = _library_importing_experiments(_graph())
    assert not bad, f"library modules that import the experiments: {bad}"


def test_experiment_check_sees_an_experiment_imported_by_the_library():
    """The check above fails on a library module that imports an experiment, even inside a function or by name."""
    sources = {"engram": ("", True), "engram.cli": ("def f():\n    from engram_experiments import preset\n", True),
               "engram.serving": ('X = "engram_experiments.report:main"\n', True),
               "engram_experiments": ("", True), "engram_experiments.preset": ("import engram.model\n", False),
               "engram_experiments.report": ("", False), "engram.model": ("", False)}
    assert _library_importing_experiments(_graph(sources)) == ["engram.cli", "engram.serving"]


def test_no_private_name_imported_across_packages():
    """What another package needs is public (documented, no leading underscore): a private name imported across
    packages is a dependency nobody promised to keep."""
    bad = _private_imports(_sources())
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_private_name_check_sees_one():
    sources = {"engram": ("", True), "engram.editing": ("", True), "engram.editing.optimize": ("", False),
               "engram_experiments": ("", True),
               "engram_experiments.edit": ("def f():\n    from engram.editing.optimize import _batch\n", False),
               "engram.editing.report": ("from .optimize import _batch\n", False)}
    assert _private_imports(sources) == ["engram_experiments.edit:2 imports engram.editing.optimize._batch"]


CORE = ["engram.config", "engram.table", "engram.tokenizer", "engram.hashing", "engram.memory", "engram.hyper",
        "engram.model",
        "engram.model_config", "engram.cache", "engram.persist", "engram.errors", "engram.utils", "engram.placement"]


@pytest.mark.parametrize("module", CORE)
def test_core_imports_no_storage_distribution_training_adapters_editing_or_cli(module):
    """The flat core reads top to bottom on its own; the packages around it depend on it, never the reverse."""
    forbidden = ("engram.tables", "engram.distributed", "engram.training", "engram.adapters", "engram.editing",
                 "engram.integrations", "engram.serving", "engram.cli", "engram.analysis")
    bad = sorted(m for m in _closure(_graph(), module) if m.startswith(forbidden))
    assert not bad, f"{module} reaches {bad}"


@pytest.mark.parametrize("package", ["engram.adapters", "engram.editing", "engram.training", "engram.tables",
                                     "engram.distributed", "engram.integrations", "engram.serving"])
def test_packages_do_not_reach_the_cli_or_analysis(package):
    g = _graph()
    modules = [m for m in g if m == package or m.startswith(package + ".")]
    bad = sorted({r for m in modules for r in _closure(g, m) if r.startswith(("engram.cli", "engram.analysis"))})
    assert not bad, f"{package} reaches {bad}"


# Where parsing JSON is not reading one of engram's own files: (module path prefix, why).
JSON_PARSE_ALLOWED = {
    "serving/app.py": "HTTP request bodies",
    "integrations/vllm/routing.py": "HTTP request bodies and the /v1/models answer (the MODEL+NAME middleware)",
    "editing/facts.py": "the user's facts file (JSON lines, checked line by line)",
    "cli/": "--set KEY=VALUE values on the command line",
    "training/corpora.py": "the user's JSON-lines corpus (`--data file.jsonl`)",
    "engram_experiments/runs.py": "a worker subprocess's arguments (call_in_subprocess: sys.argv[2])",
    "training/presets.py": "the user's `engram train --config` file and --set model.KEY=VALUE values",
}


def _persistence_offenders(path: Path, rel: str) -> list[str]:
    """Calls that write, swap or delete files and folders, or parse JSON, by hand (outside persist.py)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil", "json"):
            for a in node.names:
                if a.name in ("replace", "rename", "rmtree", "load", "loads"):
                    out.append(f"{rel}:{node.lineno} from {node.module} import {a.name}")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner, attr = ast.unparse(node.func.value), node.func.attr
        call = f"{rel}:{node.lineno} {owner}.{attr}"
        if (owner, attr) in (("os", "replace"), ("os", "rename"), ("shutil", "rmtree"), ("json", "load")):
            out.append(call)
        elif (owner, attr) == ("json", "loads") and not rel.startswith(tuple(JSON_PARSE_ALLOWED)):
            out.append(call)
        elif attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords:
            out.append(call + " (Path.replace/rename: str.replace takes two arguments)")
    return out


def test_persistence_has_one_home():
    """Every file and folder engram writes is swapped in, and every JSON file it reads is parsed, by persist.py:
    a rename, a tree removal or a JSON read written by hand elsewhere is how crash windows and one-off error
    messages come back."""
    offenders = []
    for path in sorted(p for r in ROOTS for p in r.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix() if path.is_relative_to(SRC) else \
            path.relative_to(SRC.parent).as_posix()  # engram_experiments/...
        if rel != "persist.py":
            offenders += _persistence_offenders(path, rel)
    assert not offenders, "use engram.persist instead:\n" + "\n".join(offenders)


def test_persistence_check_catches_the_old_crash_window(tmp_path):
    """The check sees a by-hand folder swap however it is spelled (the text match it replaced missed one)."""
    f = tmp_path / "m.py"
    f.write_text("import os, shutil, json\nfrom pathlib import Path\n"
                 "def swap(new, root):\n    shutil.rmtree(root)\n    os.replace(new, root)\n"
                 "    Path(new).replace(root)\n    return json.loads(Path(root, 'x.json').read_text())\n")
    got = _persistence_offenders(f, "training/data.py")
    assert len(got) == 4, got


def test_only_tables_and_distributed_install_tables():
    """Nothing outside `tables/` and `distributed/` puts a table behind a layer or sets attributes on model modules."""
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(("tables/", "distributed/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for t in getattr(node, "targets", []) + ([node.target] if isinstance(node, ast.AugAssign) else []):
                if isinstance(t, ast.Attribute) and t.attr in ("table", "backend", "sharded", "prefetcher",
                                                               "load_reduce", "engram_history"):
                    owner = ast.unparse(t.value)
                    if owner != "self":
                        offenders.append(f"{rel}:{node.lineno} {ast.unparse(t)}")
    assert not offenders, offenders


def test_no_module_over_450_lines_without_a_reason_at_its_top():
    """Issue 45: a module longer than 450 lines says why in its docstring ("Over 450 lines on purpose: ...")."""
    long = [p for p in SRC.rglob("*.py") if len(p.read_text().splitlines()) > 450]
    unexplained = [str(p.relative_to(SRC)) for p in long if "Over 450 lines on purpose" not in p.read_text()[:2000]]
    assert not unexplained, unexplained


def test_the_architecture_page_names_every_module_and_only_real_ones():
    """docs/architecture.md's "Where things live" lists every package and top-level module of both packages, and
    every file it names there exists (a map that drifts from the code sends a newcomer to the wrong place)."""
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = doc.split("## Where things live", 1)[1].split("```", 2)[1]
    roots = {"src/engram/": SRC, "src/engram_experiments/": SRC.parent / "engram_experiments"}
    current = None
    named = []
    for line in block.splitlines():
        if line.strip() in roots:
            current = roots[line.strip()]
            continue
        head = line[:19].strip()  # the first column: a module or package (or several, comma-separated)
        for token in re.findall(r"[\w/]+(?:\.py|/)", head):
            named.append((current, token))
    missing = [f"{root.name}/{t}" for root, t in named if not (root / t).exists()]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
    for root in roots.values():
        listed = {t.rstrip("/").removesuffix(".py") for r, t in named if r == root}
        here = {p.name.removesuffix(".py") for p in root.iterdir()
                if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
                and p.name != "__init__.py" and not p.name.startswith("_")}
        unlisted = sorted(here - listed)
        assert not unlisted, f"docs/architecture.md does not place {root.name}/{unlisted}"
