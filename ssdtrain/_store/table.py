"""The record table: a store's records, and every count that follows their states.

NOTE [ Record table ]

A :class:`RecordTable` holds the records of one store (by storage key, for dedup:
``find_record``) and every aggregate that follows a record's state, and nothing else
writes them:

* ``live`` (records registered), ``resident`` (bytes in memory: ``RESIDENT`` states;
  its peak goes to ``Stats.peak_resident_bytes``);
* ``writing`` (records with an outbound request in flight, ``OUTBOUND`` states,
  oldest first) and ``writing_bytes``: what the throttle holds to
  ``write_behind_bytes``;
* ``due`` (PENDING records decided to be written, write not started, oldest first)
  and ``due_bytes``; the rest of the PENDING records are in the tail window
  (``window``, a :class:`~ssdtrain._decision.policy.TailWindow`, which also keeps the spill
  budget's reservations);
* ``spill_due``: records evicted from the host tier whose pinned copy is ready to be
  written (HOSTED, ``evict`` set), and ``spill_due_bytes``, their bytes (pinned memory
  beyond the budget that the throttle bounds: NOTE [ Bounded memory ] in _store/store.py); ``host`` is the host tier's
  :class:`~ssdtrain._decision.budget.HostBudget` (``None``: no host tier);
* ``ahead``: bytes the prefetch window holds ahead of use (records flagged
  ``prefetched``, and the bytes passes passed through after their offload quota was
  spent and backward has not used yet: ``passed``, one :class:`PassedRef` per pass,
  NOTE [ The pack decision ] in _decision/policy.py).

:meth:`RecordTable.free` ends a record (FREED: its slot back to the allocator, its
memory to the graveyard, ``graveyard``, released outside the lock by the I/O thread:
NOTE [ Store lock discipline ] in _store/store.py, and out of the registry); every path that
finds a record with no handle left once its request ended frees it through it, with
no reach into the store. :meth:`RecordTable.move` is the one caller of :func:`~ssdtrain._decision.records.transition`
(NOTE [ Record state machine ]): it moves the record and, in the same call, every
aggregate the move changes, and clears what the new state may not hold (``due``
once it leaves PENDING, its host budget place once it leaves the tier's states, its
``prefetched`` flag once it is FREED). :meth:`add` and :meth:`remove` register and
unregister (``free`` unregisters last); :meth:`make_due`, :meth:`queue_spill`, :meth:`count_ahead` and
:meth:`uncount_ahead` are the other writers of the counts. After an exception cut a
locked region short, :meth:`recount` recomputes all of them from the records (NOTE [
Store lock discipline ] in _store/store.py), and :meth:`problems` lists those that disagree
with the records, and what a record holds that its state may not
(``Store.check_invariants``).

Every method runs under the store lock. The hooks read ``due_bytes``,
``writing_bytes``, ``spill_due`` and ``ahead`` without it, as hints for waking the
I/O thread (NOTE [ The store's I/O thread ] in _store/store.py).
"""

import collections
import weakref

from .._decision.records import IN_TIER, OUTBOUND, RESIDENT, State, transition

__all__ = ["RecordTable", "PassedRef"]


class PassedRef(weakref.ref):
    """A weak reference to a pass's :class:`~ssdtrain._decision.policy.PassedRanges`, with the
    bytes of it the prefetch window counts (``nbytes``). Its callback queues it into
    the store's inbox when the pass's last passed-through tensor dies (its graph was
    freed): the bytes backward never used leave the window then
    (:meth:`RecordTable.uncount_passed`)."""

    __slots__ = ("nbytes",)

    def __new__(cls, ranges, callback):
        self = weakref.ref.__new__(cls, ranges, callback)
        self.nbytes = 0
        return self

    def __init__(self, ranges, callback):
        super().__init__(ranges, callback)


class RecordTable:
    """The registry of a store's records and every aggregate over their states (NOTE [
    Record table ])."""

    __slots__ = ("registry", "live", "resident", "writing", "writing_bytes", "due", "due_bytes",
                 "spill_due", "spill_due_bytes", "ahead", "passed", "window", "host", "stats", "graveyard",
                 "closed")

    def __init__(self, window, host, stats, graveyard):
        self.registry = {}                        # storage key -> [Record]
        self.live = 0
        self.resident = 0
        self.writing = collections.OrderedDict()  # OUTBOUND records, oldest first
        self.writing_bytes = 0
        self.due = collections.OrderedDict()      # PENDING records to be written, oldest first
        self.due_bytes = 0
        self.spill_due = collections.OrderedDict()  # evicted HOSTED records (NOTE [ Host tier ])
        self.spill_due_bytes = 0
        self.ahead = 0                            # prefetched bytes not yet consumed
        self.passed = {}                          # id -> PassedRef counted in ahead
        self.window = window                      # the tail window (_policy.TailWindow)
        self.host = host                          # the host budget, or None (no host tier)
        self.stats = stats
        self.graveyard = graveyard                # memory released outside the lock (_store/iothread.py)
        self.closed = False                       # the store is closed: nothing starts

    def records(self):
        """Every registered record (a new list)."""
        return [r for group in self.registry.values() for r in group]

    # ------------------------------------------------------------ the writers
    def add(self, rec):
        """Register a new (PENDING, resident) record."""
        self.registry.setdefault(rec.key, []).append(rec)
        self.live += 1
        self._add_resident(rec.nbytes)

    def remove(self, rec):
        """Unregister ``rec`` (FREED). Idempotent: a free cut short is finished by
        calling it again."""
        group = self.registry.get(rec.key)
        if group is not None and rec in group:
            group.remove(rec)
            self.live -= 1
            if not group:
                del self.registry[rec.key]

    def move(self, rec, to):
        """``transition`` plus every aggregate that follows the state: the one way a
        record's state changes (NOTE [ Record state machine ] in _decision/records.py). During a
        repair the aggregates it moves are recomputed afterwards (:meth:`recount`), so
        it is safe there too."""
        frm = rec.state
        transition(rec, to)
        n = rec.nbytes
        if (frm in RESIDENT) != (to in RESIDENT):
            self._add_resident(n if to in RESIDENT else -n)
        if frm is State.PENDING:  # it leaves the tail window, or the due writes
            if not rec.due:
                self.window.discard(rec)
            elif self.due.pop(rec, 0) is None:
                self.due_bytes -= n
                if to is State.FREED:  # its graph died before its write could start
                    self.stats.unwritten_bytes += n  # (NOTE [ Bounded memory ] in _store/store.py)
            rec.due = False
        if rec.reserved and (to is State.KEPT or to is State.FREED):
            self.window.release(rec)  # no slot any more: the spill budget gets it back
        if frm in OUTBOUND and self.writing.pop(rec, 0) is None:
            self.writing_bytes -= n
        if to in OUTBOUND:
            self.writing[rec] = None
            self.writing_bytes += n
        if rec.tier and to not in IN_TIER:  # NOTE [ Host tier ] in _store/hosttier.py
            self.host.release(rec)
        if frm is State.HOSTED and self.spill_due.pop(rec, 0) is None:
            self.spill_due_bytes -= n
        if rec.evict:
            if to is State.HOSTED:
                self.queue_spill(rec)  # evicted meanwhile: its write is due now
            elif to not in IN_TIER:
                rec.evict = False
        if to is State.FREED:
            self.uncount_ahead(rec)

    def free(self, rec):
        """Any state -> FREED: memory, slot and registry entry go (no I/O in flight).
        Resumable: a free cut short (state FREED, still registered) is finished by
        calling it again (``Repair.repair_locked`` does). The slot is a lease: its blocks
        go back to its file when nothing holds it any more (NOTE [ Slots are leases ] in
        io/spill.py)."""
        if rec.state is not State.FREED:
            self.move(rec, State.FREED)  # it leaves the prefetch window too
        self.window.release(rec)  # a free cut short and resumed: idempotent
        rec.slot = None
        self.drop_memory(rec)
        rec.storage = rec.source = rec.staging = rec.ready = rec.produced = rec.host = None
        self.remove(rec)

    def drop_memory(self, rec):
        """``rec`` is about to let go of its memory: a host record's goes to the graveyard,
        released by the I/O thread outside the lock (freeing a large CPU tensor costs
        milliseconds of kernel time); a device record's is freed in place (a caching
        allocator's free costs nothing)."""
        if rec.device is None and rec.storage is not None:
            self.graveyard.append((rec.source, rec.storage))

    def make_due(self, rec):
        """A PENDING record left the tail window to be written (the pack decision)."""
        rec.due = True
        self.due[rec] = None
        self.due_bytes += rec.nbytes

    def queue_spill(self, rec):
        """``rec`` (HOSTED) was evicted from the host tier: its write to the SSD is due."""
        if rec not in self.spill_due:
            self.spill_due[rec] = None
            self.spill_due_bytes += rec.nbytes

    def count_ahead(self, rec):
        """``rec`` enters the prefetch window: held (or being read) ahead of its use."""
        if not rec.prefetched:
            rec.prefetched = True
            self.ahead += rec.nbytes

    def uncount_ahead(self, rec):
        """``rec`` leaves the prefetch window: used, or freed."""
        if rec.prefetched:
            rec.prefetched = False
            self.ahead -= rec.nbytes

    def count_passed(self, ranges, callback):
        """Forward of a pass ended: the bytes it passed through and backward has not used
        (``ranges``, a :class:`~ssdtrain._decision.policy.PassedRanges`) fill the prefetch window
        as kept records do, until used (:meth:`use_passed`) or their graph dies
        (``callback`` gets the :class:`PassedRef`: :meth:`uncount_passed`)."""
        if ranges.nbytes > 0:
            ref = PassedRef(ranges, callback)
            ranges.ref = ref
            ref.nbytes = ranges.nbytes
            self.passed[id(ref)] = ref
            self.ahead += ref.nbytes

    def use_passed(self, ref, nbytes):
        """Backward used ``nbytes`` of a pass's passed-through bytes."""
        if self.passed.get(id(ref)) is ref:
            ref.nbytes -= nbytes
            self.ahead -= nbytes

    def uncount_passed(self, ref):
        """The pass's passed-through tensors are gone: what backward did not use leaves
        the window. Idempotent."""
        if self.passed.get(id(ref)) is ref:
            self.ahead -= ref.nbytes
            ref.nbytes = 0
            del self.passed[id(ref)]

    def _add_resident(self, delta):
        self.resident += delta
        if self.resident > self.stats.peak_resident_bytes:
            self.stats.peak_resident_bytes = self.resident

    # ---------------------------------------------------------------- repair
    def leaving_bytes(self) -> int:
        """Bytes in memory that requests already decided will free: the due writes, and
        those in flight out of memory (a write, or a copy to the host tier; not an
        eviction from RAM, whose bytes are in host memory already)."""
        return self.due_bytes + sum(r.nbytes for r in self.writing
                                    if r.state is not State.SPILLING)

    def recount(self, recs):
        """Recompute every aggregate from ``recs`` (every registered record), and clear
        the per-record flags their state may not hold."""
        for r in recs:
            if r.prefetched and r.state not in RESIDENT:
                r.prefetched = False
        pending = sorted((r for r in recs if r.state is State.PENDING), key=lambda r: r.seq)
        writing = sorted((r for r in recs if r.state in OUTBOUND), key=lambda r: r.seq)
        for r in recs:
            if r.state is not State.PENDING:
                r.due = False
        self.window.rebuild([r for r in pending if not r.due], sum(r.reserved for r in recs))
        due = [r for r in pending if r.due]
        self.due = collections.OrderedDict((r, None) for r in due)
        self.due_bytes = sum(r.nbytes for r in due)
        self.writing = collections.OrderedDict((r, None) for r in writing)
        self.writing_bytes = sum(r.nbytes for r in writing)
        for r in recs:  # NOTE [ Host tier ] in _store/hosttier.py
            if r.state not in IN_TIER:
                r.tier, r.evict = 0, False
        if self.host is not None:
            self.host.rebuild([r for r in recs if r.tier])
        self.spill_due = collections.OrderedDict(
            (r, None) for r in sorted(recs, key=lambda r: r.seq)
            if r.evict and r.state is State.HOSTED)
        self.spill_due_bytes = sum(r.nbytes for r in self.spill_due)
        self.resident = sum(r.nbytes for r in recs if r.state in RESIDENT)
        self.ahead = sum(r.nbytes for r in recs if r.prefetched) + self._passed_bytes()
        self.live = len(recs)

    def _passed_bytes(self):
        return sum(ref.nbytes for ref in self.passed.values())

    def problems(self, recs):
        """What disagrees between the aggregates and ``recs`` (every registered
        record), and what a record holds that its state may not (a request, a slot, a
        host copy, handles): a list of messages, empty when all agree."""
        bad = []

        def check(ok, what):
            if not ok:
                bad.append(what)
        ids = set(map(id, recs))
        check(all(r.state is not State.FREED for r in recs), "a FREED record is registered")
        check(len(ids) == len(recs), "a record is registered twice")
        check(self.live == len(recs), f"live {self.live} != {len(recs)} records")
        res = sum(r.nbytes for r in recs if r.state in RESIDENT)
        check(self.resident == res, f"resident {self.resident} != {res}")
        window, due = self.window.records, self.due
        pending = [r for r in recs if r.state is State.PENDING]
        check(set(map(id, window)) | set(map(id, due)) == set(map(id, pending))
              and not set(map(id, window)) & set(map(id, due)),
              "tail window + due != PENDING records")
        check(all(r.due for r in due) and not any(r.due for r in window), "due flags")
        check(self.window.nbytes == sum(r.nbytes for r in window), "tail window bytes")
        check(self.due_bytes == sum(r.nbytes for r in due), "due bytes")
        check(self.window.reserved == sum(r.reserved for r in recs), "reserved spill bytes")
        check(self.window.limit is None or self.window.reserved <= self.window.limit,
              "reserved spill bytes beyond max_spill_bytes")
        wr = [r for r in recs if r.state in OUTBOUND]
        check(set(map(id, self.writing)) == set(map(id, wr)), "writing != WRITING records")
        check(self.writing_bytes == sum(r.nbytes for r in wr), "writing bytes")
        check(self.ahead == sum(r.nbytes for r in recs if r.prefetched) + self._passed_bytes(),
              "prefetched bytes")
        for r in recs:
            check(not r.tier or r.state in IN_TIER, f"{r!r}: in the host budget")
        host = self.host  # NOTE [ Host tier ] in _store/hosttier.py
        tier = [r for r in recs if r.tier]
        check(host is not None or not tier, "host budget records without a host tier")
        if host is not None:
            check(set(map(id, host.records)) == set(map(id, tier)), "host budget records")
            check(host.nbytes == sum(r.nbytes for r in tier), "host budget bytes")
            check(host.nbytes <= host.budget, "host bytes beyond host_budget_bytes")
        check(set(map(id, self.spill_due)) ==
              {id(r) for r in recs if r.evict and r.state is State.HOSTED},
              "evictions due != evicted HOSTED records")
        check(self.spill_due_bytes == sum(r.nbytes for r in self.spill_due),
              "evictions due bytes")
        for r in recs:  # each record on its own (NOTE [ Record state machine ])
            check(r.unseen <= r.tokens, f"{r!r}: unseen handles that are not live")
            check((r.future is not None) == (r.state in OUTBOUND or r.state is State.LOADING)
                  or (r.future is not None and not r.tokens),
                  f"{r!r}: future {r.future!r} in state {r.state.value}")
            check(r.tokens or r.future is not None, f"{r!r}: no handle and no I/O")
            in_ram = r.state in (State.HOSTING, State.HOSTED) or (
                r.state is State.LOADED and r.host is not None)
            check(r.slot is not None or in_ram or
                  r.state in (State.PENDING, State.KEPT, State.FAILED), f"{r!r}: no slot")
            check((r.host is not None) == (in_ram or r.state is State.SPILLING),
                  f"{r!r}: host copy {r.host!r} in state {r.state.value}")
        return bad
