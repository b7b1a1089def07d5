"""What the swap executor hands autograd instead of a saved tensor.

``SwapEntry`` is one device storage on its way to the host and back (shared by every saved tensor that
views it), its life an explicit ``EntryState`` (NOTE [Swap entry lifecycle] in states.py); ``SwappedTensor``
is one saved tensor: which entry, and how to rebuild the exact view (dtype, size, stride, storage offset)
plus what autograd would check on unpack (the version counter).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from chameleon_dist.device.base import byte_view
from chameleon_dist.executor.states import ISSUED_STATES, RESTORED_STATES, EntryState, checked_move

if TYPE_CHECKING:
    from chameleon_dist.device.base import CopyHandle, Device


class SwapEntry:
    """One storage swapped out (or, until its planned swap-out op, about to be), or recomputed. Host buffer
    and restored device bytes live as long as the entry.

    A policy places each swap-out at an op (``policy/simulator.py``): until then the entry *holds* the
    device original (``HELD``, ``held``), where the simulator counts it too, and the copy is issued at that
    op (``issue``); from then on the device holds it until the copy completed (NOTE [Placed swaps] in
    schedule.py). Without a policy the copy is issued at the save.

    Its life is ``state`` (NOTE [Swap entry lifecycle] in states.py), changed only by its own methods, which its
    executor calls under its lock: two threads unpacking one entry see one swap-in (NOTE [Threads and locks]).
    Data the states own, written only here: ``held`` (the original, while HELD, REFUSED or COPYING),
    ``to_host`` (the swap-out's handle while its host buffer is taken), ``to_device`` (RESTORING),
    ``device_bytes`` (the restored states), ``recipe`` (PENDING_RECOMPUTE). Plain data, not states, that
    the executor sets: ``planned`` (a policy scheduled its swap-in), ``out_in_forward`` (its swap-out is
    placed in the forward pass), ``reuse_counted`` (a reuse of its original went into the counters),
    ``writes`` (in-place writes seen since the save), ``trace_index``; fixed at construction: ``nbytes``,
    ``version``, ``position``, ``ordinal``, ``source``."""

    __slots__ = (
        "nbytes", "version", "position", "ordinal", "trace_index", "to_host", "to_device", "device_bytes", "_device",
        "stream", "reader", "planned", "writes", "source", "held", "_state", "out_in_forward", "recipe",
        "reuse_counted", "arrival", "__weakref__",
    )

    def __init__(
        self, device: "Device", source: torch.UntypedStorage, version: int, position: int, ordinal: int = -1,
        stream: object | None = None, reader: object | None = None,
    ) -> None:
        self.nbytes = source.nbytes()
        # the stream that produced the storage: its copy waits on it, and its block goes back to it (NOTE
        # [Release after copy] in device/base.py); None: the stream current at the copy. ``reader``: the stream
        # current at the save, where autograd reads it in backward and its swap-in is allocated (NOTE
        # [Producer and reader streams] in device/producers.py); None: the stream current at the swap-in
        self.stream = stream
        self.reader = reader
        self.arrival: CopyHandle | None = None  # the swap-in's handle once restored: later readers order on it
        self.version = version
        self.position = position  # index in the iteration's save order of swapped storages
        self.ordinal = ordinal  # the policy entry's save ordinal (-1: no policy)
        self.trace_index = -1  # index of its SwappedTensor in a detailed trace, when one is recorded
        self.planned = False  # a policy scheduled its swap-in
        self.writes = 0  # in-place writes seen to the swapped storage (or its restored bytes) since the swap
        # the device original, while anything keeps it alive: the user, a retained graph, the entry itself
        # until its release point (``held``), or the device, which holds it at least until its swap-out has
        # completed (NOTE [Release after copy] in device/base.py)
        self.source = weakref.ref(source)
        self.held: torch.UntypedStorage | None = source
        self._state = EntryState.HELD
        self.out_in_forward = False  # its swap-out is placed in the forward pass (NOTE [Placed swaps])
        self.recipe = None  # a recomputed storage: how to rebuild it (executor/recompute.py); no copies
        self.reuse_counted = False  # a reuse of its original went into the counters (once per entry)
        self.to_host: CopyHandle | None = None
        self.to_device: CopyHandle | None = None
        self.device_bytes: torch.Tensor | None = None
        self._device = device

    # ---- the state ----------------------------------------------------------------------------
    @property
    def state(self) -> EntryState:
        return self._state

    def _move(self, to: EntryState) -> None:
        """The one place the state changes, as the table allows (NOTE [Swap entry lifecycle] in states.py)."""
        self._state = checked_move(self._state, to)

    @property
    def awaiting_swap_out(self) -> bool:
        """HELD: its swap-out is still to be issued."""
        return self._state is EntryState.HELD

    @property
    def issued(self) -> bool:
        """Its swap-out copy was started and the host took it (also once restored after it)."""
        return self._state in ISSUED_STATES

    @property
    def refused(self) -> bool:
        return self._state is EntryState.REFUSED

    @property
    def restored(self) -> bool:
        """Device bytes are back: copied in, the original reused, or rebuilt."""
        return self._state in RESTORED_STATES

    @property
    def in_flight(self) -> bool:
        return self._state is EntryState.RESTORING

    @property
    def reused_source(self) -> bool:
        """Restored by reusing the live original: no copy, no new device bytes."""
        return self._state is EntryState.REUSED_AFTER_COPY or self._state is EntryState.REUSED_WITHOUT_COPY

    @property
    def abandoned(self) -> bool:
        return self._state is EntryState.ABANDONED

    # ---- transitions --------------------------------------------------------------------------
    def issue(self) -> bool:
        """Start the device-to-host copy (HELD -> COPYING); False (-> REFUSED: the original stays held) when
        the host budget has no room."""
        original = self.held  # (None once it left HELD, REFUSED and COPYING: the move below raises then)
        handle = self._device.copy_to_host(original, self.stream) if original is not None else None
        if handle is None:
            self._move(EntryState.REFUSED)
            return False
        self._move(EntryState.COPYING)
        self.to_host = handle
        return True

    def release(self) -> None:
        """Let go of the device original once its copy is issued (COPYING -> RELEASED; the device holds it
        until the copy completed)."""
        self._move(EntryState.RELEASED)
        self.held = None

    def recompute_later(self, recipe) -> None:
        """HELD -> PENDING_RECOMPUTE: no copy; the original is dropped after its last forward use, like the
        program's reference, and rebuilt from ``recipe`` when backward needs it (executor/recompute.py)."""
        self._move(EntryState.PENDING_RECOMPUTE)
        self.recipe, self.held = recipe, None

    def finish_rebuild(self, device_bytes: torch.Tensor) -> None:
        """PENDING_RECOMPUTE -> REBUILT: ``device_bytes`` are what its recipe rebuilt; the recipe's inputs may go."""
        self._move(EntryState.REBUILT)
        self.device_bytes = device_bytes
        self.recipe = None

    def start_swap_in(self) -> bool:
        """Start the host->device copy unless it is under way or done; True if this call started it.

        When the device original is still alive (the user holds it, a retained graph does, or its
        swap-out is still in flight), it *is* the restored copy: no transfer and no new device bytes, so
        swapping never needs more device memory than not swapping."""
        if self.restored or self.in_flight:
            return False
        if self.reuse_source():
            self._release_host_if_copied()
            return False
        # ordered after the swap-out on the link, without making the training stream wait for it
        # allocated where autograd will read it: the stream current at the save (NOTE [Backward on its
        # forward's stream] in device/simulated/engine.py), whichever stream fires a prefetch
        self.to_device = self._device.copy_to_device(self.to_host.result, after=self.to_host, stream=self.reader)
        self._move(EntryState.RESTORING)
        return True

    def reuse_source(self) -> bool:
        """Restore by reusing the device original when it is still alive (RELEASED -> REUSED_AFTER_COPY;
        HELD, REFUSED or PENDING_RECOMPUTE -> REUSED_WITHOUT_COPY); False when it is gone."""
        original = self.source()
        if original is None:
            return False
        device_bytes = byte_view(original)
        copied = self._state is EntryState.RELEASED
        self._move(EntryState.REUSED_AFTER_COPY if copied else EntryState.REUSED_WITHOUT_COPY)
        self.device_bytes = device_bytes
        self.held = None
        self.recipe = None
        return True

    def finish_swap_in(self) -> torch.Tensor:
        """The device bytes, waiting for the copy if needed (RESTORING -> RESTORED); the host buffer goes
        back to the pool."""
        if not self.restored:
            self.start_swap_in()
        if self.in_flight:
            self.device_bytes = self._device.wait(self.to_device)
            self.arrival = self.to_device
            self._device.release_host(self.to_host.result)
            self.to_host = None
            self.to_device = None
            self._move(EntryState.RESTORED)
        return self.device_bytes

    def order_reader(self) -> None:
        """A later unpack of a restored copy, maybe on another stream than the first (a storage saved by nodes
        on two streams): that stream too is ordered after the swap-in (and recorded on it, ``wait``)."""
        if self.arrival is not None:
            self._device.wait(self.arrival)

    def evict(self) -> None:
        """Pressure relief gives back a restore made ahead of its use (RESTORING or REUSED_AFTER_COPY ->
        RELEASED); the caller waited for the copy that touches the bytes (NOTE [Relief under pressure] in
        pressure.py). It comes back again on demand."""
        restoring = self._state is EntryState.RESTORING
        self._move(EntryState.RELEASED)
        if restoring:
            self.to_device = None  # the copy's device bytes go with its handle
        else:
            self.device_bytes = None
        self.arrival = None

    def abandon(self) -> None:
        """Its attempt ran out of memory and was retried (-> ABANDONED): give back the host buffer (after the
        copies that touch it) and the restored device bytes. The failed attempt's graph can outlive the
        attempt, held where the garbage collector cannot reach (PyTorch's engine keeps a graph whose backward
        raised); it must not keep device or host memory from the retry. Unpacking it afterwards raises.
        Every saved tensor of the storage asks: once is enough."""
        if self._state is not EntryState.ABANDONED:
            self._move(EntryState.ABANDONED)
        self.device_bytes = None
        self.arrival = None
        self.held = None
        self.recipe = None
        to_host = self.to_host
        if to_host is not None:
            self._device.wait(self.to_device if self.to_device is not None else to_host)
            self._device.release_host(to_host.result)
        self.to_host = self.to_device = None

    def _release_host_if_copied(self) -> None:
        """A reused original no longer needs the host copy: give it back if the swap-out is done (else the
        destructor does, after waiting for it; NOTE [Release after copy] in device/base.py)."""
        to_host = self.to_host
        if to_host is not None and to_host.done():
            self._device.release_host(to_host.result)
            self.to_host = None

    def __del__(self) -> None:
        # Never (fully) swapped back in: no backward, an exception, a forward pass with grad on. The host
        # buffer goes back after a wait on the last copy that touches it (NOTE [Release after copy] in
        # device/base.py).
        to_host = self.to_host
        if to_host is None:
            return
        try:  # under the device's lock, never waiting for another thread's (NOTE [Threads and locks] in locking.py)
            run = getattr(self._device, "run_or_defer", None)
            if run is None:
                _give_back_host(self._device, to_host, self.to_device)
            else:
                run(_give_back_host, self._device, to_host, self.to_device)
        except Exception:  # noqa: BLE001 - a destructor must not raise; the buffer is simply dropped
            pass


def _give_back_host(device: "Device", to_host: "CopyHandle", to_device: "CopyHandle | None") -> None:
    """A dropped entry's host buffer goes back to the pool after the last copy that touches it."""
    device.wait(to_device if to_device is not None else to_host)
    device.release_host(to_host.result)


def abandoned_error() -> RuntimeError:
    return RuntimeError(
        "backward reached a tensor saved by an attempt of the iteration that ran out of memory and was retried: "
        "that attempt's graph was let go (its memory went to the retry). Run backward on the retry's outputs "
        "(Chameleon.run_iteration re-runs the whole closure)."
    )


def _modified_in_place(description: str, current: int, saved: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{description}] is at version {current}; expected version {saved} instead. (Reported by "
        "chameleon's swap executor: PyTorch skips this check when saved-tensor hooks are installed.)"
    )


def _describe(tensor: torch.Tensor) -> str:
    return f"torch.{type(tensor).__name__}{list(tensor.shape)} ({tensor.dtype})"


class KeptTensor:
    """A saved tensor that stays on the device.

    Autograd gets a detached alias, not the tensor itself: a tensor saved by its own grad_fn (an op's
    output, e.g. softmax) would otherwise hold that grad_fn through the hook's reference, a cycle through
    C++ that the garbage collector cannot see, so a graph never run backward (an out-of-memory error, a
    forward pass without backward) would never be freed. The alias shares the version counter, which
    restores autograd's in-place check."""

    __slots__ = ("tensor", "version", "nbytes", "swapped", "root", "abandoned", "stream", "__weakref__")

    def __init__(self, tensor: torch.Tensor, stream: object | None = None) -> None:
        self.tensor = tensor.detach()
        self.stream = stream  # the stream current at the save (its producer's), should a passive swap take it
        self.version = tensor._version
        # the tensor that owns the version counter, should a passive swap drop the alias
        self.root = weakref.ref(tensor._base if tensor._base is not None else tensor)
        self.nbytes = tensor.untyped_storage().nbytes()
        self.swapped: SwappedTensor | None = None  # set when a passive swap took it off the device
        self.abandoned = False  # its attempt ran out of memory and was retried (``abandon``)

    def abandon(self) -> None:
        """Its attempt ran out of memory and was retried: drop the device alias (see ``SwapEntry.abandon``)."""
        self.abandoned = True
        self.tensor = None
        if self.swapped is not None:
            self.swapped.entry.abandon()

    def swap_out(self, swapped: "SwappedTensor") -> None:
        """A passive swap moved it to the host: drop the device alias (the entry holds the copy). The
        in-place check follows the original tensor's version counter, as of the save."""
        swapped.version = self.version
        swapped.base = self.root
        self.swapped = swapped
        self.tensor = None

    def unpack(self) -> torch.Tensor:
        if self.abandoned:
            raise abandoned_error()
        if self.tensor._version != self.version:
            raise _modified_in_place(_describe(self.tensor), self.tensor._version, self.version)
        return self.tensor


class KeptParameter(KeptTensor):
    """A saved parameter (or any leaf that requires grad): autograd gets the tensor object itself back, as it
    does without hooks, never an alias of its data as of the save. A framework that swaps a parameter's
    storage between forward and backward (ZeRO-3 releases each gathered weight with ``param.data = ...`` and
    gathers it again for backward) is followed: nothing here holds the released storage. A leaf has no
    grad_fn, so holding it makes no reference cycle. The in-place check compares the parameter's own version
    counter (``.data =`` keeps it) at unpack with the save's, as autograd does. ``offset`` is its storage
    offset at the save: a recipe input that viewed it re-views it relative to where it sits at unpack (its
    ``size`` and ``stride`` must be what they were)."""

    __slots__ = ("offset", "size", "stride")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.size, self.stride = tensor.size(), tensor.stride()
        self.tensor = tensor
        self.stream = None  # never swapped (parameters are not eligible)
        self.version = tensor._version
        self.root = weakref.ref(tensor)
        self.nbytes = tensor.untyped_storage().nbytes()
        self.offset = tensor.storage_offset()
        self.swapped = None
        self.abandoned = False


def keeps_itself(tensor: torch.Tensor) -> bool:
    """Whether a saved tensor is handed back as itself (``KeptParameter``): parameters and leaves that
    require grad."""
    return isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad)


def keep(tensor: torch.Tensor, stream: object | None = None) -> KeptTensor:
    """The record of a saved tensor that stays on the device: a parameter as itself, else a detached alias."""
    return KeptParameter(tensor) if keeps_itself(tensor) else KeptTensor(tensor, stream)


def keep_input(tensor: torch.Tensor) -> KeptTensor:
    """A recipe input that stays: for a parameter or a view of one, the parameter itself (ZeRO-3 may swap its
    storage before backward; the recipe re-views it where it sits then), else a detached alias."""
    parameter = parameter_of(tensor)
    return KeptParameter(parameter) if parameter is not None else KeptTensor(tensor)


def parameter_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` itself if it is kept as itself, else the parameter it is a view of (None: neither)."""
    if keeps_itself(tensor):
        return tensor
    base = tensor._base
    return base if base is not None and keeps_itself(base) else None


class SwappedTensor:
    """One saved tensor that was swapped out (its storage lives in ``entry``)."""

    __slots__ = (
        "entry", "dtype", "size", "stride", "storage_offset", "version", "entry_version", "base", "description",
        "__weakref__",
    )

    def __init__(self, entry: SwapEntry, tensor: torch.Tensor) -> None:
        self.entry = entry
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.storage_offset = tensor.storage_offset()
        self.version = tensor._version  # what autograd expects at unpack (a passive swap sets the save's)
        self.entry_version = tensor._version  # the version when the entry began watching the storage
        root = tensor._base if tensor._base is not None else tensor
        self.base = weakref.ref(root)  # shares the version counter of every view of this memory
        self.description = _describe(tensor)

    def check_version(self) -> None:
        """Raise what autograd raises when a saved tensor was modified in place after it was saved.

        The base tensor holds the version counter shared by all its views, but only weakly (the device
        memory must be free to go), and a tensor changed in place and then dropped takes its counter
        with it. So the executor also counts the writes it sees to the swapped storage (``entry.writes``,
        reported by a dispatch mode): any write after the save raises, whether the base is alive or not,
        and whether or not the swap-out copy was still reading the bytes when they changed."""
        root = self.base()
        writes = self.entry.writes
        if root is not None and root._version != self.version:
            raise _modified_in_place(self.description, root._version, self.version)
        if root is None and self.entry_version + writes != self.version:
            raise _modified_in_place(self.description, self.entry_version + writes, self.version)
        if writes:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{self.description}] was written {writes} time(s) after it was saved, through a tensor that does "
                "not share its version counter (e.g. through .data). (Reported by chameleon's swap executor: the "
                "swapped copy and the changed original differ, so backward cannot go on.)"
            )

    def rebuild(self, device_bytes: torch.Tensor) -> torch.Tensor:
        """The saved tensor on the device again: same dtype, size, stride and offset over the bytes."""
        tensor = torch.empty(0, dtype=self.dtype, device=device_bytes.device)
        return tensor.set_(device_bytes.untyped_storage(), self.storage_offset, self.size, self.stride)
