"""Which stream made each device storage, for the storages made off the iteration's own stream.

NOTE [Producer and reader streams]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A saved tensor has two streams that matter to a swap, and they differ when the program uses side streams:

- its **producer**'s: the stream current when the op that made the storage ran, which is also the stream whose
  pool its block goes back to. The swap-out's copy waits for it, and the planned release orders it after the
  copy (NOTE [Release after copy] in ``base.py``);
- its **reader**'s: the stream current at the save, where autograd runs the saving node's backward (NOTE
  [Backward on its forward's stream] in ``simulated/engine.py``). The swap-in's destination is allocated there.

An op's outputs are made on the stream current when it runs; an op that saves one of its *inputs* may run on
another stream than the op that made it (a tensor made on the compute stream and read under a side stream), so
the stream current at the save is not the producer's. The dispatch layer notes, for every op of an iteration,
the storages it made while a stream other than the iteration's own (current when the iteration began) was
current; every other storage was made on the iteration's stream. One definition, over both backends: the CUDA
caching allocator does not say which stream a block belongs to, and the simulated backend, which knows, does not
tell; its hazard checker proves the guess right.
"""

from __future__ import annotations

import weakref

import torch

from chameleon_dist.device.leaves import tensor_leaves


class ProducerStreams:
    """Storages made off the iteration's stream, and the stream that made each (see the NOTE)."""

    def __init__(self) -> None:
        self.iteration_stream = None  # current when the iteration began (None: outside an iteration)
        self._made: dict[int, tuple[weakref.ref, object]] = {}

    def begin(self, stream) -> None:
        self.iteration_stream = stream
        self._made.clear()

    def end(self) -> None:
        self.iteration_stream = None
        self._made.clear()

    def note(self, out, stream) -> None:
        """``out`` (an op's result) was made on ``stream``: remembered unless it is the iteration's stream."""
        if stream == self.iteration_stream or self.iteration_stream is None:
            return
        made = self._made
        for t in tensor_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                key = storage._cdata
                known = made.get(key)
                if known is None or known[0]() is not storage:
                    made[key] = (weakref.ref(storage), stream)

    def stream_of(self, storage: torch.UntypedStorage, default):
        """The stream that made ``storage`` (``default`` when none is noted: the iteration's, or the current
        one outside an iteration)."""
        known = self._made.get(storage._cdata)
        if known is not None and known[0]() is storage:
            return known[1]
        return self.iteration_stream if self.iteration_stream is not None else default
