"""The house rules of ``launch/`` (issue 38 item 5), enforced on the source tree: scripts import only the package's
public modules (``chameleon_dist.public_api.PUBLIC_MODULES``) and only public names of them, and the rooms import one
way: ``launch/models/`` nothing of launch, ``launch/bench/`` the models, ``launch/experiments/`` and the user's launchers
in ``launch/`` the benchmarks and the models; nothing imports an experiment from another room; no import circle.

Each rule is a function from sources (``{path: text}``) to its violations, so a test can feed it a bad example.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
from pathlib import Path

from chameleon_dist.public_api import PUBLIC_MODULES

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"

# The room of a launch module (its folder under launch/; "launch": a file of launch/ itself) -> the rooms it may
# import besides its own.
ROOMS_MAY_IMPORT = {
    "models": frozenset(),
    "bench": frozenset({"models"}),
    "experiments": frozenset({"bench", "models"}),
    "launch": frozenset({"bench", "models"}),
}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken rule: where (``path``), what it imports (``imported``) and which rule (``rule``)."""

    path: str
    imported: str
    rule: str


def launch_sources() -> dict[str, str]:
    """Every ``launch/**.py``, by its path relative to the repository (``launch/bench/harness.py``)."""
    return {p.relative_to(REPO).as_posix(): p.read_text() for p in sorted(LAUNCH.rglob("*.py"))}


def module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "launch"


def _imports(source: str, path: str) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` per import statement (``names`` empty for ``import x``)."""
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            out.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, tuple(alias.name for alias in node.names)))
    return out


def _static_public_names(module: str) -> set[str]:
    """A plain module's public names, read from its source without importing it: its top-level definitions,
    assignments and imports that do not start with an underscore."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return {n for n in names if not n.startswith("_")}


def public_names(module: str) -> set[str]:
    """What a public module offers: a package's ``__all__`` (its ``__init__`` re-exports, lazy ones included;
    importing a package loads nothing heavy), a plain module's public top-level names (read, not imported), and
    the public modules right below it."""
    below = {m.removeprefix(module + ".") for m in PUBLIC_MODULES if m.startswith(module + ".")}
    spec = importlib.util.find_spec(module)
    if spec.submodule_search_locations is not None:
        return set(importlib.import_module(module).__all__) | below
    return _static_public_names(module) | below


def api_violations(sources: dict[str, str], public: tuple[str, ...] = PUBLIC_MODULES) -> list[Violation]:
    """Imports of ``chameleon_dist`` that are not a public module, or not a public name of one."""
    found, names_of = [], {}
    for path, source in sources.items():
        for module, names in _imports(source, path):
            if module.split(".")[0] != "chameleon_dist":
                continue
            if module not in public:
                found.append(Violation(path, module, "not a public module (chameleon_dist.public_api)"))
                continue
            offered = names_of.setdefault(module, public_names(module)) if names else set()
            found.extend(Violation(path, f"{module}.{name}", "not a public name of its module")
                         for name in names if name not in offered)
    return found


def launch_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Which launch modules each launch module imports (``from launch.bench import harness`` names
    ``launch.bench.harness``)."""
    modules = {module_of(path) for path in sources}
    graph = {}
    for path, source in sources.items():
        targets = set()
        for module, names in _imports(source, path):
            if module.split(".")[0] != "launch":
                continue
            subs = {f"{module}.{n}" for n in names if f"{module}.{n}" in modules}
            targets |= subs or {module}
        graph[module_of(path)] = targets
    return graph


def room_violations(sources: dict[str, str]) -> list[Violation]:
    """Imports between rooms against ``ROOMS_MAY_IMPORT``, and imports of what is not a launch module."""
    found = []
    modules = {module_of(path) for path in sources}
    for module, targets in launch_graph(sources).items():
        room = room_of(module)
        for target in sorted(targets):
            if target not in modules:
                found.append(Violation(module, target, "not a launch module"))
            elif room_of(target) != room and room_of(target) not in ROOMS_MAY_IMPORT[room]:
                found.append(Violation(module, target, f"room {room!r} may not import room {room_of(target)!r}"))
    return found


def circles(sources: dict[str, str]) -> list[list[str]]:
    """Import circles among launch modules, each as the path around it (first module repeated at the end)."""
    graph, found, done = launch_graph(sources), [], set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            found.append(stack[stack.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, stack + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


# ---- the rules on the tree -------------------------------------------------------------------------------------
def test_launch_imports_only_the_public_api():
    found = api_violations(launch_sources())
    assert not found, "\n".join(f"{v.path}: {v.imported}: {v.rule}" for v in found)


def test_launch_rooms_import_one_way():
    found = room_violations(launch_sources())
    assert not found, "\n".join(f"{v.path}: {v.imported}: {v.rule}" for v in found)


def test_launch_has_no_import_circle():
    assert circles(launch_sources()) == []


def test_public_modules_exist_and_are_listed_once():
    assert len(set(PUBLIC_MODULES)) == len(PUBLIC_MODULES)
    assert all(importlib.util.find_spec(m) is not None for m in PUBLIC_MODULES)


def test_old_module_paths_are_aliases_of_the_moved_modules():
    """Every launch/<name>.py that a room also holds is the thin alias (for one release): importing it gives the
    moved module itself."""
    aliases = [p.stem for p in LAUNCH.glob("*.py") if any((LAUNCH / room / p.name).exists() for room in ROOMS_MAY_IMPORT)]
    assert "bench_executor" in aliases and "scale_eq1" in aliases and "toy_gpt" in aliases
    for name in aliases:
        source = (LAUNCH / f"{name}.py").read_text()
        assert len(source.splitlines()) < 20 and "runpy.run_module" in source, name
    alias = importlib.import_module("launch.bench_executor")
    assert alias is importlib.import_module("launch.bench.bench_executor")


# ---- each rule fires on a bad example --------------------------------------------------------------------------
def test_a_deep_import_is_reported():
    bad = {"launch/bench/x.py": "from chameleon_dist.device.factory import UNBOUNDED_CAPACITY_BYTES\n"}
    assert api_violations(bad) == [Violation("launch/bench/x.py", "chameleon_dist.device.factory",
                                             "not a public module (chameleon_dist.public_api)")]
    good = {"launch/bench/x.py": "from chameleon_dist.device import UNBOUNDED_CAPACITY_BYTES\n"}
    assert api_violations(good) == []


def test_an_internal_name_of_a_public_module_is_reported():
    bad = {"launch/x.py": "from chameleon_dist.integrations.megatron import gpt\nimport chameleon_dist.runtime\n"}
    assert api_violations(bad) == [
        Violation("launch/x.py", "chameleon_dist.integrations.megatron.gpt", "not a public name of its module"),
        Violation("launch/x.py", "chameleon_dist.runtime", "not a public module (chameleon_dist.public_api)"),
    ]
    assert api_violations({"launch/x.py": "from chameleon_dist.models import llama, TransformerShape\n"}) == []


def test_an_import_against_the_rooms_is_reported():
    sources = {
        "launch/models/m.py": "import torch\n",
        "launch/bench/b.py": "from launch.models import m\nfrom launch.experiments.e import run\n",
        "launch/experiments/e.py": "from launch.bench import b\n",
        "launch/train.py": "from launch.experiments import e\nfrom launch.bench.b import x\n",
    }
    assert room_violations(sources) == [
        Violation("launch.bench.b", "launch.experiments.e", "room 'bench' may not import room 'experiments'"),
        Violation("launch.train", "launch.experiments.e", "room 'launch' may not import room 'experiments'"),
    ]


def test_an_import_circle_is_reported():
    sources = {"launch/experiments/a.py": "from launch.experiments.b import f\n",
               "launch/experiments/b.py": "from launch.experiments import a\n",
               "launch/experiments/c.py": "from launch.experiments import a\n"}
    assert circles(sources) == [["launch.experiments.a", "launch.experiments.b", "launch.experiments.a"]]
    del sources["launch/experiments/b.py"]
    assert circles(sources) == []
