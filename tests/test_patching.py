"""The patch mechanism (chameleon_dist.patching) and the real patch definitions of the integrations."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from chameleon_dist.integrations import defined_patches
from chameleon_dist.patching import (
    Patch,
    PatchRefused,
    apply_patches,
    fingerprint_of,
    problems_with,
    upstream_original,
)

REPO = Path(__file__).resolve().parents[1]
PYTEST_VERSION = importlib.metadata.version("pytest")


def _write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str):
    name = f"chameleon_dummy_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


DUMMY_V1 = '''
def add_one(x):
    return x + 1


class Box:
    @staticmethod
    def make(x):
        return [x]


class SubBox(Box):
    pass
'''

DUMMY_V2 = DUMMY_V1.replace("return x + 1", "return x + 1 + 0  # changed upstream")


def _plus_ten(original):
    def add_ten(x):
        return original(x) + 9

    return add_ten


def _make_patch(module, attr: str = "add_one", *, fingerprint: str | None = None, **overrides) -> Patch:
    fields = dict(
        name=f"dummy-{attr.replace('.', '-').lower()}",
        target=f"{module.__name__}:{attr}",
        package="pytest",
        versions=">=1",
        why="test",
        remove_when="never",
        fingerprint=fingerprint or fingerprint_of(_lookup(module, attr)),
        make_replacement=_plus_ten,
    )
    fields.update(overrides)
    return Patch(**fields)


def _lookup(module, attr: str):
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.fixture
def dummy(tmp_path, monkeypatch):
    return _write_module(tmp_path, monkeypatch, DUMMY_V1)


def test_out_of_range_patch_is_refused_naming_installed_version_and_range(dummy):
    patch = _make_patch(dummy, versions="<1")
    original = dummy.add_one
    with pytest.raises(PatchRefused) as info:
        with apply_patches([patch]):
            pytest.fail("must not enter")
    message = str(info.value)
    assert f"pytest {PYTEST_VERSION}" in message
    assert "'<1'" in message and patch.name in message and "nothing was patched" in message
    assert dummy.add_one is original


def test_missing_package_is_refused(dummy):
    patch = _make_patch(dummy, package="chameleon-no-such-distribution")
    with pytest.raises(PatchRefused, match="chameleon-no-such-distribution.*not installed"):
        apply_patches([patch]).apply()


def test_changed_target_is_refused_naming_the_target(dummy, tmp_path, monkeypatch):
    recorded = fingerprint_of(dummy.add_one)
    changed = _write_module(tmp_path, monkeypatch, DUMMY_V2)
    assert fingerprint_of(changed.add_one) != recorded
    patch = _make_patch(changed, fingerprint=recorded)
    original = changed.add_one
    with pytest.raises(PatchRefused) as info:
        apply_patches([patch]).apply()
    message = str(info.value)
    assert f"{changed.__name__}:add_one" in message
    assert f"recorded fingerprint {recorded}, found {fingerprint_of(changed.add_one)}" in message
    assert "re-review the patch and update its fingerprint" in message
    assert changed.add_one is original


def test_every_problem_is_listed_and_nothing_changes(dummy):
    good = _make_patch(dummy)
    bad_range = _make_patch(dummy, "Box.make", versions="<1")
    bad_print = _make_patch(dummy, "SubBox.make", fingerprint="0" * 16)
    original = dummy.add_one
    with pytest.raises(PatchRefused) as info:
        apply_patches([good, bad_range, bad_print]).apply()
    assert len(info.value.problems) == 2
    assert bad_range.name in info.value.problems[0] and bad_print.name in info.value.problems[1]
    assert dummy.add_one is original


def test_missing_target_and_duplicate_targets_are_refused(dummy):
    missing = _make_patch(dummy, "no_such_function", fingerprint="0" * 16)
    with pytest.raises(PatchRefused, match="not found"):
        apply_patches([missing]).apply()
    twice = [_make_patch(dummy), _make_patch(dummy, name="other")]
    with pytest.raises(PatchRefused, match="both replace"):
        apply_patches(twice).apply()


def test_malformed_definitions_name_the_field(dummy):
    with pytest.raises(ValueError, match="`target`"):
        _make_patch(dummy, target="no_colon_here")
    with pytest.raises(ValueError, match="`versions`"):
        _make_patch(dummy, versions="about 2")
    with pytest.raises(ValueError, match="`remove_when`"):
        _make_patch(dummy, remove_when=" ")


def test_apply_and_restore(dummy, caplog):
    patch = _make_patch(dummy)
    original = dummy.add_one
    with caplog.at_level(logging.INFO, logger="chameleon_dist.patching"):
        with apply_patches([patch]) as patch_set:
            assert patch_set.active
            assert dummy.add_one(1) == 11
            assert upstream_original(dummy.add_one) is original
    assert dummy.add_one is original and not patch_set.active
    assert any("applied patches" in r.getMessage() and patch.name in r.getMessage() for r in caplog.records)


def test_restore_on_exception(dummy):
    original = dummy.add_one
    with pytest.raises(KeyError):
        with apply_patches([_make_patch(dummy)]):
            assert dummy.add_one(0) == 10
            raise KeyError("boom")
    assert dummy.add_one is original


def test_explicit_apply_restore_and_reentrance(dummy):
    original = dummy.add_one
    patch_set = apply_patches([_make_patch(dummy)])
    assert dummy.add_one is original, "nothing happens before apply()"
    patch_set.apply()
    replacement = dummy.add_one
    with patch_set:  # re-entering the same set only counts depth
        assert dummy.add_one is replacement
    assert dummy.add_one is replacement
    patch_set.restore()
    assert dummy.add_one is original
    with pytest.raises(RuntimeError, match="not applied"):
        patch_set.restore()


def test_nested_sets_over_the_same_target_restore_in_stack_order(dummy):
    original = dummy.add_one
    patch = _make_patch(dummy)
    with apply_patches([patch]):
        outer = dummy.add_one
        with apply_patches([patch]):  # checks and wraps the upstream original, not the outer replacement
            assert dummy.add_one is not outer and dummy.add_one(1) == 11
            assert upstream_original(dummy.add_one) is original
        assert dummy.add_one is outer
    assert dummy.add_one is original


def test_class_attributes_are_restored_exactly(dummy):
    raw = dummy.Box.__dict__["make"]
    with apply_patches([_make_patch(dummy, "Box.make"), _make_patch(dummy, "SubBox.make")]):
        assert "make" in dummy.SubBox.__dict__
    assert dummy.Box.__dict__["make"] is raw and isinstance(raw, staticmethod)
    assert "make" not in dummy.SubBox.__dict__, "an inherited attribute is deleted again, not copied down"
    assert dummy.SubBox.make(3) == [3]


def test_fingerprint_without_source_uses_the_signature():
    assert fingerprint_of(len) == fingerprint_of(len)
    assert fingerprint_of(len) != fingerprint_of(abs)
    assert re.fullmatch(r"[0-9a-f]{16}", fingerprint_of(len))


REAL_PATCHES = defined_patches()


def _skip_without_megatron_lm(patch: Patch) -> None:
    """Megatron-LM's ``megatron.training`` is not on the package registry: its patches are checked where it imports."""
    if patch.target.startswith("megatron.training"):
        pytest.importorskip(patch.target.partition(":")[0], reason="Megatron-LM's megatron.training is not importable")


def test_real_patches_exist_and_have_unique_names_and_targets():
    assert REAL_PATCHES
    assert len({p.name for p in REAL_PATCHES}) == len(REAL_PATCHES)
    assert len({p.target for p in REAL_PATCHES}) == len(REAL_PATCHES)


@pytest.mark.parametrize("patch", REAL_PATCHES, ids=lambda p: p.name)
def test_real_patch_matches_installed_upstream(patch):
    """Fails when upstream changes: re-review the patch, then update its versions/fingerprint."""
    _skip_without_megatron_lm(patch)
    assert problems_with(patch) == ()


def test_nothing_is_applied_at_import():
    importlib.import_module("chameleon_dist.integrations.megatron")
    for patch in REAL_PATCHES:
        module_name, _, attr_path = patch.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if module_name.startswith("megatron.training"):
                continue  # Megatron-LM is not installed (tests/test_megatron_lm_adaptor.py)
            raise
        value = _lookup(module, attr_path)
        assert upstream_original(value) is value, f"{patch.target} is patched without anyone applying it"


def test_importing_the_patch_definitions_imports_no_framework():
    code = (
        "import sys\n"
        "import chameleon_dist.patching, chameleon_dist.integrations\n"
        "import chameleon_dist.integrations.megatron.cuda_on_cpu, chameleon_dist.integrations.deepspeed\n"
        "chameleon_dist.integrations.defined_patches()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_readme_lists_every_defined_patch():
    rows = [line for line in (REPO / "patches" / "README.md").read_text().splitlines() if line.startswith("|")]
    for patch in REAL_PATCHES:
        matching = [row for row in rows if f"`{patch.name}`" in row]
        assert len(matching) == 1, f"patches/README.md needs one table row for {patch.name}"
        assert patch.target in matching[0] and patch.versions in matching[0] and patch.package in matching[0]
