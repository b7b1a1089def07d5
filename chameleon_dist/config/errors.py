"""``ConfigError`` and the translation of pydantic's errors into lines a user can act on.

Every line names the dotted setting (``device.capacity``), what was wrong and what to write instead.
Validators in :mod:`chameleon_dist.config.schema` raise ``PydanticCustomError`` of type
:data:`CUSTOM_ERROR` whose message already says both (its ``field`` or ``sibling`` context names the
setting when a model or another field's validator raised it); pydantic's own errors (wrong type, out of range,
unknown key) are completed here from the field's ``hint`` and, for unknown keys, a difflib close match.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ValidationError

CUSTOM_ERROR = "chameleon_config"
CONFLICT_ERROR = "chameleon_conflict"

Loc = tuple[str | int, ...]


class ConfigError(ValueError):
    """A configuration the user has to change. ``problems`` holds one line per problem."""

    def __init__(self, problems: Sequence[str] | str, source: str | None = None):
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        self.source = None if source is None else str(source)
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            return f"{where}{self.problems[0]}"
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        return f"{where}{len(self.problems)} problems in the Chameleon configuration:\n{lines}"

    def __str__(self) -> str:
        return self._message()

    def __reduce__(self):
        return (type(self), (self.problems, self.source))

    @classmethod
    def from_validation_error(
        cls,
        exc: ValidationError,
        *,
        source: str | None = None,
        model: type[BaseModel] | None = None,
        prefix: Loc = (),
    ) -> "ConfigError":
        """All of ``exc``'s errors as one ConfigError (``prefix`` is prepended to every field path)."""
        return cls([f"{path}: {message}" for path, message in describe_errors(exc, model=model, prefix=prefix)], source)


def dotted(loc: Iterable[str | int]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _submodel(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _model_at(model: type[BaseModel] | None, loc: Loc) -> type[BaseModel] | None:
    for part in loc:
        if model is None:
            return None
        field = model.model_fields.get(str(part))
        model = None if field is None else _submodel(field.annotation)
    return model


def _section_model(root: type[BaseModel] | None, parent: Loc) -> type[BaseModel] | None:
    """The model owning the keys at ``parent``: walked from ``root``, else found as a ChameleonConfig
    nested somewhere (e.g. the ``chameleon`` block of a job file whose model was not passed)."""
    if root is not None:
        return _model_at(root, parent)
    from chameleon_dist.config.schema import ChameleonConfig

    for start in range(1, len(parent) + 1):
        found = _model_at(ChameleonConfig, parent[start:])
        if found is not None:
            return found
    return None


def _hint(model: type[BaseModel] | None, name: str | int) -> str | None:
    field = None if model is None else model.model_fields.get(str(name))
    extra = None if field is None else field.json_schema_extra
    return extra.get("hint") if isinstance(extra, dict) else None


def _unknown_key(section: type[BaseModel] | None, key: str) -> str:
    if section is None:
        return "unknown setting; remove it"
    known = list(section.model_fields)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown setting; did you mean {close[0]!r}?"
    return f"unknown setting; the settings here are: {', '.join(known)}"


def _describe(error: dict, root: type[BaseModel] | None, loc: Loc) -> tuple[Loc, str]:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    parent, name = loc[:-1], (loc[-1] if loc else "")
    if kind == CUSTOM_ERROR:
        if ctx.get("field"):  # raised by a model validator about one of its fields
            loc = loc + (ctx["field"],)
        elif ctx.get("sibling"):  # raised by a field validator about another field of the same model
            loc = parent + (ctx["sibling"],)
        hint = _hint(_section_model(root, parent), name) if ctx.get("add_hint") else None
        return loc, f"{ctx['message']}; {hint}" if hint else ctx["message"]
    if kind == CONFLICT_ERROR:
        field_loc = loc + (ctx["field"],)
        remove = " and ".join(dotted(loc + (other,)) for other in ctx["remove"])
        return field_loc, f"{ctx['message']}; remove {remove}, or remove {dotted(field_loc)}"
    if kind == "extra_forbidden":
        return loc, _unknown_key(_section_model(root, parent), str(name))
    if kind in ("model_type", "dict_type"):
        section = _section_model(root, loc)
        keys = ", ".join(section.model_fields) if section is not None else "its settings"
        return loc, f"expected a mapping of settings ({keys}), got {_short(error['input'])}"
    message = error["msg"]
    message = message[:1].lower() + message[1:]
    hint = _hint(_section_model(root, parent), name)
    text = f"{_short(error['input'])} is not valid: {message}"
    return loc, f"{text}; {hint}" if hint else text


def describe_errors(
    exc: ValidationError, *, model: type[BaseModel] | None = None, prefix: Loc = ()
) -> list[tuple[str, str]]:
    """``(dotted field path, message)`` for each of ``exc``'s errors, in order, without duplicates."""
    described: list[tuple[str, str]] = []
    for error in exc.errors(include_url=False):
        loc, message = _describe(error, model, tuple(error["loc"]))
        entry = (dotted(tuple(prefix) + loc), message)
        if entry not in described:
            described.append(entry)
    return described
