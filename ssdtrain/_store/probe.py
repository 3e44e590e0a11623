"""What ``policy="auto"`` and the adaptive profile measure through a store: the SSD's
bandwidth (:meth:`Probe.time_io`), the host tier's copies (:meth:`Probe.time_copies`),
the devices' free memory (:meth:`Probe.headroom`) and their queued work
(:meth:`Probe.synchronize_devices`). :class:`Probe` is an object the store composes
(``Store.probe``), given its collaborators when made; none of them holds the store.

The bandwidth probe's requests are made outside records, under the rule every request
follows (NOTE [ Memory owned by requests ] in _store/store.py): each request owns its buffer
and its slot (a lease, NOTE [ Slots are leases ] in io/spill.py) from before it is
queued until it has ended. The probe drops its own references when it returns, whatever
cut it short; the slot goes back to its file when the last request holding it has
ended, never while one can still touch it. Until then it counts against
``max_spill_bytes`` as a slot no record holds (``SpillSet.let_go``).
"""

import mmap
import time

import torch

from .._errors import SpillIOError
from .events import _copy, _without_frames
from .._limits import host_memory
from .writeback import failed_future
from ..io.base import wait_futures

__all__ = ["Probe"]


class Probe:
    """The store's measurements (``Store.probe``).

    Args:
        spill: the store's ``SpillSet`` (the bandwidth probe's slot is in its first file).
        devices: the store's :class:`~ssdtrain._device.transfers.DeviceMap`.
        host_tier: whether the store has a host tier (else ``time_copies`` is None).
        engine: the engine requests go to; ``Store.engine``'s setter sets it here too.
        cfg: the store's resolved config (``io_timeout_s``).
        locked: ``locked(fn, *args)``, ``fn(*args)`` in a locked region of the store
            (``Store._locked``: the inbox drained first, the store repaired if it
            raises), called through a weak reference.
    """

    def __init__(self, spill, devices, host_tier, engine, cfg, locked):
        self.spill = spill
        self.devices = devices
        self.engine = engine
        self.cfg = cfg
        self._host_tier = host_tier
        self._locked = locked
        self.wait_for = wait_futures  # the store's EngineSlot.wait (it polls a polled engine)

    def time_io(self, nbytes, repeats):
        """The best of ``repeats`` times, in seconds, to write and to read ``nbytes``
        through the engine and one slot of the first spill file: ``(write_s, read_s)``
        (the adaptive policy's bandwidth probe, ``_profile.measure_bandwidth``).

        Each request owns the buffer and the slot (NOTE [ Memory owned by requests ] in
        _store/store.py): a request past ``io_timeout_s`` keeps both however long it runs, and
        the slot goes back to its file when the last request has ended.

        Raises:
            SpillIOError: a request failed, or did not end within ``io_timeout_s``.
        """
        buf = mmap.mmap(-1, nbytes)
        view = torch.frombuffer(buf, dtype=torch.uint8)
        view.fill_(0x5A)  # touch every page so the write measures the disk, not faults
        slot = self._locked(self._slot_locked, nbytes)
        owners = (view, buf, slot)
        del view, buf  # the requests' from here (and this frame's, through owners)
        best = {"write": float("inf"), "read": float("inf")}
        for _ in range(repeats):
            for op in ("write", "read"):
                t0 = time.perf_counter()
                fut = self.submit(op, slot, owners[0].data_ptr(), nbytes, owners)
                if self.wait_for([fut], self.cfg.io_timeout_s):
                    raise SpillIOError(
                        f"ssdtrain: the bandwidth probe's {op} of {nbytes} bytes at offset "
                        f"{slot.offset} of {slot.file.name} did not finish within "
                        f"io_timeout_s={self.cfg.io_timeout_s} s; the device may be hung "
                        f"or overloaded. Check the device (dmesg), or raise io_timeout_s "
                        f"if it is only slow.", filename=slot.file.directory)
                exc = fut.exception()
                if exc is not None:
                    raise _copy(_without_frames(exc))
                best[op] = min(best[op], time.perf_counter() - t0)
        return best["write"], best["read"]

    def time_copies(self, nbytes, repeats):
        """The host tier's probe (``policy="auto"``, NOTE [ The offload quota ] in
        _policies/auto.py): the best of ``repeats`` times to copy ``nbytes`` device -> pinned and
        back on a device the store has seen a saved tensor of (``(d2h_s, h2d_s)``,
        :meth:`DeviceTransfers.time_copies`), or None: no host tier, or no device tensor
        seen yet (host records never enter the host tier)."""
        if not self._host_tier:
            return None
        dev = self._locked(self._copy_device_locked)
        return None if dev is None else dev.time_copies(nbytes, repeats)

    def headroom(self):
        """``(free, total)`` bytes where the store's saved tensors live, for
        ``policy="auto"``'s memory floor (NOTE [ The offload quota ] in _policies/auto.py): the
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

    def _slot_locked(self, nbytes):
        """The probe's slot, in the first spill file: no record holds it, so it counts
        against ``max_spill_bytes`` as such while it lives (``SpillSet.let_go``)."""
        slot = self.spill.files[0].alloc(nbytes, 0)
        self.spill.let_go(slot)
        return slot

    def submit(self, op, slot, address, nbytes, owners):
        """The probe's engine call; the request owns ``owners`` (its buffer and slot)
        from before it is queued until it has ended (NOTE [ Requests own their memory ]
        in io/base.py)."""
        engine = self.engine
        do = engine.write if op == "write" else engine.read
        try:
            return do(slot.file, slot.offset, address, nbytes, owner=owners)
        except Exception as e:  # noqa: BLE001 - refused: nothing in flight
            return failed_future(e)
