"""A parameter autograd saves is handed back as itself, never as an alias of its data at the save: a framework
that swaps a parameter's storage between forward and backward (ZeRO-3 releases each gathered weight with
``param.data = ...`` and gathers it again for backward) frees the released storage with Chameleon as without
it, and backward reads the storage the parameter has then. The in-place check on a parameter stays autograd's,
and gradients are bit-identical to a run without Chameleon."""

import gc
import weakref

import pytest
import torch
from torch import nn

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.executor.recompute import ProducerLog

INPLACE_ERROR = "modified by an inplace operation"
WIDTH = 4096  # 16 KiB of fp32 per weight row: above min_swap_bytes, so a plain activation would be swapped


def _runtime():
    device = EmulatedDevice(10**9)
    return Chameleon({"min_swap_bytes": 4096, "profiler": {"warmup_iterations": 10**6}}, device=device)


class Gathered(nn.Module):
    """A weight that lives as a partition and is gathered for each use, as ZeRO-3 does: ``gather`` gives the
    parameter a fresh full storage, ``release`` an empty one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.partition = torch.randn(WIDTH)
        self.weight = nn.Parameter(torch.empty(0))

    def gather(self) -> None:
        self.weight.data = self.partition.clone()  # (inside an iteration: an op the emulated device meters)

    def release(self) -> None:
        self.weight.data = torch.empty(0)


def _forward_release_backward(module: Gathered, x: torch.Tensor, on_release=None) -> torch.Tensor:
    """Gather, forward, release (``on_release(storage weakref, live bytes before)``), gather, backward."""
    module.gather()
    gathered = weakref.ref(module.weight.data.untyped_storage())
    x = x.requires_grad_()  # (so that mul saves the parameter itself, for x's gradient)
    y = (x * module.weight).tanh().sum()
    before = on_release.live_bytes() if on_release is not None else 0
    module.release()
    gc.collect()
    if on_release is not None:
        on_release(gathered, before)
    module.gather()  # backward's gather: another storage, the same values
    y.backward()
    grad = module.weight.grad
    module.release()
    return grad


def test_a_released_weight_is_freed_and_backward_reads_the_gathered_again():
    x = torch.randn(8, WIDTH)
    reference = _forward_release_backward(Gathered(), x.clone())

    runtime = _runtime()
    module = runtime.attach(Gathered())
    seen = {}

    def on_release(gathered, before_bytes):
        seen["alive"] = gathered() is not None
        seen["freed_bytes"] = before_bytes - runtime.device.live_bytes()

    on_release.live_bytes = runtime.device.live_bytes
    with runtime.iteration():
        grad = _forward_release_backward(module, runtime.device.track(x.clone()), on_release)
    assert seen["alive"] is False, "the released gathered weight is still held (by the saved-tensor record)"
    assert seen["freed_bytes"] == WIDTH * 4, "the emulated device still counts the released weight"
    assert torch.equal(grad, reference)


def test_an_in_place_write_to_a_saved_parameter_raises_as_autograd_does():
    def run(runtime=None):
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(WIDTH))
        x = torch.randn(8, WIDTH, requires_grad=True)  # (so that mul saves the weight for x's gradient)
        if runtime is not None:
            runtime.attach(nn.ParameterList([weight]))
        y = (x * weight).sum()
        with torch.no_grad():
            weight.add_(1)
        y.backward()

    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        run()
    runtime = _runtime()
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        with runtime.iteration():
            run(runtime)


def test_replacing_data_keeps_the_version_so_backward_goes_on():
    """``.data =`` keeps the parameter's version counter (autograd does not raise): neither does Chameleon."""
    runtime = _runtime()
    module = runtime.attach(Gathered())
    x = torch.randn(8, WIDTH)
    with runtime.iteration():
        grad = _forward_release_backward(module, runtime.device.track(x.clone()))
    assert torch.equal(grad, _forward_release_backward(Gathered(), x.clone()))


class _SavesWeight(torch.autograd.Function):
    """ZeRO-3's linear: saves the input and the weight parameter itself."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(256)  # native_layer_norm saves its weight and bias parameters
        self.first = nn.Linear(256, 256)
        self.second = nn.Parameter(torch.randn(256, 256) / 16)

    def forward(self, x):
        h = self.first(self.norm(x)).relu()
        return _SavesWeight.apply(h, self.second).square().mean()


def test_gradients_are_bit_identical_to_a_run_without_chameleon():
    batches = [torch.randn(32, 256, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    plain, swapped = _Model(), _Model()
    runtime = _runtime()
    runtime.attach(swapped)
    for batch in batches:
        plain(batch).backward()
        with runtime.iteration():
            swapped(runtime.device.track(batch.clone())).backward()
        assert runtime.last_report.swap_out_bytes > 0, "the activations were swapped (the parameters were not)"
        for (name, p), q in zip(plain.named_parameters(), swapped.parameters()):
            assert torch.equal(p.grad, q.grad), name


def test_a_recipe_input_that_views_a_parameter_follows_its_storage():
    """Recomputation rebuilds an op from a parameter it read in forward: the parameter, re-gathered into
    another buffer at another offset, is read where it sits then, and the forward's buffer is not held."""
    from chameleon_dist.executor.records import KeptParameter, keep_input  # (what the executor packs inputs with)

    flat = torch.arange(64, dtype=torch.float32)
    weight = nn.Parameter(torch.empty(0))
    weight.data = flat[10:20]
    view = weight.view(2, 5)
    log = ProducerLog(lambda tensor: None)
    out = torch.ops.aten.mul.Tensor(view.detach(), 3.0)
    log.note(torch.ops.aten.mul.Tensor, (view, 3.0), {}, out)
    recipe = log.recipe_for(out, keep_input)
    assert recipe is not None and isinstance(recipe.args[0].packed, KeptParameter)
    forward_buffer = weakref.ref(flat.untyped_storage())
    expected = out.clone()
    regathered = torch.full((64,), -1.0)
    regathered[30:40] = torch.arange(10, 20, dtype=torch.float32)
    del flat, view, out
    weight.data = regathered[30:40]
    gc.collect()
    assert forward_buffer() is None, "the recipe holds the forward's gathered buffer"
    rebuilt = recipe.run(lambda packed: packed.unpack())
    assert torch.equal(rebuilt.view(torch.float32).view(2, 5), expected)
