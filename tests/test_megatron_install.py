"""``chameleon_dist.integrations.megatron.install`` in one process (gloo, world size 1): one iteration per
``forward_backward_func`` call, the optimizer step inside it, Megatron's buffers never swapped, the rank's
coordinates in reports and logs, and the error a rank raises when it runs out of memory. The multi-rank
layouts are in test_megatron_ranks.py."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.models import TransformerShape
from chameleon_dist.profiler.scope import MicroBatchClock
from chameleon_dist.ranks import RankCoordinates, RankLogPrefix

gpt = pytest.importorskip("chameleon_dist.integrations.megatron.gpt")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules  # noqa: E402
from megatron.core.utils import GlobalMemoryBuffer  # noqa: E402

from chameleon_dist.config.errors import ConfigError  # noqa: E402
from tests.megatron_steps import forward_step as _forward_step  # noqa: E402
from chameleon_dist.config.megatron_args import add_megatron_args  # noqa: E402
from chameleon_dist.device.meter import storage_key  # noqa: E402
from chameleon_dist.integrations.megatron.install import RankOutOfMemoryError, install  # noqa: E402
from chameleon_dist.integrations.megatron.schedule import ScheduleTracker  # noqa: E402
from chameleon_dist.patching import upstream_original  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

SEED = 7
SHAPE = TransformerShape(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=32,
                         micro_batch_size=2)
CONFIG = {"device": {"kind": "emulated", "capacity": "1GB"}, "min_swap_bytes": "1KiB"}


def _ddp(model):
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(overlap_grad_reduce=True), model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def _call(forward_backward, model, step: int, micro_batches: int = 2, **kwargs):
    batches = iter([gpt.synthetic_batch(SHAPE, step * micro_batches + i, SEED) for i in range(micro_batches)])
    return forward_backward(forward_step_func=_forward_step, data_iterator=batches, model=model,
                            num_microbatches=micro_batches, seq_length=SHAPE.seq_length,
                            micro_batch_size=SHAPE.micro_batch_size, **kwargs)


@pytest.fixture
def session():
    with gpt.megatron_cpu_session(seed=SEED):
        yield


def test_each_call_is_one_iteration_closed_by_the_optimizer_step(session):
    model = _ddp(gpt.build_gpt(SHAPE, seed=SEED))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    chameleon = install([model], CONFIG, optimizer=optimizer, cuda_literals_on_cpu=True)
    try:
        forward_backward, swapped = chameleon.wrap(get_forward_backward_func()), []
        for step in range(3):
            model.zero_grad_buffer()
            _call(forward_backward, model, step)
            assert chameleon.last_report is None or chameleon.last_report.iteration == step  # still open
            for p in model.parameters():
                p.grad = p.main_grad
            optimizer.step()
            assert chameleon.last_report.iteration == step + 1 and not chameleon.last_report.failed
            swapped.append(chameleon.last_report.swap_out_bytes)
        assert swapped[0] > 0  # WarmUp swapped
        steps = chameleon.tracker.forward_steps
        with torch.no_grad():
            _call(forward_backward, model, 9, forward_only=True)  # evaluation: no iteration, steps not followed
        assert chameleon.last_report.iteration == 3 and chameleon.tracker.forward_steps == steps == 6
    finally:
        chameleon.close()


def test_without_an_optimizer_the_call_closes_the_iteration(session):
    model = gpt.build_gpt(SHAPE, seed=SEED)
    chameleon = install(model, CONFIG, cuda_literals_on_cpu=True)
    try:
        forward_backward = chameleon.wrap(get_forward_backward_func())
        _call(forward_backward, model, 0)
        assert chameleon.last_report.iteration == 1
        _call(forward_backward, model, 1)
        assert chameleon.last_report.iteration == 2
    finally:
        chameleon.close()


def test_swap_leaves_losses_and_gradients_bit_identical(session):
    def train(enabled: bool):
        model = _ddp(gpt.build_gpt(SHAPE, seed=SEED))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        chameleon = install([model], {**CONFIG, "enabled": enabled}, optimizer=optimizer, cuda_literals_on_cpu=True)
        forward_backward, losses = chameleon.wrap(get_forward_backward_func()), []
        try:
            for step in range(4):
                model.zero_grad_buffer()
                losses += [d["lm loss"] for d in _call(forward_backward, model, step, micro_batches=3)]
                for p in model.parameters():
                    p.grad = p.main_grad
                optimizer.step()
        finally:
            chameleon.close()
        return losses, [p.detach().clone() for p in model.parameters()], chameleon.device.peak_bytes()

    losses_on, params_on, _ = train(True)
    losses_off, params_off, _ = train(False)
    assert all(torch.equal(a, b) for a, b in zip(losses_on, losses_off, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params_on, params_off, strict=True))


def test_megatron_buffers_are_protected_and_the_patches_come_off(session):
    model = _ddp(gpt.build_gpt(SHAPE, seed=SEED))
    chameleon = install([model], CONFIG)
    try:
        protected = chameleon.executor.protected_keys()
        grad_data = model.buffers[0].grad_data
        assert storage_key(grad_data.untyped_storage()) in protected
        assert all(storage_key(p.untyped_storage()) in protected for p in model.parameters())
        assert chameleon.device.live_bytes() >= grad_data.nbytes  # the emulated device counts the gradient buffer
        workspace = parallel_state.get_global_memory_buffer().get_tensor((8, 16), torch.float32, "chameleon-test")
        assert chameleon.executor.is_protected(workspace)  # at once, not next iteration
        assert storage_key(workspace.untyped_storage()) in chameleon.executor.protected_keys()  # and from then on
        assert upstream_original(schedules.forward_step) is not schedules.forward_step
    finally:
        chameleon.close()
    assert upstream_original(schedules.forward_step) is schedules.forward_step
    assert upstream_original(GlobalMemoryBuffer.get_tensor) is GlobalMemoryBuffer.get_tensor


def test_coordinates_in_reports_and_log_lines(session, caplog):
    model = gpt.build_gpt(SHAPE, seed=SEED)
    chameleon = install(model, CONFIG, cuda_literals_on_cpu=True)
    label = "rank 0/1 tp 0/1 pp 0/1 dp 0/1"
    try:
        assert chameleon.coordinates == RankCoordinates()
        _call(chameleon.wrap(get_forward_backward_func()), model, 0)
        assert chameleon.last_report.rank == label
        with caplog.at_level(logging.INFO, logger="chameleon_dist"):
            logging.getLogger("chameleon_dist.runtime").info("hello")
        assert f"[{label}] hello" in caplog.messages
    finally:
        chameleon.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chameleon_dist"):
        logging.getLogger("chameleon_dist.runtime").info("after")
    assert caplog.messages == ["after"]


def test_out_of_memory_raises_naming_the_rank_and_closes_the_iteration(session):
    model = gpt.build_gpt(SHAPE, seed=SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    chameleon = install(model, {"device": {"kind": "emulated", "capacity": "500KB"}, "enabled": False},
                        optimizer=optimizer, cuda_literals_on_cpu=True)
    try:
        with pytest.raises(RankOutOfMemoryError, match=r"rank 0/1 tp 0/1 pp 0/1 dp 0/1: out of memory in iteration 1 .*"
                                                        r"cannot retry an iteration alone.*--chameleon"):
            _call(chameleon.wrap(get_forward_backward_func()), model, 0)
        assert chameleon.last_report.failed and chameleon.last_report.iteration == 1
        optimizer.step()  # not inside an iteration any more: passes through
    finally:
        chameleon.close()


def test_config_from_parsed_megatron_arguments(session):
    args = add_megatron_args(argparse.ArgumentParser()).parse_args(
        ["--chameleon-device", "emulated", "--chameleon-device-capacity", "512MB", "--no-chameleon"])
    chameleon = install(gpt.build_gpt(SHAPE, seed=SEED), args)
    try:
        assert chameleon.config.enabled is False and chameleon.device.capacity_bytes == 512 * 10**6
    finally:
        chameleon.close()


def test_schedule_tracker_names_slots_and_finds_the_backward_by_identity():
    clock = MicroBatchClock()
    tracker = ScheduleTracker(clock, protect_now=lambda tensor: None)
    outputs = [object() for _ in range(4)]
    for micro_batch, output in zip((0, 1), outputs):
        tracker.on_forward_output(output, tracker.on_forward(micro_batch, None, 2))
    slots = [tracker.on_forward(None, 1, 2) for _ in range(2)]  # chunk 1, no micro-batch given: counted
    assert slots == [2, 3] and clock.current == 3
    tracker.on_backward(outputs[0])
    assert clock.current == 0
    tracker.on_backward(outputs[0])  # taken already: unknown, the clock stays
    assert clock.current == 0 and tracker.unmatched_backward_steps == 1


def test_a_named_micro_batch_reaches_the_trace_and_the_save_sites():
    """F F B B (two micro-batches in flight): counting forward/backward turns sees one micro-batch, the
    schedule's names give two."""
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    inputs = [torch.randn(8, 64) for _ in range(2)]

    def runs(named: bool):
        chameleon = Chameleon({"device": {"kind": "emulated", "capacity": "1GB"}, "min_swap_bytes": 0})
        chameleon.attach(layer)
        clock = chameleon.profiler.micro_batches
        with chameleon.iteration():
            outs = []
            for i, x in enumerate(inputs):
                if named:
                    clock.enter(i)
                outs.append(layer(x).sum())
            for i, out in enumerate(outs):
                if named:
                    clock.enter(i)
                out.backward()
        trace = chameleon.last_trace
        return trace.phase_runs(), {site.split(":")[0] for site in trace.save_sites if site}

    guessed_runs, guessed_sites = runs(named=False)
    assert guessed_runs[:2] == [("forward", 0), ("backward", 0)] and guessed_sites == {"0"}  # both forwards as one
    assert runs(named=True) == ([("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)], {"0", "1"})


def test_coordinates_validate_and_label():
    with pytest.raises(ValueError, match="tp_rank 2 is not within tp_size 2"):
        RankCoordinates(rank=0, world_size=4, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="more than world_size"):
        RankCoordinates(world_size=2, tp_size=2, pp_size=2)
    coordinates = RankCoordinates(rank=3, world_size=4, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, vpp_size=2)
    assert coordinates.label == "rank 3/4 tp 1/2 pp 1/2 dp 0/1 vpp 2"
    prefix = RankLogPrefix(coordinates).install()
    record = logging.LogRecord("chameleon_dist.runtime", logging.INFO, __file__, 1, "x %d", (1,), None)
    assert logging.getLogger("chameleon_dist.runtime").filter(record) and record.getMessage() == f"[{coordinates.label}] x 1"
    prefix.remove()
    assert prefix not in logging.getLogger("chameleon_dist.runtime").filters


@pytest.mark.parametrize("setting, value, default, flag", [
    ("context_parallel_size", 2, 1, "--context-parallel-size"), ("cuda_graph_impl", "local", "none", "--cuda-graph-impl"),
    ("enable_cuda_graph", True, False, "--enable-cuda-graph")])
def test_unsupported_megatron_features_are_refused_naming_the_flag(session, setting, value, default, flag):
    model = _ddp(gpt.build_gpt(SHAPE, seed=SEED))
    setattr(model.config, setting, value)
    with pytest.raises(ConfigError, match=flag):
        install([model], CONFIG)
    assert upstream_original(schedules.forward_step) is schedules.forward_step  # nothing was installed
    setattr(model.config, setting, default)
    args = argparse.Namespace(context_parallel_size=2)
    with pytest.raises(ConfigError, match="--context-parallel-size 2"):
        install([model], args)
