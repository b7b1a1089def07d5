"""What an out-of-memory retry of ``Chameleon.run_iteration`` restores before it runs the closure again.

- ``GradientSnapshot``: the gradient every parameter had when the iteration began (None, or its
  values), so the retry never adds to a half-accumulated gradient. Taken for the parameters of attached
  models and of the optimizer passed to ``run_iteration``; parameters the runtime cannot see are not
  restored (the runtime warns when that may have happened). Gradients zeroed in place are checked on
  their device and not copied; other existing gradients are copied to host memory just before backward
  first adds to them, without a host wait (NOTE [A gradient snapshot without host waits]);
  ``zero_grad(set_to_none=True)`` makes the snapshot free.
- ``RandomState``: the CPU generator and the device's, so dropout masks repeat exactly.
- ``final_out_of_memory``: the error the last failed attempt raises, saying why swapping could not make
  room and what to change.
- ``OptimizerStateGuard``: an out-of-memory error inside ``optimizer.step()`` is not retried (the
  step may already have changed parameters), but state entries the failed step created lazily (AdamW's
  first ``exp_avg``) are removed, so the optimizer stays usable instead of failing later with a
  ``KeyError``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

from chameleon_dist.device.base import Device
from chameleon_dist.units import format_bytes


class GradientSnapshot:
    """The gradient of every parameter as the iteration began, to give back before a retry.

    NOTE [A gradient snapshot without host waits]
    Nothing is copied, and the host never waits for the device, when the snapshot is taken: one fused
    reduction per device (``_foreach_max`` over the gradients' bytes) tells on the device which gradients
    have a bit set, and that answer travels to a host buffer asynchronously. A gradient's values matter
    to a retry only once backward is about to add to it (a retry is possible only after an out-of-memory
    error in the closure, and until backward adds to a gradient it still holds its starting bits), so
    each parameter gets a hook that runs just before autograd accumulates into its gradient, once per
    iteration: by then the answer has landed (``query``, never waiting), and a gradient whose bits are all
    0 (what ``zero_grad(set_to_none=False)`` and the zeroed buffers of Megatron and DeepSpeed leave) is not
    copied (``restore`` zeroes it again); any other is copied to a host buffer of the device's pool on the
    accumulating stream, which then waits for the copy on the device (the host does not). Were the answer
    not there yet, the gradient is copied. ``zero_grad(set_to_none=True)`` makes the snapshot free. Copies
    that the pool cannot hold, of gradients that are views into a larger buffer, and of sparse gradients are
    made with a blocking copy. Gradients that a closure writes in place before its first backward (other
    than zeroing them) are not seen. ``host_bytes`` says how much was copied; ``close`` ends it. Whether a gradient
is copied depends on whether the answer has landed, i.e. on timing: every op the snapshot issues (host buffers,
copies, a retry's restore) runs in ``hide_own_ops`` (the profiler's ``quiet``), never as the program's (NOTE
[Chameleon's own ops are never the program's] in profiler/scope.py)."""

    def __init__(self, parameters: Iterable[torch.Tensor], device: Device | None = None,
                 hide_own_ops: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> None:
        self._device = device
        self._hide_own_ops = hide_own_ops  # (the profiler's ``quiet``: NOTE [Chameleon's own ops are never the program's])
        unique = list({id(p): p for p in parameters}.values())
        self._saved: list[tuple[torch.Tensor, torch.Tensor | None]] = [(p, p.grad) for p in unique]
        self._versions = [None if g is None else g._version for _, g in self._saved]  # as the iteration began
        self._written: set[int] = set()  # copied after an in-place write the snapshot did not see
        self._nonzero = _NonzeroBits([g for _, g in self._saved], device)
        self._copies: dict[int, Any] = {}  # position -> a host copy (a device handle, or a CPU tensor)
        self._zeroed: set[int] = set()  # positions found all 0 when backward first reached them
        self.host_bytes = 0
        self._hooks = [p.register_hook(functools.partial(self._before_accumulation, i))
                       for i, (p, g) in enumerate(self._saved) if g is not None and p.requires_grad]

    def __len__(self) -> int:
        return len(self._saved)

    def covers(self, parameter: torch.Tensor) -> bool:
        return any(saved is parameter for saved, _ in self._saved)

    def _before_accumulation(self, position: int, incoming: torch.Tensor) -> None:
        """Autograd is about to add ``incoming`` into the parameter's gradient: keep its starting bits first. Its
        ops (a host buffer, the copy) are the snapshot's, never the program's: whether a copy is made depends on
        whether the zero check has landed, i.e. on how far the host ran ahead of the device."""
        with self._hide_own_ops():
            self._keep(position)

    def _keep(self, position: int) -> None:
        parameter, grad = self._saved[position]
        if position in self._copies or position in self._zeroed or parameter.grad is not grad:
            return  # kept already, or the gradient was replaced (the starting tensor is untouched)
        if self._nonzero.known_zero(position):
            self._zeroed.add(position)
            return
        if grad._version != self._versions[position]:
            self._written.add(position)  # (the copy holds what the closure wrote, not the starting bits)
        self._copies[position] = self._copy(grad)
        self.host_bytes += grad.numel() * grad.element_size()

    def _copy(self, grad: torch.Tensor) -> Any:
        return host_copy(self._device, grad)

    def restore(self) -> None:
        """Every parameter gets back the gradient it had (the same tensor object, so buffers that alias it
        stay valid), or None. A gradient the closure wrote in place before backward reached it (its version
        moved) can be given back only when it started at 0 or was zeroed: else this raises rather than let the
        retry apply the closure's write twice."""
        if self._device is not None:
            self._device.synchronize()  # (a retry: the host may read the copies and the zero answers now)
        with torch.no_grad(), self._hide_own_ops():
            for position, (parameter, grad) in enumerate(self._saved):
                if grad is None:
                    parameter.grad = None
                    continue
                kept = self._copies.get(position)
                unseen = kept is None and position not in self._zeroed and grad._version != self._versions[position]
                if unseen and self._nonzero.known_zero(position, wait=True):
                    self._zeroed.add(position)  # (started at 0: the closure's write is undone by zeroing)
                elif (unseen or position in self._written) and bool(_current(grad, kept).any()):
                    raise RuntimeError(
                        f"cannot retry the iteration: the gradient of a parameter {list(grad.shape)} was written in "
                        "place inside the closure before backward reached it, and the gradient snapshot keeps a "
                        "gradient's starting values only when backward first adds to it. Write gradients after "
                        "backward, zero them with zero_grad(set_to_none=True), or set executor.max_oom_retries: 0.")
                if position in self._zeroed:
                    grad.zero_()
                elif kept is not None:
                    grad.copy_(_current(grad, kept))
                if parameter.grad is not grad:
                    parameter.grad = grad

    def close(self) -> None:
        """The iteration is over: remove the hooks and give the host buffers back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        with self._hide_own_ops():
            for kept in self._copies.values():
                if not isinstance(kept, torch.Tensor):
                    self._device.release_host(kept.result)
            self._copies.clear()
            self._nonzero.close()


def host_copy(device: Device | None, tensor: torch.Tensor) -> Any:
    """``tensor``'s values kept on the host before a write: a copy to a host buffer of ``device``'s pool on the
    current stream, which then waits for it on the device (the host does not), for a tensor that is its whole
    storage; else (a view, no room in the pool, no device) a blocking copy to a CPU tensor."""
    whole = tensor.layout == torch.strided and tensor.is_contiguous() and tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    handle = device.copy_to_host(tensor.untyped_storage()) if whole and device is not None else None
    if handle is None:
        return tensor.detach().to("cpu", copy=True)
    device.wait(handle)  # the write, queued next on this stream, comes after the copy
    return handle


def kept_values(tensor: torch.Tensor, kept: Any) -> torch.Tensor:
    """The values ``host_copy`` kept of ``tensor`` (its CPU tensor, or the host buffer seen as ``tensor``); the
    caller synchronised the device, so the copy has landed."""
    return kept if isinstance(kept, torch.Tensor) else kept.result.view(tensor.dtype).view(tensor.shape)


def _current(grad: torch.Tensor, kept: Any) -> torch.Tensor:
    """What a retry would give back at a position: its host copy (a CPU tensor, or a device handle's bytes seen
    as the gradient), else the gradient as it is now. The caller synchronised the device: every copy landed."""
    return grad if kept is None else kept_values(grad, kept)


class _NonzeroBits:
    """Which gradients have a bit set, found on their device in one fused reduction per device and copied to
    the host asynchronously (NOTE [A gradient snapshot without host waits]). ``known_zero`` never waits:
    False until the answer has landed. None, empty and sparse gradients: never known zero (empty ones have
    nothing to keep anyway)."""

    def __init__(self, grads: list[torch.Tensor | None], device: Device | None) -> None:
        self._device = device
        self._answers: list[tuple[list[int], Any]] = []  # (positions, host copy of their flags)
        self._flags: dict[int, bool] = {}
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for position, grad in enumerate(grads):
            if grad is not None and grad.layout == torch.strided and grad.numel():
                by_device.setdefault(grad.device, []).append((position, grad))
        for found in by_device.values():
            positions = [position for position, _ in found]
            maxima = torch._foreach_max([g.detach().reshape(-1).view(torch.uint8) for _, g in found])
            flags = torch.stack(maxima).ne(0).view(torch.uint8)
            handle = device.copy_to_host(flags.untyped_storage()) if device is not None else None
            self._answers.append((positions, handle if handle is not None else flags))

    def known_zero(self, position: int, wait: bool = False) -> bool:
        """Whether the gradient at ``position`` had no bit set; with ``wait`` (a retry) the answer is waited for."""
        if self._answers:
            self._collect(wait)
        return self._flags.get(position) is False

    def _collect(self, wait: bool) -> None:
        waiting = []
        for positions, answer in self._answers:
            if (answer if isinstance(answer, torch.Tensor) else answer.result).device.type == "meta":
                if not isinstance(answer, torch.Tensor):  # sizes only (NOTE [Meta tensors]): none is known zero
                    self._device.release_host(answer.result)
                continue
            if isinstance(answer, torch.Tensor):  # no device copy: a host tensor already
                values = answer.tolist() if answer.device.type == "cpu" or wait else None
            elif wait:  # (the caller synchronised the device: the copy has landed)
                values = answer.result.tolist()
            else:
                values = answer.result.tolist() if answer.done() else None
            if values is None:
                waiting.append((positions, answer))
                continue
            self._flags.update(zip(positions, (bool(v) for v in values)))
            if not isinstance(answer, torch.Tensor):
                self._device.release_host(answer.result)
        self._answers = waiting

    def close(self) -> None:
        for _, answer in self._answers:
            if not isinstance(answer, torch.Tensor):
                self._device.release_host(answer.result)
        self._answers = []


class RandomState:
    def __init__(self, device: Device) -> None:
        self._device = device
        self._cpu = torch.random.get_rng_state()
        self._device_state = device.random_state()

    def restore(self) -> None:
        torch.random.set_rng_state(self._cpu)
        if self._device_state is not None:
            self._device.set_random_state(self._device_state)


class OptimizerStepOutOfMemoryError(torch.OutOfMemoryError):
    """Out of memory inside ``optimizer.step()`` (not retried)."""


@contextlib.contextmanager
def optimizer_state_guard(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Run ``optimizer.step()`` inside: on out-of-memory, drop the state the step created and raise an
    error that names the optimizer step."""
    before: set[Any] = set(optimizer.state.keys())
    try:
        yield
    except torch.OutOfMemoryError as exc:
        created = [p for p in list(optimizer.state.keys()) if p not in before]
        for parameter in created:
            del optimizer.state[parameter]
        raise OptimizerStepOutOfMemoryError(
            f"out of memory in optimizer.step() ({type(optimizer).__name__}), after forward and backward "
            f"succeeded: {str(exc).splitlines()[0]}\nThe optimizer step is not retried (it may already have "
            f"changed some parameters); {len(created)} optimizer state entries it had just created were "
            "discarded so the optimizer stays usable. Leave room for the optimizer state: lower "
            "memory_budget or raise device.capacity."
        ) from exc


def final_out_of_memory(
    exc: torch.OutOfMemoryError,
    retries: int,
    *,
    refused_bytes: int,
    host_budget_bytes: int | None,
    host_in_use_bytes: int,
    swaps_everything: bool,
) -> torch.OutOfMemoryError:
    """The error after the last of ``retries`` retries. ``refused_bytes``: what host_memory_budget kept on
    the device in the last attempt; ``swaps_everything``: the last attempt swapped every saved activation
    (no policy, ``min_swap_bytes`` 0). Returns ``exc`` itself when neither explains the failure."""
    if refused_bytes:
        return torch.OutOfMemoryError(
            f"{exc}\nhost_memory_budget ({format_bytes(host_budget_bytes or 0)}) refused "
            f"{format_bytes(refused_bytes)} of swaps in the last of {retries + 1} attempts, which stayed on "
            f"the device: raise host_memory_budget to at least "
            f"{format_bytes(host_in_use_bytes + refused_bytes)}."
        )
    if swaps_everything:
        return torch.OutOfMemoryError(
            f"{exc}\nChameleon already swaps every saved activation and the step still does not fit after "
            f"{retries} retries: raise device.capacity / memory_budget, lower the micro-batch size, or add "
            "recomputation."
        )
    return exc
