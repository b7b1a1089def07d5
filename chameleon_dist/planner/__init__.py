"""The planner: for a model, a cluster and its memory, which combination of parallel layout (TP, PP, DP,
VPP, EP, micro-batch), recomputation and Chameleon swapping trains fastest, and by how much.

Pure Python: a per-rank cost model (``memory``, ``timing``), the policy simulator for the swap option
(``swap_model``), a layout search (``search``), comparison tables (``tables``) and the paper's
comparison (``reproduce``). Profiles live in ``configs/models`` and ``configs/hardware``.
"""

from chameleon_dist.planner.layout import RECOMPUTE_MODES, Layout, in_flight_chunks, schedule
from chameleon_dist.planner.memory import StageMemory, layer_activations, rank_peaks, stage_memory
from chameleon_dist.planner.profiles import (
    HardwareProfile,
    ModelProfile,
    TrainingSetup,
    load_hardware,
    load_model,
    load_profile,
    shipped_names,
)
from chameleon_dist.planner.search import Plan, PlanError, SearchResult, SearchSpace, evaluate, search
from chameleon_dist.planner.timing import TimeBreakdown, iteration_time

__all__ = [
    "RECOMPUTE_MODES", "Layout", "in_flight_chunks", "schedule",
    "StageMemory", "layer_activations", "rank_peaks", "stage_memory",
    "HardwareProfile", "ModelProfile", "TrainingSetup", "load_hardware", "load_model", "load_profile", "shipped_names",
    "Plan", "PlanError", "SearchResult", "SearchSpace", "evaluate", "search",
    "TimeBreakdown", "iteration_time",
]
