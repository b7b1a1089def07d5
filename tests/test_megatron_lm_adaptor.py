"""``chameleon_dist.integrations.megatron.lm_adaptor``: adapting a Megatron-LM training script.

Megatron-LM is not on the package registry, so most tests here run a stand-in: small modules installed in
``sys.modules`` as ``megatron.training.initialize`` and ``megatron.training.training`` whose functions have Megatron-LM's
names and signatures and call each other in ``pretrain``'s order (their code is ours, not Megatron-LM's). The schedule
they run is megatron-core's own (``get_forward_backward_func``, installed), on a small GPTModel on CPU. The tests at the
end run Megatron-LM itself and are skipped where ``megatron.training`` is not importable.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import types

import pytest
import torch

gpt = pytest.importorskip("chameleon_dist.integrations.megatron.gpt")
from megatron.core import package_info  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules  # noqa: E402

from chameleon_dist.config.errors import ConfigError  # noqa: E402
from tests.megatron_steps import forward_step as _forward_step  # noqa: E402
from chameleon_dist.integrations.megatron import lm_adaptor  # noqa: E402
from chameleon_dist.integrations.megatron.cuda_on_cpu import CudaLiteralsToCpu  # noqa: E402
from chameleon_dist.models import TransformerShape  # noqa: E402
from chameleon_dist.patching import (  # noqa: E402
    PatchRefused,
    fingerprint_of,
    fingerprint_of_all,
    problems_with,
    problems_with_change,
    relied_on_code,
    upstream_original,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

SEED = 11
SHAPE = TransformerShape(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                         micro_batch_size=2)
CHAMELEON_FLAGS = ["--chameleon-device", "emulated", "--chameleon-device-capacity", "1GB",
                   "--chameleon-min-swap-bytes", "1KiB"]

FAKE_INITIALIZE = '''
"""Stand-in for Megatron-LM's megatron/training/initialize.py: same names and signatures, our own code."""
import argparse

STATE = {"args": None, "events": [], "eval_losses": [], "schedules": []}


def get_args():
    return STATE["args"]


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="stand-in Megatron-LM", allow_abbrev=False)
    parser.add_argument("--train-iters", type=int, default=3)
    parser.add_argument("--eval-interval", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--cuda-graph-impl", default="none")
    parser.add_argument("--skip-train", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()
    STATE["events"].append("parsed")
    return args


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, allow_no_cuda=False,
                        skip_mpu_initialization=False, get_embedding_ranks=None, get_position_embedding_ranks=None,
                        parsed_args=None, store=None):
    args = parse_args(extra_args_provider, ignore_unknown_args) if parsed_args is None else parsed_args
    STATE["args"] = args
    STATE["events"].append("distributed initialized")
'''

FAKE_TRAINING = '''
"""Stand-in for Megatron-LM's megatron/training/training.py: pretrain's order of calls, our own code."""
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.training.initialize import STATE, get_args, initialize_megatron


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, get_embedding_ranks=None,
             get_position_embedding_ranks=None, non_loss_data_func=None, store=None, inprocess_call_wrapper=None):
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type, checkpointing_context={})
    train_iterator, valid_iterator = train_valid_test_dataset_provider()
    if get_args().skip_train:
        return model, optimizer, []
    losses = train(forward_step_func, model, optimizer, opt_param_scheduler, train_iterator, valid_iterator, None,
                   model[0].config, {}, None)
    return model, optimizer, losses


def setup_model_and_optimizer(model_provider_func, model_type, checkpointing_context=None):
    args = get_args()
    model = [model_provider_func()]
    params = [p for chunk in model for p in chunk.parameters()]
    optimizer = None if args.skip_train else torch.optim.Adam(params, lr=1e-3)
    STATE["events"].append("model and optimizer built")
    return model, optimizer, None


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config, checkpointing_context, non_loss_data_func, inference_model=None):
    args = get_args()
    forward_backward_func = get_forward_backward_func()
    STATE["schedules"].append(forward_backward_func)
    losses = []
    for iteration in range(args.train_iters):
        losses += train_step(forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config,
                             forward_backward_func, iteration=iteration)
        if (iteration + 1) % args.eval_interval == 0:
            STATE["eval_losses"] += evaluate(forward_step_func, valid_data_iterator, model, None, config, eval_iters=1)
    return losses


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, forward_backward_func,
               iteration=None):
    args = get_args()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                   num_microbatches=args.micro_batches, seq_length=args.seq_length,
                                   micro_batch_size=args.micro_batch_size, decoder_seq_length=None, forward_only=False)
    for chunk in model:
        for param in chunk.parameters():
            param.grad = param.main_grad
    optimizer.step()
    return [loss["lm loss"] for loss in losses]


def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False,
             non_loss_data_func=None, eval_iters=None):
    args = get_args()
    forward_backward_func = get_forward_backward_func()
    with torch.no_grad():
        losses = forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                       num_microbatches=args.micro_batches, seq_length=args.seq_length,
                                       micro_batch_size=args.micro_batch_size, forward_only=True)
    return [loss["lm loss"] for loss in losses]
'''


def _load(name: str, path, monkeypatch) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _install_fake(tmp_path, monkeypatch) -> types.ModuleType:
    package = types.ModuleType("megatron.training")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    (tmp_path / "initialize.py").write_text(FAKE_INITIALIZE)
    (tmp_path / "training.py").write_text(FAKE_TRAINING)
    package.initialize = _load("megatron.training.initialize", tmp_path / "initialize.py", monkeypatch)
    package.training = _load("megatron.training.training", tmp_path / "training.py", monkeypatch)
    return package


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The stand-in Megatron-LM in ``sys.modules`` (``fake.initialize``, ``fake.training``); removed afterwards."""
    return _install_fake(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    """The stand-in's training never adapted (the reference every adapted run must equal bit for bit)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _pretrain(_install_fake(tmp_path_factory.mktemp("untouched"), monkeypatch), monkeypatch, [])


def _reviewed_again(patches=lm_adaptor.LM_PATCHES, changes=lm_adaptor.LM_INSTANCE_CHANGES) -> dict:
    """The records with the stand-in's fingerprints, as a re-review of changed upstream code would set them."""
    def current(target):
        module, _, attr = target.partition(":")
        return upstream_original(getattr(importlib.import_module(module), attr))

    return {
        "patches": [dataclasses.replace(p, fingerprint=fingerprint_of(current(p.target))) for p in patches],
        "changes": [dataclasses.replace(c, fingerprint=fingerprint_of_all(relied_on_code(c))) for c in changes],
    }


def _adapt() -> lm_adaptor.MegatronLMAdaptor:
    return lm_adaptor.MegatronLMAdaptor(**_reviewed_again()).apply()


def _targets(fake) -> tuple:
    return fake.initialize.parse_args, fake.training.setup_model_and_optimizer, fake.training.get_forward_backward_func


def _model_provider():
    model = gpt.build_gpt(SHAPE, seed=SEED)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(overlap_grad_reduce=True), model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def _batches(first_step: int):
    step = first_step
    while True:
        yield gpt.synthetic_batch(SHAPE, step, SEED)
        step += 1


def _pretrain(fake, monkeypatch, flags, extra_args_provider=None) -> dict:
    """Run the stand-in's ``pretrain`` as ``pretrain_gpt.py`` would, with ``flags`` on the command line."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    with gpt.megatron_cpu_session(seed=SEED), CudaLiteralsToCpu():
        model, optimizer, losses = fake.training.pretrain(
            lambda: (_batches(0), _batches(10_000)), _model_provider, None, _forward_step,
            extra_args_provider=extra_args_provider)
    state = fake.initialize.STATE
    return {"losses": losses, "eval_losses": list(state["eval_losses"]), "events": list(state["events"]),
            "params": [p.detach().clone() for p in model[0].parameters()], "optimizer": optimizer,
            "schedules": list(state["schedules"]), "args": state["args"]}


def _same_training(a: dict, b: dict) -> bool:
    return (len(a["losses"]) == len(b["losses"]) > 0
            and all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
            and len(a["eval_losses"]) == len(b["eval_losses"]) > 0
            and all(torch.equal(x, y) for x, y in zip(a["eval_losses"], b["eval_losses"]))
            and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])))


def test_nothing_is_patched_until_adapt_and_close_restores(fake):
    before = _targets(fake)
    adaptor = _adapt()
    try:
        assert adaptor.active
        for patched, original in zip(_targets(fake), before):
            assert patched is not original and upstream_original(patched) is original
    finally:
        adaptor.close()
    assert _targets(fake) == before and not adaptor.active
    adaptor.close()  # idempotent


def test_flags_install_after_setup_wrap_the_schedule_and_train_bit_identically(fake, monkeypatch, untouched):
    seen = []

    def users_provider(parser):
        seen.append("user")
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    adaptor = _adapt()
    reports, train_step = [], fake.training.train_step

    def reporting_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        reports.append(adaptor.chameleon.last_report)
        return result

    monkeypatch.setattr(fake.training, "train_step", reporting_train_step)  # (after adapt() checked the code)
    try:
        run = _pretrain(fake, monkeypatch, [*CHAMELEON_FLAGS, "--my-flag", "5"], extra_args_provider=users_provider)
        chameleon = adaptor.chameleon
        assert chameleon is not None and seen == ["user"] and run["args"].my_flag == 5
        assert run["args"].chameleon_device == "emulated"
        assert run["events"] == ["parsed", "distributed initialized", "model and optimizer built"]
        assert _same_training(run, untouched)
        # one iteration per train_step, closed by optimizer.step (wrapped on the instance); evaluation passed through
        assert [r.iteration for r in reports] == [1, 2, 3] and not any(r.failed for r in reports)
        assert reports[0].swap_out_bytes > 0, "WarmUp swaps: the runtime is attached to Megatron-LM's model"
        assert "step" in vars(run["optimizer"])
        assert chameleon.tracker.forward_steps == 3 * 2, "the evaluation's forward steps are not followed"
        assert run["schedules"][0] is not schedules.forward_backward_no_pipelining
        assert run["schedules"][0].__wrapped__ is schedules.forward_backward_no_pipelining
        assert chameleon.runtime.config.device.kind == "emulated"
    finally:
        adaptor.close()
    assert adaptor.chameleon is None and upstream_original(schedules.forward_step) is schedules.forward_step


@pytest.mark.parametrize("flags", [[], ["--no-chameleon", "--chameleon-device", "emulated"]],
                         ids=["no-flags", "no-chameleon"])
def test_without_flags_or_with_no_chameleon_megatron_lm_runs_untouched(fake, monkeypatch, flags, untouched):
    adaptor = _adapt()
    try:
        run = _pretrain(fake, monkeypatch, flags)
        assert adaptor.chameleon is None
        assert run["schedules"] == [schedules.forward_backward_no_pipelining], "train got megatron-core's own schedule"
        assert "step" not in vars(run["optimizer"])
        assert upstream_original(schedules.forward_step) is schedules.forward_step
        assert _same_training(run, untouched)
    finally:
        adaptor.close()


def test_skip_train_installs_nothing(fake, monkeypatch):
    adaptor = _adapt()
    try:
        run = _pretrain(fake, monkeypatch, [*CHAMELEON_FLAGS, "--skip-train"])
        assert run["optimizer"] is None and adaptor.chameleon is None
    finally:
        adaptor.close()


@pytest.mark.parametrize("flags, named", [
    (["--chameleon", "--cuda-graph-impl", "local"], "--cuda-graph-impl local"),
    (["--chameleon-memory-budget", "lots"], "--chameleon-memory-budget"),
], ids=["cuda-graphs", "bad-value"])
def test_bad_flags_are_refused_before_distributed_is_initialized(fake, monkeypatch, flags, named):
    adaptor = _adapt()
    try:
        with pytest.raises(ConfigError, match=named):
            _pretrain(fake, monkeypatch, flags)
        assert fake.initialize.STATE["events"] == ["parsed"]
    finally:
        adaptor.close()


def test_cuda_graphs_without_chameleon_are_megatron_lms_business(fake, monkeypatch):
    adaptor = _adapt()
    try:
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--cuda-graph-impl", "local", "--no-chameleon"])
        assert fake.initialize.parse_args().cuda_graph_impl == "local"
    finally:
        adaptor.close()


def test_another_megatron_lm_version_is_refused_naming_both(fake, monkeypatch):
    monkeypatch.setattr(package_info, "__version__", "0.15.3")
    before = _targets(fake)
    with pytest.raises(PatchRefused) as info:
        _adapt()
    message = str(info.value)
    assert "Megatron-LM 0.15.3" in message and package_info.__file__ in message
    assert lm_adaptor.REVIEWED_TAG in message and lm_adaptor.REVIEWED_COMMIT[:12] in message
    assert "megatron-core 0.16.1" in message and "nothing was patched" in message
    assert _targets(fake) == before


def test_changed_megatron_lm_code_is_refused_naming_each_target(fake):
    """The reviewed records against code that is not Megatron-LM core_v0.16.1 (the stand-in): a test that fails
    when upstream changes."""
    before = _targets(fake)
    with pytest.raises(PatchRefused) as info:
        lm_adaptor.adapt()
    problems = info.value.problems
    for patch in (lm_adaptor.PARSE_ARGS_ADDS_FLAGS, lm_adaptor.SETUP_INSTALLS_RUNTIME):
        found = fingerprint_of(upstream_original(getattr(importlib.import_module(patch.target.split(":")[0]),
                                                         patch.target.split(":")[1])))
        assert any(patch.target in p and f"recorded fingerprint {patch.fingerprint}, found {found}" in p
                   for p in problems), problems
    assert not any(lm_adaptor.FORWARD_BACKWARD_WRAPPED.target in p for p in problems), \
        "the stand-in imports megatron-core's own get_forward_backward_func, which is unchanged"
    assert any(lm_adaptor.OPTIMIZER_STEP_CLOSES_ITERATION.name in p for p in problems)
    assert _targets(fake) == before


def test_adapting_twice_is_refused_until_closed(fake):
    first = _adapt()
    try:
        with pytest.raises(PatchRefused, match="already patched"):
            _adapt()
    finally:
        first.close()
    _adapt().close()


def test_without_megatron_lm_adapt_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.training", None)  # what `import megatron.training` meets when absent
    monkeypatch.delitem(sys.modules, "megatron.training.training", raising=False)
    with pytest.raises(PatchRefused, match="megatron.training.training cannot be imported.*pretrain_gpt.py"):
        lm_adaptor.adapt()


def test_the_schedule_patch_matches_installed_megatron_core():
    """``training.py`` imports megatron-core's ``get_forward_backward_func``: its fingerprint is checked here too."""
    assert fingerprint_of(get_forward_backward_func) == lm_adaptor.FORWARD_BACKWARD_WRAPPED.fingerprint


def test_the_recorded_patches_apply_only_through_an_adaptor(fake):
    from chameleon_dist.patching import apply_patches

    before = _targets(fake)
    with pytest.raises(RuntimeError, match="needs an adaptor"):
        apply_patches(_reviewed_again()["patches"]).apply()
    assert _targets(fake) == before


def test_patches_readme_has_a_row_for_the_instance_change():
    from pathlib import Path

    rows = [line for line in (Path(__file__).resolve().parents[1] / "patches" / "README.md").read_text().splitlines()
            if line.startswith("|")]
    for change in lm_adaptor.LM_INSTANCE_CHANGES:
        matching = [row for row in rows if f"`{change.name}`" in row]
        assert len(matching) == 1 and change.owner in matching[0] and change.versions in matching[0]
        assert all(f"`{target}`" in matching[0] for target in change.relies_on)


# ---- Megatron-LM itself (skipped where megatron.training is not importable) ---------------------------------------

def _megatron_lm():
    return pytest.importorskip("megatron.training.training", reason="Megatron-LM's megatron.training is not "
                               "importable (it is not on the package registry): see README, Megatron-LM's pretrain_gpt.py")


@pytest.mark.parametrize("patch", lm_adaptor.LM_PATCHES, ids=lambda p: p.name)
def test_patch_matches_megatron_lm(patch):
    _megatron_lm()
    assert problems_with(patch) == ()


@pytest.mark.parametrize("change", lm_adaptor.LM_INSTANCE_CHANGES, ids=lambda c: c.name)
def test_instance_change_matches_megatron_lm(change):
    _megatron_lm()
    assert problems_with_change(change) == ()


def test_megatron_lm_parses_the_chained_flags(monkeypatch):
    _megatron_lm()
    initialize = importlib.import_module("megatron.training.initialize")
    before = initialize.parse_args
    adaptor = lm_adaptor.adapt()
    try:
        def users_provider(parser):
            parser.add_argument("--my-flag", type=int, default=0)
            return parser

        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--my-flag", "3", "--chameleon-memory-budget", "60GB"])
        args = initialize.parse_args(users_provider)
        assert args.my_flag == 3 and lm_adaptor.requested_config(args).memory_budget == 60 * 10**9
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--chameleon", "--cuda-graph-impl", "local"])
        with pytest.raises(ConfigError, match="--cuda-graph-impl local"):
            initialize.parse_args()
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
        assert lm_adaptor.requested_config(initialize.parse_args()) is None
    finally:
        adaptor.close()
    assert initialize.parse_args is before


LM_ARGV = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1", "--lr", "1e-3", "--clip-grad", "0",
           "--transformer-impl", "local", "--use-cpu-initialization", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
           "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "64", "--distributed-backend", "gloo"]


class _NoStream:
    def wait_stream(self, other):
        pass


def _megatron_lm_on_cpu(monkeypatch):
    """The torch.cuda calls Megatron-LM's get_model and train make, as CPU no-ops (this test only)."""
    for name, value in {"Stream": lambda *a, **k: _NoStream(), "current_stream": lambda *a, **k: _NoStream(),
                        "stream": lambda stream: __import__("contextlib").nullcontext(),
                        "synchronize": lambda *a, **k: None, "empty_cache": lambda: None,
                        "memory_allocated": lambda *a, **k: 0, "max_memory_allocated": lambda *a, **k: 0}.items():
        monkeypatch.setattr(torch.cuda, name, value)


def _megatron_lm_train(monkeypatch, flags, adapted: bool) -> dict:
    """Megatron-LM's own parse_args, setup_model_and_optimizer, train (with its evaluate) on a small GPT on CPU."""
    training = _megatron_lm()
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.rerun_state_machine import RerunMode, destroy_rerun_state_machine, \
        initialize_rerun_state_machine
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import destroy_global_vars, set_global_variables

    initialize = importlib.import_module("megatron.training.initialize")
    monkeypatch.setattr(sys, "argv", [*LM_ARGV, *flags])
    adaptor = lm_adaptor.adapt() if adapted else None
    losses, train_step = [], training.train_step

    def recording_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        losses.append(result[0]["lm loss"].clone())
        return result

    try:
        with gpt.megatron_cpu_session(seed=SEED), CudaLiteralsToCpu(), pytest.MonkeyPatch.context() as local:
            local.setattr(training, "train_step", recording_train_step)  # (after adapt() checked the code)
            args = initialize.parse_args(None, False)  # what initialize_megatron calls first
            validate_args(args, {})
            set_global_variables(args, build_tokenizer=False)
            args.padded_vocab_size, args.do_train, args.do_valid, args.do_test = 64, True, True, False
            initialize_rerun_state_machine(mode=RerunMode.DISABLED)
            try:
                model, optimizer, scheduler = training.setup_model_and_optimizer(
                    lambda **kwargs: gpt.build_gpt(SHAPE, seed=SEED), ModelType.encoder_or_decoder)
                training.train(_forward_step, model, optimizer, scheduler, _batches(0), _batches(10_000), None,
                               training.get_model_config(model[0]), {}, None)
                chameleon = adaptor.chameleon if adaptor is not None else None
                return {"losses": losses, "params": [p.detach().clone() for p in model[0].parameters()],
                        "iterations": None if chameleon is None else chameleon.last_report.iteration,
                        "forward_steps": None if chameleon is None else chameleon.tracker.forward_steps}
            finally:
                destroy_rerun_state_machine()
                destroy_num_microbatches_calculator()
                destroy_global_vars()
    finally:
        if adaptor is not None:
            adaptor.close()


def test_megatron_lm_trains_adapted_bit_identically_on_cpu(monkeypatch):
    """Runs Megatron-LM's train() (CPU only: on a GPU, run pretrain_gpt.py itself as the README shows)."""
    _megatron_lm()
    if torch.cuda.is_available():
        pytest.skip("this test stands in CPU no-ops for torch.cuda; on a GPU run pretrain_gpt.py itself")
    _megatron_lm_on_cpu(monkeypatch)
    plain = _megatron_lm_train(monkeypatch, [], adapted=False)
    untouched = _megatron_lm_train(monkeypatch, ["--no-chameleon"], adapted=True)
    swapped = _megatron_lm_train(monkeypatch, CHAMELEON_FLAGS, adapted=True)
    assert swapped["iterations"] == 6 and swapped["forward_steps"] == 6 * 2, "evaluation's steps are not followed"
    assert untouched["iterations"] is None
    for run in (untouched, swapped):
        assert len(run["losses"]) == 6 and all(torch.equal(a, b) for a, b in zip(run["losses"], plain["losses"]))
        assert all(torch.equal(a, b) for a, b in zip(run["params"], plain["params"]))
