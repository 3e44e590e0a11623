"""A store's repair: what makes its aggregates agree with its records again.

Every locked region of the store that an exception (an interrupt included) cuts short
ends with :meth:`Repair.repair_locked` (NOTE [ Store lock discipline ] in
_store/store.py): completion callbacks are attached again, a record whose request's
future never reached it falls back to a state that does not depend on that request (the
request owns what it uses: NOTE [ Memory owned by requests ] there), records no handle
holds are freed, and every count is recomputed from the records. The releases of dead
handles (:meth:`Repair.released_locked`, from the inbox and from :meth:`sweep_locked`)
and the invariants tests check (:meth:`problems_locked`) are here too: they are the same
walk over the records.

:class:`Repair` is given what it uses (the record table, the spill set, the write and
read paths, the failure events, the completions' callback); it holds no store.
"""

from .._decision.records import OUTBOUND, State
from .._errors import SpillIOError
from .writeback import _READ, _WRITTEN

__all__ = ["Repair"]


class Repair:
    """The repair, the releases and the invariants of one store's records; every method
    runs under the store lock."""

    __slots__ = ("_table", "_spill", "_writes", "_reads", "_events", "_callback", "__weakref__")

    def __init__(self, table, spill, writes, reads, events, callback):
        self._table = table
        self._spill = spill
        self._writes = writes
        self._reads = reads
        self._events = events
        self._callback = callback

    def released_locked(self, rec, token):
        """A handle of ``rec`` died (its ``token``'s callback queued it): a record no
        handle holds is freed (after its request, if one is in flight); a loaded one
        every handle has seen drops its read copy."""
        if rec.state is State.FREED:
            return
        try:
            rec.tokens.discard(token)
        except TypeError:  # a weak reference never hashed while alive was never added
            return
        rec.unseen.discard(token)
        if not rec.tokens:
            if rec.future is None:
                self._table.free(rec)  # else freed when the I/O completes
        elif not rec.unseen and rec.state is State.LOADED:
            self._reads.evict_locked(rec)

    def repair_locked(self):
        """Make every aggregate agree with the records again after an exception cut a
        locked region short (NOTE [ Store lock discipline ]). Never raises on its own."""
        recs = self._table.records()
        for rec in recs:
            state = rec.state
            if state in OUTBOUND or state is State.LOADING:
                fut = rec.future
                if fut is None:  # its future never reached it (NOTE [ Memory owned by requests ])
                    self.fall_back_locked(rec)
                else:  # callbacks may have been lost with the region: attach again
                    fut.add_done_callback(self._callback(
                        rec, _WRITTEN if state in OUTBOUND else _READ))
            if rec.state in (State.PENDING, State.KEPT, State.HOSTED, State.HOSTING):
                rec.slot = None  # a write cut short before it moved the record: no slot
        for rec in recs:
            rec.tokens = {r for r in rec.tokens if r() is not None}
            rec.unseen &= rec.tokens
            if rec.state is State.FREED or (not rec.tokens and rec.future is None):
                self._table.free(rec)
        self.recount_locked()

    def sweep_locked(self):
        """Release the handles that are gone but still counted (a belt to the braces of
        the tokens' callbacks). Cheap when few records are live (at a step's start). Then
        the pending failure events nobody can need any more are forgotten (counted: NOTE
        [ One event, one error ] in _store/events.py)."""
        for group in list(self._table.registry.values()):
            for rec in list(group):
                for ref in [r for r in rec.tokens if r() is None]:
                    self.released_locked(rec, ref)
        if self._events.pending:
            self._events.sweep()

    def fall_back_locked(self, rec):
        """A request of ``rec`` was being made but its future never reached the record (an
        interrupt, before the engine call or after it): the request, if it is in flight,
        owns what it uses (NOTE [ Memory owned by requests ]), so the record falls back to
        a state that does not depend on it and forgets it. A write or a copy to RAM: KEPT,
        its bytes still in memory (FAILED if its storage was replaced meanwhile); an
        eviction's write: HOSTED, evicted again (its pinned copy is intact: the write
        only reads it); a read: ON_DISK (read again when needed). The record lets go of
        the request's slot (a write's: it may still be held by the request, and counts
        against ``max_spill_bytes`` until it ends) and buffer (a read's). Idempotent."""
        slot = rec.slot if rec.state is not State.LOADING else None
        if slot is not None:
            self._spill.let_go(slot)
        if rec.state is State.SPILLING:
            rec.slot = None
            rec.evict = True
            self._table.move(rec, State.HOSTED)
        elif rec.state is State.WRITING or rec.state is State.HOSTING:
            rec.slot = rec.staging = None
            if rec.state is State.HOSTING:
                rec.host = None
            if rec.storage is not None and not rec.storage_changed():
                self._table.move(rec, State.KEPT)  # the bytes are still in memory: exact
            else:
                self._writes.fail_locked(rec, SpillIOError(
                    f"ssdtrain: the write of {rec!r} was interrupted and its bytes are gone "
                    f"(its storage was resized or replaced after it was saved)."))
        else:
            self._table.move(rec, State.ON_DISK)
            rec.storage = rec.ready = None

    def recount_locked(self):
        """Recompute every aggregate from the records: the record table's, and the spill
        allocator's from the slots alive (NOTE [ Slots are leases ] in io/spill.py)."""
        self._table.recount(self._table.records())
        self._spill.rebuild()

    def problems_locked(self):
        self.sweep_locked()
        recs = self._table.records()
        bad = self._table.problems(recs)  # NOTE [ Record table ] in _store/table.py
        return bad + self._spill.problems([r.slot for r in recs if r.slot is not None])
