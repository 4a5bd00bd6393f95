"""The house rules of docs/architecture.md, checked on the source: short functions, no
import circle, single-device models, one file name per module."""

import ast
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "dtensor3d"
MAX_FUNCTION_LINES = 50


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """dtensor3d modules imported by `path` at module level or inside functions."""
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dtensor3d"))
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.startswith("dtensor3d"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
    modules = {module_name(p) for p in sources()}
    return {m for m in found if m in modules and m != name}


def test_functions_are_short():
    long = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 50 lines:\n" + "\n".join(long)


def test_no_import_circle():
    graph = {module_name(p): imports_of(p) for p in sources()}
    # A package's __init__ re-exporting its own submodules is not a circle through them.
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_models_are_single_device():
    for path in sorted((PACKAGE / "models").rglob("*.py")):
        assert "torch.distributed" not in path.read_text(), path


def test_no_two_modules_share_a_file_name():
    names = [p.name for p in sources() if p.name != "__init__.py"]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


# The floors of docs/architecture.md: a module imports only from its own package or a lower floor.
FLOORS = {
    "errors": 0,
    "config": 1,
    "mesh": 2,
    "models": 2,
    "parallel": 3,
    "datasets": 3,
    "plan": 3,
    "checkpoint": 4,
    "training": 5,
    "launch": 5,
    "generate": 5,
    "harness": 5,  # lm-evaluation-harness's model class over generate's KV cache
    "recipe": 6,  # the library's re-export of config.schema
    "__main__": 6,
    "__init__": 0,  # dtensor3d/__init__.py: the version; the library face by name, on first use (no import)
}


def floor_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_runs_up_a_floor():
    upward = []
    for path in sources():
        name = module_name(path)
        assert floor_of(name) in FLOORS, f"{name}: add its package to FLOORS and to docs/architecture.md"
        for target in imports_of(path):
            if FLOORS[floor_of(target)] > FLOORS[floor_of(name)]:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def test_every_package_says_its_job():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 20, f"{init.relative_to(ROOT)}: a docstring saying its job and its imports"
