"""The house rules of the package layout (README "Layout"), enforced on the source tree."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "chameleon_dist"

# Which top-level parts of chameleon_dist each part may import (one-way: lower parts never import higher ones).
ALLOWED = {
    "units": set(),
    "schema_version": set(),  # the version every JSON document carries
    "config": {"units"},
    "patching": {"units"},
    "trace": {"units"},
    "device": {"units", "trace"},
    "profiler": {"units", "trace", "device"},
    "policy": {"units", "trace"},
    "executor": {"units", "trace", "policy", "device"},
    # model shapes (models/shape.py imports nothing of the package) and the meta-device Llama, which is
    # recorded through the profiler
    "models": {"units", "trace", "device", "profiler"},
    "planner": {"units", "trace", "policy", "config", "models"},
    "report": {"units", "schema_version"},
    "ranks": {"units"},
    "retry": {"units", "device"},
    # the modules' buffers a retry gives back: which ops write them is the trace's vocabulary
    "retry_buffers": {"units", "device", "trace", "retry"},
    "runtime": {
        "units", "config", "trace", "device", "profiler", "policy", "executor", "planner", "report", "retry",
        "retry_buffers", "ranks",
    },
    # the public surface scripts may import (a tuple of module names; tests/test_launch_imports.py holds launch/ to it)
    "public_api": set(),
    "integrations": None,  # anything
    "cli": None,
    "__init__": {"units", "config", "device", "report", "runtime"},
}

# The only files that may name torch.cuda: the CUDA device (device/cuda*.py), and the shims that stand in for torch.cuda
# functions Megatron calls when it runs on a CPU machine.
CUDA_ALLOWED = {"device/cuda.py", "device/cuda_memory.py", "integrations/megatron/cuda_on_cpu.py"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        yield rel, ast.parse(path.read_text(), filename=str(path))


def _part(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py")


def _imports(tree):
    """Imported module names, skipping ``if TYPE_CHECKING:`` blocks (annotations only)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_frameworks_are_imported_only_in_integrations():
    offenders = [
        f"{rel}: imports {name}"
        for rel, tree in _modules()
        if rel.parts[0] != "integrations"
        for name in _imports(tree)
        if name.split(".")[0] in {"megatron", "deepspeed"}
    ]
    assert not offenders, "\n".join(offenders)


def test_parts_import_only_what_the_design_allows():
    offenders = []
    for rel, tree in _modules():
        part = _part(rel)
        assert part in ALLOWED, f"{rel}: new top-level part {part!r}: add it to ALLOWED with its rule"
        allowed = ALLOWED[part]
        if allowed is None:
            continue
        for name in _imports(tree):
            pieces = name.split(".")
            if pieces[0] == "chameleon_dist" and len(pieces) > 1 and pieces[1] != part and pieces[1] not in allowed:
                offenders.append(f"{rel}: imports {name}")
    assert not offenders, "\n".join(offenders)


def test_torch_cuda_is_named_only_by_the_cuda_device():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if rel not in CUDA_ALLOWED and ("torch.cuda" in text or ".cuda(" in text):
            offenders.append(rel)
    assert not offenders, offenders


def test_import_initialises_no_cuda_and_no_framework():
    code = (
        "import sys, torch, chameleon_dist, chameleon_dist.device, chameleon_dist.executor, chameleon_dist.runtime\n"
        "from chameleon_dist import Chameleon, ChameleonConfig, EmulatedDevice, CudaDevice\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed'))\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_planner_command_never_imports_torch():
    """``chameleon-plan`` is pure Python: torch's import alone took it past its 2 s budget for a 64-device search
    (found in issue 29: the policy generator had come to import torch through trace/exactness.py)."""
    code = (
        "import sys\n"
        "from chameleon_dist.cli import plan\n"
        "code = plan.main(['--devices', '8', '--seq', '8192', '--global-batch', '64', '--json'])\n"
        "assert code == 0, code\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'deepspeed'))\n"
        "assert not bad, bad[:5]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_library_logs_instead_of_printing():
    offenders = []
    for rel, tree in _modules():
        if _part(rel) == "cli":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


def test_modules_stay_small():
    big = [f"{rel} ({n} lines)" for rel, n in ((p.relative_to(PACKAGE), len(p.read_text().splitlines())) for p in PACKAGE.rglob("*.py")) if n > 600]
    assert not big, big


def _integration_classes():
    for rel, tree in _modules():
        if rel.parts[0] == "integrations":
            yield from ((rel, node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef))


def test_integrations_hold_the_runtime_instead_of_subclassing_it():
    """Megatron's and DeepSpeed's objects hold a ``Chameleon`` (issue 25): none subclasses it."""
    offenders = [f"{rel}: {node.name}({ast.unparse(base)})" for rel, node in _integration_classes()
                 for base in node.bases if ast.unparse(base).split(".")[-1] == "Chameleon"]
    assert not offenders, "\n".join(offenders)


def test_integrations_keep_no_instance_state_in_class_attributes():
    """A class body in integrations/ assigns only constants (UPPER_CASE names) or a dataclass's field defaults;
    per-object state lives in ``__init__`` (a class attribute read as ``self.x`` and then written is shared
    until the first write)."""
    offenders = []
    for rel, node in _integration_classes():
        if any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list):
            continue
        for statement in node.body:
            targets = (statement.targets if isinstance(statement, ast.Assign) else
                       [statement.target] if isinstance(statement, ast.AnnAssign) and statement.value is not None
                       else [])
            offenders += [f"{rel}: {node.name}.{ast.unparse(t)}" for t in targets
                          if not (isinstance(t, ast.Name) and t.id.isupper())]
    assert not offenders, "\n".join(offenders)


def test_integrations_call_no_private_member_of_the_runtime():
    """The integrations drive the runtime through its public methods only: no ``runtime._x`` (nor
    ``self.runtime._x``, ``chameleon._x``) and no ``super()._x``."""
    held_names = {"runtime", "chameleon", "integration"}
    offenders = []
    for rel, tree in _modules():
        if rel.parts[0] != "integrations":
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            is_super = isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super"
            if name in held_names or is_super:
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


# Issue 38: every budget is resolved once, at start, by config/budgets.py (read_node, resolve_budgets); everything
# else takes its result. Each rule: the names whose call (or, for the texts, whose mention as a whole string
# constant) only the listed modules may make.
MACHINE_READERS = frozenset({
    "local_world_size", "read_host_limits", "physical_memory_bytes", "read_cgroup_limit", "read_memlock_bytes",
    "sysconf", "getrlimit", "HostShare", "resolve_budget_bytes",
})
BUDGET_RULES = (
    (MACHINE_READERS, frozenset({"config/budgets.py", "config/node.py", "config/host_limits.py"})),
    # the one resolution, at start (ChameleonConfig's own budget methods wrap it for a caller without a runtime)
    (frozenset({"read_node", "resolve_budgets"}), frozenset({"runtime.py", "config/schema.py"})),
    # ChameleonConfig's methods that read the machine afresh: make_device's default, when no reading is given
    (frozenset({"host_memory_budget_bytes", "host_share", "memory_budget_bytes"}),
     frozenset({"config/budgets.py", "config/schema.py", "device/factory.py"})),
)
MACHINE_TEXTS = frozenset({"LOCAL_WORLD_SIZE", "/proc/meminfo", "SC_PHYS_PAGES"})
MACHINE_TEXT_HOLDERS = frozenset({"config/node.py", "config/host_limits.py"})
CAPACITY_FROM_BUDGETS = frozenset({"runtime.py"})  # these take the device's capacity from ResolvedBudgets


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def budget_resolution_offenders(rel: str, tree: ast.AST) -> list[str]:
    """``"rel:line: what"`` for each place in module ``rel`` (a posix path inside the package) that resolves a
    budget outside config/budgets.py: reads the machine, resolves afresh, or asks the device for its capacity."""
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _called_name(node)
            offenders += [f"{rel}:{node.lineno}: calls {name}" for names, allowed in BUDGET_RULES
                          if name in names and rel not in allowed]
        elif isinstance(node, ast.Constant) and node.value in MACHINE_TEXTS and rel not in MACHINE_TEXT_HOLDERS:
            offenders.append(f"{rel}:{node.lineno}: names {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr == "capacity_bytes" and rel in CAPACITY_FROM_BUDGETS:
            owner = node.value
            if (owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)) == "device":
                offenders.append(f"{rel}:{node.lineno}: asks the device for its capacity (use the resolved budgets)")
    return offenders


def test_every_budget_is_resolved_once_by_config_budgets():
    offenders = [o for rel, tree in _modules() for o in budget_resolution_offenders(rel.as_posix(), tree)]
    assert not offenders, "\n".join(offenders)


def test_the_budget_rule_fires_on_a_second_resolution():
    bad = ast.parse(
        "import os\n"
        "ranks = int(os.environ.get('LOCAL_WORLD_SIZE', '1'))\n"
        "ram_bytes = os.sysconf('SC_PHYS_PAGES') * 4096\n"
        "share = config.host_memory_budget_bytes(pinned=True)\n"
        "node = read_node()\n"
        "capacity_bytes = self.device.capacity_bytes\n"
    )
    found = budget_resolution_offenders("runtime.py", bad)
    assert sorted(o.split(": ", 1)[1] for o in found if o.startswith("runtime.py:3:")) == [
        "calls sysconf", "names 'SC_PHYS_PAGES'"]
    assert any(o.startswith("runtime.py:2: names 'LOCAL_WORLD_SIZE'") for o in found)
    assert "runtime.py:4: calls host_memory_budget_bytes" in found
    assert not [o for o in found if o.startswith("runtime.py:5:")]  # the runtime runs the one resolution
    assert any(o.startswith("runtime.py:6: asks the device for its capacity") for o in found)
    assert budget_resolution_offenders("executor/swap.py", ast.parse("node = read_node()")) == [
        "executor/swap.py:1: calls read_node"]
    assert budget_resolution_offenders("config/budgets.py", ast.parse("limits = read_host_limits(None)")) == []
    assert budget_resolution_offenders("runtime.py", ast.parse("capacity_bytes = self.budgets.capacity_bytes")) == []


MAX_FUNCTION_LINES = 80  # a function longer than a screen is split into named steps


def long_functions(trees) -> list[str]:
    """``path:name (lines)`` for each function in ``trees`` (pairs of a path and its parsed module) over
    ``MAX_FUNCTION_LINES``, decorators and docstring included."""
    found = []
    for rel, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_80_lines_in_the_library_or_launch():
    launch = PACKAGE.parent / "launch"
    scripts = [(path.relative_to(launch.parent), ast.parse(path.read_text())) for path in sorted(launch.rglob("*.py"))]
    assert not long_functions([*_modules(), *scripts]), "split these into named steps"


def test_the_function_length_rule_fires_on_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    short = "def short():\n    return 1\n"
    assert long_functions([("bad.py", ast.parse(f"def long():\n{body}\n" + short))]) == ["bad.py:long (81 lines)"]
    assert long_functions([("good.py", ast.parse(short))]) == []
