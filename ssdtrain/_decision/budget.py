"""``HostBudget``: the host tier's part of the pack decision (NOTE [ Host tier ] in
_store/hosttier.py): which records the host-RAM budget admits, and which earlier ones it
evicts to the SSD to make room. Pure bookkeeping, shared by the store (under its lock,
``HostTier.admit_locked``) and the estimate's replay, so both decide alike.
"""

import collections

__all__ = ["HostBudget"]


class HostBudget:
    """The host tier's part of the pack decision (NOTE [ Host tier ] in _store/hosttier.py):
    the records admitted, in order, and their bytes. Pure bookkeeping over objects with
    ``nbytes`` and ``tier`` attributes; the store calls it under its lock.

    Args:
        budget: ``host_budget_bytes``.
        evicts: whether there is an SSD tier to evict the earliest records to.
        stats: where ``host_bytes`` and ``peak_host_bytes`` are kept.
    """

    __slots__ = ("budget", "evicts", "records", "nbytes", "stats", "_next")

    def __init__(self, budget: int, evicts: bool, stats):
        self.budget = budget
        self.evicts = evicts
        self.records = collections.OrderedDict()  # admitted, earliest first
        self.nbytes = 0
        self.stats = stats
        self._next = 0

    def admit(self, rec):
        """``rec`` left the tail window to leave device memory. Returns ``(admitted,
        evicted)``: whether ``rec`` goes to the host tier, and the records (earlier
        ones, or ``rec`` itself when it is larger than the budget) that leave the tier
        for the SSD now. Without an SSD tier nothing is evicted: ``rec`` is admitted if
        it fits, else not."""
        n = rec.nbytes
        if not self.evicts:
            if self.nbytes + n > self.budget:
                return False, []
            self._add(rec)
            return True, []
        if n > self.budget:
            return False, []
        evicted = []
        while self.nbytes + n > self.budget:  # room first: the budget is never exceeded
            old = next(iter(self.records))
            self.release(old)
            evicted.append(old)
        self._add(rec)
        return True, evicted

    def _add(self, rec):
        self._next += 1
        rec.tier = self._next
        self.records[rec] = None
        self._set(self.nbytes + rec.nbytes)

    def release(self, rec) -> None:
        """``rec`` leaves the tier's budget (evicted, freed, kept or failed). Idempotent."""
        if rec.tier:
            rec.tier = 0
            if self.records.pop(rec, 0) is None:
                self._set(self.nbytes - rec.nbytes)

    def rebuild(self, recs) -> None:
        """After a repair: the records that still count (``tier`` set), in their order."""
        recs = sorted(recs, key=lambda r: r.tier)
        self.records = collections.OrderedDict((r, None) for r in recs)
        self._set(sum(r.nbytes for r in recs))

    def _set(self, n):
        self.nbytes = n
        stats = self.stats
        stats.host_bytes = n
        if n > stats.peak_host_bytes:
            stats.peak_host_bytes = n
