"""The Hugging Face ``Trainer`` under ``ChameleonCallback`` (issue 26, item 4): a tiny random Llama (nothing is
downloaded) trained on CPU by ``transformers.Trainer`` with ``gradient_accumulation_steps=2``.

1. Within an emulated capacity between the swap floor and the unswapped peak, the Trainer with the callback
   reaches Stable and every logged loss and every final parameter is ``torch.equal`` to the same Trainer without
   it; the same run measuring only (``enabled: false``) runs out of memory there, and the failed step's iteration
   is closed as failed.
2. One iteration per optimizer step, also with a short last accumulation window and gradient clipping;
   evaluation is no iteration and changes nothing; an exception raised by the model inside a step closes the
   step's iteration as failed and leaves none open.
3. DeepSpeed under the Trainer (ZeRO-0, one gloo rank): the callback with ``config=None`` installs on the engine
   the Trainer built, from the ``"chameleon"`` block of the same DeepSpeed config, with the same guarantees.

Skipped without transformers and accelerate (``pip install -e ".[hf]"``). Accelerate keeps process-wide state
(``AcceleratorState``, and ``ACCELERATE_USE_DEEPSPEED`` in the environment once a Trainer ran DeepSpeed): each
Trainer here starts from a fresh state, and the DeepSpeed part puts the environment back."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chameleon_dist.config import ConfigError
from tests.scenario_models import one_thread

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from chameleon_dist.integrations.hf import ChameleonCallback, TrainerChameleon  # noqa: E402  (needs transformers)

REPO = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, LAYERS, HEADS, FFN, SEQ = 128, 64, 2, 4, 128, 32
BATCH, ACCUMULATION = 4, 2
STEPS = 6  # WarmUp 1 + GenPolicy 2 + Stable 3 with FAST
FAST = {"profiler": {"warmup_iterations": 1, "policy_trials": 2}, "min_swap_bytes": 1024, "memory_budget": 0.95}
SWAP_ALL = {"profiler": {"warmup_iterations": 0}, "min_swap_bytes": 0}  # no trace, no policy: swap everything
UNBOUNDED = 10**12
CAPACITY_POSITION = 0.6  # the capacity lies this far from the swap floor towards the unswapped peak
DEEPSPEED = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 0}}


def emulated(capacity: int, **config) -> dict:
    return {**config, "device": {"kind": "emulated", "capacity": capacity, "host_op_s": 1e-6}}  # (trials rank alike)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        self.rows = [torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(seed + i))
                     for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Reports(transformers.TrainerCallback):
    """After the Chameleon callback: the runtime's report of every optimizer step."""

    def __init__(self, callback: ChameleonCallback | None) -> None:
        self.callback = callback
        self.reports: list = []

    def on_step_end(self, args, state, control, **kwargs):
        held = self.callback.chameleon if self.callback is not None else None
        if held is not None:
            self.reports.append(held.last_report)


@dataclasses.dataclass
class Run:
    losses: list[float]
    eval_losses: list[float]
    params: dict[str, torch.Tensor]
    reports: list
    global_step: int
    callback: ChameleonCallback | None
    trainer: object


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      max_position_embeddings=SEQ, attn_implementation="eager", use_cache=False)
    return transformers.LlamaForCausalLM(config)


def fresh_accelerate() -> None:
    """Accelerate's shared state from an earlier Trainer (DeepSpeed's, say) must not decide this one's."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def train(tmp_path, callback: ChameleonCallback | None, *, steps: int = STEPS, examples: int = 64, epochs: int = 1,
          evaluate_every: int = 0, deepspeed: dict | None = None, model_hook=None, **arguments) -> Run:
    """``steps`` optimizer steps (or ``epochs`` over ``examples`` when ``steps`` is 0) of a fresh Trainer."""
    fresh_accelerate()
    model = build_model()
    if model_hook is not None:
        model.model.layers[1].register_forward_pre_hook(model_hook)
    reports = Reports(callback)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", seed=0,
        per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=steps or -1, num_train_epochs=epochs, logging_steps=1, learning_rate=1e-3, disable_tqdm=True,
        eval_strategy="steps" if evaluate_every else "no", eval_steps=evaluate_every or None, deepspeed=deepspeed,
        **arguments)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(examples),
                                   eval_dataset=Tokens(8, seed=1000) if evaluate_every else None,
                                   callbacks=[c for c in (callback, reports) if c is not None])
    run = Run([], [], {}, reports.reports, 0, callback, trainer)
    try:
        trainer.train()
    finally:
        run.losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        run.eval_losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
        run.params = {name: p.detach().clone() for name, p in model.named_parameters()}
        run.global_step = trainer.state.global_step
    return run


def peak(run: Run) -> int:
    assert run.reports and not any(r.failed for r in run.reports)
    return max(r.peak_device_bytes for r in run.reports)


def assert_identical(got: Run, want: Run) -> None:
    assert len(got.losses) == len(want.losses) == got.global_step
    assert torch.equal(torch.tensor(got.losses, dtype=torch.float64), torch.tensor(want.losses, dtype=torch.float64)), \
        (got.losses, want.losses)
    assert torch.equal(torch.tensor(got.eval_losses, dtype=torch.float64),
                       torch.tensor(want.eval_losses, dtype=torch.float64)), (got.eval_losses, want.eval_losses)
    assert got.params.keys() == want.params.keys()
    for name, value in want.params.items():
        assert torch.equal(got.params[name], value), name


def assert_one_iteration_per_step(run: Run) -> None:
    """Every optimizer step closed exactly one completed iteration, numbered as the Trainer's global step."""
    assert [r.iteration for r in run.reports] == list(range(1, run.global_step + 1))
    assert not any(r.failed for r in run.reports)
    assert not run.callback.chameleon.open_iteration.active
    assert "_run_epoch" not in vars(run.trainer)  # the Trainer is left as it was found


def capacity_between(floor_bytes: int, unswapped_bytes: int) -> int:
    assert floor_bytes < unswapped_bytes
    return int(floor_bytes + CAPACITY_POSITION * (unswapped_bytes - floor_bytes))


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "ACCELERATE_USE_DEEPSPEED")
"""Left in the environment by an earlier module's one-rank DeepSpeed session (or a Trainer that ran DeepSpeed):
with them a Trainer sets up a distributed run of its own (its own process group, as many threads as cores)."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One thread (Accelerate sets torch's threads to the cores unless OMP_NUM_THREADS says otherwise), and a
    single-process environment for the plain Trainer; everything is put back afterwards."""
    environment = dict(os.environ)
    for name in RANK_VARIABLES:
        os.environ.pop(name, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with one_thread():
            yield
    finally:
        os.environ.clear()
        os.environ.update(environment)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The Trainer without Chameleon, and the capacity its training needs with and without swapping."""
    tmp = tmp_path_factory.mktemp("plain")
    baseline = train(tmp, None)
    unswapped = peak(train(tmp, ChameleonCallback(emulated(UNBOUNDED, enabled=False)), steps=3))
    floor = peak(train(tmp, ChameleonCallback(emulated(UNBOUNDED, **SWAP_ALL)), steps=3))
    return baseline, capacity_between(floor, unswapped), unswapped


@pytest.mark.slow  # (out of the quick tier: the plain Trainer runs and a swapped one, 54 s loaded)
def test_trainer_reaches_stable_bit_identical_where_the_run_without_swapping_runs_out_of_memory(tmp_path, plain):
    baseline, capacity, unswapped = plain
    swapped = train(tmp_path, ChameleonCallback(emulated(capacity, **FAST)))
    assert isinstance(swapped.callback.chameleon, TrainerChameleon)
    assert_one_iteration_per_step(swapped)
    assert [r.stage for r in swapped.reports] == ["warmup"] + ["gen_policy"] * 2 + ["stable"] * 3
    assert swapped.callback.chameleon.stage == "stable"
    assert peak(swapped) <= capacity < unswapped
    assert all(r.swap_out_bytes > 0 for r in swapped.reports)  # the capacity needs it in every step
    assert_identical(swapped, baseline)

    measuring = ChameleonCallback(emulated(capacity, enabled=False))
    with pytest.raises(torch.OutOfMemoryError, match=r"optimizer step \d of the Trainer.*not retry.*enabled: true"):
        train(tmp_path, measuring)
    report = measuring.chameleon.last_report
    assert report.failed and "OutOfMemoryError" in report.error and not measuring.chameleon.open_iteration.active


@pytest.mark.slow  # (out of the quick tier: 23 s loaded)
def test_a_short_last_window_and_clipping_stay_one_iteration_per_step_and_bit_identical(tmp_path, plain):
    """20 examples in batches of 4 are 5 micro-batches an epoch: windows of 2, 2 and 1, over two epochs; the
    gradients are clipped to a norm the updates reach (``max_grad_norm`` 0.5); the capacity is the one above. The
    one-micro-batch windows are other sequences: the runtime profiles again, and still fits."""
    _, capacity, _ = plain
    shape = dict(steps=0, examples=20, epochs=2, max_grad_norm=0.5)
    swapped = train(tmp_path, ChameleonCallback(emulated(capacity, **FAST)), **shape)
    assert swapped.global_step == 6
    assert_one_iteration_per_step(swapped)
    assert peak(swapped) <= capacity
    assert_identical(swapped, train(tmp_path, None, **shape))


@pytest.mark.slow  # (out of the quick tier: 22 s loaded)
def test_evaluation_is_no_iteration_and_changes_nothing(tmp_path, plain):
    _, capacity, _ = plain
    with_eval = dict(steps=4, evaluate_every=2)
    swapped = train(tmp_path, ChameleonCallback(emulated(capacity, **FAST)), **with_eval)
    baseline = train(tmp_path, None, **with_eval)
    assert len(swapped.eval_losses) == 2
    assert_one_iteration_per_step(swapped)
    assert not any(r.sequence_changed for r in swapped.reports)  # the evaluations left no trace in the steps
    assert_identical(swapped, baseline)


def _raise_in_step(step: int, micro_batch: int):
    """A forward pre-hook that raises in the given training micro-batch (both counted from 1)."""
    calls = {"n": 0}

    def hook(module, args):
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == (step - 1) * ACCUMULATION + micro_batch:
                raise RuntimeError("the model failed on purpose")

    return hook


@pytest.mark.slow  # (out of the quick tier: 11 s loaded; the config and declaration checks stay quick)
def test_an_exception_inside_a_step_closes_its_iteration_as_failed(tmp_path):
    callback = ChameleonCallback(emulated(UNBOUNDED, **FAST))
    with pytest.raises(RuntimeError, match="failed on purpose"):
        train(tmp_path, callback, model_hook=_raise_in_step(3, 2))
    held = callback.chameleon
    assert held.last_report.failed and "failed on purpose" in held.last_report.error
    assert held.last_report.iteration == 3
    assert not held.open_iteration.active
    with held.runtime.iteration():  # nothing is left open: the next iteration starts
        pass
    assert held.last_report.iteration == 3 and not held.last_report.failed  # (the failed one was not counted)


def test_a_wrong_config_is_an_error_before_training():
    with pytest.raises(ConfigError, match="memory_budget"):
        ChameleonCallback({"memory_budget": "plenty"})


@pytest.mark.slow  # (out of the quick tier: 27 s loaded)
def test_readme_trainer_example_runs_and_swaps_where_measuring_only_runs_out_of_memory(tmp_path, capsys,
                                                                                      monkeypatch):
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Training with the Hugging Face Trainer", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert "callbacks=[callback]" in blocks[0]  # the three lines
    code = next(block for block in blocks if "TrainingArguments(" in block)
    monkeypatch.chdir(tmp_path)  # (output_dir="out")
    fresh_accelerate()
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_trainer_example"})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 8, lines
    assert all(float(re.search(r"peak ([\d.]+) MiB", line).group(1)) <= 2.75 for line in lines), lines
    assert "stable" in lines[-1] and all("swapped out 0.00" not in line for line in lines), lines

    measuring = code.replace('{"min_swap_bytes": "1KiB", ', '{"enabled": False, ')
    assert measuring != code
    fresh_accelerate()
    with pytest.raises(torch.OutOfMemoryError, match="optimizer step 2 of the Trainer"):
        exec(compile(measuring, "README.md", "exec"), {"__name__": "readme_trainer_example"})


def test_importing_the_integration_imports_no_transformers():
    code = ("import sys\nimport chameleon_dist.integrations, chameleon_dist.integrations.hf\n"
            "import chameleon_dist.integrations.hf.upstream\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate')]\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


# ---- DeepSpeed under the Trainer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepspeed_rank():
    pytest.importorskip("deepspeed")
    from tests.deepspeed_session import one_rank_deepspeed

    environment = dict(os.environ)
    session = one_rank_deepspeed()
    next(session)
    yield
    next(session, None)
    os.environ.clear()
    os.environ.update(environment)  # (the rank variables, ACCELERATE_USE_DEEPSPEED)
    fresh_accelerate()


def with_block(block: dict | None) -> dict:
    return {**DEEPSPEED, **({"chameleon": block} if block is not None else {})}


@pytest.mark.slow  # (out of the quick tier: 35 s loaded)
def test_deepspeed_under_the_trainer_follows_the_engine_from_the_configs_block(tmp_path, deepspeed_rank):
    """``config=None``: the block of the Trainer's DeepSpeed config; the runtime is the engine's."""
    bare = ChameleonCallback()
    baseline = train(tmp_path, bare, deepspeed=with_block(None))  # no block: nothing installed
    assert bare.chameleon is None and getattr(baseline.trainer.model_wrapped, "chameleon", None) is None
    unswapped = peak(train(tmp_path, ChameleonCallback(emulated(UNBOUNDED, enabled=False)), steps=3,
                           deepspeed=with_block(None)))
    floor = peak(train(tmp_path, ChameleonCallback(emulated(UNBOUNDED, **SWAP_ALL)), steps=3,
                       deepspeed=with_block(None)))
    capacity = capacity_between(floor, unswapped)

    callback = ChameleonCallback()
    swapped = train(tmp_path, callback, deepspeed=with_block(emulated(capacity, **FAST)))
    engine = swapped.trainer.model_wrapped
    assert type(engine).__name__ == "DeepSpeedEngine" and callback.chameleon is engine.chameleon
    assert_one_iteration_per_step(swapped)
    assert [r.stage for r in swapped.reports] == ["warmup"] + ["gen_policy"] * 2 + ["stable"] * 3
    assert peak(swapped) <= capacity < unswapped
    assert_identical(swapped, baseline)

    # (a block with "enabled": false installs nothing, as deepspeed.initialize does; a config passed to the
    # callback is installed as it is: with enabled false the runtime measures and runs out of memory)
    measuring = ChameleonCallback(emulated(capacity, enabled=False))
    with pytest.raises(torch.OutOfMemoryError, match=r"optimizer step \d of the Trainer.*not retry"):
        train(tmp_path, measuring, deepspeed=with_block(None))
    assert type(measuring.chameleon).__name__ == "DeepSpeedChameleon"
    assert measuring.chameleon.last_report.failed and not measuring.chameleon.open_iteration.active
    assert_no_rank_prefix_left()


def assert_no_rank_prefix_left() -> None:
    """A finished (or failed) train() leaves no rank prefix on chameleon-dist's loggers: later code in the process
    logs as before (a leftover prefix broke tests that read log lines)."""
    import logging

    from chameleon_dist.ranks import RankLogPrefix

    left = [name for name, logger in logging.Logger.manager.loggerDict.items() if name.startswith("chameleon_dist")
            and isinstance(logger, logging.Logger) and any(isinstance(f, RankLogPrefix) for f in logger.filters)]
    assert not left, left


@pytest.mark.slow  # (out of the quick tier: 7 s loaded)
def test_deepspeed_under_the_trainer_follows_a_short_last_window_with_clipping(tmp_path, deepspeed_rank):
    """Accelerate tells the engine where each window ends (``set_gradient_accumulation_boundary``), so the engine
    steps after the one-micro-batch window too, and the runtime's iteration closes there."""
    shape = dict(steps=0, examples=20, epochs=2, max_grad_norm=0.5, deepspeed=with_block(None))
    swapped = train(tmp_path, ChameleonCallback(emulated(UNBOUNDED, **FAST)), **shape)
    assert swapped.global_step == 6
    assert_one_iteration_per_step(swapped)
    assert_identical(swapped, train(tmp_path, None, **shape))


@pytest.mark.slow  # (out of the quick tier: 8 s loaded; the failed step without DeepSpeed stays quick)
def test_deepspeed_under_the_trainer_closes_a_failed_step(tmp_path, deepspeed_rank):
    callback = ChameleonCallback()
    with pytest.raises(RuntimeError, match="failed on purpose"):
        train(tmp_path, callback, deepspeed=with_block(emulated(UNBOUNDED, **FAST)), model_hook=_raise_in_step(2, 1))
    assert callback.chameleon.last_report.failed and callback.chameleon.last_report.iteration == 2
    assert not callback.chameleon.open_iteration.active
    assert_no_rank_prefix_left()


def test_a_wrong_block_is_an_error_when_the_trainer_is_built(tmp_path, deepspeed_rank):
    with pytest.raises(ConfigError, match=r"chameleon\.memory_budget"):
        train(tmp_path, ChameleonCallback(), deepspeed=with_block({"memory_budget": "plenty"}))


def test_everything_the_callback_writes_on_the_trainer_is_declared():
    """What ``integrations/hf`` assigns on objects that are not its own (or private methods it calls) is in
    ``hf/upstream.py`` (the same scan as for DeepSpeed's integration)."""
    from chameleon_dist.integrations.hf.upstream import INSTANCE_CHANGES
    from tests.test_deepspeed_upstream import _written_or_called

    declared = {a for change in INSTANCE_CHANGES for a in change.attributes}
    written = set()
    for path in sorted((REPO / "chameleon_dist" / "integrations" / "hf").glob("*.py")):
        written |= _written_or_called(ast.parse(path.read_text())) - {"<setattr>"}
    assert written and written <= declared, written - declared
