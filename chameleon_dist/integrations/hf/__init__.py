"""Hugging Face ``Trainer`` integration: ``ChameleonCallback`` (``callback.py``), a ``TrainerCallback`` that runs
each optimizer step of ``Trainer.train()`` as one iteration of the rank's runtime. Importing this package imports
no transformers; ``callback.py`` imports it on first use of a name below (the optional extra ``hf``:
``pip install -e ".[hf]"``). What the callback reads of the Trainer and wraps on it is declared in ``upstream.py``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ChameleonCallback", "TrainerChameleon", "TrainerStepOutOfMemoryError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("chameleon_dist.integrations.hf.callback"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
