"""The write path: carrying out the pack decision's verdicts on the records that leave
the tail window (NOTE [ The pack decision ] in _decision/policy.py), starting the writes it
made, their completion, the spill budget's verdicts, the failure policy and the
write-behind throttle.
:class:`WritePath` is an object the store composes (``Store._writes``), given its
collaborators when made; methods whose name ends in ``_locked`` run with the store lock
held (NOTE [ Store lock discipline ] in _store/store.py). The failure policy reports to the
store's :class:`~ssdtrain._store.events.Events` (NOTE [ One event, one error ] in _store/events.py).
"""

import errno as _errno
import functools
import logging
import time
from concurrent.futures import Future

from ..io import checksum as _checksum
from .._device import trace as _trace
from .._errors import SSDTrainError, SpillIOError
from .events import _without_frames
from .._decision.policy import KEEP_QUOTA, slot_bound
from .._decision.records import State, inplace_error, swapped_error
from ..io.spill import BLOCK
from ..io.base import then, wait_futures

log = logging.getLogger("ssdtrain")


class WritePath:
    """Everything between a record's pack decision and the end of its write: starting
    the due writes, their completion, the spill budget's verdicts and the failure
    policy. The store holds one (``Store._writes``) and calls it under its lock
    (methods ending in ``_locked``); it owns nothing but its collaborators and the
    write-behind limit in force (``write_behind``): the records and their counts are
    the table's, the slots the spill set's. The pack decision's verdicts on the records
    that leave the tail window are carried out here (:meth:`decide_locked`), and so is
    the throttle (:meth:`throttle`), which waits outside the lock and takes it through
    the store (``Store._locked``, given at each call: the write path holds no store).

    A device record admitted to the host tier is copied to RAM instead of written, and
    an evicted one is written from its pinned copy: ``tier`` (the store's
    :class:`~ssdtrain._store.hosttier.HostTier`, a weak proxy set by the store once both exist:
    each calls the other, and a cycle would keep the record table alive past the store)
    starts those requests and completes them (NOTE [ Host tier ]).

    Args:
        table: the store's :class:`~ssdtrain._store.table.RecordTable` (``move()``, ``free()``,
            ``drop_memory()``, the due writes).
        window: the :class:`~ssdtrain._decision.policy.TailWindow` (the spill budget's reservations).
        spill: the :class:`~ssdtrain.io.spill.SpillSet` slots come from.
        engine: the engine writes are submitted to; ``Store.engine``'s setter sets it.
        cfg, stats, events: the store's resolved config, ``Stats`` and
            :class:`~ssdtrain._store.events.Events`.
        callback: ``callback(rec, kind)``, the done-callback that queues a completion in
            the store's inbox (NOTE [ Store lock discipline ] in _store/store.py).
    """

    def __init__(self, table, window, spill, engine, cfg, stats, events, callback):
        self._table = table
        self._window = window
        self.spill = spill
        self.engine = engine
        self.wait_for = wait_futures  # the store's EngineSlot.wait (it polls a polled engine)
        self.cfg = cfg
        self.stats = stats
        self._events = events
        self._callback = callback
        self.tier = None
        self.write_behind = None   # the limit in force (Store.limit_write_behind)
        self.cap = cfg.write_behind_bytes  # the most bytes in flight at once (room())

    # ------------------------------------------------------ the pack decision
    def decide_locked(self, outside):
        """The tail window holds more than ``keep_tail_bytes``: its oldest records are
        decided now, in pack, never later (NOTE [ The pack decision ] in _decision/policy.py).
        ``outside``: spill bytes in use that belong to no record (``TailWindow.overflow``;
        0 without ``max_spill_bytes``)."""
        table = self._table
        host, stats = table.host, self.stats
        for rec, reason in self._window.overflow(outside):
            if reason is KEEP_QUOTA:
                self.keep_locked(rec)
                stats.quota_kept_bytes += rec.nbytes
                # Backward uses it before any record the step wrote (those are older):
                # like the kept tail it fills the prefetch window, so reads start as
                # backward consumes it and kept + read-back bytes stay within
                # prefetch_bytes; else the reads would bring the written bytes back
                # while the kept ones are still held, and the step's peak would be no
                # lower (NOTE [ The offload quota ] in _policies/auto.py).
                table.count_ahead(rec)
                continue
            if reason is None and host is not None:  # NOTE [ Host tier ] in _store/hosttier.py
                if rec.device is None:
                    if not host.evicts:  # in host memory already, and no SSD tier
                        self.tier.keep_host_record_locked(rec)
                        continue
                elif not self.tier.admit_locked(rec):
                    continue  # beyond the budget, no SSD tier: kept on the device
            if reason is None:
                table.make_due(rec)
                # Counted as decided, not as the write ends: how the write fares (done,
                # skipped because the record died first, failed) depends on timing.
                stats.offloaded_bytes += rec.nbytes
            else:
                self.over_budget_locked(rec)

    def start_due_locked(self, limit=None, inline=False):
        """Start the writes pack decided (``RecordTable.due``), oldest first, at most ``limit``
        of them (all with None) and only while there is :meth:`room` in flight. Returns
        whether it stopped at ``limit`` with more due and room for it. The store's I/O
        thread calls it one record at a time; end of forward, ``flush()`` and the throttle
        call it for all (NOTE [ The store's I/O thread ] in _store/store.py); a write that ends
        makes room, and its completion wakes the I/O thread for the next
        (``Store._settle``). What is written was decided already: when this runs changes
        nothing of it (NOTE [ Bounded memory ] in _store/store.py). ``inline``: the hooks'
        own starts (NOTE [ The data path on the hooks' thread ] in _store/store.py): host
        records, and device records' copies to the host tier whose pool can hand out a
        buffer without an allocation (NOTE [ Copies the hooks start ] in _device/transfers.py),
        oldest first, up to
        the first other device record, which the I/O thread starts (its staging may need
        an allocation); evictions are the I/O thread's."""
        done = 0
        table = self._table
        due = table.due
        while due and self.room():
            if limit is not None and done >= limit:
                return True
            rec = next(iter(due))
            if inline and rec.device is not None and not (
                    rec.tier and rec.device.pool.ready(rec.nbytes, ordered=True)):
                return False
            self.start_write_locked(rec, inline)  # it leaves ``due`` (RecordTable.move)
            done += 1
        if inline:
            return False
        spill = table.spill_due  # evicted from the host tier (NOTE [ Host tier ])
        while spill and self.room():
            if limit is not None and done >= limit:
                return True
            self.tier.start_spill_locked(next(iter(spill)))  # it leaves ``spill_due``
            done += 1
        return False

    def room(self):
        """Whether another outbound request may start: fewer bytes in flight than the
        write-behind limit (the configured one, or the lower one in force), or none at all
        (a record larger than the limit is written alone). Policy ``"auto"``, whose forward
        never waits for a write (the throttle is off), is held to it here: the writes
        beyond it stay due, in memory with their graph, and a due record whose graph dies
        first is freed unwritten (``Stats.unwritten_bytes``; NOTE [ Bounded memory ] in
        _store/store.py). Read without the lock too: a hint."""
        writing = self._table.writing_bytes
        return writing == 0 or writing < min(self.cap, self.write_behind)

    def overdue(self):
        """Whether writes are due, not started, and there is room to start one. Read
        without the lock: a hint for waking the I/O thread."""
        table = self._table
        return (table.due_bytes > 0 or bool(table.spill_due)) and self.room()

    def waiting(self):
        """Whether writes are due and not started, room or not: with a polled engine
        nothing but a poll notices the write that makes room, so the I/O thread is woken
        to wait for it (``IOThread.round``). Read without the lock: a hint."""
        table = self._table
        return table.due_bytes > 0 or bool(table.spill_due)

    def next_hint(self):
        """The oldest due write, or None. Read without the lock: a hint
        (``IOThread.reserve_staging``)."""
        try:
            return next(iter(self._table.due)) if self.overdue() else None
        except (StopIteration, RuntimeError):  # emptied or changed meanwhile
            return None

    def start_write_locked(self, rec, inline=False):
        """PENDING -> WRITING: allocate a slot and submit the write (a record admitted to
        the host tier: PENDING -> HOSTING, ``inline`` there).

        The request owns the memory it reads and its slot, from before it is queued
        (NOTE [ Memory owned by requests ]). The state moves before the submission: a
        record seen WRITING with no future is one whose submission was interrupted
        (``Repair.repair_locked`` lets it fall back to KEPT).
        """
        with _trace.span(_trace.WRITE, rec.nbytes, rec.seq):  # NOTE [ Profiler ranges ]
            if rec.storage_changed():
                # resize_()/set_ after pack: the bytes are gone; writing (or staging a device
                # record) would read freed memory.
                self.fail_locked(rec, swapped_error(
                    rec.source, "its storage was resized or replaced "
                                "(untyped_storage().resize_() or set_)"))
                return
            if rec.tier:  # admitted to the host tier: copied to RAM (NOTE [ Host tier ])
                self.tier.start_host_locked(rec, inline)
                return
            dev, ready = rec.device, None
            if dev is None:
                address = rec.storage.data_ptr() + rec.base
            else:  # NOTE [ Device records ] in _device/transfers.py
                try:
                    address, rec.staging, ready = dev.stage_out(rec.storage, rec.base, rec.nbytes,
                                                                rec.produced)
                except Exception as e:  # noqa: BLE001 - no pinned memory for the staging copy
                    self.keep_locked(rec)  # in device memory, exact; nothing was submitted
                    self._events.warn_once(
                        "staging", "ssdtrain: a device record could not be staged for writing "
                        "(%s: %s); such records stay in device memory.", type(e).__name__, e)
                    return
            rec.slot = self.spill.alloc(rec.nbytes, address % BLOCK)
            self._table.move(rec, State.WRITING)
            rec.writes += 1
            owners = (rec.source, rec.storage, rec.staging, rec.slot)
            try:
                if ready is None:
                    fut = self.submit_write(rec.slot, address, rec.nbytes, False, owners)
                else:  # submitted by the device waiter thread once the copy is done
                    fut = dev.after(ready, functools.partial(self.submit_write, rec.slot,
                                                             address, rec.nbytes, dev.direct,
                                                             owners), owners)
            except Exception as e:  # refused (e.g. the engine was shut down): nothing in flight
                fut = failed_future(e)
            rec.future = fut
            fut.add_done_callback(self._callback(rec, _WRITTEN))

    def submit_write(self, slot, address, nbytes, on_device, owner):
        """The engine call; the request owns ``owner`` (its memory and slot) from before
        it is queued until it has ended, the CRC behind it included (NOTE [ Memory owned
        by requests ])."""
        engine = self.engine
        if on_device:
            return engine.write(slot.file, slot.offset, address, nbytes, device=True,
                                owner=owner)
        crc = self.cfg.verify  # the future's result becomes the CRC of what was written
        if crc and engine.capabilities.checksums:  # by the engine, without the GIL
            return engine.write(slot.file, slot.offset, address, nbytes, crc=True, owner=owner)
        fut = engine.write(slot.file, slot.offset, address, nbytes, owner=owner)
        if crc:
            fut = then(fut, functools.partial(_checksum.crc32c, address, nbytes), owner)
        return fut

    def write_done_locked(self, rec, fut):
        """The write of ``rec`` ended (or its copy to RAM: the inbox's ``_WRITTEN``).
        Idempotent: clears ``rec.future`` last."""
        if rec.future is not fut:
            return
        if rec.state is State.HOSTING:  # NOTE [ Host tier ] in _store/hosttier.py
            return self.tier.hosted_locked(rec, fut)
        if rec.state is State.SPILLING:
            return self.tier.spilled_locked(rec, fut)
        if rec.state is State.WRITING:
            rec.staging = None
            exc = _without_frames(fut.exception())
            if exc is not None and not isinstance(exc, Exception) and rec.storage is not None \
                    and not rec.storage_changed():
                # An interrupt while the request completed inline (its CRC on this thread):
                # the bytes are still in memory, so keep them; no error to report.
                rec.slot = None
                self._table.move(rec, State.KEPT)
            elif exc is not None:
                if not self._keep_after_failed_write_locked(rec, exc):
                    self._events.report(rec, exc, lost=True)
                    self.fail_locked(rec, exc)
            elif self.written_intact_locked(rec):
                self.stats.records_written += 1
                self.stats.bytes_written += rec.nbytes
                if self.cfg.verify and (rec.device is None or not rec.device.direct):
                    rec.crc = fut.result()  # of the bytes written (host memory or staging)
                if rec.claimed:  # prefetch reached it before the write ended: hold the bytes
                    self._table.move(rec, State.LOADED)
                    rec.source = rec.produced = None
                else:
                    self._table.move(rec, State.ON_DISK)
                    self._table.drop_memory(rec)
                    rec.storage = rec.source = rec.produced = None
        rec.future = None
        if not rec.tokens:
            self._table.free(rec)

    def written_intact_locked(self, rec):
        """Whether the saved tensor was left as it was saved while its bytes were copied
        out; if not, ``rec`` fails with autograd's message (NOTE [ In-place checks ])."""
        if rec.source._version != rec.version:
            self.fail_locked(rec, inplace_error(rec.source, rec.source._version, rec.version))
            return False
        if rec.storage_changed():
            self.fail_locked(rec, swapped_error(rec.source, "its storage was resized or "
                                                "replaced while it was being written"))
            return False
        return True

    def fail_locked(self, rec, exc):
        """Any state -> FAILED: ``exc`` is raised when backward needs the record."""
        rec.error = exc
        self._table.move(rec, State.FAILED)
        self._table.drop_memory(rec)
        rec.storage = rec.source = rec.staging = rec.produced = rec.host = None

    # ----------------------------------------------------------- the throttle
    def over_write_behind(self):
        """Whether forward must wait for writes: more than the write-behind limit in
        force is written or due to be (writes in flight, due writes the I/O thread has
        not started yet, evictions from the host tier not started), or, under any limit
        in force (policy ``"auto"`` has none), more than ``write_behind_bytes`` of
        evicted records wait for the SSD: each holds its pinned copy until written
        (NOTE [ Bounded memory ] in _store/store.py). Read without the lock (pack's hint,
        ``Store._over_write_behind``): :meth:`throttle` looks again."""
        table = self._table
        return (table.writing_bytes + table.due_bytes + table.spill_due_bytes
                > self.write_behind or table.spill_due_bytes > self.cap)

    def throttle(self, locked, raise_event_locked):
        """Wait until the writes in flight fit in the write-behind limit: start every
        write that is due (this thread waits anyway), then wait for the oldest write's
        future, never under the lock; ``io_timeout_s`` for each write.

        Args:
            locked: ``locked(fn, *args)`` runs ``fn(*args)`` in a locked region of the
                store (``Store._locked``: repaired if cut short).
            raise_event_locked: the store's ``_raise_event_locked`` (the pending failure
                event, raised for the pass it belongs to).
        """
        t0 = time.perf_counter()
        table = self._table
        span = _trace.span(_trace.WAIT_WRITE, table.writing_bytes + table.due_bytes)
        try:
            while True:
                done, oldest, fut = locked(self._throttled_locked, raise_event_locked)
                if done:
                    return
                if oldest is None:
                    continue
                if fut is None:
                    raise SSDTrainError(f"ssdtrain: record {oldest!r} is being written with no "
                                        f"request; please report this bug.")
                if self.wait_for([fut], self.cfg.io_timeout_s):
                    raise SpillIOError(
                        f"ssdtrain: writing record {oldest!r} to {oldest.slot.file.name} did not "
                        f"finish within io_timeout_s={self.cfg.io_timeout_s} s; the device may be "
                        f"hung or overloaded.", filename=oldest.slot.file.directory)
        finally:
            span.__exit__(None, None, None)
            self.stats.write_stall_seconds += time.perf_counter() - t0

    def await_retiring(self, locked, settle):
        """``max_spill_bytes``: a record whose graph is gone keeps its slot reservation
        until its write lands. A pass that began while a slow disk still had the last
        step's writes in flight would decide at pack (INV-DECIDED) against reservations
        about to go: it would keep (or, with ``on_spill_full="raise"``, fail) records a
        prompt disk writes. Wait for those writes first (the limit is a hard bound on the
        spill files, so their slots cannot be counted free before they are), so what a
        step decides does not depend on I/O timing. Costs a scan of the records at a
        step's start (as the sweep does), and a wait only when the disk lags a step.

        ``Store.begin_pass`` calls it, before the pass's locked region, with the store's
        ``_locked`` (as :meth:`throttle`) and ``_settle`` (the completions of those
        writes free their records, and the reservations with them).
        """
        futs = locked(self._retiring_locked)
        if futs:
            not_done = self.wait_for(futs, self.cfg.io_timeout_s)
            settle()
            if not_done:
                log.warning("ssdtrain: %d write(s) of freed records were still in flight after "
                            "io_timeout_s=%s s at the start of a forward pass; this pass's "
                            "max_spill_bytes decisions count their slots as used.",
                            len(not_done), self.cfg.io_timeout_s)

    def _retiring_locked(self):
        """The futures of the writes of records whose handles are all gone and that hold
        a slot reservation (``await_retiring``)."""
        return [r.future for group in self._table.registry.values() for r in group
                if r.reserved and not r.tokens and r.future is not None]

    def _throttled_locked(self, raise_event_locked):
        """``(done, oldest WRITING record, its future)`` for the throttle; completes the
        oldest write if it is done (its callback may still be queued): then ``oldest`` is
        None and the throttle looks again. ``RecordTable.closed`` is the store's."""
        raise_event_locked()
        closed = self._table.closed
        if not closed:
            self.start_due_locked()
        if not self.over_write_behind() or closed:
            return True, None, None
        if self._table.spill_due_bytes > self.cap and self.write_behind > self.cap:
            self._events.warn_once(
                "evictions", "ssdtrain: forward waited for the SSD: more than "
                "write_behind_bytes=%d of records evicted from the host tier waited for their "
                "writes, each holding its pinned copy until then; waiting keeps pinned memory "
                "within host_budget_bytes + write_behind_bytes (the SSD is slower than the "
                "evictions: a larger host_budget_bytes, a faster or second spill_dir, or a "
                "lower offload quota helps; Stats.write_stall_seconds counts the waits).",
                self.cap)
        if not self._table.writing:  # nothing in flight to wait for (none could start)
            return True, None, None
        oldest = next(iter(self._table.writing))
        fut = oldest.future
        if fut is not None and fut.done():
            self.write_done_locked(oldest, fut)
            return False, None, None
        return False, oldest, fut

    # ------------------------------------------------ spill errors and budget
    def _keep_after_failed_write_locked(self, rec, exc):
        """``on_spill_error="keep"``: a record whose write failed stays in memory."""
        if self.cfg.on_spill_error != "keep" or not isinstance(exc, SpillIOError) \
                or rec.storage is None or rec.storage_changed():
            return False
        rec.slot = None  # its lease: back to the file once nothing holds it
        self._table.move(rec, State.KEPT)
        self.stats.spill_errors += 1
        self.stats.kept_bytes += rec.nbytes
        self._events.warn_once(
            "write", "ssdtrain: a spill write failed (%s); on_spill_error='keep' keeps such "
            "records in memory, so memory use grows until the device is fixed. Further failures "
            "are counted in Stats.spill_errors.", exc)
        return True

    def over_budget_locked(self, rec):
        """``max_spill_bytes``: the pack decision keeps ``rec`` in memory, as writing it
        would take the spill tier beyond the budget (``TailWindow.overflow``); queue the
        error too with ``on_spill_full="raise"``."""
        limit = self.cfg.max_spill_bytes
        need = slot_bound(rec.nbytes)
        used = self._window.reserved
        self.keep_locked(rec)
        self.stats.over_budget_bytes += rec.nbytes
        if self.cfg.on_spill_full == "raise":
            self._events.report(rec, SpillIOError(
                f"ssdtrain: writing record {rec!r} (up to {need} bytes of slots) would take the "
                f"spill files beyond max_spill_bytes={limit} ({used} bytes reserved by records "
                f"being written or on disk); "
                f"on_spill_full='raise' stops here. Raise max_spill_bytes, offload less "
                f"(min_tensor_bytes, keep_tail_bytes), or set on_spill_full='keep' to keep such "
                f"records in memory.", errno=_errno.ENOSPC,
                filename=self.spill.files[0].directory), lost=False)
        else:
            self._events.warn_once(
                "budget", "ssdtrain: max_spill_bytes=%d reached (%d bytes reserved); records "
                "beyond it stay in memory (Stats.over_budget_bytes).", limit, used)

    def keep_locked(self, rec):
        """PENDING -> KEPT: the record stays in memory until its last handle dies."""
        self._table.move(rec, State.KEPT)
        self.stats.kept_bytes += rec.nbytes


_WRITTEN = "written"
_READ = "read"


def failed_future(exc):
    """A completed future holding ``exc``: a request the engine refused is handled like
    one that failed (its error surfaces; it is never swallowed)."""
    fut = Future()
    fut.set_running_or_notify_cancel()
    fut.set_exception(exc)
    return fut
