"""The online profiler: per-iteration sequence signatures, detailed traces, and the stage machine."""

from chameleon_dist.profiler.recorder import TraceRecorder
from chameleon_dist.profiler.scope import TrainingScope, layer_of
from chameleon_dist.profiler.signature import Comparison, OpVocabulary, Signature, SignatureMode, compare
from chameleon_dist.profiler.stages import StageMachine

__all__ = [
    "Comparison",
    "OpVocabulary",
    "Signature",
    "SignatureMode",
    "StageMachine",
    "TraceRecorder",
    "TrainingScope",
    "compare",
    "layer_of",
]
