"""The host-RAM tier: device records kept in pinned host memory, the SSD beyond it.

NOTE [ Host tier ]
==================

``host_budget_bytes`` turns on a second tier between device memory and the SSD. It
applies to *device records* only (NOTE [ Device records ] in _device/transfers.py): a record
whose storage is host memory already lives in the host tier's RAM, so moving it
there frees nothing; with an SSD tier it is written as before, without one it stays
where it is (``KEPT``, a warning once: on a CPU-only run host RAM *is* the device
memory, and only an SSD can free it).

**What is decided, and when (``INV-DECIDED``).** A record leaves the tail window at a
pack (NOTE [ The pack decision ] in _decision/policy.py), and is then *admitted* to the host
tier: its bytes are counted in :class:`~ssdtrain._decision.budget.HostBudget` (in the order
records are admitted, which is save order, dedup moves in the window included). When the admitted bytes go
beyond the budget:

* with an SSD tier, the *earliest admitted* records leave the tier for the SSD until
  the rest fits (they are *evicted*): backward needs them last, so the last
  ``host_budget_bytes`` of forward are the ones in RAM when backward starts. A record
  larger than the whole budget goes to the SSD at once.
* without one (no ``spill_dir``), the record that does not fit stays in device memory
  (``KEPT``, counted in ``Stats.over_budget_bytes``): what is in RAM is never moved
  back to the device, and the latest records, which backward needs first, are the ones
  that stay there.

Both are made at the pack, from sizes and the order of saves and releases alone, so a
run moves the same records to RAM and to the SSD every time, whatever the I/O threads
do. The alternative, deciding at the end of forward when every size is known, would
have to hold every record in RAM (or on the device) until then: beyond the budget.
The budget counts the records' bytes (``Stats.host_bytes``, ``peak_host_bytes``:
never more than ``host_budget_bytes``), not the allocator's rounding of their pinned
buffers (``Stats.staging_bytes`` shows the pinned memory held, idle buffers kept for
reuse included). A record evicted from the tier and not yet written still holds its pinned copy:
its write is due (``RecordTable.spill_due_bytes``), then in flight, counted against
``write_behind_bytes`` as a staged SSD-only write is; more than ``write_behind_bytes``
of them waiting makes forward wait under every policy, ``"auto"`` included (NOTE [
Bounded memory ] in _store/store.py), so pinned memory stays within the budget plus the
write-behind limit (plus the staging pool's idle buffers).

**How it moves** (the record states in _decision/records.py):

* admitted: PENDING (due, like a write) -> HOSTING: the I/O thread queues the
  device -> pinned copy (:meth:`ssdtrain._device.transfers.DeviceTransfers.to_host`, on the
  D2H stream after the producer's event, into a buffer of the store's
  :class:`~ssdtrain._device.staging.StagingPool`: pinned allocations cost milliseconds, so
  buffers are reused, and the I/O thread reserves one outside the store lock first)
  -> HOSTED when the copy has ended (the "ssdtrain-d2h" thread waits for its event):
  the device memory is dropped, as when a write ends.
* loaded: HOSTED -> LOADED by an H2D copy into device memory allocated for the
  compute stream (:meth:`~ssdtrain._device.transfers.DeviceTransfers.from_host`, rules 5-7); it
  is queued at once, under the lock (prefetch, or unpack itself: no read to wait for,
  the consumer waits on the copy's event). When every live handle has been unpacked
  the device copy is dropped: LOADED -> HOSTED (``retain_graph`` loads it again).
* evicted: HOSTED -> SPILLING: the I/O thread writes the pinned copy to the SSD (no
  second device copy) -> ON_DISK, the buffer back in the pool (-> LOADED instead when
  prefetch or unpack claimed it meanwhile, loaded from that copy first). A record evicted while
  its copy to RAM or a load is running is spilled once it is HOSTED again; one still
  PENDING is written from the device as an SSD-only record would be.
* a record freed (its last handle gone) leaves the budget and its buffer goes back
  to the pool.

Prefetch walks HOSTING, HOSTED, SPILLING and SSD records alike (NOTE [ Prefetch
window ]). A record whose eviction write is still running (SPILLING) when prefetch or
backward reaches it is *claimed*: when the write ends it is loaded from its pinned
copy (SPILLING -> LOADED, the copy queued then, the buffer going back to the pool once
the copy has ended), never read back from the SSD; used, it is ON_DISK (it left the
budget when it was evicted). Backward still waits for that write: the load is queued
when it ends, not before (a LOADED record has no request in flight).

**The default budget** (``host_budget_bytes="auto"``): half of the memory this
process may use: the effective limit of its own memory cgroup (the least along its
path, v1 or v2) or, without one, the machine's RAM (``_limits.host_memory``, NOTE [
Memory limits ] in _limits.py). ``RLIMIT_MEMLOCK`` does not cap it: CUDA's pinned
memory is not counted against it (that NOTE says why); it is charged to the cgroup.
:func:`~ssdtrain._config.default_host_budget` computes it and says where the number
came from (``ResolvedConfig.host_budget_reason``, logged when an offloader is made).
"""

from __future__ import annotations

from .._device.transfers import device_misalign
from .._errors import SpillIOError
from .._decision.records import State
from ..io.spill import BLOCK
from .events import _without_frames
from .writeback import _WRITTEN, failed_future

__all__ = ["HostTier"]


class HostTier:
    """Moves device records through the host tier (NOTE [ Host tier ]): the pack's
    admission (with :class:`HostBudget`), the copies to RAM and back, the evicted
    records' writes to the SSD and their completion. The store holds one
    (``Store._tier``) and calls it under its lock (methods ending in ``_locked``); the
    write path hands it the records it admitted and the completions of their requests.
    It owns nothing but its collaborators: the records and their counts are the
    table's, the budget's bookkeeping the :class:`HostBudget`'s.

    Args:
        table: the store's :class:`~ssdtrain._store.table.RecordTable`.
        budget: the store's :class:`HostBudget`, or None (no host tier: no record is
            admitted, so nothing here is called).
        writes: the store's :class:`~ssdtrain._store.writeback.WritePath`: records are kept
            and failed as written ones are, and an eviction is a write
            (``submit_write``).
        cfg, stats, events: the store's resolved config, ``Stats`` and
            :class:`~ssdtrain._store.events.Events`.
        callback: ``callback(rec, kind)``, the done-callback that queues a completion in
            the store's inbox.
    """

    def __init__(self, table, budget, writes, cfg, stats, events, callback):
        self._table = table
        self._budget = budget
        self._writes = writes
        self.cfg = cfg
        self.stats = stats
        self._events = events
        self._callback = callback

    def admit_locked(self, rec):
        """The pack decision for a device record leaving the tail window with a host
        tier: admitted (due to be copied to RAM), written to the SSD, or kept on the
        device; earlier records evicted. Returns whether ``rec`` leaves device memory."""
        admitted, evicted = self._budget.admit(rec)
        for old in evicted:
            self._evict_to_ssd_locked(old)
        if admitted:
            return True
        if self._budget.evicts:
            self.stats.host_spilled_bytes += rec.nbytes  # straight to the SSD
            return True
        self._writes.keep_locked(rec)
        self.stats.over_budget_bytes += rec.nbytes
        self._events.warn_once(
            "host-budget", "ssdtrain: host_budget_bytes=%d is full and there is no spill_dir: "
            "records beyond it stay in device memory (Stats.over_budget_bytes). Give a spill_dir "
            "to write them to an SSD, or raise host_budget_bytes.", self._budget.budget)
        return False

    def keep_host_record_locked(self, rec):
        """A host record with a host tier and no SSD tier: it is in host memory already
        and nothing can free it."""
        self._writes.keep_locked(rec)
        self._events.warn_once(
            "host-record", "ssdtrain: a saved CPU tensor stays in memory: with host_budget_bytes "
            "and no spill_dir only device records move (to host RAM); host memory can only be "
            "freed by an SSD. Give a spill_dir to offload CPU tensors.")

    def _evict_to_ssd_locked(self, rec):
        """``rec`` leaves the host tier's budget for the SSD (decided at a pack). Still
        PENDING: it is written from the device like any record; else it is spilled from
        its pinned copy once that copy is all it holds (HOSTED)."""
        self.stats.host_spilled_bytes += rec.nbytes
        if rec.state is State.PENDING:
            return  # due: start_write_locked sees tier == 0 and writes it to the SSD
        rec.evict = True
        if rec.state is State.HOSTED:
            self._table.queue_spill(rec)

    # ------------------------------------------------------------ device -> RAM
    def start_host_locked(self, rec, inline=False):
        """PENDING -> HOSTING: queue the copy into pinned memory; the future completes
        when the copy has ended: the "ssdtrain-d2h" thread waits for its event, or,
        ``inline`` (started by a hook), the store's next locked region polls it (NOTE
        [ Copies the hooks start ] in _device/transfers.py)."""
        dev = rec.device
        try:
            lease, done = dev.to_host(rec.storage, rec.base, rec.nbytes, rec.produced)
        except Exception as e:  # noqa: BLE001 - no pinned memory now: stays on the device
            self._writes.keep_locked(rec)
            self._events.warn_once(
                "host-pinned", "ssdtrain: a device record could not be copied to the host tier "
                "(%s: %s); such records stay in device memory.", type(e).__name__, e)
            return
        rec.host = lease
        self._table.move(rec, State.HOSTING)
        owners = (rec.source, rec.storage, lease)  # the copy's, until it has ended
        try:
            fut = dev.polled(done, owners) if inline else dev.after(done, _landed, owners)
        except Exception as e:  # noqa: BLE001 - the waiter thread is gone (closing)
            fut = failed_future(e)
        rec.future = fut
        fut.add_done_callback(self._callback(rec, _WRITTEN))

    def hosted_locked(self, rec, fut):
        """The copy of ``rec`` to RAM ended (``WritePath.write_done_locked`` dispatches
        here). Idempotent: clears ``rec.future`` last."""
        exc = _without_frames(fut.exception())
        if exc is not None:
            # The copy never ran (an interrupt, the waiter shut down): the bytes are
            # still on the device.
            rec.host = None
            if rec.storage is not None and not rec.storage_changed():
                self._table.move(rec, State.KEPT)
                self.stats.kept_bytes += rec.nbytes
            else:
                self._events.report(rec, exc, lost=True)
                self._writes.fail_locked(rec, exc)
        elif not self._writes.written_intact_locked(rec):
            pass  # failed with autograd's message (in-place write, storage changed)
        elif rec.claimed:  # prefetch reached it: the device bytes stay, as a load
            self._table.move(rec, State.LOADED)
            rec.source = None
            rec.ready = rec.produced
            rec.produced = None
        else:
            self._table.move(rec, State.HOSTED)
            self._table.drop_memory(rec)
            rec.storage = rec.source = rec.produced = None
        rec.future = None
        if not rec.tokens:
            self._table.free(rec)

    # ------------------------------------------------------------ RAM -> device
    def load_locked(self, rec):
        """HOSTED -> LOADED: queue the copy back to device memory now (rules 5-7 of
        NOTE [ Device records ]); the consumer waits on ``rec.ready``."""
        storage, base, ready = rec.device.from_host(rec.host, device_misalign(rec.ptr, rec.lo))
        rec.storage, rec.base, rec.ready = storage, base, ready
        self._table.move(rec, State.LOADED)
        self.stats.host_loaded_bytes += rec.nbytes

    # --------------------------------------------------------------- RAM -> SSD
    def start_spill_locked(self, rec):
        """HOSTED -> SPILLING: write the pinned copy to a slot; the request owns it."""
        address = rec.host.view.data_ptr()
        writes = self._writes
        rec.slot = writes.spill.alloc(rec.nbytes, address % BLOCK)
        self._table.move(rec, State.SPILLING)
        rec.writes += 1
        owners = (rec.host, rec.slot)
        try:
            fut = writes.submit_write(rec.slot, address, rec.nbytes, False, owners)
        except Exception as e:  # noqa: BLE001 - refused: nothing in flight
            fut = failed_future(e)
        rec.future = fut
        fut.add_done_callback(self._callback(rec, _WRITTEN))

    def spilled_locked(self, rec, fut):
        """The write of an evicted record ended. Idempotent: clears ``rec.future`` last."""
        exc = _without_frames(fut.exception())
        if exc is not None and (not isinstance(exc, Exception) or (
                self.cfg.on_spill_error == "keep" and isinstance(exc, SpillIOError))):
            # An interrupt while it completed inline, or on_spill_error="keep": the bytes
            # are still in RAM. An interrupted one is evicted again; a failed one stays
            # in RAM, beyond the budget, as a failed write stays in memory.
            rec.slot = None
            again = not isinstance(exc, Exception)
            if not again:
                self.stats.spill_errors += 1
                self._events.warn_once("write", "ssdtrain: a spill write failed (%s); "
                                       "on_spill_error='keep' keeps such records in memory.", exc)
            rec.evict = again
            self._table.move(rec, State.HOSTED)
        elif exc is not None:
            self._events.report(rec, exc, lost=True)
            self._writes.fail_locked(rec, exc)
        else:
            self.stats.records_written += 1
            self.stats.bytes_written += rec.nbytes
            if self.cfg.verify and not rec.device.direct:
                rec.crc = fut.result()
            if rec.claimed and rec.tokens:  # prefetch or unpack reached it while it was
                self.load_locked(rec)  # written: loaded from its RAM copy, not read back
            else:
                self._table.move(rec, State.ON_DISK)
            # The buffer goes back to the pool (its lease's finalizer), not before the
            # load's copy out of it has ended (DeviceTransfers.from_host: lease.after).
            rec.host = None
        rec.future = None
        if not rec.tokens:
            self._table.free(rec)


def _landed():
    """The copy to RAM has ended (the waiter thread waited for its event)."""
    return None

