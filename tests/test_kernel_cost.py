"""KernelCostModel: roofline device seconds per aten op (FLOPs from torch.utils.flop_counter, bytes from
the tensors' sizes), None for ops that launch no kernel, meta tensors, odd ops; is_host_sync.

Expected values are worked out here from the shapes, not by the code under test."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from chameleon_dist.device.cost import KernelCostModel, is_host_sync, tensor_bytes
from chameleon_dist.device.model import DeviceModel

aten = torch.ops.aten

PEAK_FP32 = 1e12
PEAK_BF16 = 4e12
MEMORY = 1e11
LAUNCH = 5e-6


@pytest.fixture
def cost():
    model = DeviceModel(peak_flop_per_s={"default": PEAK_FP32, "float32": PEAK_FP32, "bfloat16": PEAK_BF16},
                        memory_bytes_per_s=MEMORY, launch_latency_s=LAUNCH)
    return KernelCostModel(model)


def roofline(flops, nbytes, peak=PEAK_FP32):
    return max(flops / peak, nbytes / MEMORY) + LAUNCH


class Recorder(TorchDispatchMode):
    """Every (func, args, kwargs, out) the dispatcher sees, as the simulated device would."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out

    def of(self, func):
        return [call for call in self.calls if call[0] == func]


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# --- compute-bound ops: FLOPs as flop_counter counts them -----------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_mm_is_compute_bound_with_2mnk_flops(cost, device):
    m, k, n = 256, 512, 128
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    out = torch.mm(a, b)
    flops = 2 * m * n * k
    nbytes = (m * k + k * n + m * n) * 4
    assert flops / PEAK_FP32 > nbytes / MEMORY  # the setup is compute-bound
    assert cost.flops(aten.mm.default, (a, b), {}, out) == flops == counted_flops(lambda: torch.mm(a, b))
    assert cost.bytes_moved(aten.mm.default, (a, b), {}, out) == nbytes
    assert cost.kernel_s(aten.mm.default, (a, b), {}, out) == pytest.approx(roofline(flops, nbytes))


def test_bf16_mm_uses_the_bf16_peak(cost):
    m, k, n = 512, 512, 512
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    out = a @ b
    expected = roofline(2 * m * n * k, (m * k + k * n + m * n) * 2, peak=PEAK_BF16)
    assert cost.kernel_s(aten.mm.default, (a, b), {}, out) == pytest.approx(expected)


def test_addmm_counts_2mnk_and_reads_the_bias(cost):
    m, k, n = 128, 256, 64
    bias, a, b = torch.randn(n), torch.randn(m, k), torch.randn(k, n)
    out = torch.addmm(bias, a, b)
    assert cost.flops(aten.addmm.default, (bias, a, b), {}, out) == 2 * m * n * k
    assert counted_flops(lambda: torch.addmm(bias, a, b)) == 2 * m * n * k
    nbytes = (n + m * k + k * n + m * n) * 4
    assert cost.kernel_s(aten.addmm.default, (bias, a, b), {}, out) == pytest.approx(roofline(2 * m * n * k, nbytes))


def test_linear_through_the_dispatcher_costs_its_addmm(cost):
    x, w, bias = torch.randn(32, 64), torch.randn(16, 64), torch.randn(16)
    with Recorder() as recorder:
        F.linear(x, w, bias)
    [(func, args, kwargs, out)] = recorder.of(aten.addmm.default)
    expected = roofline(2 * 32 * 16 * 64, (16 + 32 * 64 + 64 * 16 + 32 * 16) * 4)
    assert cost.kernel_s(func, args, kwargs, out) == pytest.approx(expected)
    [transpose] = recorder.of(aten.t.default)
    assert cost.kernel_s(*transpose) is None


def test_bmm_counts_2bmnk(cost):
    batch, m, k, n = 8, 64, 32, 48
    a, b = torch.randn(batch, m, k), torch.randn(batch, k, n)
    out = torch.bmm(a, b)
    flops = 2 * batch * m * n * k
    assert cost.flops(aten.bmm.default, (a, b), {}, out) == flops == counted_flops(lambda: torch.bmm(a, b))
    nbytes = batch * (m * k + k * n + m * n) * 4
    assert cost.kernel_s(aten.bmm.default, (a, b), {}, out) == pytest.approx(roofline(flops, nbytes))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_conv2d_forward_and_backward_count_what_flop_counter_counts(cost, device):
    n, c_in, c_out, h, w, kernel = 2, 8, 16, 20, 20, 3
    x = torch.randn(n, c_in, h, w, device=device)
    weight = torch.randn(c_out, c_in, kernel, kernel, device=device, requires_grad=True)
    with Recorder() as recorder:
        F.conv2d(x, weight, padding=1).sum().backward()
    [(func, args, kwargs, out)] = recorder.of(aten.convolution.default)
    flops = 2 * n * c_out * h * w * c_in * kernel * kernel  # padding 1 keeps h x w
    assert cost.flops(func, args, kwargs, out) == flops
    nbytes = (x.numel() + weight.numel() + out.numel()) * 4
    assert cost.kernel_s(func, args, kwargs, out) == pytest.approx(roofline(flops, nbytes))
    [backward] = recorder.of(aten.convolution_backward.default)
    assert cost.flops(*backward) == flops  # the weight gradient only (output_mask: no input grad, no bias)
    x.requires_grad_(True)
    assert counted_flops(lambda: F.conv2d(x, weight, padding=1).sum().backward()) == 3 * flops


def test_sdpa_cpu_kernels_count_the_attention_flops(cost):
    b, heads, s, d = 2, 4, 128, 64
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    with Recorder() as recorder:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    [forward] = recorder.of(aten._scaled_dot_product_flash_attention_for_cpu.default)
    [backward] = recorder.of(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    flops = 4 * b * heads * s * s * d  # q @ k^T and scores @ v: 2 * s * s * d each, per head
    assert cost.flops(*forward) == flops
    assert cost.flops(*backward) == 5 * flops // 2  # the scores again, then four gradient products
    func, args, kwargs, out = forward
    nbytes = sum(t.numel() * t.element_size() for t in (q, k, v, *out))
    assert cost.kernel_s(func, args, kwargs, out) == pytest.approx(roofline(flops, nbytes))


def test_sdpa_on_meta_decomposes_into_bmms_with_the_same_total(cost):
    b, heads, s, d = 1, 2, 64, 32
    q = torch.randn(b, heads, s, d, device="meta")
    with Recorder() as recorder:
        F.scaled_dot_product_attention(q, q, q)
    total = sum(cost.flops(*call) for call in recorder.calls)
    assert total == 4 * b * heads * s * s * d


# --- memory-bound ops, views, metadata -------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_elementwise_is_memory_bound(cost, device):
    x, y = torch.randn(1024, 1024, device=device), torch.randn(1024, 1024, device=device)
    out = x + y
    assert cost.flops(aten.add.Tensor, (x, y), {}, out) == 0
    assert cost.kernel_s(aten.add.Tensor, (x, y), {}, out) == pytest.approx(3 * 1024 * 1024 * 4 / MEMORY + LAUNCH)


def test_each_distinct_tensor_counts_once(cost):
    x = torch.randn(1000)
    assert cost.kernel_s(aten.mul.Tensor, (x, x), {}, x * x) == pytest.approx(2 * 4000 / MEMORY + LAUNCH)
    x.add_(1.0)
    assert cost.kernel_s(aten.add_.Tensor, (x, 1.0), {}, x) == pytest.approx(4000 / MEMORY + LAUNCH)
    out = torch.empty(1000)
    torch.neg(x, out=out)
    assert cost.kernel_s(aten.neg.out, (x,), {"out": out}, out) == pytest.approx(2 * 4000 / MEMORY + LAUNCH)


def test_factories_write_only_and_broadcast_views_count_the_memory_they_cover(cost):
    x = torch.randn(256, 256)
    assert cost.kernel_s(aten.ones_like.default, (x,), {}, torch.ones_like(x)) == pytest.approx(
        256 * 256 * 4 / MEMORY + LAUNCH)
    row = torch.randn(1, 256).expand(256, 256)
    assert tensor_bytes(row) == 256 * 4 and tensor_bytes(x.t()) == 256 * 256 * 4
    out = row + x
    expected = (256 + 2 * 256 * 256) * 4 / MEMORY + LAUNCH
    assert cost.kernel_s(aten.add.Tensor, (row, x), {}, out) == pytest.approx(expected)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_views_and_metadata_ops_launch_no_kernel(cost, device):
    x = torch.randn(8, 6, device=device)
    views = [
        (aten.view.default, (x, [48])), (aten.t.default, (x,)), (aten.transpose.int, (x, 0, 1)),
        (aten.expand.default, (x[:1], [8, 6])), (aten.permute.default, (x, [1, 0])), (aten.select.int, (x, 0, 1)),
        (aten.slice.Tensor, (x, 0, 0, 4)), (aten.detach.default, (x,)), (aten.alias.default, (x,)),
        (aten._unsafe_view.default, (x, [6, 8])), (aten.split.Tensor, (x, 4)), (aten.unbind.int, (x,)),
        (aten.as_strided.default, (x, [4], [1])), (aten.unsqueeze.default, (x, 0)),
    ]
    for func, args in views:
        assert cost.kernel_s(func, args, {}, func(*args)) is None, func
    metadata = [
        (aten.sym_size.int, (x, 0)), (aten.stride.default, (x,)), (aten.is_same_size.default, (x, x)),
        (aten.dim.default, (x,)), (aten.empty.memory_format, ([4, 4],)), (aten.empty_like.default, (x,)),
        (aten.new_empty_strided.default, (x, [4], [1])),
    ]
    for func, args in metadata:
        assert cost.kernel_s(func, args, {}, func(*args)) is None, func
    y = torch.randn(8, 6, device=device)
    for func in (aten.t_.default, aten.unsqueeze_.default):
        args = (y,) if func is aten.t_.default else (y, 0)
        assert cost.kernel_s(func, args, {}, func(*args)) is None, func


def test_copies_are_kernels_even_when_they_look_like_views(cost):
    x = torch.randn(64, 32)
    copies = [(aten.clone.default, (x,), {}), (aten._to_copy.default, (x,), {"dtype": torch.bfloat16}),
              (aten._to_copy.default, (x,), {})]
    for func, args, kwargs in copies:
        out = func(*args, **kwargs)
        nbytes = x.numel() * 4 + out.numel() * out.element_size()
        assert cost.kernel_s(func, args, kwargs, out) == pytest.approx(nbytes / MEMORY + LAUNCH), func
    transposed = x.t()
    with Recorder() as recorder:
        transposed.contiguous()
    [(func, args, kwargs, out)] = recorder.calls
    assert cost.kernel_s(func, args, kwargs, out) == pytest.approx(2 * x.numel() * 4 / MEMORY + LAUNCH)


def test_item_is_a_host_read_and_equal_reads_its_inputs(cost):
    x = torch.randn(100)
    assert cost.kernel_s(aten._local_scalar_dense.default, (x[:1],), {}, 0.5) is None
    assert cost.kernel_s(aten.equal.default, (x, x.clone()), {}, True) == pytest.approx(800 / MEMORY + LAUNCH)


def test_launch_latency_is_the_floor_of_every_kernel(cost):
    x = torch.ones(1)
    assert cost.kernel_s(aten.add.Tensor, (x, x), {}, x + x) == pytest.approx(LAUNCH + 8 / MEMORY)
    assert cost.kernel_s(aten.add.Tensor, (x, x), {}, x + x) >= LAUNCH


def test_a_whole_training_step_on_meta_costs_every_op_without_raising(cost):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                                torch.nn.Linear(128, 10)).to("meta")
    x = torch.randn(16, 64, device="meta")
    with Recorder() as recorder:
        F.cross_entropy(model(x), torch.zeros(16, dtype=torch.long, device="meta")).backward()
    costs = [cost.kernel_s(*call) for call in recorder.calls]
    assert all(c is None or c >= LAUNCH for c in costs)
    kernels = [c for c in costs if c is not None]
    assert len(kernels) > 10 and sum(c is None for c in costs) > 0
    flops = sum(cost.flops(*call) for call in recorder.calls)
    assert flops == 3 * 2 * 16 * (64 * 128 + 128 * 10) - 2 * 16 * 64 * 128  # fwd + both grads, no grad of x


def test_odd_ops_never_raise(cost):
    x = torch.randn(4, 4)
    # a formula that fails on these arguments: costed by its bytes
    assert cost.kernel_s(aten.mm.default, (x,), {}, torch.randn(4, 4)) == pytest.approx(128 / MEMORY + LAUNCH)
    assert cost.kernel_s(aten.mm.default, ("not a tensor", None), {}, None) == pytest.approx(LAUNCH)
    assert cost.kernel_s(lambda t: t * 2, (x,), {}, x * 2) == pytest.approx(LAUNCH + 128 / MEMORY)  # no schema
    assert cost.kernel_s(lambda t: t, (x,), {}, x) is None  # returns its input: nothing launched
    assert cost.kernel_s(object(), (), None, None) == pytest.approx(LAUNCH)
    sparse = torch.eye(3).to_sparse()
    assert cost.kernel_s(aten.neg.default, (sparse,), {}, torch.neg(sparse)) == pytest.approx(LAUNCH)  # not strided
    assert cost.kernel_s([], (), {}, None) == pytest.approx(LAUNCH)  # not even hashable


def test_each_instance_keeps_its_own_cache():
    fast = KernelCostModel(DeviceModel(peak_flop_per_s={"default": 1e15}, memory_bytes_per_s=1e12,
                                       launch_latency_s=1e-6))
    slow = KernelCostModel(DeviceModel(peak_flop_per_s={"default": 1e12}, memory_bytes_per_s=1e9,
                                       launch_latency_s=1e-6))
    a = torch.randn(128, 128)
    out = a @ a
    assert slow.kernel_s(aten.mm.default, (a, a), {}, out) > fast.kernel_s(aten.mm.default, (a, a), {}, out)
    assert fast._ops is not slow._ops and aten.mm.default in fast._ops


def test_a_preset_model_prices_a_bf16_matmul_at_its_datasheet_peak():
    cost = KernelCostModel(DeviceModel.resolve("h200"))
    n = 4096
    a = torch.empty(n, n, dtype=torch.bfloat16, device="meta")
    expected = max(2 * n**3 / 989e12, 3 * n * n * 2 / 4.8e12) + cost.model.launch_latency_s
    assert cost.kernel_s(aten.mm.default, (a, a), {}, torch.mm(a, a)) == pytest.approx(expected)


# --- host syncs ------------------------------------------------------------------------------------------


def _seen(fn):
    with Recorder() as recorder:
        fn()
    return recorder.calls


def test_host_syncs_are_the_ops_the_dispatcher_sees_for_data_dependent_results():
    x = torch.tensor([1.0, 0.0, 2.0, 2.0])
    syncing = {
        "item": lambda: x[0].item(), "bool": lambda: bool(x[0]), "nonzero": lambda: x.nonzero(),
        "masked_select": lambda: torch.masked_select(x, x > 0), "unique": lambda: torch.unique(x),
        "unique_consecutive": lambda: torch.unique_consecutive(x), "equal": lambda: torch.equal(x, x),
        "repeat_interleave": lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 0, 1])),
        "mask index": lambda: x[x > 0], "mask assign": lambda: x.__setitem__(x > 5, torch.tensor(1.0)),
        "histc": lambda: torch.histc(x), "bincount": lambda: torch.bincount(torch.tensor([1, 2])),
        "linalg.inv": lambda: torch.linalg.inv(torch.eye(2)),
    }
    for name, fn in syncing.items():
        assert any(is_host_sync(func, args, kwargs) for func, args, kwargs, _ in _seen(fn)), name
    not_syncing = {
        "add": lambda: x + 1, "int index": lambda: x[torch.tensor([0, 2])],
        "repeat_interleave output_size": lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 0, 1]), output_size=4),
        "repeat_interleave int": lambda: x.repeat_interleave(2), "histc range": lambda: torch.histc(x, 4, 0.0, 3.0),
        "mm": lambda: torch.eye(4) @ torch.eye(4), "sum": lambda: x.sum(),
        "nonzero_static": lambda: torch.nonzero_static(x, size=4),
    }
    for name, fn in not_syncing.items():
        assert not any(is_host_sync(func, args, kwargs) for func, args, kwargs, _ in _seen(fn)), name


def test_host_sync_without_arguments_answers_the_common_case():
    assert is_host_sync(aten._local_scalar_dense.default) and is_host_sync(aten._unique2.default)
    assert is_host_sync(aten.repeat_interleave.Tensor) and not is_host_sync(aten.repeat_interleave.self_int)
    assert not is_host_sync(aten.index.Tensor) and not is_host_sync(aten.mm.default)
    assert KernelCostModel(DeviceModel.resolve("a100-pcie")).is_host_sync(aten.nonzero.default)
