"""Detailed traces: what the recorder captures, JSON round-trip, and the rebuilt no-swap memory curve."""

import torch

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.policy.scaling import grown
from chameleon_dist.profiler import layer_of
from chameleon_dist.trace import BACKWARD, FORWARD, OPTIMIZER, StepTrace
from tests.models import lm_batch, lm_loss, make_lm

MODEL = dict(vocab=128, hidden=64, heads=4, layers=2, dropout=0.0)


def _run(iterations, enabled=True, micro_batches=2, link_bytes_per_s=None):
    model = make_lm(0, **MODEL)
    device = EmulatedDevice(10**9, h2d_bytes_per_s=link_bytes_per_s, d2h_bytes_per_s=link_bytes_per_s)
    chameleon = Chameleon({"enabled": enabled, "min_swap_bytes": 0}, device=device)
    chameleon.attach(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    traces, reports = [], []
    for step in range(iterations):
        def closure():
            for micro in range(micro_batches):
                tokens, labels = lm_batch(step * micro_batches + micro, batch=8, seq=32, vocab=MODEL["vocab"])
                (lm_loss(model, tokens, labels) / micro_batches).backward()

        chameleon.run_iteration(closure, optimizer=optimizer)
        optimizer.zero_grad(set_to_none=True)
        traces.append(chameleon.last_trace)
        reports.append(chameleon.last_report)
    return traces, reports


def test_trace_captures_phases_micro_batches_modules_and_saved_tensors():
    (trace,), (report,) = _run(1)
    assert trace.iteration == 1 and len(trace.ops) == report.num_ops > 100
    phases = trace.phase_counts()
    assert phases[FORWARD] > 0 and phases[BACKWARD] > 0 and phases[OPTIMIZER] > 0
    assert [op.phase for op in trace.ops if op.phase == OPTIMIZER] and trace.ops[-1].phase == OPTIMIZER
    assert {op.micro_batch for op in trace.ops} == {0, 1}
    layers = {op.layer for op in trace.ops if op.phase == FORWARD}
    assert {0, 1} <= layers and set(trace.layer_times_s) == {0, 1}
    assert any(path.endswith("blocks.1.fc1") for path in trace.module_paths)
    saved = [t for t in trace.tensors if t.saved]
    assert saved and any(t.is_parameter for t in saved) and any(not t.is_parameter for t in saved)
    assert trace.saved_bytes() > 0 and len(trace.swaps) > 0
    for storage in trace.storages:
        if storage.created_at >= 0 and storage.freed_at >= 0:
            assert storage.created_at <= storage.freed_at
    names = {trace.op_names[op.name_id] for op in trace.ops}
    assert "aten.mm.default" in names or "aten.addmm.default" in names


def test_only_warmup_iterations_are_traced():
    traces, reports = _run(4)
    assert [r.stage for r in reports] == ["warmup", "warmup", "gen_policy", "gen_policy"]
    assert [t.iteration for t in traces] == [1, 2, 2, 2], "gen_policy iterations keep the last warm-up trace"


def test_json_round_trip(tmp_path):
    (trace,), _ = _run(1)
    path = trace.save(tmp_path / "trace.json")
    again = StepTrace.load(path)
    assert again.to_dict() == trace.to_dict()
    assert again.no_swap_memory_curve() == trace.no_swap_memory_curve()


def test_unsupported_schema_version_is_refused():
    (trace,), _ = _run(1)
    data = trace.to_dict()
    data["schema_version"] = 999
    try:
        StepTrace.from_dict(data)
    except ValueError as exc:
        assert "schema version 999" in str(exc)
    else:
        raise AssertionError("a trace of another schema version must be refused")


def test_no_swap_curve_rebuilt_from_a_swapped_iteration_matches_a_run_without_swap():
    (swapped, _), _ = _run(2, link_bytes_per_s=2e9)
    (unswapped, _), _ = _run(2, enabled=False)
    measured_peak = max(unswapped.memory_curve())
    rebuilt_peak = max(swapped.no_swap_memory_curve())
    assert max(swapped.memory_curve()) < 0.8 * measured_peak, "the swapped run really held less"
    assert abs(rebuilt_peak - measured_peak) <= 0.02 * measured_peak, (rebuilt_peak, measured_peak)
    rebuilt = [peak for _, peak, _ in swapped.micro_batch_peaks()]
    measured = [peak for _, peak, _ in unswapped.micro_batch_peaks(unswapped.memory_curve())]
    assert len(rebuilt) == len(measured) == 2
    for a, b in zip(rebuilt, measured):
        assert abs(a - b) <= 0.02 * b


def test_no_swap_curve_counts_nothing_twice_when_restores_reuse_originals_still_being_copied():
    # A link so slow that no swap-out lands before backward needs its tensor: every restore reuses the
    # device original, which never left. The rebuilt curve must not add those bytes back a second time
    # (it did, 31% above the run without swap, whenever swap-outs were slow, e.g. on a loaded machine).
    (swapped,), (report,) = _run(1, link_bytes_per_s=1e7)
    (unswapped,), _ = _run(1, enabled=False)
    assert report.swap_out_bytes > 0 and swapped.swaps
    assert all(swap.restored_at >= 0 for swap in swapped.swaps if swapped.storages[swap.storage_id].freed_at >= 0)
    measured_peak = max(unswapped.memory_curve())
    assert abs(max(swapped.no_swap_memory_curve()) - measured_peak) <= 0.02 * measured_peak


def test_layer_of_module_paths():
    assert layer_of("decoder.layers.3.mlp.linear_fc1") == 3
    assert layer_of("blocks.12") == 12
    assert layer_of("embedding.word_embeddings") == -1


def test_a_grown_trace_counts_a_reused_original_once():
    # every restore of this iteration reused its original (the link is too slow for any swap-out to
    # land before backward): the original's lifetime grows, and no restored copy is added beside it
    (trace,), _ = _run(1, link_bytes_per_s=1e7)
    bigger = grown(trace, 1.5)
    start = trace.start_live_bytes
    for curve in ("memory_curve", "no_swap_memory_curve"):
        base, more = getattr(trace, curve)(), getattr(bigger, curve)()
        assert max(more) - start <= 1.5 * (max(base) - start) + 1, curve
