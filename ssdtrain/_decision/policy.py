"""What is offloaded: the pack decision, shared by the store and ``ssdtrain estimate``.

NOTE [ The pack decision ]

``INV-DECIDED``. What happens to a saved tensor is a function of the sequence of saves and releases
and of the configuration alone, never of when the store's I/O thread gets to a
record. Three pieces decide it, and both callers (``Store.pack``/``_pack_locked`` in
``_store/store.py`` and the estimate's replay in ``estimate/replay.py``) call the same ones:

1. :func:`pass_reason`: why the tensor stays in memory as it is (``PASS_SMALL``,
   ``PASS_KIND``, ``PASS_LEAF``, ``PASS_STATE``), or ``None`` and its storage and key.
2. :func:`ssdtrain._decision.records.find_record`: the live record that already holds the
   tensor's bytes (dedup), or ``None`` (a new record).
3. :class:`TailWindow`: a new record enters the window of the last
   ``keep_tail_bytes`` of saved bytes (a dedup hit on a record in it moves it to the
   end: it is used again, late). When the window holds more, its oldest records
   leave it *at that pack*, each decided once: to be written (it reserves its worst
   case of spill slots, :func:`slot_bound`), or kept in memory because
   ``max_spill_bytes`` would be exceeded (``KEEP_BUDGET``), or kept because the step's
   offload quota is spent (``KEEP_QUOTA``: the default policy, ``"auto"``, NOTE [ The
   offload quota ] in ``_policies/auto.py``). A record freed while in the window was never
   decided (dropped: nothing to write). When forward ends, what is left in the window
   is the kept tail (``KEEP_TAIL``).

The quota is the one input that is not configuration: a byte count fixed when a step
(a forward pass) begins, from what earlier steps measured, and the same for the whole
step (with the memory floor, the least the step writes: the record that crosses the
quota is written too while fewer bytes than the floor are, ``TailWindow.begin_step``).
Within the step the decision stays a pure function of the saves and releases, the
configuration and those numbers (:attr:`Stats.offload_quota_bytes` shows the quota;
the estimate replays a given quota, without a floor, ``ssdtrain estimate
--offload-quota``).

Once a step's quota is spent, everything the step saves after is kept, so a new
record would only cost time: a tensor whose storage has no live record is passed
through in memory instead (``QuotaPassThrough``, no record, no lock, no device event), and
:class:`PassedRanges` counts the bytes a record would have had (first save of each
range: ``unique_bytes``, ``quota_kept_bytes``, ``kept_bytes``; a later save of those
bytes: ``deduplicated_bytes``), so the statistics, the quota's measurements and the
estimate's replay are the same as with records. Those bytes fill the prefetch window
when forward ends, as kept records do (NOTE [ The offload quota ] in ``_policies/auto.py``).
Not with a plan (``track``/``attach`` and ``set_plan`` or the adaptive policy), whose
per-layer bookkeeping needs records.

A record that left the window stays out of it whatever happens next: a later save of
the same bytes does not bring it back, whether its write has started or not. The
store's I/O thread only carries out the writes decided (``RecordTable.due``); a record
freed before its write started is not written. ``Stats.offloaded_bytes`` counts the
decision (at pack), not the write's end, whose fate (done, skipped, failed) depends on
timing. So ten runs of one model
offload the same bytes, and the estimate, which replays the same three pieces on fake
tensors, gives them exactly.

Parameters and buffers are never offloaded: their owner keeps them in memory
anyway, so writing them frees nothing. Autograd hands pack hooks plain tensors
(a parameter arrives as a ``Tensor``, ``weight.t()`` as a view with no
``_base``), so they are recognised by storage: while any offloader intercepts,
a global module forward pre-hook records the storages of the parameters and
buffers of every module that runs (:class:`ModuleStateTracker`).
"""

import collections
import dataclasses
import threading
from typing import Optional

import torch

from .._align import BLOCK, align_up
from .._identity import StorageWeakRef, record_range, storage_key

__all__ = ["ModuleStateTracker", "TRACKER", "is_offloadable_kind", "pass_reason", "TailWindow",
           "PassedRanges",
           "slot_bound", "PASS_SMALL", "PASS_KIND", "PASS_LEAF", "PASS_STATE", "KEEP_TAIL",
           "KEEP_BUDGET", "KEEP_QUOTA", "PASS_CAPTURE", "StepLimits", "NO_LIMITS"]

# Why a saved tensor or a record stays in memory (NOTE [ The pack decision ]).
PASS_SMALL = "small"    # fewer bytes than min_tensor_bytes
PASS_KIND = "kind"      # not a plain strided CPU/CUDA tensor with a storage
PASS_LEAF = "leaf"      # a leaf that requires grad (autograd saves the tensor itself)
PASS_STATE = "state"    # a parameter or buffer of a module that ran
KEEP_TAIL = "tail"      # in the tail window when forward ended
KEEP_BUDGET = "budget"  # writing it would exceed max_spill_bytes
KEEP_QUOTA = "quota"    # the step's offload quota was spent (policy "auto")
PASS_CAPTURE = "capture"  # saved during a CUDA graph capture (NOTE [ Device records ], rule 8)


def is_offloadable_kind(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided CPU or CUDA tensor ssdtrain can spill and rebuild.

    Everything else (subclasses, sparse, nested, quantized, meta, conj/neg views,
    other devices) is passed through in memory.
    """
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) \
        and t.layout == torch.strided and (t.is_cpu or t.is_cuda) \
        and not t.is_quantized and not t.is_conj() and not t.is_neg()


def pass_reason(t, nbytes, min_bytes, is_state, offloadable=is_offloadable_kind):
    """The first step of the pack decision (NOTE [ The pack decision ]).

    Args:
        t: the saved tensor; ``nbytes`` its bytes (``numel * element_size``).
        min_bytes: ``max(1, min_tensor_bytes)``.
        is_state: ``storage key -> bool``, whether a storage is a parameter's or a
            buffer's (``TRACKER.contains``).
        offloadable: the kind rule; the estimate passes its version for fake tensors.

    Returns:
        ``(reason, None, None)`` if ``t`` stays in memory as it is (a ``KEEP_*``
        constant), else ``(None, storage, key)``: it goes to a record.
    """
    if nbytes < min_bytes:
        return PASS_SMALL, None, None
    if not offloadable(t):
        return PASS_KIND, None, None
    if t.requires_grad and t.grad_fn is None:
        return PASS_LEAF, None, None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # no storage: never offloaded
        return PASS_KIND, None, None
    key = storage_key(storage)
    if is_state(key):
        return PASS_STATE, None, None
    return None, storage, key


def slot_bound(nbytes: int) -> int:
    """The most spill bytes a record of ``nbytes`` can take: its slot starts at the
    record's address modulo ``BLOCK`` (NOTE [ Zero-copy O_DIRECT from unaligned
    tensors ]), unknown to a decision that must not depend on addresses, so the budget
    counts the worst misalignment."""
    return align_up(nbytes + BLOCK - 1)


@dataclasses.dataclass(frozen=True)
class StepLimits:
    """What one step (a forward pass and its backward) may do, fixed before its pass
    opens and handed to the store with it (``Store.begin_pass``): nothing else sets a
    step's limits, and a pass never sees half of one step's and half of another's.

    The default is a step with no limits of its own: every eligible record is decided
    by the tail window (``policy="static"``, and ``"adaptive"``, whose plan decides per
    layer), the write-behind limit standing (the config's, or the applied plan's:
    ``Store.limit_write_behind``) and the prefetch window ``prefetch_bytes``.
    ``policy="auto"`` gives each step its own (NOTE [ The offload quota ] in _policies/auto.py)."""

    #: bytes the step may decide to write, its earliest records first (None: no quota)
    quota: Optional[int] = None
    #: with a quota, the least it writes (the memory floor; 0: none)
    floor: int = 0
    #: the write-behind limit for this step (None: the standing one)
    write_behind: Optional[int] = None
    #: the prefetch window for this step's reads (None: ``prefetch_bytes``)
    window: Optional[int] = None

    def __post_init__(self):
        for name in ("quota", "write_behind", "window"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"StepLimits.{name} must be None or a byte count >= 0, "
                                 f"got {value!r}")
        if type(self.floor) is not int or self.floor < 0:
            raise ValueError(f"StepLimits.floor must be a byte count >= 0, got {self.floor!r}")


NO_LIMITS = StepLimits()


class TailWindow:
    """The records of forward not decided yet: the last ``keep_tail_bytes`` of saved
    bytes, oldest use first, and the spill budget of those decided to be written
    (NOTE [ The pack decision ]). Pure bookkeeping over objects with ``nbytes`` and
    ``reserved`` attributes; the store calls it under its lock.

    Attributes:
        records: the records in the window, oldest use first.
        nbytes: their bytes.
        reserved: spill bytes reserved by records decided to be written and not yet
            released (:meth:`release`).
        quota: the most bytes the step may decide to write (``None``: no limit), set by
            :meth:`begin_step`.
        written: bytes decided to be written since :meth:`begin_step`.
        at_least: the step writes records until this many bytes are written, the one
            that crosses the quota included (the memory floor, set by :meth:`begin_step`).
    """

    __slots__ = ("tail_bytes", "keep_bytes", "limit", "records", "nbytes", "reserved", "quota",
                 "written", "spent", "at_least")

    def __init__(self, keep_tail_bytes: int, max_spill_bytes=None):
        self.tail_bytes = keep_tail_bytes  # the configuration's
        self.keep_bytes = keep_tail_bytes  # in force: 0 under a quota (begin_step)
        self.limit = max_spill_bytes
        self.records = collections.OrderedDict()
        self.nbytes = 0
        self.reserved = 0
        self.quota = None
        self.written = 0
        self.spent = False
        self.at_least = 0

    def begin_step(self, quota=None, at_least=0) -> None:
        """A step (forward pass) begins with an offload ``quota`` in bytes (``None``: no
        limit): its earliest records are written while they fit in it, and from the
        first that does not, every record the step decides is kept (``KEEP_QUOTA``).
        Backward needs the earliest records last, so their reads have the most time.

        Under a quota nothing waits in the window: each record is decided at the pack
        that saves it, so that the step's records past the quota are known to be kept
        as they come (the store then keeps them without records, NOTE [ The pack
        decision ]). The kept tail is the quota's to keep: ``policy="auto"`` sets it to
        at most the step's bytes less ``keep_tail_bytes``.

        ``at_least`` (the memory floor, NOTE [ The offload quota ] step 0; 0: none): until
        that many bytes are written a record is written even where it does not fit in
        the quota, so a step offloads at least the floor (a quota alone could leave it
        one record short, for good: the floor is measured from such steps)."""
        self.quota = quota
        self.at_least = at_least
        self.written = 0
        self.spent = quota is not None and quota <= 0
        self.keep_bytes = self.tail_bytes if quota is None else 0

    def add(self, rec) -> None:
        """A new record: the newest of the window."""
        self.records[rec] = None
        self.nbytes += rec.nbytes

    def touch(self, rec) -> None:
        """A save served by ``rec`` (dedup): if it is in the window, it is the newest
        again. A record that left the window stays out."""
        if rec in self.records:
            self.records.move_to_end(rec)

    def discard(self, rec) -> bool:
        """``rec`` leaves the window without a decision (freed: dropped, or kept by a
        plan); whether it was in it."""
        if self.records.pop(rec, 0) is None:
            self.nbytes -= rec.nbytes
            return True
        return False

    def over(self) -> bool:
        """Whether the window holds more than ``keep_tail_bytes`` (a decision is due)."""
        return self.nbytes > self.keep_bytes

    def overflow(self, outside: int = 0):
        """The records that leave the window now, oldest first, with their decision:
        ``(rec, None)`` to be written (its :func:`slot_bound` reserved), ``(rec,
        KEEP_QUOTA)`` kept because the step's quota is spent (:meth:`begin_step`),
        ``(rec, KEEP_BUDGET)`` kept because the reservation would take the spill tier
        beyond ``max_spill_bytes``. ``outside``: spill bytes in use that belong to no
        record (the bandwidth probe's slot, a request's its record let go of:
        ``SpillSet.outside_bytes``)."""
        out = []
        recs = self.records
        while self.nbytes > self.keep_bytes and recs:
            rec, _ = recs.popitem(last=False)
            self.nbytes -= rec.nbytes
            reason = None
            if self.quota is not None and (self.spent or (
                    self.written + rec.nbytes > self.quota and self.written >= self.at_least)):
                self.spent = True  # a prefix of the step's records: none after it either
                reason = KEEP_QUOTA
            elif self.limit is not None:
                need = slot_bound(rec.nbytes)
                if self.reserved + outside + need > self.limit:
                    reason = KEEP_BUDGET
                else:
                    self.reserved += need
                    rec.reserved = need
            if reason is None:
                self.written += rec.nbytes
            out.append((rec, reason))
        return out

    def close(self):
        """Forward ended: the records still in the window (the kept tail), oldest first;
        the window is empty after."""
        recs = list(self.records)
        self.records.clear()
        self.nbytes = 0
        return recs

    def release(self, rec) -> None:
        """``rec`` no longer needs spill slots (freed, or kept after all)."""
        if rec.reserved:
            self.reserved -= rec.reserved
            rec.reserved = 0

    def rebuild(self, window, reserved) -> None:
        """After a repair: ``window`` (records, oldest use first) and the reserved bytes,
        recomputed from the records."""
        self.records = collections.OrderedDict((r, None) for r in window)
        self.nbytes = sum(r.nbytes for r in window)
        self.reserved = reserved


class PassedRanges:
    """The byte ranges a step passed through after its quota was spent (NOTE [ The pack
    decision ]): what records they would have been, so that they are counted as
    records would be. Pure bookkeeping for one pass; the store and the estimate call
    it on the thread that runs forward.

    Attributes:
        ranges: storage key -> ``[(lo, hi, version, ptr, span)]``, as
            :func:`ssdtrain._decision.records.find_record` matches a record.
        nbytes: the bytes of those ranges not yet used by backward (what the prefetch
            window counts from the end of forward, ``RecordTable.count_passed``).
    """

    __slots__ = ("ranges", "nbytes", "ref", "__weakref__")

    def __init__(self):
        self.ranges = {}
        self.nbytes = 0
        self.ref = None  # the record table's PassedRef once forward ended (_store/table.py)

    def add(self, key, version, extent, ptr, span) -> int:
        """A save of ``extent`` of storage ``key``: the bytes of the record it would make
        (counted in :attr:`nbytes`), or 0 when a range passed before holds it (a dedup
        hit; same rules as ``find_record``)."""
        group = self.ranges.get(key)
        start, end = extent
        if group is None:
            group = self.ranges[key] = []
        else:
            for lo, hi, v, p, sp in group:
                if v == version and lo <= start and end <= hi and p == ptr and sp == span:
                    return 0
        lo, hi = record_range(extent, span)
        group.append((lo, hi, version, ptr, span))
        self.nbytes += hi - lo
        return hi - lo


class ModuleStateTracker:
    """Weakly remembers the storages of parameters and buffers of modules that run."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = set()  # whoever intercepts now (an Offloader's ForwardState)
        self._hook = None
        self._storages = {}  # storage key -> StorageWeakRef (pins the key, see _identity)

    def start(self, user) -> None:
        """``user`` intercepts: record module state while anyone does. Idempotent per user,
        and a start or stop cut short by an interrupt is completed by the next call
        (NOTE [ Forward phases ] in _offloader/forward.py), so a repair can always call them."""
        with self._lock:
            self._users.add(user)
            if not self._registered():
                self._prune()
                self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
                    self._pre_forward)

    def stop(self, user) -> None:
        """``user`` stopped intercepting (a user not started is ignored)."""
        with self._lock:
            self._users.discard(user)
            if not self._users and self._hook is not None:
                self._hook.remove()  # idempotent; forgotten only once removed
                self._hook = None

    def _registered(self) -> bool:
        h = self._hook
        if h is None:
            return False
        hooks = h.hooks_dict_ref()
        return hooks is not None and h.id in hooks

    def contains(self, key: int) -> bool:
        return key in self._storages

    def add(self, t) -> None:
        if t is None:
            return
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # wrapper subclasses without storage: never offloaded anyway
        key = storage_key(s)
        if key not in self._storages:
            self._storages[key] = StorageWeakRef(s)

    def _pre_forward(self, module, args):
        for p in module._parameters.values():
            self.add(p)
        for b in module._buffers.values():
            self.add(b)

    def _prune(self):
        dead = [k for k, ref in self._storages.items() if ref.expired()]
        for k in dead:
            del self._storages[k]


TRACKER = ModuleStateTracker()
