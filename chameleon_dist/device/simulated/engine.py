"""Which stream each op runs on in the simulated backend, forward and backward, as the autograd engine decides on
a GPU.

NOTE [Backward on its forward's stream]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On CUDA the autograd engine runs each node's backward on the stream that was current when its forward ran (the
node records it), whatever stream ``backward()`` was called under, and it orders streams itself: a node waits for
the streams of the nodes that feed it its gradients, an incoming gradient made on another stream is recorded on
the consumer's stream (so its block is not reused under the consumer), the root waits for the caller's stream, and
the caller's stream waits for the pass. Code that allocates in backward (a swap-in's destination) must therefore
allocate on the stream of the node that reads it, not on the stream that happens to be current when it runs.

The simulated backend does the same, so the hazard checker sees what a GPU would do:

- **Forward**: an op queued on a stream other than the compute stream notes its outputs; at the start of the next
  op (its autograd node exists by then: autograd attaches it after the kernel) each output's ``grad_fn`` is
  tagged with that stream in ``grad_fn.metadata``. Nodes made on the compute stream are not tagged.
- **Backward**: ``torch._C._current_autograd_node()`` names the running node; its stream is its tag (the compute
  stream when untagged). A stream entered with ``use_stream`` inside the node is current inside that block; one
  entered outside the pass (``backward()`` called under a side stream) is the caller's and does not change where
  nodes run. Once any node runs elsewhere, each node entered registers a pre-hook on the nodes it feeds: the
  consumer's stream waits for every feeding stream, and the incoming gradients whose blocks belong to another
  stream are recorded on the consumer's (as ``record_stream`` would: the engine's input buffer does this on a GPU).
  The root waits for the caller's stream; the first op after the pass orders the caller's stream after every
  stream the pass used (the engine waits for its leaf streams: a superset here).

Not modelled: the engine's per-device worker threads (on the CPU the pass runs on the calling thread, as the
simulated device's does), and the gradient that ``backward()`` itself makes for the root when the root runs on
another stream than the caller (not recorded; the root does wait for it).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Iterator

import torch

from chameleon_dist.device.simulated.clock import SimStream

_STREAM_KEY = "chameleon_dist:simulated_stream"  # grad_fn.metadata: the stream its forward ran on
_FEEDS_KEY = "chameleon_dist:feeding_streams"  # grad_fn.metadata: streams of the nodes that feed it gradients

_current_node = torch._C._current_autograd_node


class EngineStreams:
    """The current stream per thread, forward and backward (NOTE [Backward on its forward's stream]).

    ``record(tensor, stream)`` is the backend's ``record_stream`` (gradients crossing streams are recorded
    through it)."""

    def __init__(self, compute: SimStream, record: Callable[[torch.Tensor, SimStream], None]) -> None:
        self.compute = compute
        self._record = record
        self._local = threading.local()
        self.tagging = False  # some forward op ran off the compute stream: nodes may run elsewhere

    # ---- forward: tagging nodes with their stream ---------------------------------------------
    def note_outputs(self, outputs: list[torch.Tensor], stream: SimStream) -> None:
        """Outputs of a forward op queued on ``stream``: their nodes are tagged at the next op."""
        if stream is self.compute or not outputs:
            return
        self.tagging = True
        pending = self._pending()
        pending.extend((weakref.ref(t), stream) for t in outputs)

    def settle(self) -> None:
        """Tag the nodes of the outputs noted so far (called before each op: autograd attached them by now).
        An output with no node yet is looked at once more, at the next op (a pack hook can run an op between
        a kernel and the attachment of its node), then dropped: it has no autograd history."""
        local = self._local
        pending, bare = getattr(local, "pending", None), getattr(local, "bare", None)
        if not pending and not bare:
            return
        local.pending, local.bare = [], []
        for ref, stream in bare or ():
            self._tag(ref, stream)
        for ref, stream in pending or ():
            if not self._tag(ref, stream):
                local.bare.append((ref, stream))

    @staticmethod
    def _tag(ref, stream: SimStream) -> bool:
        """Tag the node of the tensor ``ref`` names; False when it has none (yet)."""
        tensor = ref()
        node = tensor.grad_fn if tensor is not None else None
        if node is None:
            return tensor is None
        node.metadata.setdefault(_STREAM_KEY, stream)
        return True

    def _pending(self) -> list:
        local = self._local
        pending = getattr(local, "pending", None)
        if pending is None:
            pending = local.pending = []
        return pending

    # ---- the current stream -------------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[None]:
        """``stream`` is current on this thread inside the block (inside a node: for that node's work)."""
        local = self._local
        before = getattr(local, "stream", None), getattr(local, "entered", None)
        local.stream, local.entered = stream, _current_node()
        try:
            yield
        finally:
            local.stream, local.entered = before

    def current(self) -> SimStream:
        local = self._local
        explicit = getattr(local, "stream", None)
        node = _current_node()
        if node is None:
            if getattr(local, "pass_streams", None) is not None:
                self._end_pass(explicit if explicit is not None else self.compute)
            return explicit if explicit is not None else self.compute
        if explicit is not None and getattr(local, "entered", None) is node:
            return explicit
        if getattr(local, "node", None) is node:
            return local.node_stream
        return self._enter(node, explicit)

    def stream_of(self, node) -> SimStream:
        """The stream ``node``'s backward runs on: its forward's (the compute stream when untagged)."""
        if not self.tagging:
            return self.compute
        return node.metadata.get(_STREAM_KEY, self.compute)

    # ---- backward: ordering between nodes -----------------------------------------------------
    def _enter(self, node, explicit: SimStream | None) -> SimStream:
        local = self._local
        stream = self.stream_of(node)
        self._begin_pass(stream, explicit)
        local.pass_streams.add(stream)
        local.node, local.node_stream = node, stream
        if self.tagging:
            self._feed(node, stream)
        return stream

    def _begin_pass(self, stream: SimStream, explicit: SimStream | None) -> None:
        """A pass begins (unless under way): its first node's ``stream`` waits for the caller's."""
        local = self._local
        if getattr(local, "pass_streams", None) is not None:
            return
        caller = explicit if explicit is not None else self.compute
        local.pass_streams = set()
        if stream is not caller:
            stream.wait_stream(caller)

    def _feed(self, node, stream: SimStream) -> None:
        """``node`` (on ``stream``) feeds its next functions: each one waits for ``stream`` when it runs, and
        records the gradients it is given on its own stream (a pre-hook, registered once per consumer; it holds
        no reference to its node, which would keep the graph alive in a cycle)."""
        for child, _ in node.next_functions:
            if child is None:
                continue
            metadata = child.metadata
            feeds = metadata.get(_FEEDS_KEY)
            if feeds is None:
                feeds = metadata[_FEEDS_KEY] = set()
                child.register_prehook(self._prehook(self.stream_of(child), feeds))
            feeds.add(stream)

    def _prehook(self, stream: SimStream, feeds: set):
        def order_consumer(grad_outputs):
            for feeding in feeds:
                if feeding is not stream:
                    stream.wait_stream(feeding)
            for grad in grad_outputs:
                if isinstance(grad, torch.Tensor):
                    self._record(grad, stream)
            node = _current_node()  # (the node whose pre-hooks run)
            local = self._local
            self._begin_pass(stream, getattr(local, "stream", None))
            local.pass_streams.add(stream)
            local.node, local.node_stream = node, stream
            if node is not None:
                self._feed(node, stream)
            return None

        return order_consumer

    def _end_pass(self, caller: SimStream) -> None:
        """The first op after a backward pass: the caller's stream waits for every stream the pass used."""
        local = self._local
        for stream in local.pass_streams:
            if stream is not caller:
                caller.wait_stream(stream)
        local.pass_streams = None
        local.node = local.node_stream = None
