"""What the DeepSpeed integration changes on DeepSpeed objects (``integrations/deepspeed/upstream.py``): every
record matches the installed DeepSpeed (fails when upstream changes), names attributes the relied-on code
really has, has its row in patches/README.md, covers every attribute the integration's modules write or
private method they call, and ``install`` refuses a DeepSpeed outside the records before touching the engine."""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import inspect
from pathlib import Path

import pytest

from chameleon_dist.integrations import defined_instance_changes, defined_patches
from chameleon_dist.patching import (
    PatchRefused,
    fingerprint_of_all,
    problems_with_change,
    relied_on_code,
    verify_instance_changes,
)

REPO = Path(__file__).resolve().parents[1]
INTEGRATION = REPO / "chameleon_dist" / "integrations" / "deepspeed"
CHANGES = defined_instance_changes()
OWN_ATTRIBUTES = {"chameleon"}  # engine.chameleon: chameleon-dist's own attribute on the engine, not DeepSpeed's
TORCH_ATTRIBUTES = {"grad"}  # parameter.grad = None: torch's own attribute, as DeepSpeed's zero_grad sets it
OWN_OBJECTS = {"self", "clock", "executor", "runtime", "data", "device", "torch", "logger", "timer_self"}
"""Names bound to chameleon-dist's own objects inside integrations/deepspeed (their attributes are ours)."""


def test_changes_have_unique_names_also_among_patches():
    names = [c.name for c in CHANGES] + [p.name for p in defined_patches()]
    assert CHANGES and len(set(names)) == len(names)


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.name)
def test_change_matches_installed_deepspeed(change):
    """Fails when upstream changes: re-review the code in ``relies_on``, then update versions/fingerprint. (The
    records include the Hugging Face Trainer callback's, checked against transformers, and the meta Megatron
    session's, against megatron-core.)"""
    pytest.importorskip(change.owner.partition(":")[0])
    assert problems_with_change(change) == ()


def _source_of(obj) -> str:
    if isinstance(obj, dict):
        return " ".join(f"{key.__name__} {value.__name__}" for key, value in obj.items())
    return inspect.getsource(obj)


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.name)
def test_every_declared_attribute_is_in_the_code_it_relies_on(change):
    pytest.importorskip(change.owner.partition(":")[0])
    text = "\n".join(_source_of(obj) for obj in relied_on_code(change))
    assert [a for a in change.attributes if a not in text] == []


def test_readme_lists_every_instance_change():
    rows = [line for line in (REPO / "patches" / "README.md").read_text().splitlines() if line.startswith("|")]
    for change in CHANGES:
        matching = [row for row in rows if f"`{change.name}`" in row]
        assert len(matching) == 1, f"patches/README.md needs one table row for {change.name}"
        row = matching[0]
        assert change.owner in row and change.versions in row and change.package in row and change.how in row
        assert all(f"`{a}`" in row for a in change.attributes), f"{change.name}: the row names every attribute"


def _written_or_called(tree: ast.AST) -> set[str]:
    """Attributes assigned on (or private methods called on) objects that are not chameleon-dist's own."""
    found: set[str] = set()

    def owner_name(node: ast.AST) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                while isinstance(item, ast.Subscript):
                    item = item.value
                if isinstance(item, ast.Attribute) and owner_name(item.value) not in OWN_OBJECTS:
                    found.add(item.attr)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "setattr" and owner_name(node.args[0]) not in OWN_OBJECTS:
                found.add("<setattr>")
            if (isinstance(func, ast.Attribute) and func.attr.startswith("_") and not func.attr.startswith("__")
                    and owner_name(func.value) not in OWN_OBJECTS):
                found.add(func.attr)
    return found


def test_every_attribute_the_integration_writes_is_declared():
    declared = {a for change in CHANGES for a in change.attributes} | OWN_ATTRIBUTES | TORCH_ATTRIBUTES
    undeclared = {}
    for path in sorted(INTEGRATION.glob("*.py")):
        if path.name in {"upstream.py", "cpu.py"}:
            continue
        names = _written_or_called(ast.parse(path.read_text())) - declared - {"<setattr>"}
        if names:
            undeclared[path.name] = sorted(names)
    assert undeclared == {}, "declare these in integrations/deepspeed/upstream.py"


def test_an_out_of_range_deepspeed_is_refused_naming_version_and_remedy():
    pytest.importorskip("deepspeed")
    found = importlib.metadata.version("deepspeed")
    old = dataclasses.replace(CHANGES[0], versions="<0.1")
    with pytest.raises(PatchRefused) as info:
        verify_instance_changes([old])
    message = str(info.value)
    assert f"installed deepspeed {found} is outside the supported range '<0.1'" in message
    assert "install deepspeed<0.1, or re-review the change" in message and old.name in message


def test_changed_upstream_code_is_refused_naming_both_fingerprints():
    pytest.importorskip("deepspeed")
    change = CHANGES[0]
    stale = dataclasses.replace(change, fingerprint="0" * 16)
    with pytest.raises(PatchRefused) as info:
        verify_instance_changes([stale])
    assert f"recorded fingerprint {'0' * 16}, found {fingerprint_of_all(relied_on_code(change))}" in str(info.value)
    assert "re-review the change and update its fingerprint" in str(info.value)


def test_install_refuses_before_touching_the_engine(monkeypatch):
    """A refused DeepSpeed: the engine keeps its class's methods and map, and gets no runtime."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from chameleon_dist.config import ChameleonConfig
    from chameleon_dist.integrations.deepspeed import engine as engine_module
    from chameleon_dist.integrations.deepspeed import upstream

    monkeypatch.setattr(upstream, "INSTANCE_CHANGES",
                        (*upstream.INSTANCE_CHANGES[1:], dataclasses.replace(upstream.INSTANCE_CHANGES[0],
                                                                             versions="<0.1")))
    engine = SimpleNamespace()  # anything install touched would show up in vars(engine) or raise
    with pytest.raises(PatchRefused, match="deepspeed.*outside the supported range"):
        engine_module.install(engine, ChameleonConfig())
    assert vars(engine) == {}


def test_importing_the_records_imports_no_deepspeed():
    import subprocess
    import sys

    code = ("import sys\nimport chameleon_dist.integrations as i\ni.defined_instance_changes()\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'deepspeed']\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
