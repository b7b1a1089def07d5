"""The version of the JSON documents chameleon-dist writes: iteration reports (``IterationReport.to_dict()``),
``chameleon-train``'s ``report.json``, ``chameleon-plan --json`` and the benchmarks' ``--json`` results.

Each carries ``"schema_version": SCHEMA_VERSION``. It goes up by one when a key is renamed, removed or changes
meaning; adding a key leaves it as it is (readers ignore keys they do not know). Version 1 is the layout of issue 38.
"""

from __future__ import annotations

from typing import Any, Mapping

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = "schema_version"


def versioned(document: Mapping[str, Any]) -> dict[str, Any]:
    """``document`` with ``schema_version`` as its first key (a key of that name in it is replaced)."""
    return {SCHEMA_VERSION_KEY: SCHEMA_VERSION, **{k: v for k, v in document.items() if k != SCHEMA_VERSION_KEY}}
