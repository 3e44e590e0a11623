"""What ``policy="auto"`` and the adaptive profile measure through a store: the SSD's
bandwidth (:meth:`Probe.time_io`), the host tier's copies (:meth:`Probe.time_copies`),
the devices' free memory (:meth:`Probe.headroom`) and their queued work
(:meth:`Probe.synchronize_devices`). :class:`Probe` is an object the store composes
(``Store.probe``), given its collaborators when made; none of them holds the store.

The bandwidth probe's requests are made outside records, under the rule every request
follows (NOTE [ Memory owned by requests ] in _store.py): their buffer is owned by the
request, and their slot (``Probe.slots``) is freed by the store when the last of them
has ended (a ``SLOT_FREE`` event in its inbox), never by a caller that stopped
waiting. The store's repair and ``check_invariants`` count those slots as in use.
A probe cut short by an interrupt (before its ``try``, or inside its ``finally``)
leaves its slot registered with its requests (``Probe.slots``: slot -> futures);
the store's next pass reclaims every slot whose requests have all ended
(:meth:`Probe.reclaim_locked`: no probe runs then, they run on the training thread
before a pass opens), so an interrupt never keeps one for good. A request whose
submission an interrupt cut short may be in flight with its future lost: its place in
the list holds a future that never ends (:class:`_Submitting`, holding the buffer) from
before the engine call until the call's future replaces it, and the store quarantines
such a slot with that buffer (kept for the rest of the process, as a record's request
in the same case: ``Store._quarantine_locked``), never reusing what the request may
still touch.
"""

import mmap
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from ._errors import SpillIOError
from ._events import _copy, _without_frames
from ._limits import host_memory
from ._writeback import _owning, failed_future

__all__ = ["Probe", "SLOT_FREE"]

SLOT_FREE = "slot free"  # inbox event: a slot outside records has no request left


class _Submitting(Future):
    """A probe request's place while it is submitted: never done, so the slot is not
    freed, and holding the request's buffer (``owners``), should an interrupt lose the
    engine call's own future."""

    def __init__(self, owners):
        super().__init__()
        self.owners = owners


class Probe:
    """The store's measurements (``Store.probe``).

    Args:
        spill: the store's ``SpillSet`` (the bandwidth probe's slot is in its first file).
        devices: the store's :class:`~ssdtrain._device.DeviceMap`.
        host_tier: whether the store has a host tier (else ``time_copies`` is None).
        engine: the engine requests go to; ``Store.engine``'s setter sets it here too.
        cfg: the store's resolved config (``io_timeout_s``).
        locked: ``locked(fn, *args)``, ``fn(*args)`` in a locked region of the store
            (``Store._locked``: the inbox drained first, the store repaired if it
            raises), called through a weak reference.
        settle: the store's ``_settle`` (drain the inbox, wake the I/O thread for the
            memory dropped), likewise.
        callback: ``callback(slot, kind)``, the done-callback that queues an event in
            the store's inbox (NOTE [ Store lock discipline ] in _store.py).
    """

    def __init__(self, spill, devices, host_tier, engine, cfg, locked, settle, callback):
        self.spill = spill
        self.devices = devices
        self.engine = engine
        self.cfg = cfg
        self.slots = {}  # slots allocated outside records (the bandwidth probe's) -> requests
        self._host_tier = host_tier
        self._locked = locked
        self._settle = settle
        self._callback = callback

    def time_io(self, nbytes, repeats):
        """The best of ``repeats`` times, in seconds, to write and to read ``nbytes``
        through the engine and one slot of the first spill file: ``(write_s, read_s)``
        (the adaptive policy's bandwidth probe, ``_profile.measure_bandwidth``).

        The requests own their buffer, and the slot is freed when the last of them has
        ended (NOTE [ Memory owned by requests ] in _store.py): a request past
        ``io_timeout_s`` keeps both however long it runs.

        Raises:
            SpillIOError: a request failed, or did not end within ``io_timeout_s``.
        """
        buf = mmap.mmap(-1, nbytes)
        view = torch.frombuffer(buf, dtype=torch.uint8)
        view.fill_(0x5A)  # touch every page so the write measures the disk, not faults
        owners = (view, buf)
        futures = []  # registered with the slot: reclaim_locked frees it once they ended
        slot = self._locked(self._slot_locked, nbytes, futures)
        best = {"write": float("inf"), "read": float("inf")}
        try:
            for _ in range(repeats):
                for op in ("write", "read"):
                    t0 = time.perf_counter()
                    fut = self.submit(op, slot, view.data_ptr(), nbytes, owners, futures)
                    try:
                        exc = fut.exception(timeout=self.cfg.io_timeout_s)
                    except FutureTimeout:
                        raise SpillIOError(
                            f"ssdtrain: the bandwidth probe's {op} of {nbytes} bytes at offset "
                            f"{slot.offset} of {slot.file.name} did not finish within "
                            f"io_timeout_s={self.cfg.io_timeout_s} s; the device may be hung "
                            f"or overloaded. Check the device (dmesg), or raise io_timeout_s "
                            f"if it is only slow.", filename=slot.file.directory) from None
                    if exc is not None:
                        raise _copy(_without_frames(exc))
                    best[op] = min(best[op], time.perf_counter() - t0)
        finally:
            view = None
            self._free_slot_after(slot, futures)
            if all(f.done() for f in futures):
                owners = None
                try:
                    buf.close()  # at once; a request in flight keeps it (its owners)
                except BufferError:  # exported still: released with its last reference
                    pass
        return best["write"], best["read"]

    def time_copies(self, nbytes, repeats):
        """The host tier's probe (``policy="auto"``, NOTE [ The offload quota ] in
        _auto.py): the best of ``repeats`` times to copy ``nbytes`` device -> pinned and
        back on a device the store has seen a saved tensor of (``(d2h_s, h2d_s)``,
        :meth:`DeviceTransfers.time_copies`), or None: no host tier, or no device tensor
        seen yet (host records never enter the host tier)."""
        if not self._host_tier:
            return None
        dev = self._locked(self._copy_device_locked)
        return None if dev is None else dev.time_copies(nbytes, repeats)

    def headroom(self):
        """``(free, total)`` bytes where the store's saved tensors live, for
        ``policy="auto"``'s memory floor (NOTE [ The offload quota ] in _auto.py): the
        device with the least free of those it has seen a saved tensor of, else host
        memory as this process's cgroup bounds it (``_limits.host_memory``: available
        and total, NOTE [ Memory limits ] in _limits.py). ``Store.headroom`` calls it
        under the store's lock, so that the bytes still leaving memory are read in the
        same snapshot; it reads the device map (``DeviceMap.seen``) without taking it."""
        seen = self.devices.seen()
        if seen:
            return min((leaf.headroom(device) for leaf, device in seen), key=lambda r: r[0])
        host = host_memory()
        return host.available, host.total

    def synchronize_devices(self) -> bool:
        """Wait for the work queued on every device the store has seen a saved tensor
        of; whether there was one. ``policy="auto"`` times its baseline steps' forward
        with it (kernels are asynchronous: the host's clock alone sees their launches)."""
        seen = self.devices.seen()
        for leaf, device in seen:
            leaf.synchronize(device)
        return bool(seen)

    def _copy_device_locked(self):
        seen = self.devices.seen()
        return self.devices.get(*seen[0]) if seen else None

    def _slot_locked(self, nbytes, futures):
        slot = self.spill.files[0].alloc(nbytes, 0)
        self.slots[slot] = futures  # a repair meanwhile keeps it (Store._recount_locked)
        return slot

    def reclaim_locked(self):
        """Free the slots whose requests have all ended (the store's pass start: no probe
        is running then). A probe frees its own slot when its last request ends; one cut
        short by an interrupt before it could leaves the slot here. Returns ``[(slot,
        owners)]`` of the slots whose submission was cut short: the store quarantines
        them (a request may be in flight), then takes them out of :attr:`slots`."""
        lost = []
        if self.slots:
            for slot, futures in list(self.slots.items()):
                cut = [f.owners for f in futures if type(f) is _Submitting]
                if cut:
                    lost.append((slot, cut))
                elif all(f.done() for f in futures):
                    self.free_slot_locked(slot)
        return lost

    def submit(self, op, slot, address, nbytes, owners, futures):
        """The probe's engine call; the request owns ``owners`` (its buffer) until it
        ends. Its future is appended to ``futures`` (the slot's requests), in place of
        a :class:`_Submitting` there from just before the engine call."""
        engine = self.engine
        do = engine.write if op == "write" else engine.read
        futures.append(_Submitting(owners))  # until the engine call's future is known
        try:
            fut = do(slot.file, slot.offset, address, nbytes)
        except Exception as e:  # noqa: BLE001 - refused: nothing in flight
            fut = failed_future(e)
        futures[-1] = fut = _owning(fut, owners)
        return fut

    def _free_slot_after(self, slot, futures):
        """Free ``slot`` (outside records) once every request in ``futures`` has ended:
        now, or from the last one's completion through the store's inbox (a
        ``SLOT_FREE``)."""
        left = [f for f in futures if not f.done()]
        if not left:
            self._locked(self.free_slot_locked, slot)
            self._settle()
            return
        count = [len(left)]
        mutex = threading.Lock()
        done = self._callback(slot, SLOT_FREE)  # holds the store weakly

        def ended(fut):
            with mutex:
                count[0] -= 1
                last = count[0] == 0
            if last:
                done(fut)
        for f in left:
            f.add_done_callback(ended)

    def free_slot_locked(self, slot):
        """Idempotent: the slot goes back to its file once (the store's drain, on a
        ``SLOT_FREE``)."""
        if self.slots.pop(slot, None) is not None:
            slot.file.free(slot)  # bookkeeping only: also after close(), which kept it
