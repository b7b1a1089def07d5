"""Framework integrations: the only place in chameleon-dist that imports Megatron-core, DeepSpeed or transformers.

Importing this package imports no framework; the submodules that need one import it themselves. ``hf`` is the
Hugging Face ``Trainer``'s ``ChameleonCallback`` (its holder, ``TrainerChameleon``, is a ``HeldRuntime`` too).

Shape: each framework's object (``megatron.install`` returns a ``MegatronChameleon``; DeepSpeed's
``engine.chameleon`` is a ``DeepSpeedChameleon``) holds the rank's ``Chameleon`` as ``runtime`` and an
``OpenIteration`` (``held_runtime.py``, ``open_iteration.py``); it drives the runtime through its public methods
only (``iteration``, ``retry_out_of_memory``, ``optimizer_phase``, ``attach``). What either changes in framework
code is declared: ``Patch`` records for functions (``defined_patches``), ``InstanceChange`` records for attributes
of framework objects (``defined_instance_changes``, DeepSpeed's in ``deepspeed/upstream.py``).
"""

from __future__ import annotations

from chameleon_dist.patching import InstanceChange, Patch


def defined_patches() -> tuple[Patch, ...]:
    """Every runtime patch defined by the integrations (definitions only; nothing is applied)."""
    from chameleon_dist.integrations.deepspeed.cpu import CPU_PATCHES as DEEPSPEED_CPU_PATCHES
    from chameleon_dist.integrations.megatron.cuda_on_cpu import CPU_PATCHES
    from chameleon_dist.integrations.megatron.lm_adaptor import LM_PATCHES
    from chameleon_dist.integrations.megatron.meta_routing import META_PATCHES
    from chameleon_dist.integrations.megatron.schedule import SCHEDULE_PATCHES

    return (*CPU_PATCHES, *SCHEDULE_PATCHES, *LM_PATCHES, *META_PATCHES, *DEEPSPEED_CPU_PATCHES)


def defined_instance_changes() -> tuple[InstanceChange, ...]:
    """Every change the integrations make on framework objects (definitions only; nothing is changed)."""
    from chameleon_dist.integrations.deepspeed.upstream import INSTANCE_CHANGES as DEEPSPEED_INSTANCE_CHANGES
    from chameleon_dist.integrations.hf.upstream import INSTANCE_CHANGES as HF_INSTANCE_CHANGES
    from chameleon_dist.integrations.megatron.meta_routing import META_INSTANCE_CHANGES

    return (*DEEPSPEED_INSTANCE_CHANGES, *HF_INSTANCE_CHANGES, *META_INSTANCE_CHANGES)
