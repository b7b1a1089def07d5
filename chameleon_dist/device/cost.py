"""``KernelCostModel``: how long an aten op occupies its stream on the simulated device.

A roofline: ``max(flops / peak_for(dtype), bytes_moved / memory_bytes_per_s) + launch_latency_s``.

- FLOPs are what ``torch.utils.flop_counter`` counts (its ``flop_registry``, called the way its
  ``FlopCounterMode`` calls it), plus the CPU kernels of scaled-dot-product attention, which the
  registry does not list (it lists the CUDA ones) and which a simulated GPU running on the CPU sees.
  Ops without a formula (elementwise, reductions, copies) count no FLOPs: the byte term times them.
- ``bytes_moved`` is the bytes of every strided tensor the op reads (its arguments) and writes (its
  outputs), each distinct tensor once: ``numel * element_size``, except that a broadcast view (a zero
  stride) counts only the memory it covers.
- ``None`` for an op that launches no kernel: views and other ops whose outputs all alias an input
  (``view``, ``t``, ``expand``, ``detach``, ``alias``, ``_unsafe_view``, ``lift_fresh``...), in-place
  metadata changes (``Tag.inplace_view``: ``t_``, ``unsqueeze_``, ``as_strided_``, ``resize_``, ``set_``),
  allocations whose memory nothing writes (``empty``, ``empty_strided``, ``new_empty``...), and ops
  returning no tensor that neither read data nor write in place (``sym_size``, ``stride``,
  ``is_same_size``, ``dim``, ``record_stream``). ``_local_scalar_dense`` (``item()``) is a copy to the
  host, not a kernel: None, and :func:`is_host_sync`. (``_to_copy`` always makes a new tensor, so it is
  a copy kernel; ``x.to(x.dtype)`` never reaches the dispatcher.)

Only sizes, strides and dtypes are read, never data: meta tensors work. No op makes it raise: what cannot
be worked out falls back to the byte term (or to the launch latency alone).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch
from torch.utils import flop_counter

from chameleon_dist.device.model import DeviceModel

logger = logging.getLogger(__name__)

# Ops that allocate without writing, or only change metadata (by schema name, "aten::empty").
_NO_KERNEL_OPS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::empty_permuted", "aten::new_empty",
    "aten::new_empty_strided", "aten::record_stream", "aten::set_", "aten::resize_", "aten::_local_scalar_dense",
    "aten::item", "aten::lift_fresh",
})
# Factories that take a tensor for its sizes and dtype only: they write their output, read nothing.
_WRITE_ONLY_OPS = frozenset({
    "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::rand_like", "aten::randn_like",
    "aten::randint_like", "aten::new_zeros", "aten::new_ones", "aten::new_full",
})

# Ops that make the host wait for the device on a GPU, and why (see is_host_sync).
_HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense",  # item(), bool(t), float(t): copies a value to the host
    "aten::item",
    "aten::is_nonzero",  # bool(t): reads the value
    "aten::equal",  # returns a Python bool
    "aten::allclose",  # returns a Python bool
    "aten::nonzero", "aten::argwhere", "aten::nonzero_numpy",  # the output size is the count of nonzeros
    "aten::masked_select",  # the output size is the count of true mask elements
    "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::_unique",
    "aten::_unique2",  # the output size is the number of distinct values
    "aten::bincount",  # the output size is input.max() + 1, read on the host
    "aten::_linalg_check_errors",  # linalg.inv/cholesky/solve read the error info back to raise
})
# Sync for some arguments only: decided in is_host_sync.
_REPEAT_INTERLEAVE = "aten::repeat_interleave"  # repeats a tensor, no output_size: the host needs sum(repeats)
_MASK_INDEXING = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
_HISTC = "aten::histc"  # min == max (the default 0, 0): the range is read from the data on the host

_MASK_DTYPES = (torch.bool, torch.uint8)


def _sdpa_cpu_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# Formulas for ops the registry lacks, by schema name: the CPU (and "overrideable") attention kernels,
# counted with flop_counter's own attention formulas.
_EXTRA_FLOP_FORMULAS: tuple[tuple[str, Callable[..., int]], ...] = (
    ("aten::_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_flop),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward_flop),
    ("aten::_scaled_dot_product_fused_attention_overrideable", _sdpa_cpu_flop),
    ("aten::_scaled_dot_product_fused_attention_overrideable_backward", _sdpa_cpu_backward_flop),
)


# The code of the function torch's shape_wrapper puts around a registered formula: a formula with it is
# called here with the shapes directly (what shape_wrapper would pass), without its pytree walk.
_SHAPE_WRAPPER_CODE = flop_counter.shape_wrapper(lambda *args, **kwargs: 0).__code__


class _OpInfo(NamedTuple):
    """What one op overload's schema says, worked out once per op by each KernelCostModel."""

    name: str
    no_kernel: bool  # never launches a kernel whatever its arguments
    may_alias: bool  # returns tensors without writing in place: a view when they all alias an input
    flop_formula: Callable[..., Any] | None  # called as the registry's formulas are (tensors, out_val=)
    shape_formula: Callable[..., Any] | None  # the same formula unwrapped: shapes, out_shape=
    reads_inputs: bool = True  # False: the tensor arguments give sizes only (ones_like)


_GENERIC = _OpInfo("", False, True, None, None)


def _op_info(func: Any) -> _OpInfo:
    schema = getattr(func, "_schema", None)
    if schema is None:  # a higher-order or Python op: nothing to go on but its tensors
        return _GENERIC._replace(name=str(func), flop_formula=flop_counter.flop_registry.get(func))
    name = schema.name
    tags = getattr(func, "tags", ())
    packet = getattr(func, "_overloadpacket", None)
    formula = flop_counter.flop_registry.get(packet) or dict(_EXTRA_FLOP_FORMULAS).get(name)
    wrapped = getattr(formula, "__wrapped__", None)
    shape_formula = wrapped if getattr(formula, "__code__", None) is _SHAPE_WRAPPER_CODE and wrapped else None
    returns_tensor = any("Tensor" in str(ret.type) for ret in schema.returns)
    mutable = schema.is_mutable
    # equal, allclose: no tensor out, but kernels read the data before the host gets the answer
    reads_data = not returns_tensor and (torch.Tag.data_dependent_output in tags or name in _HOST_SYNC_OPS)
    no_kernel = (name in _NO_KERNEL_OPS or torch.Tag.inplace_view in tags
                 or (not returns_tensor and not mutable and not reads_data))
    return _OpInfo(name, no_kernel, returns_tensor and not mutable, formula, shape_formula,
                   name not in _WRITE_ONLY_OPS)


def _collect(value: Any, into: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append the tensors in ``value`` (a tensor, or lists/tuples/dicts of them, nested) to ``into``."""
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                into.append(item)
            elif isinstance(item, (list, tuple, dict)):
                _collect(item, into)
    elif isinstance(value, dict):
        _collect(tuple(value.values()), into)
    return into


def _shapes(value: Any) -> Any:
    """``value`` with every tensor replaced by its shape, as torch's shape_wrapper passes it to a formula."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if type(value) in (list, tuple):
        return type(value)(_shapes(item) for item in value)
    return value


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes a kernel moves to read or write ``tensor``: ``numel * element_size``, or the memory a
    broadcast view (a zero stride) covers when that is less. 0 for a tensor that is not strided."""
    if tensor.layout != torch.strided:
        return 0
    numel = tensor.numel()
    if numel == 0:
        return 0
    strides = tensor.stride()
    if 0 in strides:
        span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, strides))
        numel = min(numel, span)
    return int(numel) * tensor.element_size()


def _compute_dtype(tensors: list[torch.Tensor]) -> torch.dtype | None:
    """The dtype the op computes in: its first floating-point tensor's, else its first tensor's."""
    for tensor in tensors:
        if tensor.is_floating_point():
            return tensor.dtype
    return tensors[0].dtype if tensors else None


def _is_alias(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` share a storage (works on meta tensors, whose data pointers are all 0)."""
    return a is b or torch._C._is_alias_of(a, b)


def _all_alias(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    return bool(outputs) and all(any(_is_alias(output, inp) for inp in inputs) for output in outputs)


class KernelCostModel:
    """Device seconds per aten op for one :class:`DeviceModel`. Per-op facts are cached in the instance."""

    def __init__(self, model: DeviceModel) -> None:
        self.model = model
        self._ops: dict[Any, _OpInfo] = {}
        self._peaks: dict[torch.dtype | None, float] = {}
        self._formula_failed: set[str] = set()

    def _info(self, func: Any) -> _OpInfo:
        info = self._ops.get(func)
        if info is None:
            try:
                info = _op_info(func)
            except Exception:  # an op whose schema cannot be read: cost it by its tensors
                logger.debug("cannot read the schema of %r; costing it by the bytes it moves", func, exc_info=True)
                info = _GENERIC._replace(name=str(func))
            self._ops[func] = info
        return info

    def _peak(self, dtype: torch.dtype | None) -> float:
        peak = self._peaks.get(dtype)
        if peak is None:
            peak = self.model.peak_for(dtype) if dtype is not None else self.model.peak_flop_per_s["default"]
            self._peaks[dtype] = peak
        return peak

    def _flops(self, info: _OpInfo, args: tuple, kwargs: dict, out: Any) -> int:
        if info.flop_formula is None:
            return 0
        try:
            if info.shape_formula is not None:
                return int(info.shape_formula(*_shapes(args), out_shape=_shapes(out),
                                              **{key: _shapes(value) for key, value in kwargs.items()}))
            return int(info.flop_formula(*args, **kwargs, out_val=out))
        except Exception:
            if info.name not in self._formula_failed:
                self._formula_failed.add(info.name)
                logger.debug("flop formula of %s failed; costing it by the bytes it moves", info.name, exc_info=True)
            return 0

    def _bytes(self, tensors: list[torch.Tensor]) -> int:
        seen: set[int] = set()
        total = 0
        for tensor in tensors:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            try:
                total += tensor_bytes(tensor)
            except Exception:  # symbolic sizes, an odd subclass: that tensor counts nothing
                logger.debug("cannot size a %s argument; it counts no bytes", type(tensor).__name__, exc_info=True)
        return total

    def launches_kernel(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> bool:
        """False for a view, a metadata op, an allocation or a host read (see the module docstring)."""
        info = self._info(func)
        if info.no_kernel:
            return False
        return not (info.may_alias and _all_alias(_collect(out, []), _collect((args, kwargs or {}), [])))

    def flops(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> int:
        """The op's FLOPs as ``torch.utils.flop_counter`` counts them; 0 without a formula (or if it fails)."""
        return self._flops(self._info(func), args, kwargs or {}, out)

    def bytes_moved(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> int:
        """Bytes of every strided tensor read (arguments) and written (outputs), each distinct tensor once
        (the arguments of a factory such as ``ones_like`` give sizes only and are not read)."""
        outputs = _collect(out, [])
        if not self._info(func).reads_inputs:
            return self._bytes(outputs)
        return self._bytes(_collect((args, kwargs or {}), outputs))

    def kernel_s(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> float | None:
        """Device seconds ``func(*args, **kwargs) -> out`` occupies its stream; None when it launches no kernel."""
        try:
            info = self._info(func)
            if info.no_kernel:
                return None
            kwargs = kwargs or {}
            outputs = _collect(out, [])
            inputs = _collect(kwargs, _collect(args, []))
            if info.may_alias and _all_alias(outputs, inputs):
                return None
            model = self.model
            moved = self._bytes(outputs + inputs if info.reads_inputs else outputs)
            memory_s = moved / model.memory_bytes_per_s
            flops = self._flops(info, args, kwargs, out)
            compute_s = flops / self._peak(_compute_dtype(inputs or outputs)) if flops > 0 else 0.0
            return max(compute_s, memory_s) + model.launch_latency_s
        except Exception:
            logger.debug("cannot cost %r; charging the launch latency only", func, exc_info=True)
            return self.model.launch_latency_s

    def is_host_sync(self, func: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
        """See :func:`is_host_sync`."""
        return is_host_sync(func, args, kwargs)


def _schema_name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else ""


def is_host_sync(func: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """True when ``func`` makes the host wait for the device on a GPU: the host needs a value or an
    output size that only the device's result holds.

    Always: ``_local_scalar_dense``/``item`` (copies a value to the host), ``is_nonzero``, ``equal`` and
    ``allclose`` (Python results), ``nonzero``/``argwhere``, ``masked_select``, the ``unique`` family and
    ``bincount`` (output sizes read from the data), ``_linalg_check_errors`` (linalg reads its error
    flags back to raise). With these arguments only: ``repeat_interleave`` with a tensor of repeats and no
    ``output_size``; ``index``/``index_put(_)`` with a boolean (or uint8) mask index (turned into
    ``nonzero``); ``histc`` with ``min == max`` (the range is read from the data). Without arguments a
    conditional op answers for its common case (integer indices: no; tensor repeats and default
    ``histc``: yes). ``nonzero_static`` is the sync-free ``nonzero`` and is not listed.
    """
    name = _schema_name(func)
    if name in _HOST_SYNC_OPS:
        return True
    kwargs = kwargs or {}
    if name == _REPEAT_INTERLEAVE:
        tensor_repeats = "Tensor" in getattr(func, "_overloadname", "")  # Tensor, self_Tensor (not self_int)
        return tensor_repeats and kwargs.get("output_size") is None
    if name in _MASK_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t.dtype in _MASK_DTYPES for t in _collect(indices, []))
    if name == _HISTC:
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return low == high
    return False
