"""The package's import graph: no cycles (function-level imports included), and the model files stay pure.

Every `import`/`from ... import` statement anywhere in a module (top level, functions, methods)
is an edge; importing `engram.pkg.mod` from outside `pkg` also runs `engram/pkg/__init__.py`, so it
is an edge to the subpackage too (the root package `engram` is left out: every module lives under it).
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "engram"


def _module_name(path: Path) -> str:
    parts = ("engram",) + path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}

    def add(src: str, target: str) -> None:
        while target and target not in modules:  # `from pkg import name`: name is an attribute, not a module
            target = target.rpartition(".")[0]
        if not target or target == src:
            return
        graph[src].add(target)
        parent = target.rpartition(".")[0]
        while parent not in ("", "engram"):  # another subpackage's __init__ runs first (our own already runs)
            if parent != src and not src.startswith(parent + "."):
                graph[src].add(parent)
            parent = parent.rpartition(".")[0]

    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("engram"):
                        add(name, a.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                elif node.module and node.module.startswith("engram"):
                    mod = node.module
                else:
                    continue
                for a in node.names:
                    add(name, f"{mod}.{a.name}")
    return graph


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
    assert "engram.tables.base" in g["engram.tables.backends"] and "engram.tables" in g["engram.training.optim"]


def test_no_import_cycles():
    g = _graph()
    cycles = sorted(m for m in g if m in _closure(g, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


CORE = ["engram.config", "engram.tokenizer", "engram.hashing", "engram.memory", "engram.hyper", "engram.model",
        "engram.model_config", "engram.cache", "engram.persist", "engram.utils"]


@pytest.mark.parametrize("module", CORE)
def test_core_imports_no_storage_distribution_training_adapters_editing_or_cli(module):
    """The flat core reads top to bottom on its own; the packages around it depend on it, never the reverse."""
    forbidden = ("engram.tables", "engram.distributed", "engram.training", "engram.adapters", "engram.editing",
                 "engram.integrations", "engram.serving", "engram.cli", "engram.analysis", "engram.api", "engram.verify")
    bad = sorted(m for m in _closure(_graph(), module) if m.startswith(forbidden))
    assert not bad, f"{module} reaches {bad}"


@pytest.mark.parametrize("package", ["engram.adapters", "engram.editing", "engram.training", "engram.tables",
                                     "engram.distributed", "engram.integrations", "engram.serving"])
def test_packages_do_not_reach_the_cli_or_analysis(package):
    g = _graph()
    modules = [m for m in g if m == package or m.startswith(package + ".")]
    bad = sorted({r for m in modules for r in _closure(g, m) if r.startswith(("engram.cli", "engram.analysis"))})
    assert not bad, f"{package} reaches {bad}"


def test_persistence_helpers_have_one_home():
    """Atomic writes, folder replacement and JSON reading are defined once, in persist.py."""
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == "persist.py":
            continue
        text = path.read_text()
        offenders += [f"{rel}: {n}" for n in ("def atomic_write_bytes", "def replace_dir", "def read_json") if n in text]
        if rel != "persist.py" and "os.replace(tmp" in text and "rmtree" in text:
            offenders.append(f"{rel}: replaces a folder by hand (rmtree + os.replace); use persist.replace_dir")
    assert not offenders, offenders


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
