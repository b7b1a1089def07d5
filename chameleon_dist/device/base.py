"""The narrow `Device` protocol the executor talks to, shared by the real and the emulated device.

The unit of transfer is a whole *untyped storage* seen as a flat uint8 tensor ("byte view"): swapping a
storage instead of a tensor keeps views, strides and storage offsets exact (so restored tensors are
bit-identical and feed the same kernels) and lets several saved tensors that share one storage share one
host copy.
"""

from __future__ import annotations

import time
from typing import Callable, ContextManager, Protocol, runtime_checkable

import torch
from torch import nn

from chameleon_dist.device.host_pool import HostBufferPool


# NOTE [Release after copy]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Memory that a copy reads or writes is never handed back for reuse before that copy has completed. The
# device layer (``StreamDevice``, over either backend: NOTE [One device code path] in ``device/backend.py``)
# enforces this for each of the three kinds of memory a swap touches:
#
# - The swap-out's device source. ``copy_to_host`` returns at once and the caller drops its references
#   right away: from then on the device holds the source storage, so its block cannot be freed while the
#   copy reads it. The copy waits on the stream that produced the storage (recorded at the save: a side
#   stream's tensor is not copied before its producer finished), and that stream owns the block. The
#   device lets go of it
#   * at ``release_source(handle)``, a planned release point: the owning stream waits for the copy's
#     done-event on the device (the host does not block) before the reference is dropped, and the caching
#     allocator reuses blocks in stream order, so the block is handed out again only after the copy. On a
#     GPU the host runs far ahead of the device, so a copy issued a few ops ago has usually not even
#     started: a release that only took finished copies would free nothing in the forward pass;
#   * at ``release_all_sources``, the same for every held source (backward begins, memory pressure, a retry,
#     and each save in WarmUp, which has no release points: waiting for finished copies there would keep
#     the whole forward pass on the device, and the detailed trace would take the device's hold for the
#     program's, shrinking every candidate's window);
#   * at ``release_completed_sources``, the copies whose done-event has fired (no waiting, no stall).
#   No ``record_stream`` for any of this (the paper's "custom recordStream").
# - The swap-in's device destination, allocated on the stream that reads it (the one current at the save,
#   where autograd runs the saving node's backward: NOTE [Producer and reader streams] in ``producers.py``)
#   and written by the copy. A handle dropped before anyone ``wait``-ed on it makes that stream wait for its
#   copy on the way out (``StreamCopyHandle.__del__``). A second reader on another stream is ordered by
#   ``wait`` and recorded there (``record_stream``: the one use, for a block two streams read).
# - The host buffer in between. Callers give it back with ``release_host`` only after ``wait`` on the last
#   copy that touches it (or once that copy is ``done()``); as ``wait`` does not block the host, the device
#   keeps the buffer out of the pool until the done-event of its last copy has fired.
#
# The twin rule, "a swapped-in tensor is never read before its copy has completed", is ``wait``'s job. On
# the emulated device the hazard checker (NOTE [Stream hazards] in ``device/simulated/hazards.py``) raises
# whenever either rule would be broken on the device's timeline.
# The policy simulator predicts the earliest release this rule allows; the executor picks the release points.


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all bytes of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def module_device_bytes(module: nn.Module, device: "Device") -> int:
    """Bytes of ``module``'s parameters and buffers that live on ``device`` (each storage counted once)."""
    storages: dict[int, int] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if device.is_device_tensor(tensor):
            storage = tensor.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


class CopyHandle(Protocol):
    """One asynchronous copy. ``result`` is the destination byte view (valid once complete)."""

    nbytes: int
    result: torch.Tensor

    def done(self) -> bool:
        """True once the copy has completed (never blocks)."""
        ...


class DeviceTimer(Protocol):
    """Measures the device's own work between points of the training thread (layer times in traces).

    ``mark`` notes "now" in the order the device executes the training stream's work and returns an opaque
    mark; ``elapsed_s(start, end)`` is the device time between two marks. On an accelerator the host only
    queues kernels, so a host clock read in a forward hook measures kernel launches, not their execution:
    there a mark is an event recorded on the compute stream and the time is read from the device once,
    after ``resolve`` (one synchronisation for a whole iteration, never one per layer). ``elapsed_s`` is
    only valid for marks made before the latest ``resolve``."""

    def mark(self) -> object:
        """Note this point of the training stream's work (never blocks)."""
        ...

    def resolve(self) -> None:
        """Wait until the device has reached every mark made so far (call once, before ``elapsed_s``)."""
        ...

    def completed(self, mark: object) -> bool:
        """True once the device has reached ``mark`` (never blocks): ``elapsed_s`` up to it is valid then."""
        ...

    def elapsed_s(self, start: object, end: object) -> float:
        """Seconds of device time from ``start`` to ``end`` (both made before the latest ``resolve``)."""
        ...


class HostTimer:
    """A ``DeviceTimer`` for devices whose work runs on the host thread that calls it (the emulated
    device, the meta device): a mark is ``time.perf_counter()`` and nothing needs resolving."""

    def mark(self) -> float:
        return time.perf_counter()

    def resolve(self) -> None:
        """Nothing to wait for: the host's clock was read when the work had run."""

    def completed(self, mark: float) -> bool:
        return True

    def elapsed_s(self, start: float, end: float) -> float:
        return end - start


PressureHandler = Callable[[int], int]
"""Called with the number of bytes an allocation is short of; returns how many bytes it released."""


@runtime_checkable
class Device(Protocol):
    """What the executor and the runtime need from an accelerator: copies, host buffers, memory accounting
    and the host link's bandwidth.

    ``d2h_bytes_per_s`` / ``h2d_bytes_per_s`` (read-only) are the device-to-host and host-to-device
    bandwidths the policy should plan with:

    - a positive number: the link's rate in that direction (the emulated device's modelled link, or the
      rate a ``CudaDevice`` was built with, i.e. the config's ``device.d2h_bytes_per_s`` /
      ``device.h2d_bytes_per_s``);
    - ``math.inf``: an instant link, whose copies complete as they are issued (an emulated device built
      without a bandwidth);
    - ``None``: the device does not know its link (a ``CudaDevice`` built without a rate); the caller
      supplies its own figure."""

    name: str
    emulated: bool
    capacity_bytes: int
    host_pool: HostBufferPool

    @property
    def d2h_bytes_per_s(self) -> float | None:
        """Device-to-host bandwidth: bytes per second, ``math.inf`` (instant) or ``None`` (unknown)."""
        ...

    @property
    def h2d_bytes_per_s(self) -> float | None:
        """Host-to-device bandwidth: bytes per second, ``math.inf`` (instant) or ``None`` (unknown)."""
        ...

    def live_bytes(self) -> int:
        """Device bytes currently held by live tensors."""
        ...

    def peak_bytes(self) -> int:
        """Highest ``live_bytes`` since the last ``reset_peak``."""
        ...

    def reset_peak(self) -> None: ...

    def stall_s(self) -> float:
        """Total seconds the training stream waited on copies since the device was made."""
        ...

    def active(self) -> ContextManager[None]:
        """Context entered around one training iteration on the training thread (metering, streams)."""
        ...

    def track_module(self, module: nn.Module) -> None:
        """Count ``module``'s parameters and buffers as device memory."""
        ...

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives in this device's memory (a swap candidate)."""
        ...

    def current_stream(self) -> object:
        """The stream work is queued on now (recorded at a save: the saved tensor's producer)."""
        ...

    def is_capturing(self) -> bool:
        """True while a CUDA graph is being captured on the current stream (NOTE [No swapping under graph
        capture] in ``executor/capture.py``); never on the emulated device."""
        ...

    def copy_to_host(self, storage: torch.UntypedStorage, stream: object | None = None) -> CopyHandle | None:
        """Start copying ``storage`` to a host buffer after the work queued so far on ``stream`` (the
        producer's, from ``producer_stream`` at the save; default: the current stream); ``None`` when the host
        budget has no room.

        The device holds ``storage`` from now on; the caller drops its own references right away (see
        NOTE [Release after copy])."""
        ...

    def copy_to_device(self, host: torch.Tensor, after: CopyHandle | None = None,
                       stream: object | None = None) -> CopyHandle:
        """Allocate device memory for ``host`` on ``stream``, the stream that will read it (the one current at
        the save; default: the current stream; may raise ``torch.OutOfMemoryError``) and start the copy, on
        the link, after ``after`` (the swap-out that filled ``host``) without blocking the training stream."""
        ...

    def producer_stream(self, tensor: torch.Tensor) -> object:
        """The stream that made ``tensor``'s storage and owns its block (NOTE [Producer and reader streams] in
        ``device/producers.py``)."""
        ...

    def wait(self, handle: CopyHandle) -> torch.Tensor:
        """Make the training stream wait for ``handle``; returns its result. Waiting counts as stall."""
        ...

    def release_host(self, host: torch.Tensor) -> None:
        """Give a host buffer back to the pool; call after ``wait`` on the last copy that touches it (or
        once that copy is ``done()``). See NOTE [Release after copy]."""
        ...

    def release_all_sources(self) -> int:
        """The planned release point: let go of every swap-out source the device still holds, finished or
        not, each block's reuse ordered after its copy (on the GPU: the host does not block, the compute
        stream may wait, counted as stall). Returns the bytes let go here. See NOTE [Release after copy]."""
        ...

    def release_source(self, handle: CopyHandle) -> int:
        """A planned release point: let go of ``handle``'s source and of every source issued before it,
        ordered on the device (the owning stream waits for the copy; the host does not block). Returns the
        bytes let go. See NOTE [Release after copy]."""
        ...

    def release_completed_sources(self) -> int:
        """Let go of the swap-out sources whose copy has already completed; never waits, never stalls.
        Returns the bytes let go here. See NOTE [Release after copy]."""
        ...

    def set_pressure_handler(self, handler: PressureHandler | None) -> None:
        """Install a callback tried when an op or a swap-in runs out of memory, before the op runs once
        more (NOTE [Relief inside the op] in ``device/dispatch.py``)."""
        ...

    def synchronize(self) -> None:
        """Wait for every copy started so far."""
        ...

    def timer(self, keep_waits: bool = False) -> DeviceTimer:
        """A timer of this device's work (layer times in detailed traces): CUDA events on a GPU, the host
        clock where the host runs the work. One per iteration; see ``DeviceTimer``. ``keep_waits``: its spans can
        leave out the waits on copies inside them (``EventTimer.compute_s``)."""
        ...

    def random_state(self) -> torch.Tensor | None:
        """The device's random generator state (None when the device draws from the CPU generator)."""
        ...

    def set_random_state(self, state: torch.Tensor) -> None:
        """Restore a state from ``random_state`` (an out-of-memory retry replays the same dropout masks)."""
        ...
