"""The runtime on meta tensors (issue 28): a model whose parameters and activations are meta tensors runs
through ``Chameleon`` on the emulated device as a real one does (NOTE [Meta tensors] in
``device/simulated/backend.py``). Bit-identity cannot be checked on meta, so the same small model runs once on
real tensors and once on meta, and every decision and simulated figure must be the same: the traces, the
policies, what was swapped, recomputed and when, the peaks and the device clock's times."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from chameleon_dist import Chameleon
from chameleon_dist.config import ConfigError, load_config
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.factory import make_device
from chameleon_dist.device.host_pool import HostBufferPool
from chameleon_dist.device.simulated.meta import meta_host_buffer
from launch.models.toy_gpt import GPT

VOCAB, HIDDEN, HEADS, LAYERS = 128, 64, 4, 2
BATCH, SEQ = 4, 64


def _run(device_type: str, iterations: int, config: dict, *, zero_grad: bool = True, link_bytes_per_s=None):
    """Train the toy GPT on ``device_type`` tensors for ``iterations``; returns (reports, traces, runtime, model)."""
    torch.manual_seed(0)
    with torch.device(device_type):
        model = GPT(VOCAB, HIDDEN, HEADS, LAYERS)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1)).to(device_type)
    device = EmulatedDevice(2**30, preset="h100-pcie", host_op_s=2e-5, meta_tensors=device_type == "meta",
                            h2d_bytes_per_s=link_bytes_per_s, d2h_bytes_per_s=link_bytes_per_s)
    runtime = Chameleon({"min_swap_bytes": 1024, **config}, device=device)
    runtime.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # (no step on meta values: lr 0 keeps real ones too)

    def step():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    reports, traces = [], []
    for _ in range(iterations):
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        runtime.run_iteration(step, optimizer=optimizer)
        reports.append(runtime.last_report.to_dict())
        traces.append(runtime.last_trace)
    return reports, traces, runtime, model


def _trace_view(trace):
    if trace is None:
        return None
    return trace.to_dict() if hasattr(trace, "to_dict") else trace


def _same_run(config: dict, iterations: int, **kwargs):
    """Run both ways; returns the real run's reports and the two runtimes."""
    real_reports, real_traces, real, _ = _run("cpu", iterations, config, **kwargs)
    meta_reports, meta_traces, meta, _ = _run("meta", iterations, config, **kwargs)
    for number, (a, b) in enumerate(zip(real_reports, meta_reports), start=1):
        assert a == b, f"iteration {number}: the meta run's report differs from the real run's"
    for number, (a, b) in enumerate(zip(real_traces, meta_traces), start=1):
        assert _trace_view(a) == _trace_view(b), f"iteration {number}: the meta run's trace differs"
    return real_reports, real, meta


def test_meta_run_takes_the_real_runs_decisions_under_a_tight_budget():
    """Swap and recompute, with a budget the unswapped run does not fit: every report field (stage, policy,
    peak, iteration and stall time on the device clock, bytes swapped and recomputed, matches) equal."""
    reports, real, meta = _same_run({"memory_budget": 3_000_000}, 9)
    stages = [r["stage"] for r in reports]
    assert "stable" in stages and "gen_policy" in stages, stages
    assert any(r["swap_out_bytes"] for r in reports if r["stage"] == "stable"), "nothing swapped in Stable"
    assert max(r["peak_device_bytes"] for r in reports[2:]) <= 3_000_000
    assert reports[-1]["policy"], "Stable should apply a generated policy"


def test_meta_run_takes_the_real_runs_decisions_when_it_mixes_swap_and_recomputation():
    """A 1 GB/s link cannot carry what the budget needs in time: the policies mix swaps with recomputation
    (the replayed forward ops run on meta too)."""
    reports, _, _ = _same_run({"memory_budget": 2_000_000}, 9, link_bytes_per_s=1e9)
    stable = [r for r in reports if r["stage"] == "stable"]
    assert stable and all(r["recomputed_bytes"] and r["swap_out_bytes"] for r in stable), stable


def test_meta_run_matches_with_gradients_kept_between_iterations():
    """Gradients that persist (no zero_grad): the retry snapshot copies them on both devices alike (on meta no
    gradient is known to be zero)."""
    _same_run({"memory_budget": 3_000_000}, 4, zero_grad=False)


def test_meta_run_is_metered_from_sizes():
    """Parameters and activations on meta count as device memory: the peak is the real run's, not 0."""
    reports = _run("meta", 1, {})[0]
    parameter_bytes = sum(p.numel() * 4 for p in GPT(VOCAB, HIDDEN, HEADS, LAYERS).parameters())
    assert reports[0]["peak_device_bytes"] > 2 * parameter_bytes
    assert reports[0]["iteration_s"] > 0


def test_attention_on_meta_takes_the_fused_kernel_the_cpu_run_takes():
    """On meta, torch picks the math path (the full score matrix, saved for backward): the meta device asks
    the CPU's choice instead. This fails when torch's meta device picks the fused kernel by itself; then
    ``FusedAttentionChoice`` in device/simulated/meta.py can go."""
    q = torch.empty(2, 4, 64, 16, device="meta", requires_grad=True)
    assert torch._fused_sdp_choice(q, q, q, is_causal=True) == 0, "torch now picks a fused kernel on meta"
    device = EmulatedDevice(2**30, preset="h100-pcie", host_op_s=2e-5, meta_tensors=True)
    with device.active():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert "FlashAttention" in type(out.grad_fn).__name__, type(out.grad_fn).__name__


def test_grouped_query_attention_on_meta_takes_the_fused_kernel_with_the_cpu_runs_saved_tensors():
    """Fewer key/value heads (Llama2-70B's GQA-8): the fused kernel takes them as they are, on CPU and on meta."""
    shapes = [(1, 8, 64, 16), (1, 2, 64, 16), (1, 2, 64, 16)]
    results = []
    for device_type in ("cpu", "meta"):
        q, k, v = (torch.empty(s, device=device_type, requires_grad=True) for s in shapes)
        device = EmulatedDevice(2**30, preset="h100-pcie", host_op_s=2e-5, meta_tensors=device_type == "meta")
        with device.active():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        results.append((type(out.grad_fn).__name__, tuple(out.shape)))
    assert results[0] == results[1] and "FlashAttention" in results[0][0], results


def test_a_meta_model_on_a_device_without_meta_tensors_names_the_setting():
    with torch.device("meta"):
        model = GPT(VOCAB, HIDDEN, HEADS, LAYERS)
    runtime = Chameleon({}, device=EmulatedDevice(2**30, host_op_s=2e-5))
    with pytest.raises(ValueError, match="device.meta_tensors: true"):
        runtime.attach(model)


def test_meta_tensors_on_cuda_is_a_config_error_and_auto_takes_the_emulated_device():
    with pytest.raises(ConfigError, match="meta_tensors"):
        load_config({"device": {"kind": "cuda", "meta_tensors": True}})
    device = make_device(load_config({"device": {"kind": "auto", "meta_tensors": True, "capacity": 2**30}}))
    assert device.emulated and device.meta_tensors


def test_host_pool_reuses_meta_buffers_by_storage_not_address():
    """Meta buffers all have data pointer 0: a view lent from a larger idle buffer must go back as that buffer,
    and two lent buffers must not be confused."""
    pool = HostBufferPool(None, allocate=meta_host_buffer)
    first, second = pool.acquire(1000), pool.acquire(2000)
    pool.release(second)
    view = pool.acquire(1900)  # a view of the idle 2000-byte buffer
    assert view.numel() == 1900 and pool.in_use_bytes == 3000
    pool.release(view)
    pool.release(first)
    assert pool.in_use_bytes == 0 and pool.cached_bytes == 3000


def test_recomputation_leaves_no_reference_cycle_holding_device_memory():
    """Found by the real-against-meta comparison: a recipe's argument packer was a closure that called itself,
    so it, the packed inputs and the kept tensors they held formed a cycle that only the garbage collector
    freed, at a moment that depends on every Python allocation (on a GPU: a device block released late, and a
    peak that moves from run to run). With the collector off, nothing the runtime made may be left in a cycle."""
    import gc

    gc.collect()
    gc.disable()
    try:
        reports, _, runtime, model = _run("cpu", 4, {"memory_budget": 2_000_000}, link_bytes_per_s=1e9)
        assert any(r["recomputed_bytes"] for r in reports)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()  # (the runtime and model are alive: what is found was made and dropped by the iterations)
        left = [o for o in gc.garbage if isinstance(o, torch.Tensor) and o.numel() > 1000]
        # (what the executor makes per saved tensor; a device's clock and streams refer to each other by design,
        # and a device another test dropped may be collected here)
        names = sorted({type(o).__qualname__ for o in gc.garbage
                        if type(o).__module__.startswith(("chameleon_dist.executor", "chameleon_dist.profiler"))})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not left, f"{len(left)} tensors left in reference cycles: {[tuple(t.shape) for t in left]}"
    assert not names, f"objects left in reference cycles: {names}"


def _llama_layer_times(config: dict, link_bytes_per_s: float) -> dict[int, float]:
    from chameleon_dist.models.llama import LlamaShape, build_llama

    shape = LlamaShape(num_layers=2, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632, vocab_size=512,
                       seq_length=2048, micro_batch_size=2)  # kernel-bound: ~6 ms of kernels a layer, ~1 ms of host
    model = build_llama(shape)
    device = EmulatedDevice(2**40, preset="h100-pcie", host_op_s=1e-5, meta_tensors=True,
                            h2d_bytes_per_s=link_bytes_per_s, d2h_bytes_per_s=link_bytes_per_s)
    runtime = Chameleon({"min_swap_bytes": 1 << 16, **config}, device=device)
    runtime.attach(model)
    tokens = torch.zeros(2, 2048, dtype=torch.long, device="meta")
    runtime.run_iteration(lambda: model(tokens, tokens).backward())
    return runtime.last_trace.layer_times_s


def test_warmup_layer_times_leave_out_the_waits_on_its_copies():
    """WarmUp swaps every saved tensor and orders the compute stream after each copy: the layer times it records
    (what the generator calibrates with) must be the layers' own cost, not the waits. Before, on a kernel-bound
    model over a slow link, they were several times the measured-only run's."""
    measured = _llama_layer_times({"enabled": False}, 5e9)
    warmup = _llama_layer_times({}, 5e9)
    assert measured and set(warmup) == set(measured)
    for layer, seconds in measured.items():
        assert warmup[layer] == pytest.approx(seconds, rel=0.05), (layer, warmup[layer], seconds)


def test_policies_are_generated_from_compute_only_layer_times():
    """``compute_only`` takes the swap-everything iteration's stall out of the trace's iteration time, but the
    measured layer times are compute only already (``LayerTimes.resolve``): they must not shrink by the stall's
    share again (which made Llama2-7B's forward look a third of its length, and no policy fit at 94%)."""
    import dataclasses

    from chameleon_dist.policy.trials import compute_only
    from tests.policy_traces import layered_trace

    trace = dataclasses.replace(layered_trace([[100, 200], [100, 200]], iteration_s=3.0),
                                layer_times_s={0: 0.4, 1: 0.5})
    plain = compute_only(trace, stall_s=2.0, time_scale=1.0)
    assert plain.iteration_s == pytest.approx(1.0)
    assert plain.layer_times_s == {0: 0.4, 1: 0.5}
    scaled = compute_only(trace, stall_s=2.0, time_scale=1.5)
    assert scaled.iteration_s == pytest.approx(1.5)
    assert scaled.layer_times_s == pytest.approx({0: 0.6, 1: 0.75})


def test_reading_a_value_of_a_meta_tensor_names_the_setting():
    """What cannot run on meta (a value read: ``.item()``, a Python ``bool`` of a tensor; e.g. Hugging Face's mask
    preprocessing looks at position ids) fails with a message saying why, not torch's bare one."""
    device = EmulatedDevice(2**30, preset="h100-pcie", host_op_s=2e-5, meta_tensors=True)
    x = device.track(torch.empty(4, device="meta"))
    with device.active():
        assert torch.ones(2).sum().item() == 2.0  # (a CPU tensor's value is the host's: it reads as always)
        with pytest.raises(RuntimeError, match="device.meta_tensors: true"):
            (x.sum() > 0).item()
