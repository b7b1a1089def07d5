"""The JSON keys and values of ``IterationReport.to_dict()`` stay as they were (issue 25 item 2): a few real
iterations on the emulated device with a fixed device model (preset h100-pcie, a fixed host cost per op),
so every figure repeats, against the reports saved in tests/data/iteration_reports.json.

The scenario covers WarmUp, GenPolicy and Stable under a capacity that makes the policy swap, a sequence
change (a longer sequence sends the runtime back to WarmUp), and a failed iteration. To write the file
again after a deliberate change of the report: ``CHAMELEON_WRITE_REPORTS=1 pytest tests/test_report_json.py``.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from chameleon_dist import Chameleon, EmulatedDevice
from tests.models import lm_batch, lm_loss, make_lm

SAVED = Path(__file__).parent / "data" / "iteration_reports.json"
MODEL = dict(vocab=128, hidden=64, heads=4, layers=2, dropout=0.0)
STEPS = [(32, 1)] * 7 + [(48, 1)] + [(32, 2)] * 2  # (tokens, micro-batches): rescaled, then a new program
CAPACITY_BYTES = 2_800_000  # under the unswapped peak (3.3 MB at 32 tokens): the policy must swap


def _device() -> EmulatedDevice:
    return EmulatedDevice(CAPACITY_BYTES, preset="h100-pcie", host_op_s=2e-5)


def _reports() -> list[dict]:
    torch.manual_seed(0)
    model = make_lm(0, **MODEL)
    chameleon = Chameleon({"min_swap_bytes": 0, "profiler": {"warmup_iterations": 2, "policy_trials": 2}},
                          device=_device())
    chameleon.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    for step, (seq, micro_batches) in enumerate(STEPS):
        batches = [lm_batch(step * 2 + i, batch=8, seq=seq, vocab=MODEL["vocab"]) for i in range(micro_batches)]

        def closure(batches=batches):
            total = torch.zeros(())
            for tokens, labels in batches:
                loss = lm_loss(model, tokens, labels) / len(batches)
                loss.backward()
                total += loss.detach()
            return total

        optimizer.zero_grad(set_to_none=True)
        chameleon.run_iteration(closure, optimizer=optimizer)
        out.append(chameleon.last_report.to_dict())
    with pytest.raises(ValueError), chameleon.iteration():  # a failed iteration's report
        lm_loss(model, *lm_batch(99, batch=8, seq=32, vocab=MODEL["vocab"])).backward()
        raise ValueError("the data loader broke\nsecond line")
    out.append(chameleon.last_report.to_dict())
    return out


def test_iteration_reports_keep_their_json_keys_and_values():
    reports = _reports()
    as_json = json.loads(json.dumps(reports))
    if os.environ.get("CHAMELEON_WRITE_REPORTS"):
        SAVED.write_text(json.dumps(as_json, indent=1) + "\n")
    saved = json.loads(SAVED.read_text())
    # the scenario still covers what it is meant to: swaps under a policy, Stable, a sequence change, a failure
    assert {r["stage"] for r in saved} == {"warmup", "gen_policy", "stable"}
    assert any(r["matched_exact"] for r in saved) and any(r["sequence_changed"] for r in saved)
    assert saved[-1]["failed"] and any(r["stage_transition"] for r in saved)
    assert len(reports) == len(saved)
    for report in (as_json[-1], saved[-1]):  # a failed iteration's time is the host's (perf_counter)
        report["iteration_s"] = None
    for i, (now, before) in enumerate(zip(as_json, saved)):
        assert list(now) == list(before), f"report {i}: keys (or their order) changed"
        assert now == before, f"report {i}: " + ", ".join(
            f"{k}: {before[k]!r} -> {now[k]!r}" for k in before if now[k] != before[k])
