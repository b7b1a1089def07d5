"""Planner inputs for a measured setup: the CPU Megatron-core GPT on the emulated device, and a hardware
profile calibrated from measured per-layer time and link bandwidth.

The GPT that ``chameleon_dist.integrations.megatron.gpt.build_gpt`` makes uses Megatron's local layer spec:
LayerNorm, GeLU MLP, linear biases, learned absolute positions, untied output layer, unfused attention
(its ``b a s s`` scores buffer lives in Megatron's global memory buffer), fp32 throughout, no dropout.
Training there is plain ``torch.optim.Adam`` with ``zero_grad(set_to_none=True)``: gradients are not a
persistent buffer. The functions here only describe that setup; measuring it is the launch script's job.
"""

from __future__ import annotations

from chameleon_dist.planner.layout import Layout
from chameleon_dist.planner.memory import StageMemory, stage_memory, stage_memory_swapping_everything
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup
from chameleon_dist.planner.timing import layer_flops

UNBOUNDED_BYTES = 2**62


def megatron_cpu_gpt(num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int,
                     seq_length: int, ffn_hidden_size: int | None = None) -> ModelProfile:
    return ModelProfile(
        name=f"megatron-cpu-gpt-{num_layers}x{hidden_size}", num_layers=num_layers, hidden_size=hidden_size,
        num_attention_heads=num_attention_heads, ffn_hidden_size=ffn_hidden_size or 4 * hidden_size,
        vocab_size=vocab_size, seq_length=seq_length, activation="gelu", normalization="layernorm",
        add_bias_linear=True, position_embedding="learned", tie_embeddings=False,
    )


def cpu_setup(micro_batch: int, seq_length: int, micro_batches: int = 1, min_swap_bytes: int = 0) -> TrainingSetup:
    return TrainingSetup(
        global_batch_size=micro_batch * micro_batches, seq_length=seq_length, precision="fp32", zero_stage=0,
        attention="unfused", sequence_parallel=False, persistent_grads=False, min_swap_bytes=min_swap_bytes,
        memory_margin=0.0,  # a measured run's budget is exact
    )


def cpu_peak(model: ModelProfile, setup: TrainingSetup, micro_batch: int, recompute: str = "none",
             swap_everything: bool = False) -> StageMemory:
    """The predicted per-rank peak of a single-rank run (TP = PP = DP = 1), without swapping or with the
    executor that swaps every saved activation (the two settings the validation measures)."""
    layout = Layout(micro_batch=micro_batch, recompute=recompute)
    estimate = stage_memory_swapping_everything if swap_everything else stage_memory
    return estimate(model, setup, layout, 0)


def calibrated_hardware(model: ModelProfile, setup: TrainingSetup, micro_batch: int, layer_forward_s: float,
                        optimizer_step_s: float, link_bytes_per_s: float, memory_bytes: int = UNBOUNDED_BYTES,
                        usable_bytes: int | None = None) -> HardwareProfile:
    """A one-device profile whose compute rate reproduces the measured forward time of one layer, whose
    memory bandwidth reproduces the measured optimizer step, whose host link is the emulated one, and
    whose usable memory is the runtime's budget on a device of ``memory_bytes``."""
    flops = layer_flops(model, setup, micro_batch).forward_flops
    state_bytes = model.parameter_count(setup.seq_length) * (2 * setup.optimizer_bytes + setup.grad_bytes + setup.param_bytes)
    return HardwareProfile(
        name="calibrated-cpu", description="emulated device, calibrated from measurements on this CPU",
        memory_bytes=memory_bytes, reserved_bytes=memory_bytes - (usable_bytes or memory_bytes),
        peak_flops_per_s=flops / layer_forward_s, efficiency=1.0,
        memory_bytes_per_s=state_bytes / optimizer_step_s, h2d_bytes_per_s=link_bytes_per_s,
        d2h_bytes_per_s=link_bytes_per_s, devices_per_node=1, intra_node_bus_bytes_per_s=1.0,
        inter_node_bus_bytes_per_s=1.0, host_memory_bytes=UNBOUNDED_BYTES,
    )


__all__ = ["calibrated_hardware", "cpu_peak", "cpu_setup", "megatron_cpu_gpt"]
