"""``TrainingScope``: what the profiler needs to know about where the training thread is.

Whether an op belongs to the model's autograd work cannot be read from the grad mode alone: custom
autograd functions (Megatron's parallel linear layers, for one) run their forward with grad disabled.
So an op counts as part of autograd when grad is on, when it runs inside a backward pass, or when it
runs inside the forward of an attached model that was entered with grad on. A validation pass under
``torch.no_grad()`` enters the model with grad off and stays outside. ``quiet()`` hides the executor's
own bookkeeping ops (copies, restores) from the profiler, so the sequence describes the model only.

NOTE [Chameleon's own ops are never the program's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What Chameleon does inside an iteration depends on timing (how far the host ran ahead of the device), memory
pressure and the policy, so an op it issues that the profiler counted would make the same program look like
another one (a static MLP left Stable every few iterations: the gradient snapshot's copies moved the op count by
a third). Every op Chameleon issues inside an observed iteration runs where the profiler's modes do not record
it, on every backend (the same code runs over CUDA and the simulated backend):

- the pack hook (host buffers, swap-out copies, releases of earlier sources) and the unpack hook (swap-ins,
  waits, restores, recompute replays, prefetches fired there, overdue swap-outs): ``hide_own_ops``, which the
  runtime sets to ``quiet`` (executor/swap.py);
- the op clock's placed swap-outs, releases and prefetch swap-ins (``SwapExecutor.on_op``): called from
  ``SignatureMode``'s own dispatch, where no mode above the device's records, and inside ``hide_own_ops``;
- relief (stream-ordered release, evicting prefetches, passive swap): inside the device dispatch layer's own
  ``__torch_dispatch__`` (device/dispatch.py), below the profiler's modes, which are off there; a swap-in's
  relief runs in the unpack hook (hidden);
- the gradient snapshot (retry.py): its zero check runs before the iteration opens; the copies made before
  backward first accumulates into a gradient, a retry's restore and ``close`` run in ``quiet``;
- the release of every held source when the executor's block ends: stream waits and reference drops, no op.

``quiet`` is per thread: a hook's ops run on the thread that runs the hook (a joined worker's pack, autograd's
device thread's unpack), while another thread's model ops meanwhile are the program's.
``tests/test_own_ops_hidden.py`` checks that every iteration's signature, with swaps, recompute replays, relief
and retries, is the one a run that keeps everything on the device records, over both ``zero_grad`` settings.

``LayerClock``: which transformer layer (a module at ``layers.<i>``, ``blocks.<i>``, ``h.<i>`` or
``layer.<i>``) of the attached models is running, in every iteration (two hooks per layer call).

``MicroBatchClock``: which micro-batch the training thread works on, when an engine's schedule says so.

``LayerTimes``: how long each layer's forward and backward took in a profiled iteration, measured with the
device's timer (CUDA events on a GPU, the host clock on the emulated device).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from typing import Any, Iterator

import torch
from torch import nn

from chameleon_dist.device.base import DeviceTimer

logger = logging.getLogger(__name__)


_LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|blocks|h|layer)\.(\d+)(?:\.|$)")


def layer_of(module_path: str) -> int:
    """The transformer-layer index in a module path such as ``decoder.layers.3.mlp`` (else -1)."""
    match = _LAYER_PATTERN.search(module_path)
    return int(match.group(1)) if match else -1


def is_layer_path(path: str) -> bool:
    """Whether ``path`` names a transformer layer itself (``layers.3``, not ``layers.3.mlp``)."""
    match = _LAYER_PATTERN.search(path)
    return bool(match) and match.end() == len(path)


_EXPERT_PATTERN = re.compile(r"(?:^|\.)(?:experts|local_experts)\.(\d+)$")


def expert_of(path: str) -> int:
    """The expert index when ``path`` names one expert of an MoE layer itself (``layers.1.mlp.experts.5``,
    Megatron's ``local_experts.5``), else -1."""
    match = _EXPERT_PATTERN.search(path)
    return int(match.group(1)) if match else -1


class LayerClock:
    """The transformer layer running now (-1: none), and the expert inside it (-1: none), from hooks on the
    layer and expert modules of watched models. Experts that are not modules of their own (one module looping
    over expert weights, one grouped op for all experts) have no index here."""

    def __init__(self) -> None:
        self._stack: list[int] = []
        self._experts: list[int] = []

    def watch(self, model: nn.Module) -> None:
        for path, module in model.named_modules():
            stack, index = (self._stack, layer_of(path)) if is_layer_path(path) else (self._experts, expert_of(path))
            if index >= 0:
                module.register_forward_pre_hook(self._enter(stack, index))
                module.register_forward_hook(self._leave(stack), always_call=True)

    @staticmethod
    def _enter(stack: list[int], index: int):
        def hook(module, args) -> None:
            stack.append(index)

        return hook

    @staticmethod
    def _leave(stack: list[int]):
        def hook(module, args, output) -> None:
            if stack:
                stack.pop()

        return hook

    @property
    def layer(self) -> int:
        return self._stack[-1] if self._stack else -1

    @property
    def expert(self) -> int:
        return self._experts[-1] if self._experts else -1

    @property
    def site(self) -> str:
        """The layer, and the expert running inside it (``"3.e5"``), for save sites (NOTE [Save-site matching]
        in executor/matching.py)."""
        expert = self.expert
        return f"{self.layer}" if expert < 0 else f"{self.layer}.e{expert}"

    def reset(self) -> None:
        """Forget layers and experts an exception left entered (an iteration starts over)."""
        self._stack.clear()
        self._experts.clear()


class MicroBatchClock:
    """The micro-batch the training thread works on now, as the engine's schedule names it (Megatron's
    forward and backward steps, DeepSpeed's pipeline instructions), or None when nobody names it.

    With None, the trace recorder and the executor infer it: a forward op (a save) after a backward pass
    starts the next micro-batch. That is right for gradient accumulation in a plain loop (F B F B ...) and
    wrong under 1F1B pipelining, where the first stage runs F F B F B ... B B with up to ``pp`` micro-batches
    in flight, and under interleaving, where model chunks alternate: there an integration calls ``enter``
    at each forward and backward step with the schedule's own identity (a number unique within the
    iteration, e.g. ``chunk * micro_batches + micro_batch``). The profiler clears it when an iteration
    begins, so a plain loop after a pipelined one infers again."""

    def __init__(self) -> None:
        self.current: int | None = None

    def enter(self, micro_batch: int) -> None:
        """The schedule's next step works on ``micro_batch`` (its forward or its backward)."""
        self.current = micro_batch

    def clear(self) -> None:
        self.current = None


class TrainingScope:
    """Which ops belong to the model's program (the signature's and the trace's "inside" ops): those run with
    gradients enabled, inside a watched model's forward, or by autograd's backward; never those of the
    optimizer step (``optimizer_step``), whatever its grad mode (DeepSpeed's ZeRO step runs with gradients
    enabled, and a step skipped on an fp16 overflow must not read as another program)."""

    def __init__(self) -> None:
        self._entered_with_grad: list[bool] = []
        self._grad_forwards = 0
        self._optimizer_steps = False
        self._quiet = threading.local()  # ``depth``: ``quiet()`` blocks this thread is inside

    @property
    def paused(self) -> bool:
        """Whether this thread runs Chameleon's own ops now (``quiet``): the profiler does not record them. Per
        thread: a hook's ops run on the thread that runs the hook (a joined worker's pack, autograd's device
        thread's unpack), and another thread's model ops meanwhile are still the model's."""
        return getattr(self._quiet, "depth", 0) > 0

    @property
    def optimizer_active(self) -> bool:
        """Whether the optimizer step is running (``optimizer_step``)."""
        return self._optimizer_steps

    def optimizer_step(self, active: bool) -> None:
        """The optimizer step begins (True) or ends (False); ``reset`` ends it too."""
        self._optimizer_steps = active

    def reset(self) -> None:
        """A new iteration or attempt: no optimizer step is running (a step that raised never said it ended)."""
        self._optimizer_steps = False

    def watch(self, model: nn.Module) -> None:
        """Hooks on the model's own forward (one pair per call of the whole model, not per layer)."""
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module, args) -> None:
        grad = torch.is_grad_enabled()
        self._entered_with_grad.append(grad)
        self._grad_forwards += grad

    def _leave(self, module, args, output) -> None:
        if self._entered_with_grad:
            self._grad_forwards -= self._entered_with_grad.pop()

    def in_autograd(self) -> bool:
        if self._optimizer_steps:
            return False
        return torch.is_grad_enabled() or self._grad_forwards > 0 or torch._C._current_graph_task_id() != -1

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Chameleon's own ops inside (NOTE [Chameleon's own ops are never the program's]): not recorded."""
        local = self._quiet
        local.depth = getattr(local, "depth", 0) + 1
        try:
            yield
        finally:
            local.depth -= 1


def _grad_node(values: Any):
    """The autograd node that produced the first tensor with one among ``values`` (a tensor, or a tuple or
    list of them, as modules take and return them), else None."""
    for value in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            return value.grad_fn
    return None


class LayerTimes:
    """Forward and backward time per transformer layer in one profiled iteration (summed over its calls,
    e.g. one per micro-batch), measured with ``timer``: a ``DeviceTimer``, so that on a GPU the times are the
    kernels' execution, read once after the iteration, not the host's time to launch them.

    Forward: a mark when the layer is entered and one when it returns (outside backward: a checkpointed
    layer recomputed inside backward is not counted again). Backward: a pre-hook on the autograd node that
    produced the layer's output marks the start of the layer's backward (its output gradient is complete),
    a pre-hook on the node that produced the layer's input marks its end (the input gradient is complete,
    from the residual branch and the layer alike). Node hooks leave the graph and the op sequence unchanged,
    unlike module backward hooks, which wrap inputs and outputs in extra autograd functions (and would make
    profiled iterations' op sequences differ from the others'). A layer whose input needs no gradient, or
    whose output is not used by the loss, has no backward time; one whose input also feeds later layers
    directly gets the time until those are done too."""

    def __init__(self, timer: DeviceTimer) -> None:
        self.timer = timer  # (a timer with ``compute_s``: its spans exclude the waits on copies, see ``resolve``)
        self._open: dict[int, tuple[object, object]] = {}  # layer -> (start mark, its input's grad node)
        self._forward: list[tuple[int, object, object]] = []  # (layer, start mark, end mark)
        self._backward: list[list] = []  # [layer, start mark or None, end mark or None]
        self._hooks: list = []
        self._closed = False

    def enter(self, layer: int, args: Any) -> None:
        """A layer's forward begins (from its forward pre-hook, outside backward)."""
        self._open[layer] = (self.timer.mark(), _grad_node(args))

    def leave(self, layer: int, output: Any) -> None:
        """A layer's forward returned ``output`` (from its forward hook)."""
        opened = self._open.pop(layer, None)
        if opened is None:
            return
        start, input_node = opened
        self._forward.append((layer, start, self.timer.mark()))
        output_node = _grad_node(output)
        if input_node is not None and output_node is not None:
            span = [layer, None, None]
            self._backward.append(span)
            self._hooks.append(output_node.register_prehook(self._marker(span, 1)))
            self._hooks.append(input_node.register_prehook(self._marker(span, 2)))

    def _marker(self, span: list, slot: int):
        def hook(grad_outputs):
            if not self._closed and span[slot] is None:
                span[slot] = self.timer.mark()

        return hook

    def reset(self) -> None:
        """Forget everything measured so far (an out-of-memory retry starts the iteration over)."""
        self._remove_hooks()
        self._open.clear()
        self._forward, self._backward = [], []

    def resolve(self) -> tuple[dict[int, float], dict[int, float]]:
        """Stop measuring, wait once for the device to reach every mark, and return ``(forward, backward)``
        seconds per layer: with a device timer, each span's ``compute_s`` (its device time less the time its
        stream waited on copies inside it: WarmUp's release waits, a swap-in's wait; at least the host's own time
        over it), so that calibration sees what the layer costs, not what the WarmUp policy made it wait. A device
        that cannot synchronise (after a failed iteration) yields no times rather than masking the iteration's own
        error."""
        self._closed = True
        self._remove_hooks()
        forward: dict[int, float] = {}
        backward: dict[int, float] = {}
        try:
            self.timer.resolve()
        except RuntimeError as exc:
            logger.warning("layer times unavailable: the device could not synchronise (%s)", exc)
            return forward, backward
        elapsed_s = self.timer.elapsed_s
        compute_s = getattr(self.timer, "compute_s", elapsed_s)  # (a device timer: without the waits on copies)
        for layer, start, end in self._forward:
            forward[layer] = forward.get(layer, 0.0) + compute_s(start, end)
        for layer, start, end in self._backward:
            if start is not None and end is not None:
                backward[layer] = backward.get(layer, 0.0) + compute_s(start, end)
        return forward, backward

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
