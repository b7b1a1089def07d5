"""The narrow `Device` protocol the executor talks to, shared by the real and the emulated device.

The unit of transfer is a whole *untyped storage* seen as a flat uint8 tensor ("byte view"): swapping a
storage instead of a tensor keeps views, strides and storage offsets exact (so restored tensors are
bit-identical and feed the same kernels) and lets several saved tensors that share one storage share one
host copy.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Protocol, runtime_checkable

import torch
from torch import nn

from chameleon_dist.device.host_pool import HostBufferPool


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


PressureHandler = Callable[[int], int]
"""Called with the number of bytes an allocation is short of; returns how many bytes it released."""


@runtime_checkable
class Device(Protocol):
    """What the executor needs from an accelerator: copies, host buffers and memory accounting."""

    name: str
    emulated: bool
    capacity_bytes: int
    host_pool: HostBufferPool

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

    def copy_to_host(self, storage: torch.UntypedStorage) -> CopyHandle | None:
        """Start copying ``storage`` to a host buffer; ``None`` when the host budget has no room.

        The device keeps ``storage`` alive until the copy has completed and then lets it go (the caller
        drops its own references right away), so device memory returns exactly when it is safe."""
        ...

    def copy_to_device(self, host: torch.Tensor, after: CopyHandle | None = None) -> CopyHandle:
        """Allocate device memory for ``host`` (may raise ``torch.OutOfMemoryError``) and start the copy,
        on the link, after ``after`` (the swap-out that filled ``host``) without blocking the training
        stream on it."""
        ...

    def wait(self, handle: CopyHandle) -> torch.Tensor:
        """Make the training stream wait for ``handle``; returns its result. Waiting counts as stall."""
        ...

    def release_host(self, host: torch.Tensor) -> None:
        """Give a host buffer back to the pool once nothing reads it any more."""
        ...

    def release_pending(self) -> int:
        """Let go of every swapped-out source whose copy has completed (ordered after the copy)."""
        ...

    def release_completed(self) -> int:
        """Without waiting: let go of the swapped-out sources whose copies have already completed."""
        ...

    def set_pressure_handler(self, handler: PressureHandler | None) -> None:
        """Install a callback tried before an out-of-memory error is raised (where supported)."""
        ...

    def synchronize(self) -> None:
        """Wait for every copy started so far."""
        ...

    def random_state(self) -> torch.Tensor | None:
        """The device's random generator state (None when the device draws from the CPU generator)."""
        ...

    def set_random_state(self, state: torch.Tensor) -> None:
        """Restore a state from ``random_state`` (an out-of-memory retry replays the same dropout masks)."""
        ...
