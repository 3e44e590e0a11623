"""The read path: pass queues, the prefetch window, starting and finishing reads,
dropping read copies. :class:`ReadPath` is an object the store composes (``Store._reads``),
given its collaborators when made; methods whose name ends in ``_locked`` run with the
store lock held (NOTE [ Store lock discipline ] in _store/store.py).

NOTE [ Prefetch window ]

Each forward under the offloader is a *pass*. When it ends, its records that are being
written or are on disk are queued newest first (backward uses them in reverse order);
``ReadPath.pump_locked`` starts reads from the queue of the pass whose backward runs (the last
one whose record was used) while fewer than the window's bytes are held ahead of use:
``prefetch_bytes``, or under ``policy="auto"`` what the step's loads need to arrive
in time (``ReadPath.window``, NOTE [ Loads in time ] in _policies/auto.py). The kept tail counts
against the same window. A record is read at most once per use:
one that was used and dropped (every live handle unpacked) is never prefetched
again until a new pack uses it (``Record.used``).
"""

import collections
import functools
import time

import torch

from ..io import checksum as _checksum
from .._device import trace as _trace
from .._device.transfers import device_misalign
from .._errors import SSDTrainError, resource_error
from .._decision.records import GEOMETRY_ALIGN, State
from ..io.spill import BLOCK
from ..io.base import then, wait_futures
from .events import _needed_by, _without_frames, timeout_error
from .writeback import _READ, failed_future


# States prefetch brings back: being written or copied to RAM (their bytes are kept
# when the request ends), on disk, in the host tier, being evicted from it (loaded from
# its RAM copy when the write ends: NOTE [ Host tier ] in _store/hosttier.py).
_FETCHED = frozenset({State.WRITING, State.ON_DISK, State.HOSTING, State.HOSTED,
                      State.SPILLING})
_NEAR = 2  # records: a window this close to backward's use is refilled by unpack itself


class _Pass:
    """One forward under the offloader: the records it saved, for prefetch."""

    __slots__ = ("records", "queue", "reported", "aborted", "passed")

    def __init__(self):
        self.records = []
        self.passed = None  # PassedRanges past the quota (NOTE [ The pack decision ])
        self.queue = None  # deque of records to prefetch, built when forward ends
        # NOTE [ One event, one error ] in _store/events.py: an error was raised for it; in
        # its forward (a pack raised: the forward never ended, its graph is garbage).
        self.reported = self.aborted = False


class ReadPath:
    """Everything between a record's write and its use in backward: the pass queues,
    the prefetch window, reads and their completion, dropping read copies. The store
    holds one (``Store._reads``) and calls it under its lock (methods ending in
    ``_locked``); it owns the pass queues (``passes``) and nothing else: the records
    and their counts are the table's, the read buffers the pool's.

    Args:
        table: the store's :class:`~ssdtrain._store.table.RecordTable` (``move()``, ``free()``,
            the bytes ahead of use).
        buffers: the :class:`~ssdtrain.io.readbuf.ReadBuffers` reads of host records land in.
        engine: the engine reads are submitted to; ``Store.engine``'s setter (the store's
            ``replace_engine``, tests) sets ``engine`` here too.
        cfg, stats, events: the store's resolved config, ``Stats`` and
            :class:`~ssdtrain._store.events.Events`.
        callback: ``callback(rec, kind)``, the done-callback that queues a completion in
            the store's inbox (NOTE [ Store lock discipline ] in _store/store.py).
        load_host: ``load_host(rec)``, the host tier's load of a HOSTED record (a copy
            from RAM queued at once: NOTE [ Host tier ] in _store/hosttier.py).
    """

    def __init__(self, table, buffers, engine, cfg, stats, events, callback, load_host):
        self._table = table
        self._buffers = buffers
        self.engine = engine
        self.wait_for = wait_futures  # the store's EngineSlot.wait (it polls a polled engine)
        self.cfg = cfg
        # Bytes held or loading ahead of backward's use: prefetch_bytes, or under
        # policy "auto" what the step's loads need to arrive in time (NOTE [ Loads in
        # time ] in _policies/auto.py; StepLimits.window, set by Store.begin_pass).
        self.window = cfg.prefetch_bytes
        self.stats = stats
        self._events = events
        self._callback = callback
        self._load_host = load_host
        self.passes = []  # passes whose prefetch is not finished; the last one is pumped

    def queue_pass_locked(self, p):
        """Forward of pass ``p`` ended (``Store._end_pass_locked``, after the due writes
        started and the tail was kept): its records being written or on disk are queued
        newest first, and the first window's reads start here, once per forward:
        backward's first unpacks come at once, and in whatever order its graph takes.
        The I/O thread starts the reads as the window slides (NOTE [ The store's I/O
        thread ] in _store/store.py)."""
        todo = {id(r): r for r in p.records if r.state in _FETCHED}
        p.queue = collections.deque(sorted(todo.values(), key=lambda r: -r.seq))
        p.records = None
        self.passes = [q for q in self.passes if q.queue] + ([p] if p.queue else [])
        self.pump_locked()

    def pump_low_locked(self, used):
        """Unpack's part of prefetch, after it used record ``used``: the I/O thread fills
        the window as it slides (NOTE [ The store's I/O thread ] in _store/store.py). When it
        lags so far that backward would soon miss, this thread starts reads itself: while
        less than a quarter of the window is held or being read ahead of use, and
        when the next record the window would take is one of the next ``_NEAR`` records
        backward uses (it walks a pass in reverse pack order: the queue's order)."""
        low = self.window >> 2
        while self._table.ahead < low and self.pump_locked(1):
            pass
        if self.passes and self._table.ahead < self.window:
            queue = self.passes[-1].queue
            if queue and 0 < used.seq - queue[0].seq <= _NEAR:
                self.pump_locked(1)

    def pump_locked(self, limit=None, inline=False, device_only=False):
        """Start reads from the queue of the pass whose backward runs while fewer than
        the window's bytes are held ahead of use, at most ``limit`` of them (all with
        None). Returns whether it stopped at ``limit`` with more to do. The store's I/O
        thread calls it (NOTE [ The store's I/O thread ] in _store/store.py), and ``flush()``;
        unpack too, ``inline`` (NOTE [ The data path on the hooks' thread ] there): loads
        from the host tier (stream work: NOTE [ Copies the hooks start ] in _device/transfers.py),
        and reads up to the first device record on the SSD, whose read the I/O thread
        starts (its staging may need an allocation); the I/O thread then passes
        ``device_only``: it leaves a host record's read to unpack, which has room for it
        as soon as the thread does."""
        budget = self.window
        started = 0
        while self.passes and self._table.ahead < budget:
            p = self.passes[-1]
            if not p.queue:
                self.passes.pop()
                continue
            rec = p.queue[0]
            if rec.tokens and not rec.prefetched and not rec.used:
                if rec.state is State.WRITING or rec.state is State.HOSTING or \
                        rec.state is State.SPILLING:
                    rec.claimed = True
                    self._table.count_ahead(rec)
                elif rec.state is State.ON_DISK:
                    if limit is not None and started >= limit:
                        return True
                    if (inline and rec.device is not None) or \
                            (device_only and rec.device is None):
                        return False
                    try:
                        buf = self._read_buffer_locked(rec)
                    except Exception as e:  # noqa: BLE001 - no memory for a read buffer now
                        p.queue.popleft()  # read when backward needs it (a miss)
                        self._events.warn_once("prefetch-memory", "ssdtrain: a prefetch read could "
                                               "not get its buffer (%s: %s); records are read when "
                                               "backward needs them until memory frees up.",
                                               type(e).__name__, e)
                        return False
                    self.start_read_locked(rec, buf)
                    self._table.count_ahead(rec)
                    started += 1
                elif rec.state is State.HOSTED:  # a copy from RAM, queued now
                    if limit is not None and started >= limit:
                        return True
                    # Stream work and a device allocation, no pinned one: the hooks'
                    # own too (NOTE [ Copies the hooks start ] in _device/transfers.py).
                    self._load_host(rec)
                    self._table.count_ahead(rec)
                    started += 1
            p.queue.popleft()
        return False

    def due(self):
        """Whether the prefetch window has room and a queue to fill it from. Read without
        the lock: a hint for waking the I/O thread."""
        return bool(self.passes) and self._table.ahead < self.window

    def next_hint(self):
        """The next record the window would take, or None. Read without the lock: a hint
        (``IOThread.reserve_staging``)."""
        try:
            queue = self.passes[-1].queue if self.due() else None
            return queue[0] if queue else None
        except (IndexError, AttributeError, RuntimeError):  # changed meanwhile
            return None

    # ------------------------------------------------------------------- unpack
    def use_locked(self, rec, handle):
        """The unpacked view of a resident record (``Store.unpack``: its bytes are in
        memory, under the lock: once it is released, a write that ends drops them). The
        handle is seen in this generation; a LOADED record whose live handles are all
        seen drops its copy; the window slides, and reads start if backward is near."""
        storage, base = rec.storage, rec.base
        if rec.device is not None:  # a load's copy, or (in memory) the producer: rule 7
            rec.device.consume(storage, rec.produced if rec.ready is None else rec.ready)
        if handle.token in rec.unseen:
            rec.unseen.discard(handle.token)
            if rec.prefetched:
                self._table.uncount_ahead(rec)
        self.promote_locked(rec)
        itemsize = handle.dtype.itemsize
        offset, odd = divmod(base + handle.rel, itemsize)
        if odd:
            raise SSDTrainError(f"ssdtrain: a view of {rec!r} at byte {handle.rel} does not fall "
                                f"on a {handle.dtype} element (base {base}); please report this "
                                f"bug.")
        view = torch.empty((0,), dtype=handle.dtype, device=storage.device).set_(
            storage, offset, handle.size, handle.stride)
        if not rec.unseen and rec.state is State.LOADED:
            self.evict_locked(rec)
        self.pump_low_locked(rec)  # the window slid: the I/O thread starts the next reads
        return view

    def fetch_locked(self, rec, handle, first, counted):
        """``Store.unpack`` of ``rec``, not in memory (not ``SERVABLE``): ``(view, None)``
        for a HOSTED record (its copy from RAM queued now), else ``(None, the future to
        wait for)``: its read in flight (a prefetch hit if ``first``: this handle's first
        unpack in this generation), its eviction's write (loaded from RAM once written),
        or a read started now (a miss). ``counted``: this unpack's hit or miss was counted
        already (a second round, ``Store._loaded_locked``)."""
        stats = self.stats
        if rec.state is State.HOSTED:  # NOTE [ Host tier ]: a copy from RAM, queued now
            stats.prefetch_misses += not counted
            self._load_host(rec)
            return self.use_locked(rec, handle), None
        if rec.state is State.LOADING:
            stats.prefetch_hits += first
        elif rec.state is State.SPILLING:  # NOTE [ Host tier ]: loaded from RAM once written
            if not counted:
                if first and rec.prefetched:  # prefetch claimed it
                    stats.prefetch_hits += 1
                else:
                    stats.prefetch_misses += 1
            rec.claimed = True
        elif rec.state is State.ON_DISK:
            stats.prefetch_misses += 1
            self.start_read_locked(rec)
        else:
            raise SSDTrainError(f"ssdtrain: unpacking a record in state {rec.state.value}; "
                                f"please report this bug.")
        return None, rec.future

    def wait(self, rec, fut):
        """Wait, outside the lock, for the request ``fut`` of ``rec`` that unpack needs
        (``io_timeout_s`` at most; ``Stats.stall_seconds``). Raises nothing of the
        request's own: the store looks at its outcome under the lock."""
        t0 = time.perf_counter()
        try:
            # The store's wait (EngineSlot.wait: it polls a polled engine); it never raises
            # the request's error, whose traceback would hold this handle (_without_frames).
            with _trace.span(_trace.WAIT_READ, rec.nbytes, rec.seq):
                late = self.wait_for([fut], self.cfg.io_timeout_s)
        finally:
            self.stats.stall_seconds += time.perf_counter() - t0
        if late:
            raise timeout_error(rec, "reading", f"{_needed_by()}; the device may be hung or "
                                f"overloaded. Check the device (dmesg), or raise io_timeout_s "
                                f"if it is only slow.", self.cfg.io_timeout_s)

    def promote_locked(self, rec):
        """Backward of another pass began (e.g. 1F1B): prefetch for it now."""
        owner = rec.owner
        if owner is not None and owner.queue and self.passes and self.passes[-1] is not owner \
                and owner in self.passes:
            self.passes.remove(owner)
            self.passes.append(owner)

    def _read_buffer_locked(self, rec):
        """Where a read of ``rec`` lands: ``(storage, lead, address, owner)``. Changes no
        record; raises if the memory cannot be had."""
        misalign, dev = rec.slot.offset % BLOCK, rec.device
        if dev is None:
            lead = rec.lo % GEOMETRY_ALIGN  # NOTE [ View geometry ] in _decision/records.py
            try:
                storage = self._buffers.storage(misalign, lead, rec.nbytes)
            except (OSError, MemoryError) as e:  # ENOMEM, vm.max_map_count: say so
                err = resource_error(f"no read buffer for record {rec!r}", e,
                                     nbytes=rec.nbytes)
                if err is None:
                    raise
                raise err from None
            return storage, lead, storage.data_ptr() + lead, storage
        # Lands in staging (or device memory); the storage is set when it is done.
        address, owner = dev.read_buffer(misalign, rec.nbytes)
        return None, 0, address, owner

    def start_read_locked(self, rec, buf=None):
        """ON_DISK -> LOADING: a read buffer (``buf``, or one made here) and the read; the
        request owns the buffer and the slot from before it is queued (NOTE [ Memory
        owned by requests ]): a record seen LOADING with no future falls back to ON_DISK
        (``Repair.repair_locked``)."""
        with _trace.span(_trace.READ, rec.nbytes, rec.seq):  # NOTE [ Profiler ranges ]
            storage, lead, address, owner = self._read_buffer_locked(rec) if buf is None else buf
            slot = rec.slot
            rec.storage, rec.base = storage, lead
            self._table.move(rec, State.LOADING)
            owners = (owner, slot)
            try:
                fut = self.submit_read(rec, slot, address, owner, owners)
            except Exception as e:  # refused: nothing in flight, the read fails
                fut = failed_future(e)
            rec.future = fut
            fut.add_done_callback(self._callback(rec, _READ))

    def submit_read(self, rec, slot, address, buf, owner):
        """The engine call; the request owns ``owner`` (its buffer and slot) until it has
        ended, the CRC and the device copy behind it included."""
        dev = rec.device
        engine = self.engine
        if dev is not None and dev.direct:
            fut = engine.read(slot.file, slot.offset, address, rec.nbytes, device=True,
                              owner=owner)
        elif dev is None and self.cfg.verify and engine.capabilities.checksums:
            # The engine's worker takes the CRC of the bytes read (no GIL); the result is
            # compared when the read is completed (read_done_locked).
            fut = engine.read(slot.file, slot.offset, address, rec.nbytes, crc=True,
                              owner=owner)
            fut.ssdtrain_crc = rec.crc
        else:
            fut = engine.read(slot.file, slot.offset, address, rec.nbytes, owner=owner)
            if self.cfg.verify:
                fut = then(fut, functools.partial(_verify, rec, rec.crc, slot, address,
                                                  rec.nbytes), owner)
        if dev is not None:  # NOTE [ Device records ] in _device/transfers.py: rules 5-7
            fut = then(fut, functools.partial(dev.stage_in, buf,
                                              device_misalign(rec.ptr, rec.lo)), owner)
        return fut

    def read_done_locked(self, rec, fut):
        """The read of ``rec`` ended. Idempotent (the waiter and the callback may both
        call it): clears ``rec.future`` last."""
        if rec.future is not fut:
            return
        if rec.state is State.LOADING:
            exc = _without_frames(fut.exception())
            if exc is None and "ssdtrain_crc" in fut.__dict__:
                exc = _mismatch(rec, fut.ssdtrain_crc, fut.result())
            if exc is not None and not isinstance(exc, Exception):
                # An interrupt while the read completed inline (its CRC on this thread):
                # the engine is done with the buffer; drop it, a later unpack reads again.
                self._table.move(rec, State.ON_DISK)
                rec.storage = rec.ready = None
            elif exc is not None:
                rec.error = exc
                self._table.move(rec, State.FAILED)
                rec.storage = None
            else:
                if rec.device is not None:
                    rec.storage, rec.base, rec.ready = fut.result()
                self._table.move(rec, State.LOADED)
                self.stats.bytes_read += rec.nbytes
                self.stats.records_read += 1
        rec.future = None
        if not rec.tokens:
            self._table.free(rec)

    def evict_locked(self, rec):
        """LOADED -> ON_DISK (or HOSTED, loaded from the host tier): every live handle
        has been unpacked; drop the copy (retain_graph reads it again, on demand)."""
        self._table.move(rec, State.ON_DISK if rec.host is None else State.HOSTED)
        rec.storage = rec.ready = None
        rec.generation += 1
        rec.used = True
        rec.unseen = set(rec.tokens)


def _verify(rec, expected, slot, address, nbytes):
    err = _mismatch(rec, expected, _checksum.crc32c(address, nbytes), slot)
    if err is not None:
        raise err


def _mismatch(rec, expected, observed, slot=None):
    """The IntegrityError for ``rec`` read back with CRC ``observed``; None if it matches."""
    if observed == expected:
        return None
    slot = slot or rec.slot
    return _checksum.mismatch(f"record {rec!r}", f"{slot.file.name} at offset {slot.offset}",
                              expected, observed)
