"""The planner: for a model, a cluster and its memory, which combination of parallel layout (TP, PP, DP,
VPP, EP, micro-batch), recomputation and Chameleon swapping trains fastest, and by how much.

Pure Python: a per-rank cost model (``memory``, ``timing``, ``efficiency``), a swap estimate monotone in
memory and link speed (``swap_model``, ``swap_prefix``), host RAM per node (``host_memory``), the layouts a
world size allows (``space``), a layout search (``search``), comparison tables (``tables``), ranges over
assumed inputs (``sensitivity``), calibration files (``calibration``), the paper's comparison
(``reproduce``) and one device's predictions per approach with the host link's physical bound
(``single_device``). Profiles live in ``configs/models``, ``configs/hardware`` and ``configs/clusters``.
"""

from chameleon_dist.planner.layout import RECOMPUTE_MODES, Layout, RecomputeMode, in_flight_chunks, schedule
from chameleon_dist.planner.memory import (
    StageMemory,
    layer_activations,
    rank_peaks,
    stage_memory,
    stage_memory_swapping_everything,
)
from chameleon_dist.planner.profiles import (
    HardwareProfile,
    ModelProfile,
    TrainingSetup,
    load_hardware,
    load_model,
    load_profile,
    shipped_names,
)
from chameleon_dist.planner.search import Approach, Plan, PlanError, SearchResult, evaluate, search
from chameleon_dist.planner.single_device import (
    PhysicalBound,
    Prediction,
    hardware_from_preset,
    physical_bound,
    predict_single_device,
)
from chameleon_dist.planner.space import SearchSpace
from chameleon_dist.planner.timing import TimeBreakdown, iteration_time

__all__ = [
    "RECOMPUTE_MODES", "Layout", "RecomputeMode", "in_flight_chunks", "schedule",
    "StageMemory", "layer_activations", "rank_peaks", "stage_memory", "stage_memory_swapping_everything",
    "HardwareProfile", "ModelProfile", "TrainingSetup", "load_hardware", "load_model", "load_profile", "shipped_names",
    "Approach", "Plan", "PlanError", "SearchResult", "SearchSpace", "evaluate", "search",
    "PhysicalBound", "Prediction", "hardware_from_preset", "physical_bound", "predict_single_device",
    "TimeBreakdown", "iteration_time",
]
