"""``SwapExecutor``: saved-tensor hooks that move activations to the host and back, as a policy says.

Without a policy, every saved activation whose storage holds at least ``min_swap_bytes`` leaves the device
asynchronously when autograd saves it and comes back when backward needs it, with the next ``prefetch_depth``
swapped storages (in reverse save order, the order backward usually needs them) brought back ahead of time.
With a policy (``IterationContext.policy``), only the saved storages the policy matches leave the device (NOTE
[Save-site matching] in ``matching.py``: a policy made for one sequence length, batch size or expert load
applies to another), each at the ops the policy placed its swap-out, release and swap-in (NOTE [Placed swaps]
in schedule.py), or, when the policy says so, rebuilt from its producer's inputs (NOTE [Per-tensor recompute]
in recompute.py); one needed before its prefetch started is fetched on demand and counted. Under memory
pressure the executor lets in-flight swap-outs land, gives back prefetches not used yet, then swaps out idle
kept tensors synchronously (passive swap): its ``PressureRelief`` (``pressure.py``). Each swapped storage's
life is an explicit state (NOTE [Swap entry lifecycle] in ``states.py``): the executor reads it and asks the
entry to move.

Never swapped: parameters and views of them, what ``protect`` names (engine buffers), tensors that are not
plain dense device tensors, and anything packed while a backward pass runs (recompute inside backward).
Values are copied byte for byte and views are rebuilt with their exact strides: training stays bit-identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from chameleon_dist.device.base import Device
from chameleon_dist.device.locking import lock_entry_points
from chameleon_dist.executor.attempt import SwapAttempt
from chameleon_dist.executor.capture import capture_aware
from chameleon_dist.executor.context import IterationContext, SwapCounters
from chameleon_dist.executor.matching import PolicyMatcher
from chameleon_dist.executor.pressure import PressureRelief
from chameleon_dist.executor.protection import StorageProtection
from chameleon_dist.executor.records import KeptTensor, SwapEntry, SwappedTensor, abandoned_error, keep, keep_input
from chameleon_dist.executor.schedule import NEVER
from chameleon_dist.executor.states import EntryState
from chameleon_dist.executor.threads import IterationThreads
from chameleon_dist.policy.model import Decision, Policy, PolicyEntry
from chameleon_dist.policy.outcome import RetryAction
from chameleon_dist.trace.writes import WriteWatch
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

_IDLE = IterationContext()


class SwapExecutor:
    """Swaps the activations autograd saves to host memory and back, one iteration at a time.

    Inside ``with executor.active(context):`` every tensor autograd saves goes through the executor's
    saved-tensor hooks: it stays on the device, or (policy decision, or every eligible tensor without a
    policy) its storage is copied to the host asynchronously and its device block released once the copy
    completed (NOTE [Release after copy] in ``device/base.py``), and it is copied back before backward
    reads it. Values come back byte for byte: losses and gradients are bit-identical to a run without it.

    Args:
        device: where activations live and the host link they travel over (CUDA or emulated).
        min_swap_bytes: storages smaller than this are never swapped (their copies cost more in launch
            overhead than they free). An out-of-memory retry may lower it (``new_attempt``).
        prefetch_depth: without a planned swap-in point, how many swapped storages (in reverse save
            order) are brought back ahead of the one backward needs. More hides more copy time but holds
            more device memory during backward.
        prefetch_limit_bytes: a planned swap-in waits while it would take the device above this many bytes
            (the runtime passes the memory budget); None: no limit.

    Raises:
        ValueError: for a negative ``min_swap_bytes`` or ``prefetch_depth``.
        RuntimeError: when backward unpacks a saved tensor that was changed in place after its save,
            as autograd does (kept, swapped, or with its copy still in flight).

    Example::

        executor = SwapExecutor(device, min_swap_bytes=2**20)
        executor.protect(model)  # parameters and buffers never leave
        with executor.active(IterationContext(policy=policy)) as counters:
            model(batch).sum().backward()

    Under memory pressure the device calls ``relieve_pressure`` (the runtime installs it as the device's
    pressure handler). After an out-of-memory error, ``new_attempt`` starts the iteration over.
    """

    def __init__(self, device: Device, min_swap_bytes: int, prefetch_depth: int = 2,
                 prefetch_limit_bytes: int | None = None) -> None:
        if min_swap_bytes < 0:
            raise ValueError(f"min_swap_bytes must be >= 0, got {min_swap_bytes}")
        if prefetch_depth < 0:
            raise ValueError(f"executor.prefetch_depth must be >= 0, got {prefetch_depth}")
        self.device = device
        self.min_swap_bytes = min_swap_bytes
        self.prefetch_depth = prefetch_depth
        self.prefetch_limit_bytes = prefetch_limit_bytes  # planned swap-ins wait while they would pass it (budget)
        self.counters = SwapCounters()
        self.threads = IterationThreads()  # who may drive it; its lock guards what follows (NOTE in threads.py)
        self._lock = self.threads.lock
        self._protection = StorageProtection()
        self._host_budget_warned = False
        self._context = _IDLE  # what the caller gave ``active`` for the current iteration
        self._matcher: PolicyMatcher | None = None
        self.captures_producers = False  # the dispatch mode calls ``on_produced`` (the policy recomputes)
        self._attempt = SwapAttempt.start(self._lock)  # what this attempt saved and placed (a retry: a new one)
        self._relief = PressureRelief(  # (NOTE [Relief under pressure] in pressure.py)
            device, entry_for=self._entry_for,
            issue_pending_swap_outs=functools.partial(self._issue_overdue, everything=True),
        )

    @property
    def due_op(self) -> int:
        """The op count at which the next placed point is due (read by the dispatch mode, ``OpListener``)."""
        return self._attempt.due_op

    def relieve_pressure(self, short_bytes: int) -> int:
        """Free at least ``short_bytes`` of device memory if possible; returns the bytes freed (NOTE [Relief
        under pressure] in pressure.py). The runtime installs it as the device's pressure handler."""
        return self._relief.relieve(short_bytes, self._attempt, self.counters)

    # ---- setup ------------------------------------------------------------------------------
    def protect(self, owner: nn.Module | Callable[[], Iterable[torch.Tensor]]) -> None:
        """Never swap ``owner``'s tensors or views of them: a module's parameters and buffers, or what a
        callable yields (an engine's own buffers: gradient buckets, workspaces), read when each iteration
        begins. ``protect_now`` adds a buffer made during an iteration."""
        self._protection.add(owner)

    def protect_now(self, tensor: torch.Tensor) -> bool:
        """Protect ``tensor``'s storage until the next iteration begins; False if it already was."""
        return self._protection.add_now(tensor)

    def is_protected(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is protected now (as the swap path checks it when autograd saves)."""
        return self._protection.protects(tensor.untyped_storage())

    def unprotect_now(self, tensor: torch.Tensor) -> None:
        """Undo a ``protect_now`` that returned True (the storage is about to go: its address may be reused)."""
        self._protection.remove_now(tensor)

    def protected_keys(self) -> set[int]:
        """Storage keys of the protected tensors (as of now)."""
        self._refresh_protected()
        return self._protection.keys()

    def _refresh_protected(self) -> None:
        self._attempt.holders.set_parameters(self._protection.refresh())

    @property
    def policy(self) -> Policy | None:
        """The policy the current attempt applies (None: every eligible tensor is swapped)."""
        return self._matcher.policy if self._matcher is not None else None

    def _use_policy(self, policy: Policy | None) -> None:
        if policy is None:
            self._matcher = None
        elif self._matcher is None or self._matcher.policy is not policy:  # (reset per attempt)
            self._matcher = PolicyMatcher(policy)
        self.captures_producers = policy is not None and any(e.decision == Decision.RECOMPUTE for e in policy.entries)

    @contextlib.contextmanager
    def active(self, context: IterationContext | None = None) -> Iterator[SwapCounters]:
        """Swap during the block, as ``context`` says (default: no policy, no profiler, the executor
        watches for in-place writes itself); yields this iteration's counters."""
        context = context if context is not None else _IDLE
        self._context = context
        self._use_policy(context.policy)
        self.counters = SwapCounters()
        self._refresh_protected()
        self._start_attempt()
        watch = contextlib.nullcontext() if context.writes_reported else WriteWatch(self.note_writes)
        try:
            hooks = torch.autograd.graph.saved_tensors_hooks(*capture_aware(self.device, self._pack, self._unpack))
            with watch, hooks, self.threads.shared():
                yield self.counters
            self.device.release_all_sources()
        finally:
            self._end_attempt()
            self._context = _IDLE

    def note_writes(self, tensors) -> None:
        """An op is about to write ``tensors`` in place: count it on every entry whose bytes live in one
        of their storages, so that unpacking a tensor saved before the write raises (``check_version``)."""
        self._attempt.by_storage.note_writes(tensors)

    def new_attempt(self, retry: RetryAction | None = None) -> None:
        """An out-of-memory retry starts the iteration over: the counters (the same object ``active``
        yielded, emptied in place) and the save numbering describe only the attempt that completes, and
        the failed attempt's saved tensors give back their device and host memory (unpacking one later
        raises), and the device lets go of every swap-out source it still holds for them (ordered after their
        copies). ``retry`` (the policy controller's ``on_out_of_memory``) sets what the retry runs with: its
        ``min_swap_bytes``, and ``swap_everything`` drops the policy for the rest of the iteration."""
        self._attempt.abandon()
        self.device.release_all_sources()
        fresh = SwapCounters()
        for field in dataclasses.fields(SwapCounters):
            setattr(self.counters, field.name, getattr(fresh, field.name))
        if retry is not None:
            self.min_swap_bytes = retry.min_swap_bytes
            if retry.swap_everything:
                self._use_policy(None)
        self._start_attempt()

    def _start_attempt(self) -> None:
        """A new attempt: matching, release flag and per-attempt bookkeeping start over (the counters are fresh)."""
        if self._matcher is not None:
            self._matcher.reset()
            self.counters.matches = self._matcher.counts
        self._end_attempt()

    def _end_attempt(self) -> None:
        """Forget the attempt: a new, empty one takes its place (it knows the same protected parameters)."""
        self._attempt = SwapAttempt.start(self._lock, parameters_of=self._attempt.holders)

    # ---- hooks ------------------------------------------------------------------------------
    def _eligible(self, tensor: torch.Tensor) -> bool:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return False  # parameters, subclasses (DTensor, fake), sparse and nested tensors stay
        if tensor.is_leaf and tensor.requires_grad:
            return False
        if torch._C._current_graph_task_id() != -1:
            return False  # packed inside backward (recompute): it is needed right away
        storage = tensor.untyped_storage()
        if storage.nbytes() < max(self.min_swap_bytes, 1):
            return False
        if self._protection.protects(storage):
            return False
        return self.device.is_device_tensor(tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | KeptTensor | SwappedTensor:
        with self._context.hide_own_ops():
            return self._pack_in_hidden_scope(tensor)

    def _pack_in_hidden_scope(self, tensor: torch.Tensor) -> torch.Tensor | KeptTensor | SwappedTensor:
        """The pack hook's work; the caller has entered ``hide_own_ops`` (the profiler does not see its ops)."""
        if type(tensor) is not torch.Tensor and type(tensor) is not nn.Parameter:
            return tensor  # tensor subclasses (DTensor, fake tensors) are left to their own logic
        nbytes = tensor.numel() * tensor.element_size()
        self.counters.saved_bytes.append(nbytes)
        by_layer, layer = self.counters.saved_bytes_by_layer, self._context.layer_clock()
        by_layer[layer] = by_layer.get(layer, 0) + nbytes
        attempt = self._attempt
        if attempt.unpacked and torch._C._current_graph_task_id() == -1:
            attempt.micro_batch += 1  # a forward save after a backward pass: the next micro-batch
            attempt.unpacked = False
        storage = tensor.untyped_storage()
        seen = attempt.seen_before(storage)
        # (sites are for the trace and the matcher: swapping everything needs none)
        wanted = not seen and (self._matcher is not None or self._context.observer is not None)
        site = self._site(tensor) if wanted else ""
        if self._context.observer is not None:
            self._context.observer.on_saved(tensor, site)
        if self._matcher is None:  # WarmUp has no release points: each save lets go of the earlier sources,
            self.device.release_all_sources()  # ordered on the device (NOTE [Release after copy] in base.py)
        else:
            self.device.release_completed_sources()
        entry = None
        eligible = self._eligible(tensor)
        if self._matcher is not None and not seen and tensor.layout == torch.strided:
            # every first save took an ordinal in the trace, eligible or not: the walk passes them all
            planned = self._matcher.match(tensor, site, eligible=eligible)
            if planned is not None:
                entry = self._entry_for(tensor, planned)
        elif eligible:
            if self._matcher is None:
                entry = self._entry_for(tensor)
            elif attempt.by_storage.has(storage):
                entry = self._entry_for(tensor)  # another view of a storage swapped: shares its copy
        if entry is not None:
            swapped = SwappedTensor(entry, tensor)
            attempt.packed.append(weakref.ref(swapped))
            if self.captures_producers:  # (a recipe input whose own object died finds its storage here)
                attempt.holders.note(storage, swapped)
            return swapped
        kept = keep(tensor, self.device.current_stream())  # (a parameter as itself: NOTE in records.KeptParameter)
        attempt.packed.append(weakref.ref(kept))
        if self.captures_producers:
            attempt.holders.note(storage, kept)
        if self._matcher is not None and tensor.numel() * tensor.element_size() >= self.min_swap_bytes and eligible:
            attempt.kept.append(weakref.ref(kept))  # a passive swap may take it later
        return kept

    def _site(self, tensor: torch.Tensor) -> str:
        """NOTE [Save-site matching] in ``matching.py``."""
        dtype, named = str(tensor.dtype).removeprefix("torch."), self._context.micro_batch()
        return f"{self._attempt.micro_batch if named is None else named}:{self._context.site_clock()}:{dtype}:{tensor.dim()}"

    def _entry_for(self, tensor: torch.Tensor, planned: PolicyEntry | None = None,
                   reader: object | None = None) -> SwapEntry | None:
        """The entry ``tensor``'s storage leaves the device with: an existing one for the same bytes, else a
        new one. With a policy entry (``planned``), its swap-out, release and swap-in are scheduled on the
        op clock at the points the policy placed them, shifted by how far the sequence had moved at the
        save (NOTE [Placed swaps] in schedule.py); else the copy starts now and the device lets go once it completed.
        None when the host budget has no room (the tensor stays on the device)."""
        storage, attempt = tensor.untyped_storage(), self._attempt
        entry = attempt.by_storage.entry_of(storage)
        if entry is not None and entry.version == tensor._version:
            return entry  # same bytes already on their way out: share the host copy
        if planned is not None and planned.decision == Decision.RECOMPUTE:
            return self._recompute_entry(tensor, planned)
        entry = SwapEntry(self.device, storage, tensor._version, position=len(attempt.order),
                          ordinal=planned.save_ordinal if planned is not None else -1,
                          stream=self.device.producer_stream(tensor),
                          reader=reader if reader is not None else self.device.current_stream())
        op_count = self._context.op_clock() if planned is not None else -1
        if op_count >= 0:
            shift = op_count - planned.save_op_index
            issue_at = planned.swap_out_at + 1 + shift  # (at the end of op ``swap_out_at``)
            release_at = planned.release_at + 1 + shift if planned.release_at >= 0 else -1
        else:
            issue_at = release_at = -1
        if issue_at <= op_count and not self._issue(entry):
            return None
        if planned is not None:  # its prefetch, shifted like the save
            trigger = planned.swap_in_at + (op_count - planned.save_op_index if op_count >= 0 else 0)
            attempt.schedule(attempt.placed.swap_ins, trigger, entry)
            entry.planned = True
        if entry.issued:
            entry.release()  # (the device holds the original until its copy completed)
        if release_at > op_count:
            attempt.schedule(attempt.placed.releases, release_at, entry)
        if entry.awaiting_swap_out:
            attempt.schedule(attempt.placed.swap_outs, issue_at, entry)
            self.counters.delayed_swap_outs += 1
            backward_start = self._matcher.backward_start.get(planned.micro_batch, planned.first_backward_use)
            entry.out_in_forward = planned.swap_out_at < backward_start
        attempt.by_storage.add(storage, entry)
        attempt.order.append(weakref.ref(entry))
        attempt.swapped_since_release = True
        return entry

    def _recompute_entry(self, tensor: torch.Tensor, planned: PolicyEntry) -> SwapEntry | None:
        """An entry that leaves the device with no copy and is rebuilt when backward needs it (NOTE
        [Per-tensor recompute] in recompute.py); None (kept, counted) when it cannot be rebuilt exactly."""
        storage = tensor.untyped_storage()
        recipe = self._attempt.producers.recipe_for(tensor, self._pack_input)
        if recipe is None:
            self.counters.recompute_unavailable += 1
            return None
        entry = SwapEntry(self.device, storage, tensor._version, position=-1, ordinal=planned.save_ordinal)
        entry.recompute_later(recipe)  # (its original goes after its last forward use)
        self._attempt.by_storage.add(storage, entry)
        return entry

    def _pack_input(self, tensor: torch.Tensor) -> KeptTensor | SwappedTensor:
        """A recipe's tensor input, packed like a saved tensor: the ``SwappedTensor`` of the entry that swaps
        or recomputes its storage, else what ``records.keep_input`` keeps (the in-place check holds)."""
        entry = self._attempt.by_storage.entry_of(tensor.untyped_storage())
        if entry is not None and entry.version == tensor._version and not entry.abandoned:
            return SwappedTensor(entry, tensor)
        return keep_input(tensor)

    def on_produced(self, func, args, kwargs, out) -> None:
        """A forward op ran (the dispatch mode calls this while ``captures_producers``)."""
        if torch._C._current_graph_task_id() == -1:
            self._attempt.producers.note(func, args, kwargs, out)

    def _rebuild(self, entry: SwapEntry) -> None:
        """Backward needs a recomputed tensor: the device original if something kept it alive, else its
        producer run again on its (unpacked) inputs."""
        if entry.reuse_source():
            self.counters.reused_original_bytes += entry.nbytes
        else:
            entry.finish_rebuild(entry.recipe.run(self._unpack_in_hidden_scope))  # (its recipe's inputs may go)
            self._attempt.by_storage.watch(entry.device_bytes.untyped_storage(), entry)
            self.counters.recomputed_bytes += entry.nbytes
            self.counters.recomputed_storages += 1

    def _issue(self, entry: SwapEntry) -> bool:
        """Start ``entry``'s swap-out; False when the host budget has no room (it stays on the device)."""
        if not entry.issue():
            nbytes = entry.nbytes
            self.counters.kept_on_device_bytes += nbytes
            if not self._host_budget_warned:
                logger.warning(
                    "host_memory_budget is full: keeping %s activations on the device (raise host_memory_budget)",
                    format_bytes(nbytes),
                )
                self._host_budget_warned = True
            return False
        if self._context.observer is not None:
            entry.trace_index = self._context.observer.on_swap_out(entry.held)
        self.counters.swap_out_bytes += entry.nbytes
        self.counters.swapped_storages += 1
        if entry.ordinal >= 0:
            self.counters.placed.append((self._context.op_clock(), "out", entry.ordinal))
        return True

    # ---- the op clock -------------------------------------------------------------------------
    def on_op(self, op_count: int) -> None:
        """An op of the iteration ended and ``op_count`` ops have run: start the swap-outs, releases and
        swap-ins placed there (NOTE [Placed swaps] in schedule.py). The caller's dispatch mode calls this
        only when ``op_count >= due_op``, so an op with nothing due costs one comparison. Nothing while a graph
        is captured: it stays due (NOTE [No swapping under graph capture] in capture.py)."""
        if self.device.is_capturing():
            return
        attempt = self._attempt
        attempt.due_op = NEVER
        placed = attempt.placed
        with self._context.hide_own_ops():
            for entry in placed.due(placed.swap_outs, op_count):
                if entry.awaiting_swap_out and self._issue(entry):
                    entry.release()
            due = [entry for entry in placed.due(placed.releases, op_count) if entry.issued]
            if due:  # the planned release point, ordered on the device: NOTE [Release after copy] in device/base.py
                for entry in due:
                    if entry.to_host is not None:
                        self.device.release_source(entry.to_host)
                self.counters.placed.extend((op_count, "release", entry.ordinal) for entry in due)
            if placed.swap_ins and placed.swap_ins[0][0] <= op_count:
                self._fire_triggers(op_count)
        attempt.due_op = placed.next_op()

    def _issue_overdue(self, everything: bool = False) -> None:
        """Backward began: swap-outs placed in the forward pass whose op never came (the sequence moved)
        start now, the latest safe point (before backward needs the link), and their originals go once
        copied; counted. Those placed in the backward pass keep their op. ``everything``: memory pressure,
        all pending ones start now."""
        attempt = self._attempt
        for entry in attempt.placed.take_swap_outs(everything):
            if self._issue(entry):
                entry.release()
            self.counters.late_swap_outs += not everything
        attempt.due_op = attempt.placed.next_op()

    def _unpack(self, packed: torch.Tensor | KeptTensor | SwappedTensor) -> torch.Tensor:
        self.threads.check_thread()
        with self._context.hide_own_ops():
            return self._unpack_in_hidden_scope(packed)

    def _unpack_in_hidden_scope(self, packed: torch.Tensor | KeptTensor | SwappedTensor) -> torch.Tensor:
        attempt = self._attempt
        attempt.unpacked = True
        if attempt.placed.swap_ins:
            self._fire_triggers(self._context.op_clock())
        if isinstance(packed, KeptTensor):
            if packed.swapped is None:
                return packed.unpack()
            packed = packed.swapped  # taken by a passive swap
        if not isinstance(packed, SwappedTensor):
            return packed
        if packed.entry.abandoned:
            raise abandoned_error()
        packed.check_version()
        if attempt.swapped_since_release:
            # A backward pass begins: a swap-out still waiting for its op starts now, and every swap-out
            # issued in the forward pass lets go of its device block (NOTE [Release after copy] in
            # device/base.py).
            attempt.swapped_since_release = False
            if attempt.placed.swap_outs:
                self._issue_overdue()
            self.device.release_all_sources()
        entry = packed.entry
        if entry.state is EntryState.PENDING_RECOMPUTE:
            self._rebuild(entry)
        elif entry.arrival is not None:  # (restored for an earlier unpack: order this one's stream too)
            entry.order_reader()
        elif not entry.restored:
            if not entry.in_flight and entry.planned:
                self.counters.on_demand_fetches += 1
            self._swap_in(entry)
            entry.finish_swap_in()
            if not entry.reused_source:  # a restored copy: backward may write it (a retained graph re-reads)
                attempt.by_storage.watch(entry.device_bytes.untyped_storage(), entry)
            if not entry.planned:
                self._prefetch_before(entry)
        tensor = packed.rebuild(entry.device_bytes)
        if self._context.observer is not None and entry.trace_index >= 0:
            self._context.observer.on_restored(entry.trace_index, tensor)
        return tensor

    def _swap_in(self, entry: SwapEntry) -> None:
        at_op = self._context.observer.op_count if self._context.observer is not None else -1
        if entry.start_swap_in():
            self.counters.swap_in_bytes += entry.nbytes
        elif entry.reused_source and not entry.reuse_counted:
            entry.reuse_counted = True
            self.counters.reused_original_bytes += entry.nbytes
        else:
            return
        if self._context.observer is not None:
            # a reused original counts as restored here too: its block never died before this op, and a
            # trace that took it for gone would add its bytes back to the no-swap curve a second time
            self._context.observer.on_swap_in(entry.trace_index, at_op)

    def _prefetch_would_not_fit(self, entry: SwapEntry) -> bool:
        """The caching allocator could not serve the swap-in on its reader's stream now (its pools are
        fragmented or the segment it needs would pass the capacity): it waits rather than cost a relief.
        False where the device cannot tell."""
        fits = getattr(self.device, "fits", None)
        return fits is not None and fits(entry.nbytes, entry.reader) is False

    def _fire_triggers(self, op_count: int) -> None:
        """Start the planned swap-ins whose trigger op has been reached. One that would take the device
        above ``prefetch_limit_bytes`` waits for the next op (or its use): the policy's prediction was
        short there, and an early prefetch must not be what breaks the budget."""
        limit, attempt = self.prefetch_limit_bytes, self._attempt
        for entry in attempt.placed.due(attempt.placed.swap_ins, op_count):
            if entry.restored or entry.in_flight:
                continue
            if limit is not None and op_count >= 0 and entry.source() is None and (
                    self.device.live_bytes() + entry.nbytes > limit or self._prefetch_would_not_fit(entry)):
                attempt.schedule(attempt.placed.swap_ins, op_count + 1, entry)
                self.counters.prefetches_deferred += 1
                return
            if not self._prefetch(entry):
                return
            if entry.ordinal >= 0:
                self.counters.placed.append((op_count, "in", entry.ordinal))

    def _prefetch_before(self, entry: SwapEntry) -> None:
        """Keep the next ``prefetch_depth`` storages backward will likely need (saved earlier) coming in."""
        ahead = 0
        for ref in reversed(self._attempt.order[: entry.position]):
            if ahead >= self.prefetch_depth:
                return
            candidate = ref()
            if candidate is None or candidate.restored:
                continue
            ahead += 1
            if candidate.in_flight:
                continue
            if not self._prefetch(candidate):
                return

    def _prefetch(self, entry: SwapEntry) -> bool:
        """Start a swap-in ahead of its use; False (and nothing started) when the device has no room."""
        attempt = self._attempt
        attempt.prefetching = True
        try:
            self._swap_in(entry)
        except torch.OutOfMemoryError:
            logger.debug("prefetch skipped: no device memory for %s", format_bytes(entry.nbytes))
            return False
        finally:
            attempt.prefetching = False
        self.counters.prefetched += 1
        return True


lock_entry_points(SwapExecutor, "_pack", "_unpack", "on_op", "relieve_pressure", "new_attempt", "note_writes",
                  "on_produced", "protect_now", "unprotect_now", "_start_attempt", "_end_attempt")
