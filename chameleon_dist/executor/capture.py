"""What the saved-tensor hooks do while a CUDA graph is being captured.

NOTE [No swapping under graph capture]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Swapping is unsupported inside a CUDA-graph capture (Megatron's CUDA graphs, Transformer Engine's graphed
callables, a graph captured by hand). A capture records the kernels queued on the capturing stream to replay
them later; querying an event, making another stream wait on the capturing one, or queueing a copy on a
copy stream invalidates the capture (``cudaErrorStreamCaptureInvalidated``), and a replay would repeat
copies into host buffers the pool has since handed to other tensors. So while
``Device.is_capturing()`` (the CUDA backend asks whether the current stream is capturing; the emulated
device while its backend's ``capture()`` block runs, where querying an event or waiting on the device raises
``GraphCaptureQueryError`` as CUDA refuses both), the pack hook keeps every saved tensor on the device exactly as it is and queues
nothing: no ``event.query``, no ``wait_stream``, no copy, no release of a held source, no entry a
passive swap could take later. The unpack hook hands a kept tensor back (with autograd's in-place check)
and queues nothing either; a tensor swapped out before the capture began cannot come back inside it
(that would be a copy in the graph) and raises ``GraphCaptureSwapError``. The capture's memory is the
graph's private pool's, which Chameleon neither plans nor meters.

Every path that could queue work asks the same question first: the saved-tensor hooks (here), the op clock
that the profiler's dispatch modes drive (``SwapExecutor.on_op``: a swap-out, release or swap-in placed at an op
inside the capture stays due and starts at the first op after it), relief in the dispatch layer (never retried
under capture), and a copy handle dropped inside a capture (``StreamCopyHandle.__del__``: the device keeps its
bytes and orders its stream after the copy once the capture has ended, ``StreamDevice.apply_deferred_guards``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from chameleon_dist.executor.records import KeptTensor

Hook = Callable[[Any], Any]


class GraphCaptureSwapError(RuntimeError):
    """A tensor swapped out before a CUDA-graph capture was needed inside it (NOTE [No swapping under
    graph capture])."""


def capture_aware(device, pack: Hook, unpack: Hook) -> tuple[Hook, Hook]:
    """``pack`` and ``unpack`` (the executor's saved-tensor hooks), asking ``device.is_capturing()`` first at
    each call: while a graph is captured they are not called (NOTE [No swapping under graph capture])."""

    def pack_unless_capturing(tensor):
        return kept_under_capture(tensor) if device.is_capturing() else pack(tensor)

    def unpack_unless_capturing(packed):
        return unpacked_under_capture(packed) if device.is_capturing() else unpack(packed)

    return pack_unless_capturing, unpack_unless_capturing


def kept_under_capture(tensor: torch.Tensor) -> KeptTensor | torch.Tensor:
    """The pack hook's answer during a capture: the tensor stays, with no stream recorded (no passive swap
    may take it) and nothing queued. Parameters and tensor subclasses are handed to autograd as themselves."""
    if type(tensor) is not torch.Tensor:
        return tensor
    return KeptTensor(tensor)


def unpacked_under_capture(packed) -> torch.Tensor:
    """The unpack hook's answer during a capture: a kept tensor back (checked for in-place writes), else an
    error, since restoring a swapped tensor would queue a copy inside the graph."""
    if isinstance(packed, KeptTensor) and packed.swapped is None:
        return packed.unpack()
    if isinstance(packed, torch.Tensor):
        return packed
    raise GraphCaptureSwapError(
        "a saved tensor swapped to host memory before a CUDA-graph capture began was needed inside the capture: "
        "swapping is unsupported across graph capture (NOTE [No swapping under graph capture] in "
        "chameleon_dist/executor/capture.py). Capture the forward and backward of the same graphed region "
        "together, or exclude the captured modules from Chameleon (executor protection / enabled: false)"
    )
