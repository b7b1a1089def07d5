"""Policy generation and selection: logical layers and their timing, candidates and Eq. 2 scores, the simulator, the
``Policy`` the executor applies, and the ``PolicyController`` that chooses one per iteration. Pure Python over a
``StepTrace``; no device needed."""

from chameleon_dist.policy.candidates import Candidate, Reduction, find_candidates, reduction_list, score_candidates
from chameleon_dist.policy.generator import PolicySet, generate_policies
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.layers import (
    Eq1Error,
    LayerGroup,
    calibrated_group_times_s,
    eq1_error,
    eq1_group_times_s,
    logical_layers,
    op_times_s,
)
from chameleon_dist.policy.model import POLICY_SCHEMA_VERSION, Decision, Infeasibility, LayerLoad, Policy, PolicyEntry
from chameleon_dist.policy.simulator import Planned, SimResult, simulate

__all__ = [
    "Candidate", "Reduction", "find_candidates", "reduction_list", "score_candidates",
    "PolicySet", "PolicySettings", "generate_policies",
    "Eq1Error", "LayerGroup", "calibrated_group_times_s", "eq1_error", "eq1_group_times_s", "logical_layers", "op_times_s",
    "POLICY_SCHEMA_VERSION", "Decision", "Infeasibility", "LayerLoad", "Policy", "PolicyEntry",
    "Planned", "SimResult", "simulate",
]
