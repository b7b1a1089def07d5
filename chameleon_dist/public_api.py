"""The package's public surface: the modules a script outside the library (``launch/``, a user's own launcher)
may import. Everything else is internal and may move between releases without notice.

A public module's names are its ``__all__`` (for the packages, what their ``__init__.py`` re-exports from the
modules inside them). Where a script needs an internal name, the package re-exports it from a public module
(README "Public API"); ``tests/test_launch_imports.py`` checks that every ``launch/**.py`` imports only these.
This module imports nothing: reading the list costs nothing.
"""

from __future__ import annotations

PUBLIC_MODULES: tuple[str, ...] = (
    "chameleon_dist",  # Chameleon, ChameleonConfig, ConfigError, load_config, EmulatedDevice, CudaDevice, ...
    "chameleon_dist.config",
    "chameleon_dist.device",
    "chameleon_dist.device.presets",
    "chameleon_dist.trace",
    "chameleon_dist.profiler",
    "chameleon_dist.policy",
    "chameleon_dist.executor",
    "chameleon_dist.models",
    "chameleon_dist.models.llama",  # imports torch and the profiler, hence not re-exported by chameleon_dist.models
    "chameleon_dist.planner",
    "chameleon_dist.planner.calibrate",  # planner figures calibrated on CPU runs (reproduce_paper's validation)
    "chameleon_dist.planner.calibration",  # calibration files
    "chameleon_dist.planner.reproduce",  # the paper's comparison
    "chameleon_dist.report",
    "chameleon_dist.schema_version",  # the version key every JSON result carries
    "chameleon_dist.units",
    "chameleon_dist.patching",
    "chameleon_dist.integrations.megatron",
    # the package's lazy name ``install`` is shadowed by this submodule once it is imported: import the function
    # from here
    "chameleon_dist.integrations.megatron.install",
    "chameleon_dist.integrations.deepspeed",
    "chameleon_dist.integrations.hf",
)
