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
from chameleon_dist.planner.memory import StageMemory, head_activations, layer_activations, stage_layers, stage_memory
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup
from chameleon_dist.planner.swap_model import storage_parts
from chameleon_dist.planner.timing import layer_flops, stage_timing

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
    )


def cpu_peak(model: ModelProfile, setup: TrainingSetup, micro_batch: int, recompute: str = "none",
             swap_everything: bool = False) -> StageMemory:
    """The predicted per-rank peak of a single-rank run (TP = PP = DP = 1)."""
    layout = Layout(micro_batch=micro_batch, recompute=recompute)
    return stage_memory(model, setup, layout, 0, swap_everything=swap_everything)


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


def swap_everything_stall_s(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, micro_batch: int,
                            prefetch_depth: int = 2) -> float:
    """Stall of the runtime's baseline executor on one micro-batch: every saved tensor of at least
    ``setup.min_swap_bytes`` is copied out when it is saved (FIFO on the device-to-host link) and back
    before its use (FIFO on the host-to-device link, never before its copy out completed), the next
    ``prefetch_depth`` storages in reverse save order being requested when one is used. Saves are spread
    evenly over their layer's forward, uses over its backward; the training stream waits for late copies."""
    layout = Layout(micro_batch=micro_batch)
    timing = stage_timing(model, hardware, setup, layout)
    layer_parts = storage_parts(layer_activations(model, setup, 1, micro_batch).tensors)
    head_parts = storage_parts(head_activations(model, setup, 1, micro_batch))
    blocks = [(layer_parts, timing.layer.forward_op_s, timing.layer.backward_op_s)] * model.num_layers
    blocks.append((head_parts, timing.head_forward_s, timing.head_backward_s))
    floor = max(1, setup.min_swap_bytes)
    clock = d2h_free = 0.0
    saved: list[tuple[int, float]] = []  # (bytes, time its copy out completes), in save order
    for parts, forward_s, _ in blocks:
        for j, nbytes in enumerate(parts):
            at = clock + forward_s * (j + 1) / len(parts)
            if nbytes >= floor:
                d2h_free = max(at, d2h_free) + nbytes / hardware.d2h_bytes_per_s
                saved.append((nbytes, d2h_free))
        clock += forward_s
    uses: list[float] = []  # when backward needs each saved storage, in reverse save order
    t = clock
    for parts, _, backward_s in reversed(blocks):
        wanted = [n for n in parts if n >= floor]
        for j in range(len(wanted)):
            uses.append(t + backward_s * j / max(1, len(wanted)))
        t += backward_s
    order = list(reversed(saved))
    issued = [0.0] * len(order)
    done = [0.0] * len(order)
    h2d_free, stall, next_issue = 0.0, 0.0, 0
    for k, use_at in enumerate(uses):
        use_at += stall
        while next_issue < len(order) and next_issue <= k + prefetch_depth:
            request = use_at if next_issue == k else (use_at if next_issue > k else issued[next_issue])
            nbytes, out_done = order[next_issue]
            start = max(request, h2d_free, out_done)
            h2d_free = done[next_issue] = start + nbytes / hardware.swap_h2d_bytes_per_s
            issued[next_issue] = request
            next_issue += 1
        if done[k] > use_at:
            stall += done[k] - use_at
    return stall


__all__ = ["calibrated_hardware", "cpu_peak", "cpu_setup", "megatron_cpu_gpt", "stage_layers", "swap_everything_stall_s"]
