"""An out-of-memory retry inside one iteration leaves no trace of the failed attempt (issue 10, item 8).

``run_iteration`` re-runs the closure inside the same ``iteration()``: the signature, the detailed trace,
the saved-bytes list and the report's counters must describe only the attempt that completed, exactly as
a run without the retry would have recorded them."""


import pytest
import torch
from torch import nn

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.profiler.online import OnlineProfiler
from chameleon_dist.profiler.recorder import TraceRecorder
from chameleon_dist.profiler.signature import OpVocabulary
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.outcome import IterationOutcome
from chameleon_dist.policy.selection import PolicyController
from chameleon_dist.trace.stages import Stage, Verdict

from tests.models import lm_batch, lm_loss, make_lm

MODEL = dict(vocab=64, hidden=32, heads=4, layers=2, dropout=0.1)
WARMUP_ONLY = {"profiler": {"warmup_iterations": 3}}


def _closure(model, micro_batches=2, vocab=MODEL["vocab"]):
    def closure():
        model.zero_grad(set_to_none=True)  # every iteration starts from no gradients: the same ops
        total = torch.zeros(())
        for micro in range(micro_batches):
            tokens, labels = lm_batch(micro, batch=4, seq=16, vocab=vocab)
            loss = lm_loss(model, tokens, labels) / micro_batches
            loss.backward()
            total += loss.detach()
        return total

    return closure


def _fail_once(module: nn.Module, on_call: int) -> None:
    """``module`` raises an out-of-memory error at its ``on_call``-th forward, once: deep inside the model,
    after earlier micro-batches accumulated gradients, as a real device running out would."""
    calls = []

    def hook(mod, args):
        calls.append(1)
        if len(calls) == on_call:
            raise torch.OutOfMemoryError("injected: out of memory")

    module.register_forward_pre_hook(hook)


def _trace_view(trace):
    """Everything in a StepTrace that does not depend on wall-clock time, with op names spelled out."""
    paths = trace.module_paths
    return {
        "ops": [
            (trace.op_names[op.name_id], op.phase, op.micro_batch, paths[op.module_id] if op.module_id >= 0 else None,
             op.layer, op.inputs, op.outputs, op.live_bytes)
            for op in trace.ops
        ],
        "tensors": [(t.storage_id, t.dtype, t.shape, t.nbytes, t.is_parameter, t.saved) for t in trace.tensors],
        "storages": [(s.nbytes, s.created_at, s.freed_at, s.is_parameter) for s in trace.storages],
        "swaps": [(s.storage_id, s.nbytes, s.out_at, s.restored_at) for s in trace.swaps],
        "saves": list(trace.saves),
        "layers": sorted(trace.layer_times_s),
        "start_live_bytes": trace.start_live_bytes,
    }


def _report_counters(report):
    fields = ("num_ops", "swap_out_bytes", "swap_in_bytes", "swapped_storages", "prefetched", "passive_swaps",
              "pressure_waits", "kept_on_device_bytes", "on_demand_fetches", "stage")
    return {name: getattr(report, name) for name in fields}


def _op_names(chameleon, signature):
    names = chameleon.profiler.vocabulary.names
    return [names[i if i >= 0 else ~i] for i in signature.ids.tolist()]


def _assert_same_iteration(retried, clean):
    assert retried.last_report.oom_retries >= 1 and clean.last_report.oom_retries == 0
    retried_view, clean_view = _trace_view(retried.last_trace), _trace_view(clean.last_trace)
    assert len(retried_view["ops"]) == len(clean_view["ops"])
    for key in clean_view:
        assert retried_view[key] == clean_view[key], f"the retried iteration's trace differs in {key}"
    assert _report_counters(retried.last_report) == _report_counters(clean.last_report)
    retried_sig, clean_sig = retried.profiler.reference, clean.profiler.reference
    assert _op_names(retried, retried_sig) == _op_names(clean, clean_sig)
    assert retried_sig.saved_bytes == clean_sig.saved_bytes and len(clean_sig.saved_bytes) > 0


def _run(chameleon, closure):
    torch.manual_seed(1)  # the same dropout masks in every runtime compared
    return chameleon.run_iteration(closure)


def _runtime(model, capacity_bytes=10**10, **config):
    chameleon = Chameleon({"min_swap_bytes": "4KiB", **WARMUP_ONLY, **config}, device=EmulatedDevice(capacity_bytes))
    chameleon.attach(model)
    return chameleon


def test_a_retry_in_warmup_records_the_same_trace_as_a_clean_iteration():
    clean_model, model = make_lm(0, **MODEL), make_lm(0, **MODEL)
    # min_swap_bytes 0: the retry swaps what the first attempt did (a larger value would be lowered)
    clean, retried = _runtime(clean_model, min_swap_bytes=0), _runtime(model, min_swap_bytes=0)
    _fail_once(model.blocks[1].fc1, on_call=2)  # in the second micro-batch, inside blocks.1
    _run(clean, _closure(clean_model))
    _run(retried, _closure(model))
    assert retried.last_report.oom_retries == 1 and retried.last_report.stage == Stage.WARMUP
    _assert_same_iteration(retried, clean)
    for p, q in zip(clean_model.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)

    # the next iteration compares with a reference that holds only the completed attempt
    reference = retried.profiler.reference
    _run(retried, _closure(model))
    report = retried.last_report
    assert report.oom_retries == 0 and report.num_ops == clean.last_report.num_ops
    following = retried.profiler.reference  # (renewed by every WarmUp iteration)
    assert torch.equal(following.ids, reference.ids) and following.saved_bytes == reference.saved_bytes
    assert report.sequence_cosine == pytest.approx(1.0) and report.sequence_length_change == 0.0
    assert report.saved_bytes_change == 0.0 and not report.sequence_changed and not report.to_dict()["sequence_change_major"]


def test_a_real_out_of_memory_retry_records_the_same_trace_as_a_run_that_fit_at_once():
    """The emulated device runs out inside an op (min_swap_bytes too large to swap anything); the retry
    lowers min_swap_bytes. Its trace equals that of a runtime that used the lowered value from the start."""
    clean_model = make_lm(0, **MODEL)
    clean = _runtime(clean_model, min_swap_bytes="4KiB")
    _run(clean, _closure(clean_model))
    capacity = clean.last_report.peak_device_bytes + 4096  # fits with 4 KiB, not without swapping

    model = make_lm(0, **MODEL)
    retried = _runtime(model, capacity, min_swap_bytes="64KiB")  # nothing qualifies on the first attempt
    _run(retried, _closure(model))
    assert retried.last_report.oom_retries == 1 and retried.executor.min_swap_bytes == 4 * 2**10
    _assert_same_iteration(retried, clean)


def test_the_report_counts_the_pressure_help_of_the_completed_attempt_only():
    """The failed attempt ran short of memory twice and got help (a passive swap, then in-flight
    swap-outs that were waited for); the attempt that completed needed none: the report says so."""
    capacity_bytes = 2 * 10**7
    model = make_lm(0, **MODEL)
    chameleon = _runtime(model, capacity_bytes, min_swap_bytes=0)
    ballast = []
    helped = []

    def relieve_pressure(short_bytes):  # stands in for the executor's: a passive swap, then a wait
        helped.append(short_bytes)
        if len(helped) == 1:
            chameleon.executor.counters.passive_swaps += 1
        else:
            chameleon.executor.counters.pressure_waits += 1
        freed_bytes = sum(t.untyped_storage().nbytes() for t in ballast)
        ballast.clear()
        return freed_bytes

    chameleon.device.set_pressure_handler(relieve_pressure)
    step = _closure(model)
    attempts = []

    def closure():
        attempts.append(1)
        if len(attempts) == 1:  # runs short twice, is helped each time, then fails anyway
            for _ in range(2):
                room_floats = (capacity_bytes - chameleon.device.live_bytes()) // 4
                ballast.append(torch.empty(room_floats * 6 // 10))
                big = torch.empty(room_floats * 6 // 10)
                del big
            raise torch.OutOfMemoryError("injected: out of memory after the pressure was relieved")
        return step()

    _run(chameleon, closure)
    report = chameleon.last_report
    assert len(attempts) == 2 and len(helped) == 2 and report.oom_retries == 1
    assert report.passive_swaps == 0 and report.pressure_waits == 0


def test_the_trace_times_the_completed_attempt_and_its_own_stall():
    """Policies take compute time = trace time - stall: both must span the attempt that completed. Over a
    slow link every attempt stalls on its swap-ins; the failed one's time and stall are left out."""
    model = make_lm(0, **MODEL)
    device = EmulatedDevice(10**10, h2d_bytes_per_s=20e6, d2h_bytes_per_s=20e6)
    chameleon = Chameleon({"min_swap_bytes": 0, **WARMUP_ONLY}, device=device)
    chameleon.attach(model)
    step = _closure(model)
    starts = []  # (device-time mark, device stall) when each attempt began
    timer = device.timer()  # (times are device time: the trace's too)

    def closure():
        starts.append((timer.mark(), device.stall_s()))
        step()
        if len(starts) == 1:
            raise torch.OutOfMemoryError("injected: out of memory after a whole attempt")

    _run(chameleon, closure)
    end = timer.mark()
    timer.resolve()
    trace, report = chameleon.last_trace, chameleon.last_report
    (first, first_stall_s), (second, second_stall_s) = starts
    assert second_stall_s > first_stall_s, "the failed attempt stalled on its swap-ins"
    both_s, second_only_s = timer.elapsed_s(first, end), timer.elapsed_s(second, end)
    assert trace.iteration_s <= second_only_s < both_s, "the trace spans the second attempt, not both"
    assert trace.iteration_s > 0.5 * second_only_s
    assert chameleon.controller.trace_stall_s == {trace.iteration: pytest.approx(device.stall_s() - second_stall_s)}
    assert report.stall_s == pytest.approx(device.stall_s() - first_stall_s), "the report's stall is the iteration's"


def _verdict(observation) -> Verdict:
    """The policy controller's verdict on a GenPolicy iteration whose completed attempt needed no passive
    swap, after one out-of-memory retry (what the runtime tells it: ``Chameleon.iteration``)."""
    controller = PolicyController(PolicySettings(budget_bytes=2**30, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9))
    return controller.record(IterationOutcome(
        iteration=2, stage=Stage.GEN_POLICY, policy=None, peak_device_bytes=0, iteration_s=0.1, stall_s=0.0,
        attempt_stall_s=0.0, oom_retries=observation.failed_attempts, profiled=False,
        failed_attempt_passive_swaps=observation.failed_attempt_passive_swaps))


def test_passive_swaps_of_a_failed_attempt_still_send_the_runtime_back_to_warmup():
    """The report counts the completed attempt's passive swaps only, but a failed attempt's passive swaps
    still tell the stage machine that the policy did not hold."""
    x = torch.randn(4, 4, requires_grad=True)

    def in_gen_policy():
        profiler = OnlineProfiler(1, 2, 0.05, 0.95, lambda: 0, True)
        with profiler.observe(1, [], set) as observation:
            (x * 2).sum().backward()
        profiler.conclude(observation, [64], Verdict())
        assert profiler.stage == Stage.GEN_POLICY
        return profiler

    profiler = in_gen_policy()
    with profiler.observe(2, [], set) as observation:
        (x * 2).sum().backward()
        profiler.new_attempt(observation, passive_swaps=3)
        assert observation.ids == []
        (x * 2).sum().backward()
    profile = profiler.conclude(observation, [64], _verdict(observation))
    assert profile.transition is not None and profile.transition.after == Stage.WARMUP
    assert "3 passive swap" in profile.transition.reason
    assert profile.signature.num_ops == len(observation.ids) > 0

    # without the failed attempt's passive swaps, the same iteration is just one more trial
    profiler = in_gen_policy()
    with profiler.observe(2, [], set) as observation:
        (x * 2).sum().backward()
        profiler.new_attempt(observation)
        (x * 2).sum().backward()
    assert profiler.conclude(observation, [64], _verdict(observation)).transition is None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)])
        self.fail = False

    def forward(self, x):
        x = self.layers[0](x)
        if self.fail:  # an attempt that takes another branch (layers.2) and runs out of memory in it
            self.fail = False
            x = self.layers[2](x)
            raise torch.OutOfMemoryError("injected")
        return self.layers[1](x)


def _record_attempt(recorder, model, x, keep):
    """The attempt that completes: a forward and backward, with a swap and a restore reported."""
    y = model(x).relu()
    keep.append(y)
    swap = recorder.on_swap_out(y.untyped_storage())
    (y * 3).sum().backward()
    recorder.on_swap_in(swap, recorder.op_count)


def test_records_of_the_failed_attempt_cannot_touch_the_new_attempt():
    """A storage created in the failed attempt that dies after the restart, a module left half-entered by
    the error, and a swap index handed out before the restart must not show in (or corrupt) the records
    of the attempt that completes; hooks and parameter keys survive the restart."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(4, 8, requires_grad=True)

    def run(fail_first):
        recorder = TraceRecorder(OpVocabulary(), lambda: 0, set(), 1, True)
        ids = recorder.signature_ids = []
        recorder.watch_modules(model)
        keep = []
        with recorder:
            if fail_first:
                survivor = (x * 2).relu()  # outlives the failed attempt's end
                stale_swap = recorder.on_swap_out(survivor.untyped_storage())
                model.fail = True
                with pytest.raises(torch.OutOfMemoryError):
                    model(survivor)
                recorder.new_attempt()
                assert recorder.signature_ids is ids and recorder.op_count == 0
                ids.clear()  # (the profiler clears the signature list it shares with the recorder)
            _record_attempt(recorder, model, x, keep)
            if fail_first:
                del survivor  # dies now: its record belonged to the failed attempt
                recorder.on_swap_in(stale_swap, at_op=10**6)
                recorder.on_restored(stale_swap, keep[0])
            z = keep[0] + 1  # reads the completed attempt's storage after the stale notes
            del z
        x.grad = None
        model.zero_grad(set_to_none=True)
        return recorder.finish(), list(ids)

    clean_trace, clean_ids = run(fail_first=False)
    retried_trace, retried_ids = run(fail_first=True)
    retried_view, clean_view = _trace_view(retried_trace), _trace_view(clean_trace)
    for key in clean_view:
        assert retried_view[key] == clean_view[key], f"the failed attempt shows in {key}"
    assert clean_view["layers"] == [0, 1], "module hooks still time the layers after the restart"
    clean_names, retried_names = clean_trace.op_names, retried_trace.op_names
    assert [clean_names[i if i >= 0 else ~i] for i in clean_ids] == [retried_names[i if i >= 0 else ~i] for i in retried_ids]


def test_tiny_llama_retry_in_warmup_records_the_same_trace():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train()

    def closure(model):
        def step():
            model.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for micro in range(2):
                tokens, labels = lm_batch(micro, batch=4, seq=16, vocab=config.vocab_size)
                loss = model(input_ids=tokens, labels=labels).loss / 2
                loss.backward()
                total += loss.detach()
            return total

        return step

    clean_model, model = build(), build()
    clean, retried = _runtime(clean_model, min_swap_bytes=0), _runtime(model, min_swap_bytes=0)
    _fail_once(model.model.layers[1].mlp, on_call=2)
    _run(clean, closure(clean_model))
    _run(retried, closure(model))
    assert retried.last_report.oom_retries == 1
    _assert_same_iteration(retried, clean)
    reference = retried.profiler.reference
    _run(retried, closure(model))
    report = retried.last_report
    assert torch.equal(retried.profiler.reference.ids, reference.ids)
    assert report.sequence_cosine == pytest.approx(1.0) and not report.sequence_changed and not report.to_dict()["sequence_change_major"]
