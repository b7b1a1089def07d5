"""Framework integrations: the only place in chameleon-dist that imports Megatron-core or DeepSpeed.

Importing this package imports no framework; the submodules that need one import it themselves.
"""

from __future__ import annotations

from chameleon_dist.patching import InstanceChange, Patch


def defined_patches() -> tuple[Patch, ...]:
    """Every runtime patch defined by the integrations (definitions only; nothing is applied)."""
    from chameleon_dist.integrations.deepspeed.cpu import CPU_PATCHES as DEEPSPEED_CPU_PATCHES
    from chameleon_dist.integrations.megatron.cuda_on_cpu import CPU_PATCHES
    from chameleon_dist.integrations.megatron.schedule import SCHEDULE_PATCHES

    return (*CPU_PATCHES, *SCHEDULE_PATCHES, *DEEPSPEED_CPU_PATCHES)


def defined_instance_changes() -> tuple[InstanceChange, ...]:
    """Every change the integrations make on framework objects (definitions only; nothing is changed)."""
    from chameleon_dist.integrations.deepspeed.upstream import INSTANCE_CHANGES as DEEPSPEED_INSTANCE_CHANGES

    return DEEPSPEED_INSTANCE_CHANGES
