"""The planner's predictions for one device (TP1 PP1 DP1): a whole model, or a pipeline stage's layers with or
without the embedding and the head, trained in ``micro_batches`` micro-batches one after the other.

Every figure comes from the planner's own cost model through :func:`~chameleon_dist.planner.search.evaluate`
(``memory`` for the peak, ``timing`` for the iteration, ``swap_model`` for the policy's verdict under a
budget). A stage of ``N`` layers is the model with ``num_layers = N``; a budget below the device's capacity
is the device's usable memory (``memory_bytes - reserved_bytes``), which is all the planner fits against.

Approaches (``APPROACHES``): ``none`` keeps every activation (its peak is reported even when it does not
fit), ``selective`` and ``full`` recompute the attention core or whole layers, ``swap`` is the swap
model's swap-only estimate for the budget (``swap_prefix``), and ``swap+recompute`` is swap on top of selective
recomputation. The planner does not model the runtime policy's own per-tensor choice to rebuild rather than
copy (its swap estimate only swaps), nor swap with full recomputation.

:func:`physical_bound` is the link's limit on overlapped swapping: the share of one layer's saved
activations that the device-to-host link moves during that layer's forward, from the same roofline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from chameleon_dist.planner.calibrate import UNBOUNDED_BYTES
from chameleon_dist.planner.layout import Layout, RecomputeMode
from chameleon_dist.planner.memory import head_activations, layer_activations
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, make_setup
from chameleon_dist.planner.search import Plan, evaluate, why_swap_failed
from chameleon_dist.planner.timing import TimeBreakdown, layer_times

# The shipped hardware profiles' training efficiency (configs/hardware/*.yaml: published LLM MFU is ~35-55%;
# Megatron-LM SC21 52%, PaLM 46%; the midpoint).
DEFAULT_EFFICIENCY = 0.45

_LAYOUTS = {  # approach -> (recomputation, swap)
    "none": (RecomputeMode.NONE, False),
    "selective": (RecomputeMode.SELECTIVE, False),
    "full": (RecomputeMode.FULL, False),
    "swap": (RecomputeMode.NONE, True),
    "swap+recompute": (RecomputeMode.SELECTIVE, True),
}
APPROACHES = tuple(_LAYOUTS)


@dataclasses.dataclass(frozen=True)
class Prediction:
    approach: str
    layout: Layout
    iteration_s: float
    peak_bytes: int  # with swap: the policy's predicted peak
    static_bytes: int  # model state and workspace: what neither swap nor recomputation moves
    budget_bytes: int
    fits: bool  # within the budget (with swap: the policy's verdict)
    stall_s: float  # swap stall per iteration
    swapped_bytes: int  # moved to the host per iteration
    time: TimeBreakdown
    reason: str = ""  # why it does not fit

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["layout"], data["time"] = self.layout.describe(), self.time.to_dict()
        return data


def stage_model(model: ModelProfile, num_layers: int | None = None) -> ModelProfile:
    """``model`` with ``num_layers`` layers (validated; None: as it is)."""
    if num_layers is None or num_layers == model.num_layers:
        return model
    return ModelProfile.model_validate({**model.model_dump(), "num_layers": num_layers,
                                        "name": f"{model.name}-{num_layers}-layers"})


def with_budget(hardware: HardwareProfile, budget_bytes: int | None) -> HardwareProfile:
    """``hardware`` whose usable memory is ``budget_bytes`` (None: its own usable memory); a budget above the
    capacity raises the capacity with it."""
    if budget_bytes is None:
        return hardware
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
    memory = max(hardware.memory_bytes, budget_bytes)
    return _replace(hardware, memory_bytes=memory, reserved_bytes=memory - budget_bytes)


def _replace(hardware: HardwareProfile, **changes: Any) -> HardwareProfile:
    return HardwareProfile.model_validate({**hardware.model_dump(), **changes})


def hardware_from_preset(preset: Any, *, efficiency: float = DEFAULT_EFFICIENCY, reserved_bytes: int = 0,
                         host_memory_bytes: int = UNBOUNDED_BYTES) -> HardwareProfile:
    """A one-device profile from an accelerator preset's figures (``chameleon_dist.device.presets``; read by
    attribute, the planner does not import the device package): its 16-bit peak at ``efficiency``, HBM rate,
    capacity, link rates, and the H2D rate while D2H also runs (``duplex_factor`` of it). Collective bus
    rates are placeholders: one device never communicates."""
    return HardwareProfile(
        name=preset.name, description=f"{preset.description} (one device, from its preset)",
        memory_bytes=preset.memory_bytes, reserved_bytes=reserved_bytes, peak_flops_per_s=preset.peak_flop_per_s,
        efficiency=efficiency, memory_bytes_per_s=preset.memory_bytes_per_s, h2d_bytes_per_s=preset.h2d_bytes_per_s,
        d2h_bytes_per_s=preset.d2h_bytes_per_s, h2d_concurrent_bytes_per_s=preset.h2d_bytes_per_s * preset.duplex_factor,
        devices_per_node=1, intra_node_bus_bytes_per_s=1.0, inter_node_bus_bytes_per_s=1.0,
        host_memory_bytes=host_memory_bytes,
    )


def _why(plan: Plan) -> str:
    if plan.feasible:
        return ""
    if plan.swap:
        failed = next((s for s in plan.swap if not s.feasible), plan.swap[0])
        return f"does not fit even with swap: {why_swap_failed(failed)}"
    return f"peak {plan.peak_bytes / 1e9:.2f} GB > budget {plan.usable_bytes / 1e9:.2f} GB"


def predict_single_device(model_profile: ModelProfile, hardware_profile: HardwareProfile, *, seq_length: int,
                          micro_batch_size: int, micro_batches: int, num_layers: int | None = None,
                          pre_process: bool = True, post_process: bool = True,
                          approaches: Iterable[str] = APPROACHES, budget_bytes: int | None = None,
                          **setup_settings: Any) -> dict[str, Prediction]:
    """Predicted iteration time and peak device bytes of each approach on one device.

    ``num_layers`` (None: the model's) layers, with the embedding (``pre_process``) and the final norm,
    output layer and loss (``post_process``); ``budget_bytes`` (None: the profile's usable memory) is what
    ``fits`` is judged against and what the swap policy must fit. ``setup_settings`` go to
    :class:`~chameleon_dist.planner.profiles.TrainingSetup` (e.g. ``attention="unfused"``, ``precision``).
    """
    unknown = [a for a in approaches if a not in _LAYOUTS]
    if unknown:
        raise ValueError(f"unknown approaches {unknown}; choose from {', '.join(APPROACHES)}")
    model = stage_model(model_profile, num_layers)
    hardware = with_budget(hardware_profile, budget_bytes)
    setup_settings.setdefault("memory_margin", 0.0)  # the budget is the run's own: nothing else shares it
    setup = make_setup(global_batch_size=micro_batch_size * micro_batches, seq_length=seq_length, **setup_settings)
    out = {}
    for approach in approaches:
        recompute, swap = _LAYOUTS[approach]
        layout = Layout(micro_batch=micro_batch_size, recompute=recompute, swap=swap, pre_process=pre_process,
                        post_process=post_process)
        plan = evaluate(model, hardware, setup, layout)
        out[approach] = Prediction(
            approach=approach, layout=layout, iteration_s=plan.iteration_s, peak_bytes=plan.peak_bytes,
            static_bytes=plan.memory[0].static_bytes, budget_bytes=hardware.usable_bytes, fits=plan.feasible,
            stall_s=plan.time.stall, swapped_bytes=plan.swapped_bytes, time=plan.time, reason=_why(plan))
    return out


@dataclasses.dataclass(frozen=True)
class PhysicalBound:
    """What the device-to-host link can take off the device while the forward runs (one micro-batch)."""

    layer_forward_s: float  # one layer's forward on the planner's roofline
    layer_saved_bytes: int  # what one layer saves for backward, no recomputation
    d2h_bytes_per_s: float
    share: float  # of a layer's saved bytes the link moves during its forward, capped at 1
    total_saved_bytes: int  # every layer's, and the head's with ``post_process``
    savable_bytes: int  # share x total_saved_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def physical_bound(model_profile: ModelProfile, hardware_profile: HardwareProfile, *, seq_length: int,
                   micro_batch_size: int = 1, num_layers: int | None = None, post_process: bool = True,
                   efficiency: float | None = None, d2h_bytes_per_s: float | None = None,
                   **setup_settings: Any) -> PhysicalBound:
    """``share = min(1, d2h_bytes_per_s x layer_forward_s / layer_saved_bytes)`` and the bytes it implies for
    the whole stage. ``efficiency`` (the MFU the roofline runs at) and ``d2h_bytes_per_s`` override the
    profile's; ``setup_settings`` go to the training setup (flash attention and bf16 by default)."""
    changes = {k: v for k, v in (("efficiency", efficiency), ("d2h_bytes_per_s", d2h_bytes_per_s)) if v is not None}
    hardware = _replace(hardware_profile, **changes) if changes else hardware_profile
    model = stage_model(model_profile, num_layers)
    setup = make_setup(global_batch_size=micro_batch_size, seq_length=seq_length, **setup_settings)
    layout = Layout(micro_batch=micro_batch_size, post_process=post_process)
    forward_s = layer_times(model, hardware, setup, layout).forward_op_s
    saved = layer_activations(model, setup, 1, micro_batch_size).full_bytes
    share = min(1.0, hardware.d2h_bytes_per_s * forward_s / saved)
    head = sum(t.nbytes for t in head_activations(model, setup, 1, micro_batch_size)) if post_process else 0
    total = model.num_layers * saved + head
    return PhysicalBound(forward_s, saved, hardware.d2h_bytes_per_s, share, total, int(share * total))


__all__ = ["APPROACHES", "DEFAULT_EFFICIENCY", "PhysicalBound", "Prediction", "hardware_from_preset",
           "physical_bound", "predict_single_device", "stage_model", "with_budget"]
