"""What an out-of-memory retry of ``Chameleon.run_iteration`` restores before it runs the closure again.

- ``GradientSnapshot``: the gradient every parameter had when the iteration began (None, or its
  values), so the retry never adds to a half-accumulated gradient. Taken for the parameters of attached
  models and of the optimizer passed to ``run_iteration``; parameters the runtime cannot see are not
  restored (the runtime warns when that may have happened). Gradients zeroed in place are checked on
  their device and not copied; other existing gradients are copied to host memory once per iteration,
  outside the metered device; ``zero_grad(set_to_none=True)`` makes the snapshot free.
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
from typing import Any, Iterable, Iterator

import torch

from chameleon_dist.device.base import Device
from chameleon_dist.units import format_bytes


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_ZEROS = object()  # marks a gradient whose every bit was 0 when the snapshot was taken (nothing copied)


class GradientSnapshot:
    """The gradient of every parameter as the iteration began, to give back before a retry.

    A gradient whose bits are all 0 (what ``zero_grad(set_to_none=False)`` and the zeroed gradient
    buffers of Megatron and DeepSpeed leave) is not copied: ``restore`` zeroes it again. Checking costs a
    read of the gradient on its device (a single synchronization for all of them); copying would cost a
    device-to-host copy of every gradient in every iteration. Other gradients (accumulated across
    iterations, sparse ones) are copied to host memory. ``host_bytes`` says how much was copied."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor | None, Any]] = []
        unique = list({id(p): p for p in parameters}.values())
        zero_bits = _all_zero_bits([p.grad for p in unique])
        self.host_bytes = 0
        for parameter, zero in zip(unique, zero_bits):
            grad = parameter.grad
            if grad is None:
                kept = None
            elif zero:
                kept = _ZEROS
            else:
                kept = grad.detach().to("cpu", copy=True)
                self.host_bytes += grad.numel() * grad.element_size()
            self._saved.append((parameter, grad, kept))

    def __len__(self) -> int:
        return len(self._saved)

    def covers(self, parameter: torch.Tensor) -> bool:
        return any(saved is parameter for saved, _, _ in self._saved)

    def restore(self) -> None:
        """Every parameter gets back the gradient it had (the same tensor object, so buffers that alias it
        stay valid), or None."""
        with torch.no_grad():
            for parameter, grad, kept in self._saved:
                if grad is None:
                    parameter.grad = None
                    continue
                if kept is _ZEROS:
                    grad.zero_()
                else:
                    grad.copy_(kept)
                if parameter.grad is not grad:
                    parameter.grad = grad


def _all_zero_bits(grads: list[torch.Tensor | None]) -> list[bool]:
    """For each dense gradient: whether all its bits are 0 (exactly what ``zero_()`` writes; -0.0 and NaN
    are not). None and sparse gradients: False. One host synchronization for all of them."""
    flags = []
    for grad in grads:
        integer = None if grad is None or grad.layout != torch.strided else _SAME_SIZE_INTEGER.get(grad.element_size())
        if integer is None or grad.is_complex():
            flags.append(None)
            continue
        flags.append(grad.detach().view(integer).any())
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        if f is not None:
            by_device.setdefault(f.device, []).append(f)
    answers = {device: iter(torch.stack(found).tolist()) for device, found in by_device.items()}
    return [False if f is None else not next(answers[f.device]) for f in flags]


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
