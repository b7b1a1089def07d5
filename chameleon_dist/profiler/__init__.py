"""The online profiler: per-iteration sequence signatures, detailed traces, and the stage machine."""

from chameleon_dist.profiler.recorder import TraceRecorder, layer_of
from chameleon_dist.profiler.signature import Comparison, OpVocabulary, Signature, SignatureMode, compare
from chameleon_dist.profiler.stages import GEN_POLICY, STABLE, WARMUP, StageMachine, Transition

__all__ = [
    "Comparison",
    "GEN_POLICY",
    "OpVocabulary",
    "STABLE",
    "Signature",
    "SignatureMode",
    "StageMachine",
    "TraceRecorder",
    "Transition",
    "WARMUP",
    "compare",
    "layer_of",
]
