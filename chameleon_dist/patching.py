"""The one mechanism through which chameleon-dist changes code it does not own.

Every runtime patch of Megatron-core, DeepSpeed or torch is a :class:`Patch`: a frozen record of *what*
is replaced (``target``), *for which upstream versions* (``package`` + ``versions``), *why*, *when it can
go* (``remove_when``) and a ``fingerprint`` of the upstream object it was written against. Nothing is
patched at import time. :func:`apply_patches` returns a :class:`PatchSet` that, when applied (usually as
a context manager), first checks every patch -- installed version inside the range, target importable,
fingerprint unchanged -- and refuses with one :class:`PatchRefused` listing every problem *before*
touching anything. On exit the originals are restored, also after an exception; nested use restores in
stack order.

A replacement returned by ``make_replacement`` carries a reference to the upstream object it replaced
(attribute ``__chameleon_original__``), so a nested application of the same patch still sees, checks and
wraps the true upstream object instead of the outer replacement.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import inspect
import logging
import textwrap
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

logger = logging.getLogger(__name__)

FINGERPRINT_HEX_CHARS = 16
_ORIGINAL_ATTR = "__chameleon_original__"
_PATCH_NAME_ATTR = "__chameleon_patch__"
_MISSING = object()


class PatchRefused(RuntimeError):
    """One or more patches cannot be applied; nothing was changed. ``problems`` lists each one."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"{len(self.problems)} patch problem(s); nothing was patched:\n{lines}\n"
            "Install a supported version of the package named above, or re-review the patch against the "
            "installed upstream code and update its `versions`/`fingerprint` in the module that defines it."
        )


@dataclasses.dataclass(frozen=True)
class Patch:
    """Definition of one runtime patch (data only; applying it is :func:`apply_patches`' job).

    ``target`` is ``"module.path:Attr.sub_attr"``: the last attribute is the one replaced.
    ``versions`` is a PEP 440 specifier for the installed distribution ``package``.
    ``fingerprint`` is :func:`fingerprint_of` of the upstream target the patch was written against.
    ``make_replacement(original)`` returns the object installed in place of ``original``.
    """

    name: str
    target: str
    package: str
    versions: str
    why: str
    remove_when: str
    fingerprint: str
    make_replacement: Callable[[Any], Any]

    def __post_init__(self) -> None:
        module, sep, attrs = self.target.partition(":")
        if not (module and sep and attrs and all(attrs.split("."))):
            raise ValueError(
                f"Patch {self.name!r}: `target` must look like 'module.path:Attr.sub_attr', got {self.target!r}"
            )
        try:
            SpecifierSet(self.versions)
        except InvalidSpecifier as exc:
            raise ValueError(
                f"Patch {self.name!r}: `versions` {self.versions!r} is not a PEP 440 specifier ({exc})"
            ) from exc
        if not callable(self.make_replacement):
            raise ValueError(f"Patch {self.name!r}: `make_replacement` must be callable(original) -> replacement")
        for field in ("name", "package", "why", "remove_when", "fingerprint"):
            if not getattr(self, field).strip():
                raise ValueError(f"Patch {self.name!r}: `{field}` must not be empty")

    @property
    def defined_in(self) -> str:
        """Module that defines the replacement (where to edit the patch)."""
        return getattr(self.make_replacement, "__module__", None) or "<unknown module>"


def unbound_replacement(name: str, needs: str) -> Callable[[Any], Any]:
    """A ``make_replacement`` for a ``Patch`` whose replacement must first be bound to an object (a runtime's
    tracker, an adaptor): applying the record itself raises, saying what it ``needs``."""

    def refuse(original: Any) -> Any:
        raise RuntimeError(f"patch {name!r} needs {needs}")

    return refuse


def fingerprint_of(obj: Any) -> str:
    """A short sha256 of ``obj``'s source (or of its signature when it has no Python source; a mapping, such as
    a class's dispatch table, by the qualified names of its keys and values)."""
    if isinstance(obj, dict):
        text = "\n".join(sorted(f"{_qualified(key)} -> {_qualified(value)}" for key, value in obj.items()))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX_CHARS]
    try:
        text = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        try:
            text = repr(inspect.signature(obj))
        except (TypeError, ValueError):
            text = f"{type(obj).__module__}.{type(obj).__qualname__}:{getattr(obj, '__qualname__', '')}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX_CHARS]


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', type(obj).__module__)}.{getattr(obj, '__qualname__', repr(obj))}"


def fingerprint_of_all(objects: Iterable[Any]) -> str:
    """One short sha256 over :func:`fingerprint_of` of each of ``objects``, in order."""
    text = "\n".join(fingerprint_of(obj) for obj in objects)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX_CHARS]


def upstream_original(obj: Any) -> Any:
    """Follow replacements installed by this module back to the upstream object."""
    while hasattr(obj, _ORIGINAL_ATTR):
        obj = getattr(obj, _ORIGINAL_ATTR)
    return obj


@dataclasses.dataclass(frozen=True)
class _Resolved:
    owner: Any
    attr: str
    raw: Any  # what owner.__dict__ holds (``_MISSING`` if inherited), used to restore exactly
    value: Any  # what getattr returns


def _resolve(target: str) -> _Resolved:
    module_name, _, attr_path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = attr_path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    value = getattr(owner, attr)
    if inspect.isclass(owner):
        raw = owner.__dict__.get(attr, _MISSING)
    else:
        raw = value
    return _Resolved(owner=owner, attr=attr, raw=raw, value=value)


def installed_version(package: str) -> str | None:
    """Installed version of distribution ``package``, or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_problem(where: str, package: str, versions: str, kind: str) -> tuple[str | None, str | None]:
    """(installed version, problem): the problem is None when ``package`` is installed inside ``versions``."""
    found = installed_version(package)
    if found is None:
        return None, f"{where}: package {package!r} is not installed; it supports {package}{versions}"
    try:
        in_range = SpecifierSet(versions).contains(Version(found), prereleases=True)
    except InvalidVersion:
        in_range = False
    if not in_range:
        return found, (
            f"{where}: installed {package} {found} is outside the supported range "
            f"{versions!r}; install {package}{versions}, or re-review the {kind} for "
            f"{found} and update its `versions`"
        )
    return found, None


def problems_with(patch: Patch) -> tuple[str, ...]:
    """Every reason ``patch`` cannot be applied to the installed packages (empty when it can)."""
    where = f"patch {patch.name!r} on {patch.target} (defined in {patch.defined_in})"
    found, problem = _version_problem(where, patch.package, patch.versions, "patch")
    if problem is not None:
        return (problem,)
    try:
        resolved = _resolve(patch.target)
    except (ImportError, AttributeError) as exc:
        return (
            f"{where}: target {patch.target} not found in {patch.package} {found} "
            f"({type(exc).__name__}: {exc}); the upstream code moved: re-review the patch",
        )
    actual = fingerprint_of(upstream_original(resolved.value))
    if actual != patch.fingerprint:
        return (
            f"{where}: target {patch.target} changed upstream ({patch.package} {found}): recorded "
            f"fingerprint {patch.fingerprint}, found {actual}; re-review the patch and update its fingerprint",
        )
    return ()


def verify_patches(patches: Iterable[Patch]) -> None:
    """Raise :class:`PatchRefused` listing every problem of ``patches``; return quietly if there are none."""
    patches = tuple(patches)
    problems: list[str] = []
    seen: dict[str, str] = {}
    for patch in patches:
        if patch.target in seen:
            problems.append(
                f"patches {seen[patch.target]!r} and {patch.name!r} both replace {patch.target}; "
                "apply only one of them"
            )
        seen.setdefault(patch.target, patch.name)
        problems.extend(problems_with(patch))
    if problems:
        raise PatchRefused(problems)


@dataclasses.dataclass
class _Applied:
    patch: Patch
    resolved: _Resolved
    replacement: Any


class PatchSet:
    """A group of patches applied and restored together. Use as a context manager, or apply()/restore().

    Re-entering the same ``PatchSet`` only counts depth; the originals come back when the outermost use
    ends. Separate ``PatchSet`` objects over the same targets nest and restore in stack order.
    """

    def __init__(self, patches: Iterable[Patch]) -> None:
        self.patches: tuple[Patch, ...] = tuple(patches)
        self._applied: list[_Applied] = []
        self._depth = 0

    @property
    def active(self) -> bool:
        """Whether the patches are currently installed by this set."""
        return self._depth > 0

    def apply(self) -> PatchSet:
        """Check every patch, then install them all (or raise :class:`PatchRefused` and change nothing)."""
        if self._depth > 0:
            self._depth += 1
            return self
        verify_patches(self.patches)
        prepared = []
        for patch in self.patches:
            resolved = _resolve(patch.target)
            replacement = patch.make_replacement(upstream_original(resolved.value))
            _mark(replacement, patch, upstream_original(resolved.value))
            prepared.append(_Applied(patch=patch, resolved=resolved, replacement=replacement))
        try:
            for item in prepared:
                setattr(item.resolved.owner, item.resolved.attr, item.replacement)
                self._applied.append(item)
        except BaseException:
            self._restore_all()
            raise
        self._depth = 1
        if self.patches:
            logger.info("applied patches: %s", ", ".join(p.name for p in self.patches))
        return self

    def restore(self) -> None:
        """Undo :meth:`apply` (the outermost one, when re-entered)."""
        if self._depth == 0:
            raise RuntimeError("PatchSet.restore() called but the patches are not applied")
        self._depth -= 1
        if self._depth == 0:
            self._restore_all()

    def _restore_all(self) -> None:
        names = []
        while self._applied:
            item = self._applied.pop()
            owner, attr = item.resolved.owner, item.resolved.attr
            if getattr(owner, attr, None) is not item.replacement:
                logger.warning(
                    "patch %r: %s was changed by someone else while patched; restoring the original anyway "
                    "(patch sets must be restored in the reverse order of applying)",
                    item.patch.name,
                    item.patch.target,
                )
            if item.resolved.raw is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, item.resolved.raw)
            names.append(item.patch.name)
        if names:
            logger.info("restored patches: %s", ", ".join(reversed(names)))

    def __enter__(self) -> PatchSet:
        return self.apply()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()


def apply_patches(patches: Iterable[Patch]) -> PatchSet:
    """A :class:`PatchSet` for ``patches``; nothing changes until it is entered (or ``apply()`` is called)."""
    return PatchSet(patches)


def _mark(replacement: Any, patch: Patch, original: Any) -> None:
    if replacement is original:
        raise TypeError(
            f"patch {patch.name!r}: make_replacement returned the original object; return a new function "
            f"(defined in {patch.defined_in})"
        )
    try:
        setattr(replacement, _ORIGINAL_ATTR, original)
        setattr(replacement, _PATCH_NAME_ATTR, patch.name)
    except (AttributeError, TypeError) as exc:
        raise TypeError(
            f"patch {patch.name!r}: make_replacement must return an object that accepts attributes "
            f"(e.g. a plain function), got {type(replacement).__name__} (defined in {patch.defined_in})"
        ) from exc


INSTANCE_CHANGE_KINDS = ("wraps", "replaces", "writes", "calls", "reads")


@dataclasses.dataclass(frozen=True)
class InstanceChange:
    """Sibling of :class:`Patch` for what an integration changes on *objects* of a framework (the class and its
    module stay untouched): a bound method wrapped on an instance, an instance attribute replaced, private state
    written, a private method called, or private state read. Data only; the integration does the change itself,
    after :func:`verify_instance_changes` passed.

    ``owner`` is ``"module.path:Class"`` (or a module, for module-level state) whose objects are changed;
    ``attributes`` the names changed on them; ``how`` one of :data:`INSTANCE_CHANGE_KINDS`;
    ``relies_on`` the upstream code (``"module.path:Qual.name"``) the change was reviewed against, whose
    :func:`fingerprint_of_all` is ``fingerprint``; ``defined_in`` the module that makes the change.
    """

    name: str
    owner: str
    attributes: tuple[str, ...]
    how: str
    relies_on: tuple[str, ...]
    package: str
    versions: str
    why: str
    remove_when: str
    fingerprint: str
    defined_in: str

    def __post_init__(self) -> None:
        if self.how not in INSTANCE_CHANGE_KINDS:
            raise ValueError(f"InstanceChange {self.name!r}: `how` must be one of {INSTANCE_CHANGE_KINDS}, got {self.how!r}")
        if not self.attributes or not all(a.strip() for a in self.attributes):
            raise ValueError(f"InstanceChange {self.name!r}: `attributes` must name at least one attribute")
        for target in self.relies_on:
            module, sep, attrs = target.partition(":")
            if not (module and sep and attrs and all(attrs.split("."))):
                raise ValueError(f"InstanceChange {self.name!r}: `relies_on` entries must look like "
                                 f"'module.path:Attr.sub_attr', got {target!r}")
        if not self.relies_on:
            raise ValueError(f"InstanceChange {self.name!r}: `relies_on` must name the upstream code it relies on")
        try:
            SpecifierSet(self.versions)
        except InvalidSpecifier as exc:
            raise ValueError(
                f"InstanceChange {self.name!r}: `versions` {self.versions!r} is not a PEP 440 specifier ({exc})"
            ) from exc
        for field in ("name", "owner", "package", "why", "remove_when", "fingerprint", "defined_in"):
            if not getattr(self, field).strip():
                raise ValueError(f"InstanceChange {self.name!r}: `{field}` must not be empty")


def _resolve_owner(owner: str) -> Any:
    module_name, _, attr_path = owner.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split(".") if attr_path else ():
        obj = getattr(obj, part)
    return obj


def _code_at(target: str) -> Any:
    """The upstream object at ``target``; for a function behind a decorator that does not keep ``__wrapped__``
    (DeepSpeed's ``instrument_w_nvtx``), the decorated function itself, whose source is the code relied on."""
    obj = upstream_original(_resolve(target).value)
    name = target.rpartition(".")[2].rpartition(":")[2]
    if inspect.isfunction(obj) and obj.__name__ != name:
        inner = [cell.cell_contents for cell in obj.__closure__ or ()
                 if inspect.isfunction(cell.cell_contents) and cell.cell_contents.__name__ == name]
        if len(inner) == 1:
            return inner[0]
    return obj


def relied_on_code(change: InstanceChange) -> tuple[Any, ...]:
    """The upstream objects ``change.relies_on`` names (raises ImportError/AttributeError when one moved)."""
    return tuple(_code_at(target) for target in change.relies_on)


def problems_with_change(change: InstanceChange) -> tuple[str, ...]:
    """Every reason ``change`` must not be made on the installed packages (empty when it may)."""
    where = (f"instance change {change.name!r} ({change.how} {', '.join(change.attributes)} on {change.owner} "
             f"objects, in {change.defined_in})")
    found, problem = _version_problem(where, change.package, change.versions, "change")
    if problem is not None:
        return (problem,)
    try:
        _resolve_owner(change.owner)
        code = relied_on_code(change)
    except (ImportError, AttributeError) as exc:
        return (
            f"{where}: {change.owner} or the code it relies on ({', '.join(change.relies_on)}) is not found in "
            f"{change.package} {found} ({type(exc).__name__}: {exc}); the upstream code moved: re-review the change",
        )
    actual = fingerprint_of_all(code)
    if actual != change.fingerprint:
        return (
            f"{where}: the code it relies on ({', '.join(change.relies_on)}) changed upstream ({change.package} "
            f"{found}): recorded fingerprint {change.fingerprint}, found {actual}; re-review the change and "
            "update its fingerprint",
        )
    return ()


def verify_instance_changes(changes: Iterable[InstanceChange]) -> None:
    """Raise :class:`PatchRefused` listing every problem of ``changes``; return quietly if there are none."""
    problems = [problem for change in changes for problem in problems_with_change(change)]
    if problems:
        raise PatchRefused(problems)
