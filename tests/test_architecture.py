"""The layering ARCHITECTURE.md describes, checked on the source so it stays true: which package may import which
(actor and learner never import each other; they meet only through transport/ messages and what driver/ hands
them), no import cycle between modules (lazy imports included), small modules, a short launcher."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the layers, bottom first: a package imports only packages of the layers below its own (none of its own layer:
# actor and learner never import each other; they meet only through transport/ messages and what driver/ hands them)
LAYERS = [{"sampling", "transport", "tasks"}, {"models"}, {"configs"}, {"drafters"}, {"actor", "learner"}, {"driver"},
          {"bench"}]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
PACKAGES = sorted(LAYER)
THIRD_PARTY_FORBIDDEN = {"sampling": {"vllm", "transformers", "ray", "deepspeed", "zmq"}}


def modules() -> dict[str, Path]:
    found = {p.stem: p for p in [ROOT / "launch.py"]}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return found


def imports(path: Path, known: dict[str, Path], top_level: bool = False) -> set[str]:
    """Every module (project or third party) `path` imports, at any depth of the file (`top_level`: outside any
    function or class, what importing it runs)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
    return names


def test_packages_import_only_the_layers_below_them():
    known = modules()
    wrong = []
    for name, path in known.items():
        package = name.split(".")[0]
        if package not in LAYER:
            continue
        for imported in imports(path, known):
            top = imported.split(".")[0]
            if top in LAYER and top != package and LAYER[top] >= LAYER[package]:
                wrong.append(f"{name} imports {imported}")
            if top in THIRD_PARTY_FORBIDDEN.get(package, ()):
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
    known = modules()
    graph = {name: {i for i in imports(path, known) if i in known and i != name} for name, path in known.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [])
            assert cycle is None, " -> ".join(cycle)


def test_modules_stay_small_and_the_launcher_reads_as_the_algorithm():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long
    assert len((ROOT / "launch.py").read_text().splitlines()) <= 150


def test_long_bodies_are_cut_into_named_phases():
    """No function of the run's own packages is over 60 lines: a long body reads as calls that name its phases."""
    long = []
    for name, path in modules().items():
        if name.split(".")[0] in {"actor", "learner", "drafters", "driver", "sampling", "transport"}:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                    long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


HEAVY = {"torch", "transformers", "ray", "vllm", "deepspeed"}  # what a module may defer importing


def test_project_imports_sit_at_the_top_unless_they_bring_a_heavy_dependency():
    """The top of a file shows what it depends on: a project module imported inside a function (outside bench/) must
    be one whose import loads torch, transformers, Ray, vLLM or DeepSpeed (an import deferred for its cost, or until
    the environment those read at import is set)."""
    known = modules()

    def heavy(name: str, seen: set[str]) -> bool:
        seen.add(name)
        imported = imports(known[name], known, top_level=True)
        return any(i.split(".")[0] in HEAVY for i in imported) or any(
            heavy(i, seen) for i in imported if i in known and i not in seen)

    light = []
    for name, path in known.items():
        if name.split(".")[0] == "bench":
            continue
        for imported in imports(path, known) - imports(path, known, top_level=True):
            if imported in known and not heavy(imported, set()):
                light.append(f"{name} imports {imported} inside a function")
    assert not light, "\n".join(light)
