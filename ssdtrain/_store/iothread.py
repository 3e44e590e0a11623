"""The store's I/O thread as an object: its wake-up queue, its loop, the graveyard it
empties, its end, and the release of the store's engine and files.

What the thread does in a round (:meth:`IOThread.round`: start what is due, one request
per lock hold, the staging it needs reserved outside the lock), when, and what happens
at ``close()``, at a fork and when the store is collected, is here. NOTE [ The store's I/O thread ] in _store/store.py says
why the thread exists and what it may do; NOTE [ Store lock discipline ] there why
memory is released outside the lock (the graveyard).

:class:`IOThread` holds the store only weakly (the thread holds it during a round), so
an unreachable store is collected; its finalizer then ends the thread and releases the
engine and the spill files on a thread of their own (a collected store must not block
whichever thread dropped it).
"""

import collections
import logging
import mmap
import queue
import threading
import weakref

import time

import torch

from .._decision.records import State
from .._device import trace as _trace
from .._errors import SSDTrainError, resource_error
from ..io.readbuf import unmap_now
from ..io.spill import BLOCK
from .engine import WAIT_SLICE_S
from .events import _without_frames

__all__ = ["IOThread"]

log = logging.getLogger("ssdtrain")

_NAME_THREAD = getattr(torch._C, "_set_thread_name", None)  # pthread_setname_np
_STOP = object()   # tells the store's I/O thread to end
_JOIN_S = 10.0     # how long close() waits for the I/O thread to end its round


class IOThread:
    """The I/O thread of one store ("ssdtrain-store"). ``kick()`` wakes it; each wake is
    one :meth:`round` (through ``store._background_round()``, which tests may wrap).
    Until ``start()`` and after ``stop()`` (or in a forked child) it runs nothing, and
    ``kick()`` releases the graveyard on the caller's thread instead.

    Args:
        store: the store (held weakly).
        engine, spill, devices: what is released when the store is collected without
            ``close()`` (the finalizer's arguments: they must not hold the store);
            ``devices`` is the store's :class:`~ssdtrain._device.transfers.DeviceMap`.
    """

    def __init__(self, store, engine, spill, devices):
        self.kicks = queue.SimpleQueue()      # wakes the thread
        # Memory dropped under the store lock, released outside it (NOTE [ Store lock
        # discipline ]): tensors whose last reference the store held, read buffers'
        # mappings (NOTE [ Unmapping off the training thread ] in io/readbuf.py).
        self.graveyard = collections.deque()
        self.thread = threading.Thread(target=_work, args=(weakref.ref(store), self.kicks, self),
                                       name="ssdtrain-store", daemon=True)
        self.running = False                  # the thread runs (else work is done inline)
        self.idle = True                      # it waits for a kick (written by it alone)
        self._devices = devices
        self._spill = spill
        self.staging_failed = False           # the last reserve_staging could not allocate
        # Threads and files go when the store becomes unreachable (the Offloader and
        # every graph holding its handles are gone) or at interpreter exit.
        self._finalizer = weakref.finalize(store, _release_in_background, engine, spill,
                                           devices, self.kicks, self.thread)

    def start(self, engine):
        """Start the thread. Without one to be had the store never ran: ``engine``, the
        devices and the files are released here, and the error says so."""
        try:
            self.thread.start()
        except RuntimeError as e:
            self._finalizer.detach()
            _release_resources(engine, self._spill, self._devices, self.kicks, self.thread)
            raise (resource_error("could not start the store's I/O thread (ssdtrain-store)",
                                  e, threads=1) or e) from None
        self.running = True

    def round(self, store):
        """One round on ``store`` (the thread holds it for the round): start what is due,
        one request per lock hold, so that the hooks get the lock between requests, and
        release the graveyard outside the lock, until nothing is left. The store's paths
        are reached through ``store`` for the round only: the thread, which outlives the
        store by its release, holds none of them (NOTE [ The store's paths ])."""
        poller = store._poller
        while True:
            since = 0 if poller is None else poller.ended()
            self.reserve_staging(store)  # a pinned allocation, if one is due, outside the lock
            with store._lock:
                more = store._guarded_locked(self.start_one_locked, store)
            self.bury()
            if not (more or store._inbox):
                if poller is None or store.closed or store._paused or \
                        not store._writes.waiting():
                    return
                # Writes wait for room, and only a poll notices the write that makes it
                # (NOTE [ The data path on the hooks' thread ] in _store/store.py): wait
                # for one to end, without the GIL; the hooks poll meanwhile too.
                poller.wait_any(since, WAIT_SLICE_S)
                continue
            time.sleep(0)  # hand the GIL to a thread that waits for it (the training thread)

    def start_one_locked(self, store):
        """Start one request that is due: the oldest write the tail window overflowed
        into, else the next prefetch read. Whether more may be due.

        A device record's write whose staging this thread has not reserved (it became
        due after :meth:`reserve_staging` looked: a pack made it due while this thread
        waited for the lock) is not started here: the round goes back to reserve it
        outside the lock (NOTE [ Device records ]), unless that reservation failed (then
        the write finds out under the lock, and says so)."""
        if store.closed or store._paused:
            return False
        writes = store._writes
        if store._devices.staging and not self.staging_failed:
            rec = writes.next_hint()
            dev = None if rec is None else rec.device
            if dev is not None and not dev.direct and not dev.pool.ready(rec.nbytes):
                return True
        return writes.start_due_locked(1) or \
            store._reads.pump_locked(1, device_only=store._poller is not None)

    def reserve_staging(self, store):
        """Before the round takes the lock: when the next write or prefetch read due is a
        device record's, make sure its staging pool has a buffer for it, so that the
        pinned allocation (milliseconds) runs outside the lock (NOTE [ Device records ]).
        Reads the due writes and the prefetch queue without the lock: a hint."""
        self.staging_failed = False
        if not store._devices.staging:
            return
        for rec in (store._writes.next_hint(), store._reads.next_hint()):
            dev = None if rec is None else rec.device
            if dev is None or dev.direct:
                continue
            # A read takes staging at its slot's offset in a page (read_buffer), and only
            # a read from the SSD takes any (NOTE [ Bounded staging ] in _device/staging.py).
            slot = rec.slot if rec.state is State.ON_DISK else None
            if rec.state is State.PENDING or slot is not None:
                try:
                    dev.pool.reserve(rec.nbytes, offset=0 if slot is None else slot.offset % BLOCK)
                except Exception:  # noqa: BLE001 - the request finds out under the lock, and logs it
                    self.staging_failed = True

    @staticmethod
    def failed(store, exc):
        """An exception escaped a round on ``store``: a bug (the round's locked region has
        repaired the store). It is raised at the next pack or end of forward, never
        swallowed; while an event is pending, it joins it (only logged)."""
        _without_frames(exc)  # its frames hold the store (logged by Events.report)
        err = SSDTrainError(f"ssdtrain: the store's I/O thread failed: {type(exc).__name__}: "
                            f"{exc}; the store has repaired itself and goes on. Please report "
                            f"this bug.")
        err.__cause__ = exc
        with store._lock:  # NOTE [ One event, one error ] in _store/events.py
            store._guarded_locked(store._events.report, None, err, False)

    def kick(self):
        """Wake the thread if it waits (a thread in a round looks again before it waits).
        Once it has ended (a closed or forked store), only memory is left to release:
        here. Costs a ``SimpleQueue.put`` (C code) at most."""
        if self.running:
            if self.idle:
                self.kicks.put(None)
        elif self.graveyard:
            self.bury()

    def bury(self):
        """Release the memory dropped under the lock (never call this with it held). Any
        thread may call it, several at once."""
        grave = self.graveyard
        if not grave:
            return
        with _trace.span(_trace.RELEASE):
            while grave:
                try:
                    item = grave.popleft()
                except IndexError:  # another thread took the last one
                    return
                if type(item) is mmap.mmap:
                    unmap_now(item)
                item = None

    def bury_records(self, every=False):
        """Release the host memory records dropped (tensors), oldest first, up to the first
        read buffer's mapping, which is left to the thread (NOTE [ Unmapping off the
        training thread ] in io/readbuf.py): the hooks' own release with a polled engine
        (NOTE [ The data path on the hooks' thread ] in _store/store.py). With ``every``, the
        records behind a mapping too (the end of a backward: they go before the
        optimizer step); the mappings go back to the graveyard's end. Whether a mapping
        is left (the caller wakes the thread for it)."""
        grave, maps = self.graveyard, []
        try:
            while grave:
                try:
                    if type(grave[0]) is mmap.mmap and not every:
                        return True
                    item = grave.popleft()
                except IndexError:  # another thread took the last one
                    break
                if type(item) is mmap.mmap:
                    if every:
                        maps.append(item)
                    else:  # the I/O thread took the head meanwhile
                        unmap_now(item)
                item = None
        finally:
            # Interrupted before this line, a mapping popped goes with its last reference
            # (its deallocation unmaps it), as everywhere in io/readbuf.py.
            grave.extend(maps)
        return bool(maps)

    def dropped_bytes(self):
        """Bytes of the host storages in the graveyard: let go of, not yet released
        (NOTE [ Measured memory ] in _policies/adaptive.py). Idle read buffers' mappings, also
        there, are not activations (docs/planner.md) and are not counted; a storage is
        counted once. Read without the lock: a sample."""
        grave = self.graveyard
        if not grave:
            return 0
        total, seen = 0, set()
        for item in list(grave):  # one C call: the thread pops from it meanwhile
            if type(item) is not tuple:
                continue
            source, storage = item
            if storage is None and source is not None:
                storage = source.untyped_storage()
            if storage is not None:
                ptr = storage.data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += storage.nbytes()
        return total

    def stop(self):
        """End the thread (close()): later work is done inline."""
        self.running = False
        _stop(self.kicks, self.thread)

    def release(self, engine, in_flight):
        """``close()``: release ``engine``, the devices and the spill files, once (the
        finalizer is detached); in the background when a request may still be in flight
        (a hung request must not hang close(): released when it ends)."""
        if self._finalizer.detach() is not None:
            args = (engine, self._spill, self._devices, self.kicks, self.thread)
            if in_flight:
                _release_in_background(*args, daemon=True)
            else:
                _release_resources(*args)

    def forked(self):
        """In a forked child: the thread is the parent's, not in this process; nothing
        the parent owns is released here."""
        self.running = False
        self.kicks = queue.SimpleQueue()
        self._finalizer.detach()


def _work(ref, kicks, io):
    """The store's I/O thread (NOTE [ The store's I/O thread ] in _store/store.py): a round of
    work per wake; holds the store only during a round, so an unreachable store is
    collected."""
    if _NAME_THREAD is not None:  # the OS's name, which profilers and top -H show
        _NAME_THREAD("ssdtrain-store")
    while True:
        item = kicks.get()  # releases the GIL while it waits
        while item is not _STOP and not kicks.empty():  # one round for the kicks so far
            item = kicks.get()
        if item is _STOP:
            return
        store = ref()
        if store is None:
            return
        io.idle = False
        _round(store)
        # A hook that queued work while idle was False did not kick: look once more
        # (also after a failed round). Work queued after this line finds idle True.
        io.idle = True
        _round(store)
        store = None


def _round(store):
    """One round of the I/O thread; an exception escaping it is reported, not lost."""
    try:
        store._background_round()
    except BaseException as e:  # noqa: BLE001 - reported at the next pack
        try:
            IOThread.failed(store, e)
        except BaseException:  # noqa: BLE001 - the thread must keep serving
            pass
        e = None  # noqa: F841 - its traceback holds the store


def _stop(kicks, worker):
    """Tell the I/O thread to end and wait for it (not from the thread itself)."""
    kicks.put(_STOP)
    if worker is not threading.current_thread() and worker.is_alive():
        worker.join(_JOIN_S)
        if worker.is_alive():
            log.warning("ssdtrain: the store's I/O thread did not end within %.0f s of "
                        "close(); left running (a daemon thread).", _JOIN_S)


def _release_resources(engine, spill, devices, kicks, worker):
    try:
        _stop(kicks, worker)
        devices.close()  # writes waiting for a device copy are submitted first
        engine.shutdown()  # waits for requests still queued: they use the files
    finally:
        spill.close()


def _release_in_background(engine, spill, devices, kicks, worker, daemon=False):
    # A garbage-collected store must not block whatever thread dropped it (it may even
    # be an engine worker, which cannot join itself).
    if not threading.main_thread().is_alive():
        # Interpreter exit (atexit runs after threading's shutdown stopped the main
        # thread): a thread started now would not be waited for, and finalization
        # would end it inside the native engine's join (std::terminate, exit code
        # 134). Release here, in order: nothing else runs any more.
        _release_resources(engine, spill, devices, kicks, worker)
        return
    try:
        threading.Thread(target=_release_resources, args=(engine, spill, devices, kicks, worker),
                         name="ssdtrain-release", daemon=daemon).start()
    except RuntimeError as e:  # no thread to be had ("can't start new thread")
        if daemon:  # a request may hang: releasing here could hang too; left to the exit
            log.warning("ssdtrain: the engine and spill files of a closed Offloader were not "
                        "released: %s", resource_error("no thread for the release", e) or e)
        else:  # nothing in flight: release here, on the thread that dropped the store
            _release_resources(engine, spill, devices, kicks, worker)
