"""Ops that write state their schema does not declare: the one table, read by the exactness judge
(``trace/exactness.py``: such an op is not recomputed) and by the dispatch layer's ``retryable``
(``device/dispatch.py``: such an op that ran out of memory is not run again).

NOTE [Undeclared state writes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A schema marks an argument it writes with a write alias (``Tensor(a!)``), and every rule that asks "does this
op change anything besides its outputs" reads that mark. A few aten ops update a buffer in place without it:
batch norm's kernels take ``Tensor? running_mean, Tensor? running_var`` and, while training, apply the
momentum update to them; autograd's version counter does not move either. Run a second time on the same
inputs (a recompute in backward, a retry after relief), such an op applies the update twice, and nothing
else can tell. Checked on torch 2.13's schemas (``tests/test_undeclared_state_writes.py`` fails on an entry
whose schema starts declaring the write, or whose arguments change name).

Each entry says which arguments it writes, and when the arguments show it writes nothing: the bool argument
``unless_false`` is False (not training: the running statistics are read, not written), or every written
argument is None (no statistics to update). Arguments whose values are not known (not passed and without a
default in the schema) count as written.

Not in the table, after checking what they do:

- ``_native_batch_norm_legit`` (the default overload) and ``_batch_norm_with_update`` declare their writes
  (``Tensor(a!) running_mean``): the mutable-schema rule refuses them already.
- ``_native_batch_norm_legit_functional`` and ``_batch_norm_with_update_functional`` return the updated
  statistics as new tensors (``running_mean_out``) and leave their inputs as they were (checked on CPU);
  ``_native_batch_norm_legit_no_training``, ``_native_batch_norm_legit.no_stats`` and
  ``_batch_norm_no_update`` only read them.
- ``_cudnn_rnn``/``miopen_rnn`` advance their ``dropout_state`` only while drawing dropout masks, which the
  ``nondeterministic_seeded`` rules refuse on their own.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping, Protocol


class ArgumentValues(Protocol):
    """An op's argument values by schema name (``trace.exactness`` builds them from a call)."""

    def known(self, name: str) -> bool: ...

    def get(self, name: str) -> Any: ...


@dataclasses.dataclass(frozen=True)
class StateWrite:
    """An op that writes the arguments ``written`` in place although its schema does not say so."""

    written: tuple[str, ...]
    unless_false: str | None  # a bool argument that, False, means the op writes nothing
    reason: str

    def writes(self, values: ArgumentValues) -> bool:
        """Whether a call with these argument values writes (unknown values: it may, so it does)."""
        flag = self.unless_false
        if flag is not None and values.known(flag) and values.get(flag) is False:
            return False
        return not all(values.known(name) and values.get(name) is None for name in self.written)


_RUNNING = ("running_mean", "running_var")
_MOMENTUM = "applies the momentum update to running_mean/running_var in place while {when}"

UNDECLARED_STATE_WRITES: Mapping[str, StateWrite] = MappingProxyType({
    "native_batch_norm": StateWrite(_RUNNING, "training", _MOMENTUM.format(when="training")),
    "cudnn_batch_norm": StateWrite(_RUNNING, "training", _MOMENTUM.format(when="training") + " (CUDA, cuDNN)"),
    "miopen_batch_norm": StateWrite(_RUNNING, "training", _MOMENTUM.format(when="training") + " (ROCm, MIOpen)"),
    "batch_norm_update_stats": StateWrite(_RUNNING, None, _MOMENTUM.format(when="computing the batch's statistics")),
    "batch_norm_gather_stats": StateWrite(
        _RUNNING, None, _MOMENTUM.format(when="reducing the ranks' statistics") + " (SyncBatchNorm, CUDA)"),
    "batch_norm_gather_stats_with_counts": StateWrite(
        _RUNNING, None, _MOMENTUM.format(when="reducing the ranks' statistics") + " (SyncBatchNorm, CUDA)"),
    # composites: a dispatch mode sees the kernel they call, a trace may still name them
    "batch_norm": StateWrite(_RUNNING, "training", _MOMENTUM.format(when="training") + " (calls one of the above)"),
    "_batch_norm_impl_index": StateWrite(_RUNNING, "training",
                                         _MOMENTUM.format(when="training") + " (calls one of the above)"),
    "instance_norm": StateWrite(_RUNNING, "use_input_stats", "copies the per-instance statistics' average into "
                                "running_mean/running_var while use_input_stats"),
})
"""aten op name (the overload packet's, as ``OpOverload._opname`` gives it) -> what it writes and why. Only
the overloads whose schema is not mutable are concerned (an ``out=`` overload is refused as mutable)."""
