"""Device memory after every op of the model, for the main job's plot.

The device meter can sample live bytes after every metered op, but a run with Chameleon executes ops of
its own (host copies, restores in backward) that a run without it does not: sampled per metered op, the
two curves have different lengths and drift apart on one x axis. ``ModelOpTimeline`` samples only the
ops the profiler's signature counts: the runtime's own work runs in the profiler's ``quiet()`` scope and
is skipped (its memory still shows in the next sample), and profiler markers are not computation. One
more op is skipped in every run: ``aten.detach``. It makes no memory (a view), and autograd runs one for
every saved input tensor it hands to a saved-tensor hook, outside the runtime's quiet scope, so a run
with Chameleon's hooks has more of them (78 per iteration in the main job) although the model is the
same. So the curves of any two runs of the same model share their x axis, op for op, whatever is swapped.

The mode must sit above the device's meter (entered inside ``Chameleon.iteration()``) so that each
sample already counts the op's outputs; ``sampling`` arranges that for ``run_iteration``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chameleon_dist.profiler.scope import TrainingScope

T = TypeVar("T")


class ModelOpTimeline(TorchDispatchMode):
    """Appends ``live_bytes()`` to ``samples_bytes`` after every op of the model (see the module docstring)."""

    def __init__(self, live_bytes: Callable[[], int], scope: TrainingScope) -> None:
        super().__init__()
        self._live_bytes = live_bytes
        self._scope = scope
        self.samples_bytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._scope.paused and func not in _NOT_SAMPLED and getattr(func, "namespace", None) != "profiler":
            self.samples_bytes.append(self._live_bytes())
        return out


# detach: see the module docstring (a view; autograd adds one per saved input when saved-tensor hooks are on)
_NOT_SAMPLED = frozenset({torch.ops.aten.detach.default})


@contextlib.contextmanager
def sampling(
    timeline: ModelOpTimeline, closure: Callable[[], T], optimizer: torch.optim.Optimizer
) -> Iterator[tuple[Callable[[], T], torch.optim.Optimizer]]:
    """A closure and an optimizer for ``Chameleon.run_iteration`` whose ops are sampled into ``timeline``.

    The samples restart with every attempt of the closure (an out-of-memory retry leaves only the attempt
    that completed), and the optimizer's ``step`` is sampled too (the peak may be there); the optimizer
    gets its own ``step`` back when the block ends."""

    def sampled_closure() -> T:
        timeline.samples_bytes.clear()
        with timeline:
            return closure()

    own_step = vars(optimizer).get("step")  # an instance attribute of its own, if any
    step = optimizer.step

    def sampled_step(*args, **kwargs):
        with timeline:
            return step(*args, **kwargs)

    optimizer.step = sampled_step  # an instance attribute: hides the class's step for this block only
    try:
        yield sampled_closure, optimizer
    finally:
        if own_step is None:
            del optimizer.step
        else:
            optimizer.step = own_step
