"""``CudaDevice``: ``StreamDevice`` over the CUDA backend (NOTE [One device code path] in
``device/backend.py``). This file is the only one that names ``torch.cuda``: the backend (streams, events,
the caching allocator) and the exact-size pinned host allocator.

Importing this module makes no CUDA call; everything that touches CUDA runs inside ``CudaDevice``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import time
import weakref
from collections.abc import Callable, Mapping

import torch
from torch.utils._pytree import tree_leaves

from chameleon_dist.device import caching_geometry, cuda_memory
from chameleon_dist.device.host_arena import HostArena
from chameleon_dist.device.stream_device import StreamDevice
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
LOCAL_RANK_ENV = "LOCAL_RANK"


def _unregister_then_close(address: int, region: mmap.mmap, clear_last_error: Callable[[], None]) -> None:
    """A finaliser (of the last owner of a registered region): ``cudaHostUnregister`` while ``region`` is still
    mapped (this finaliser holds it), then close it. A failed unregister leaves CUDA's last error set for this
    thread: read back at once (NOTE [A failed cudaHostRegister]). Never raises."""
    try:
        error = int(torch.cuda.cudart().cudaHostUnregister(address))
    except Exception:  # noqa: BLE001 - a finaliser must not raise (e.g. at interpreter shutdown)
        error = 0
    if error != 0:
        logger.debug("cudaHostUnregister(%#x) returned cudaError %d", address, error)
        try:
            clear_last_error()
        except Exception:  # noqa: BLE001 - as above
            logger.debug("could not read back the error cudaHostUnregister left", exc_info=True)
    try:
        region.close()
    except BufferError:  # a view of it is still being released: unmapped when that goes (unregistered already)
        pass


class PinnedHostAllocator:
    """Exactly ``nbytes`` of page-locked host memory per call.

    ``torch.empty(n, pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
    request up to a power of two (up to ~2x host RAM) and keeps freed blocks cached for the process
    lifetime, so the pool's byte budget would not bound real host memory. Instead each buffer is its own
    anonymous ``mmap`` (page-aligned, pages shared with nothing else) registered with
    ``cudaHostRegister`` and unregistered when its storage dies (the pattern of PyTorch's own checkpoint
    stager), or, once ``reserve_arena`` was called, a slice of one region registered once
    (``device/host_arena.py``: no page-locking in the save path when sizes change).

    NOTE [A failed cudaHostRegister]
    A failed ``cudaHostRegister`` (a memlock limit, no pinnable memory left) also sets the CUDA runtime's
    last error for this thread, and the next kernel launched on it would raise that stale error
    (PyTorch checks ``cudaGetLastError`` after every launch). ``_clear_last_error`` reads it back at once;
    then the allocator warns once and hands out pageable host memory from then on (copies from it are
    synchronous: slower, never wrong). ``page_locks`` counts every ``cudaHostRegister`` call."""

    def __init__(self, torch_device_of: Callable[[], torch.device]) -> None:
        self._torch_device_of = torch_device_of
        self.registered_buffers = 0
        self.fallback_buffers = 0
        self.page_locks = 0
        self.pinning_failed = False

    def __call__(self, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if self.pinning_failed:
            return self._fallback(nbytes)
        region, address = self._registered_region(nbytes)
        if region is None:
            return self._fallback(nbytes)
        buffer = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)
        self._unregister_when_gone(buffer.untyped_storage(), region, address)
        self.registered_buffers += 1
        return buffer

    def reserve_arena(self, nbytes: int) -> HostArena | None:
        """One region of ``nbytes`` page-locked now (one ``cudaHostRegister``), to carve buffers from; None
        when pinning failed (then every buffer is pageable, see NOTE [A failed cudaHostRegister])."""
        if self.pinning_failed or nbytes <= 0:
            return None
        region, address = self._registered_region(nbytes)
        if region is None:
            return None
        logger.info("reserved %s of page-locked host memory for swapped tensors (one registration)",
                    format_bytes(len(region)))
        arena = HostArena(region, nbytes)
        self._unregister_when_gone(arena, region, address)  # (each buffer's finaliser holds the arena)
        return arena

    def _registered_region(self, nbytes: int) -> tuple[mmap.mmap | None, int]:
        """An anonymous mapping of whole pages holding ``nbytes``, registered (``_unregister_when_gone``)."""
        region_bytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        region = mmap.mmap(-1, region_bytes)
        probe = torch.frombuffer(region, dtype=torch.uint8, count=1)
        address = probe.data_ptr()
        del probe
        self.page_locks += 1
        error = int(torch.cuda.cudart().cudaHostRegister(address, region_bytes, _CUDA_HOST_REGISTER_PORTABLE))
        if error != 0:
            self._clear_last_error()
            self.pinning_failed = True
            logger.warning(
                "cudaHostRegister of %s failed (cudaError %d, a memlock limit?): swapped tensors use pageable "
                "host memory from now on (synchronous copies, slower); raise the memlock limit (ulimit -l) or "
                "lower host_memory_budget", format_bytes(region_bytes), error,
            )
            region.close()
            return None, 0
        return region, address

    def _unregister_when_gone(self, owner: object, region: mmap.mmap, address: int) -> None:
        """Unregister ``region`` then close it once ``owner`` (what holds every view of it) is gone. Not a
        finaliser of the region itself: that runs after its mapping is gone."""
        finalizer = weakref.finalize(owner, _unregister_then_close, address, region, self._clear_last_error)
        finalizer.atexit = False  # never call into CUDA after its context is gone

    def _clear_last_error(self) -> None:
        """Read back (and so reset) this thread's CUDA error (NOTE [A failed cudaHostRegister])."""
        cudart = torch.cuda.cudart()
        get_last_error = getattr(cudart, "cudaGetLastError", None)
        if get_last_error is not None:
            get_last_error()
            return
        # PyTorch's cudart bindings have no cudaGetLastError; a kernel launch reads and resets it (and raises it)
        device = self._torch_device_of()
        try:
            with torch.cuda.device(device.index if device.type == "cuda" else None):
                torch.zeros(1, dtype=torch.uint8, device=device)
        except RuntimeError as error:
            logger.debug("the error cudaHostRegister left behind, read back: %s", str(error).splitlines()[0])

    def _fallback(self, nbytes: int) -> torch.Tensor:
        self.fallback_buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8)


def resolve_device_index(device_index: int | None, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The rank's GPU before any model is attached, and where it came from: ``device_index`` when given,
    else ``LOCAL_RANK`` (torchrun and the deepspeed launcher set it) when it names a visible device, else the
    current device. Nothing is created on a device here: a rank that has not called ``set_device`` yet binds
    to its own GPU, not to cuda:0. ``CudaDevice.track_module`` checks the attached model against it.

    Raises:
        ValueError: an explicit index out of range.
    """
    count = torch.cuda.device_count()
    if device_index is not None:
        index = int(device_index)
        if not 0 <= index < count:
            raise ValueError(f"CUDA device index {index} is out of range: {count} device(s) visible")
        return index, f"device_index={index}"
    local_rank = (os.environ if environ is None else environ).get(LOCAL_RANK_ENV, "").strip()
    if local_rank.isdigit() and int(local_rank) < count:
        return int(local_rank), f"{LOCAL_RANK_ENV}={local_rank}"
    if local_rank:  # e.g. one visible GPU per process (CUDA_VISIBLE_DEVICES): the launcher bound it already
        logger.debug("%s=%s names no visible CUDA device (%d visible): using the current device",
                     LOCAL_RANK_ENV, local_rank, count)
    return int(torch.cuda.current_device()), "the current device (torch.cuda.current_device())"


class CudaDeviceMismatchError(ValueError):
    """The attached model lives on another GPU than the one the runtime was built for."""


class CudaBackend:
    """The CUDA backend of ``StreamDevice`` (NOTE [One device code path] in ``device/backend.py``): real
    streams and events, the caching allocator, exact-size pinned host buffers."""

    emulated = False
    meta_tensors = False  # a GPU computes: a model on meta tensors is refused (StreamDevice.track_module)

    def __init__(self, capacity_bytes: int | None = None, device_index: int | None = None,
                 enforce_capacity: bool = False) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"CUDA is not available (torch {torch.__version__}, CUDA build: {torch.version.cuda}): "
                "set `device.kind: emulated` (with a `device.capacity`) in the chameleon config to run "
                "on the CPU with an emulated device"
            )
        index, self.index_source = resolve_device_index(device_index)
        self.index = index
        self.torch_device = torch.device("cuda", index)
        properties = torch.cuda.get_device_properties(index)
        self.name = f"cuda:{index} ({properties.name})"
        # free + reserved by this process - a measured reserve (NOTE [The budget compares memory_allocated])
        self.capacity_reading = cuda_memory.usable_capacity_bytes(index, configured_capacity_bytes=capacity_bytes)
        self.capacity_bytes = self.capacity_reading.capacity_bytes
        logger.info("%s (cuda:%d from %s)", self.capacity_reading.describe(), index, self.index_source)
        self.capacity_enforced = bool(enforce_capacity)
        if self.capacity_enforced:
            cuda_memory.enforce_capacity(index, self.capacity_bytes)
        self._peak = cuda_memory.PeakReader(index)
        self.host_allocator_instance = PinnedHostAllocator(lambda: self.torch_device)

    # ---- streams and events -----------------------------------------------------------------
    def current_stream(self):
        return torch.cuda.current_stream(self.torch_device)

    def new_stream(self, name: str | None = None):
        return torch.cuda.Stream(device=self.torch_device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def host_time_s(self) -> float:
        """The host's clock (seconds, monotonic)."""
        return time.perf_counter()

    def new_event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    # ---- memory -----------------------------------------------------------------------------
    def live_bytes(self) -> int:
        """``memory_allocated`` (also a sample for the iteration's peak)."""
        return self._peak.sample()

    def peak_bytes(self) -> int:
        """This iteration's peak ``memory_allocated``: exact when the process's maximum grew in it, else a
        lower bound (``cuda_memory.PeakReader``). The process's peak statistics are never reset."""
        return self._peak.peak_bytes()

    def reset_peak(self) -> None:
        """Start of an iteration for ``peak_bytes`` (resets nothing: Megatron and DeepSpeed read the peaks)."""
        self._peak.begin()

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda" and tensor.device.index == self.index

    def track(self, tensor: torch.Tensor) -> None:
        """The caching allocator counts every tensor already."""

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def host_allocator(self) -> PinnedHostAllocator:
        return self.host_allocator_instance

    def host_side(self):
        return contextlib.nullcontext()

    def allocate(self, nbytes: int) -> torch.Tensor:
        block = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        self._peak.sample()  # a swap-in is where the iteration's peak often is
        return block

    def active(self):
        return torch.cuda.device(self.index)

    def random_state(self) -> torch.Tensor:
        """This device's CUDA generator state (dropout on the GPU draws from it, not from the CPU's)."""
        return torch.cuda.get_rng_state(self.index)

    def set_random_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.index)

    # ---- work ---------------------------------------------------------------------------------
    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        self._peak.sample()  # a swap-out in forward, every earlier source still held: near the peak
        destination.copy_(source, non_blocking=True)

    def run_op(self, func, args: tuple, kwargs: dict):
        return func(*args, **kwargs)

    def short_bytes(self, error: torch.OutOfMemoryError, func, args: tuple, kwargs: dict,
                    request_bytes: int | None = None) -> int:
        """What relief should free: the segment the failed request needs, read from the error's "Tried to
        allocate N" (an op's arguments say little of it: factory ops, attention scores, logits, embedding
        backward), plus a fragmentation margin (``caching_geometry.cuda_short_bytes``). Without that text, the
        request's bytes when the caller knows them (a swap-in's block), else the op's tensor arguments' bytes,
        at least 1 MiB."""
        if request_bytes is not None:
            fallback_bytes = request_bytes
        else:
            leaves = (t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            fallback_bytes = max(sum(t.numel() * t.element_size() for t in leaves), 2**20)
        return caching_geometry.cuda_short_bytes(str(error), fallback_bytes)

    def request_fit(self, error: torch.OutOfMemoryError):
        """None: the allocator's pools are not read here (relief frees ``short_bytes``, margin included)."""
        return None

    def fits(self, nbytes: int, stream=None) -> bool | None:
        """Unknown on CUDA (None): the prefetch limit judges by ``memory_allocated`` alone."""
        return None


class CudaDevice(StreamDevice):
    """A CUDA device (``device_index``; default ``LOCAL_RANK``, else the current device: ``resolve_device_index``;
    the attached model must live on it) seen through the ``Device`` protocol:
    ``StreamDevice`` over ``CudaBackend``. ``capacity_bytes`` defaults to the device's total memory; it is
    what the policy plans against. ``d2h_bytes_per_s`` / ``h2d_bytes_per_s`` are the host link's rates as the
    caller knows them (the config's); ``None``, the default, means unknown."""

    def __init__(self, capacity_bytes: int | None = None, host_memory_budget_bytes: int | None = None,
                 device_index: int | None = None, d2h_bytes_per_s: float | None = None,
                 h2d_bytes_per_s: float | None = None, enforce_capacity: bool = False) -> None:
        backend = CudaBackend(capacity_bytes, device_index, enforce_capacity)
        super().__init__(backend, host_memory_budget_bytes, d2h_bytes_per_s=d2h_bytes_per_s,
                         h2d_bytes_per_s=h2d_bytes_per_s)

    def track_module(self, module) -> None:
        """Check that ``module`` lives on this runtime's GPU, then count it (``StreamDevice.track_module``).

        Raises:
            CudaDeviceMismatchError: the model's CUDA parameters and buffers are all on other GPUs (the
                runtime would swap none of its tensors and report another GPU's memory), naming both.
        """
        model_indices = sorted({tensor.device.index for tensor in itertools.chain(module.parameters(), module.buffers())
                                if tensor.device.type == "cuda"})
        if model_indices and self.index not in model_indices:
            model = ", ".join(f"cuda:{index}" for index in model_indices)
            first = model_indices[0]
            raise CudaDeviceMismatchError(
                f"the parameters of {type(module).__name__} are on {model}, but this Chameleon runtime was built "
                f"for cuda:{self.index} (from {self.backend.index_source}): move the model to cuda:{self.index}, "
                f"or build the runtime for cuda:{first} (launch with {LOCAL_RANK_ENV}={first}, call "
                f"torch.cuda.set_device({first}) before Chameleon(...), or pass "
                f"Chameleon(device=CudaDevice(device_index={first})))"
            )
        super().track_module(module)

    # (the backend's, read through: one copy of each)
    @property
    def index(self) -> int:
        return self.backend.index

    @property
    def torch_device(self) -> torch.device:
        return self.backend.torch_device

    @property
    def host_allocator(self) -> PinnedHostAllocator:
        return self.backend.host_allocator_instance

    @property
    def capacity_reading(self) -> cuda_memory.CapacityReading:
        return self.backend.capacity_reading

    @property
    def capacity_enforced(self) -> bool:
        return self.backend.capacity_enforced
