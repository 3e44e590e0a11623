"""Records, handles and the one table of their legal state transitions.

NOTE [ Record state machine ]

One :class:`Record` per saved storage range; many :class:`Handle` objects may
point at it (dedup). Its ``state`` changes only through :func:`transition`, which
checks the move against ``TRANSITIONS`` (an illegal move is a bug: it raises
``AssertionError``, always, not only under ``python -O``-less runs). The rule is kept by
code, not by care: ``Record.state`` is a read-only property (assigning it raises
``AttributeError``), :func:`transition` is the one function that writes the slot behind
it, and the store calls :func:`transition` only from ``RecordTable.move``, which also
moves the aggregates that follow the state. ``tests/test_contracts.py`` scans the source
for any other writer::

    state     bytes in memory?  on disk?  I/O in flight?  moves to (event)
    PENDING   yes (the tensor)  no        no              WRITING (left the tail window: due)
                                                          KEPT    (forward ended, plan "keep",
                                                                   max_spill_bytes reached)
                                                          FAILED  (its write was due and the
                                                                   storage was resized/replaced)
    WRITING   yes (the tensor)  landing   write           ON_DISK (write done: bytes dropped)
                                                          LOADED  (write done, prefetch claimed it)
                                                          KEPT    (write failed and
                                                                   on_spill_error="keep")
                                                          FAILED  (write failed, storage changed)
    KEPT      yes               no        no              -
    ON_DISK   no                yes       no              LOADING (read started)
    LOADING   landing           yes       read            LOADED  (read done)
                                                          FAILED  (read failed or corrupt)
                                                          ON_DISK (repair: its future was lost)
    LOADED    yes (read copy)   yes, or   no              ON_DISK (every live handle unpacked once)
                                in RAM                    HOSTED  (the same, loaded from RAM)
    HOSTING   yes (the tensor)  no        copy to RAM     HOSTED  (copy done: device bytes dropped)
                                                          LOADED  (copy done, prefetch claimed it)
                                                          KEPT    (the copy could not be queued)
                                                          FAILED  (storage changed under it)
    HOSTED    no (in host RAM)  no        no              LOADED  (loaded from RAM to the device)
                                                          SPILLING (evicted: its write starts)
    SPILLING  no (in host RAM)  landing   write           ON_DISK (write done: RAM copy dropped)
                                                          LOADED  (write done, prefetch or unpack
                                                                   claimed it: loaded from RAM)
                                                          HOSTED  (write failed and
                                                                   on_spill_error="keep"; or
                                                                   its future was lost)
                                                          FAILED  (write failed)
    FAILED    no                -         no              -
    any       -                 -         -               FREED   (last handle gone and no I/O in
                                                                   flight; or close())

A record is *resident* (counted in ``RecordTable.resident``) while it holds bytes in
memory: PENDING, WRITING, KEPT, LOADING (the read buffer), LOADED, HOSTING. FREED is
final. "Memory" is the memory the saved tensor lives in: device memory for a device
record. HOSTED and SPILLING hold the record's bytes in the host tier instead (pinned
host RAM, NOTE [ Host tier ] in _store/hosttier.py), which is not resident.

Byte geometry: a record covers bytes ``[lo, hi)`` of its storage. Its bytes in
memory are ``record.storage`` from byte ``record.base`` on (the original storage
with ``base == lo``, or a read buffer with ``base == lo % 16``: see NOTE [ View
geometry ]). A handle stores its view's offset in bytes relative to ``lo``
(``Handle.rel``), never in elements of another dtype.

NOTE [ View geometry ]

A view of dtype ``d`` starts at byte ``lo + rel`` of the original storage, where
``lo + rel`` is a multiple of ``d.itemsize`` (torch requires it). A read buffer
rebuilds the record at byte ``base`` of a new storage; the view's element offset
there is ``(base + rel) / itemsize``, which is an integer for every dtype only if
``base ≡ lo (mod 16)`` (16 = the largest itemsize, complex128; every itemsize
divides it). So ``base = lo % 16``, never 0 when ``lo`` is not 16-aligned: a
mixed-dtype view deduplicated into a small window that starts at an odd byte
comes back at its own bytes.
"""

import enum
import operator
import weakref

import torch

from .._identity import byte_extent

__all__ = ["State", "TRANSITIONS", "RESIDENT", "OUTBOUND", "DEAD", "Record", "Handle", "Token",
           "QuotaPassThrough",
           "PassThrough", "transition", "find_record", "GEOMETRY_ALIGN", "IN_TIER"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
GEOMETRY_ALIGN = 16  # the largest element size torch has (complex128); NOTE [ View geometry ]


class State(enum.Enum):
    PENDING = "pending"    # in the tail window, or decided to be written (``RecordTable.due``)
                           # and its write not started; bytes in memory
    WRITING = "writing"    # write in flight; bytes in memory
    KEPT = "kept"          # stays in memory until freed
    ON_DISK = "on_disk"    # only on disk
    LOADING = "loading"    # read in flight
    LOADED = "loaded"      # in memory again (and still on disk)
    FAILED = "failed"      # a write or read failed; ``error`` says why
    HOSTING = "hosting"    # device -> host RAM copy in flight (host tier); device bytes held
    HOSTED = "hosted"      # only in host RAM (the host tier, NOTE [ Host tier ])
    SPILLING = "spilling"  # evicted from host RAM: its write to the SSD is in flight
    FREED = "freed"        # no handle left (final)

    # Members are singletons compared by identity: hashing them by identity, in C, keeps
    # every set and dict of states off Enum.__hash__, a Python call (six per record in
    # the hooks' state moves: NOTE [ The data path on the hooks' thread ] in _store/store.py).
    __hash__ = object.__hash__


_S = State
TRANSITIONS = {
    _S.PENDING: frozenset({_S.WRITING, _S.HOSTING, _S.KEPT, _S.FAILED, _S.FREED}),
    _S.WRITING: frozenset({_S.ON_DISK, _S.LOADED, _S.KEPT, _S.FAILED, _S.FREED}),
    _S.KEPT: frozenset({_S.FREED}),
    _S.ON_DISK: frozenset({_S.LOADING, _S.FREED}),
    _S.LOADING: frozenset({_S.LOADED, _S.FAILED, _S.ON_DISK, _S.FREED}),
    _S.LOADED: frozenset({_S.ON_DISK, _S.HOSTED, _S.FREED}),
    _S.FAILED: frozenset({_S.FREED}),
    _S.HOSTING: frozenset({_S.HOSTED, _S.LOADED, _S.KEPT, _S.FAILED, _S.FREED}),
    _S.HOSTED: frozenset({_S.LOADED, _S.SPILLING, _S.FREED}),
    _S.SPILLING: frozenset({_S.ON_DISK, _S.LOADED, _S.HOSTED, _S.FAILED, _S.FREED}),
    _S.FREED: frozenset(),
}
"""Legal moves: ``TRANSITIONS[a]`` is the set of states ``a`` may move to (NOTE [ Record
state machine ]). WRITING/LOADING -> FREED happens only when the request has completed,
or at ``close()``, where the request keeps its memory (NOTE [ Memory owned by requests ]
in _store/store.py)."""

RESIDENT = frozenset({_S.PENDING, _S.WRITING, _S.KEPT, _S.LOADING, _S.LOADED, _S.HOSTING})
"""States whose record holds its bytes (or its read buffer) in memory."""

OUTBOUND = frozenset({_S.WRITING, _S.HOSTING, _S.SPILLING})
"""States with a request in flight that moves the record's bytes out (a write to the
SSD, or a copy to the host tier): counted against ``write_behind_bytes``."""

SERVABLE = frozenset({_S.PENDING, _S.WRITING, _S.KEPT, _S.LOADED, _S.HOSTING})
"""States whose bytes can be handed to backward at once (no read)."""

DEAD = frozenset({_S.FAILED, _S.FREED})
"""States whose record serves no new save (dedup)."""


def find_record(group, version, extent, ptr, span):
    """The record of ``group`` (the live records of one storage key) that holds the
    bytes ``extent`` of the storage in this state, or ``None``: the dedup step of the
    pack decision (NOTE [ The pack decision ] in _decision/policy.py), for the store and the
    estimate alike.

    Same key, same version counter (no in-place write since), the same data pointer
    and size (no ``resize_``/``set_`` since: NOTE [ Storage identity ]), an extent
    inside the record's ``[lo, hi)``, and a record that is not FAILED or FREED."""
    if group:
        start, end = extent
        for r in group:
            if r.version == version and r.lo <= start and end <= r.hi and r.ptr == ptr \
                    and r.span == span and r.state not in DEAD:
                return r
    return None


def transition(rec, to):
    """Move ``rec`` to state ``to``; raises ``AssertionError`` on an illegal move."""
    if to not in TRANSITIONS[rec.state]:
        raise AssertionError(f"ssdtrain: illegal record transition {rec.state.value} -> "
                             f"{to.value} for {rec!r}; please report this bug.")
    rec._state = to  # the only writer of the state (NOTE [ Record state machine ])


class Record:
    """One saved storage range ``[lo, hi)`` and where its bytes are."""

    __slots__ = ("key", "sref", "lo", "hi", "nbytes", "version", "source", "storage", "base",
                 "ptr", "span", "slot", "future", "_state", "seq", "tokens", "unseen",
                 "generation", "used", "error", "prefetched", "claimed", "writes", "owner", "crc",
                 "device", "staging", "ready", "produced", "due", "reserved", "host", "tier",
                 "evict", "__weakref__")

    def __init__(self, key, sref, lo, hi, version, source, seq, storage):
        self.key, self.sref = key, sref
        self.lo, self.hi, self.nbytes = lo, hi, hi - lo
        self.version = version
        self.source = source            # a detached alias: keeps the bytes alive, shares _version
        self.storage = storage          # ``source``'s (the caller has it already)
        self.base = lo                  # byte of ``storage`` where this record's ``lo`` lies
        self.ptr = self.storage.data_ptr()    # to see a resize_ or swap of the storage
        self.span = self.storage.nbytes()
        self.slot = None
        self.future = None              # the request in flight (write or read), if any
        self._state = State.PENDING     # read as ``state``; written by transition() alone
        self.seq = seq                  # pack order of the latest handle (prefetch order)
        self.tokens = set()             # weakrefs of live handles: release is idempotent
        self.unseen = set()             # live handles not unpacked since the last load
        self.generation = 0             # bumped each time the in-memory copy is dropped
        self.used = False               # used and dropped since its last pack: never prefetched
        self.error = None
        self.prefetched = False         # counted in the prefetch window, not yet consumed
        self.claimed = False            # prefetch wants the bytes held when the write ends
        self.writes = 0
        self.owner = None               # the _Pass that packed it last (prefetch window)
        self.crc = None                 # CRC32C of the bytes written (verify=True)
        self.device = None              # DeviceTransfers of a CUDA record (_device/transfers.py)
        self.staging = None             # pinned copy being written (CUDA records)
        self.ready = None               # event: the loaded device copy has landed
        self.produced = None            # event: the saved CUDA tensor is complete (pack)
        self.due = False                # left the tail window to be written (RecordTable.due)
        self.reserved = 0               # spill bytes the decision reserved (TailWindow)
        self.host = None                # the host tier's pinned copy (a staging lease)
        self.tier = 0                   # its place in the host budget (HostBudget), 0: none
        self.evict = False              # decided to leave the host tier for the SSD

    state = property(operator.attrgetter("_state"), doc="""The record's :class:`State`:
        read-only; it changes through :func:`transition` alone (NOTE [ Record state
        machine ]).""")

    @property
    def handles(self):
        return len(self.tokens)

    def storage_changed(self):
        """Whether the original storage was resized or given other memory since pack
        (``untyped_storage().resize_()``, ``set_``): the version counter cannot see it."""
        src = self.source
        if src is None:
            return False
        s = src.untyped_storage()
        return s.data_ptr() != self.ptr or s.nbytes() != self.span

    def __repr__(self):
        return f"<Record {self.state.value} {self.nbytes} B seq={self.seq}>"


class Handle:
    """What autograd holds instead of a saved tensor: a record and the view to rebuild.

    ``rel`` is the view's first byte relative to the record's ``lo`` (NOTE [ View
    geometry ]). A dying handle only queues its release (its ``Token``).
    """

    __slots__ = ("record", "token", "dtype", "size", "stride", "rel", "version",
                 "tensor_ref", "base_ref", "__weakref__")

    def __init__(self, record, t, byte_offset, version, inbox_append):
        self.record = record
        # The record counts its live handles by these weak references. When the handle
        # dies, the weak reference's callback, ``deque.append`` of the store's inbox (C
        # code: no Python frame, so no interrupt can cut it short), queues the token:
        # the release (NOTE [ Store lock discipline ]). No ``__del__``.
        self.token = Token(self, inbox_append, record)
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.rel = byte_offset - record.lo
        self.version = version
        # Version checks at unpack (NOTE [ In-place checks ]): the saved tensor is often a
        # temporary view; its base, which shares the version counter, usually lives on.
        self.tensor_ref = weakref.ref(t)
        self.base_ref = None if t._base is None else weakref.ref(t._base)


class Token(weakref.ref):
    """A weak reference to a :class:`Handle` that knows its record; queued into the
    store's inbox by its callback when the handle dies (the release event)."""

    __slots__ = ("record",)

    def __new__(cls, handle, callback, record):
        self = weakref.ref.__new__(cls, handle, callback)
        self.record = record
        return self

    def __init__(self, handle, callback, record):
        super().__init__(handle, callback)


class PassThrough:
    """A saved tensor passed through in memory, with the version it was saved at.

    Holds a detached alias (no reference cycle through ``grad_fn``) that shares the
    version counter and the storage, so in-place writes after saving are caught as
    autograd would, and a weak reference to the saved tensor itself, so a ``.data``
    swap on it is seen at unpack.
    """

    __slots__ = ("tensor", "version", "ref")

    def __init__(self, t):
        self.tensor = t.detach()
        self.version = t._version
        # Only plain strided tensors have a storage to compare (not sparse, subclasses...).
        self.ref = weakref.ref(t) if type(t) in _PLAIN and t.layout is _STRIDED else None

    def unpack(self):
        t = self.tensor
        if t._version != self.version:
            raise inplace_error(t, t._version, self.version)
        if self.ref is None:
            return t
        orig = self.ref()
        s = t.untyped_storage()
        if orig is not None and orig.untyped_storage()._cdata != s._cdata:
            return swapped(orig)
        if t.numel() and s.nbytes() < byte_extent(t)[1]:
            raise swapped_error(t, "its storage was resized (untyped_storage().resize_())")
        return t


class QuotaPassThrough(PassThrough):
    """A :class:`PassThrough` saved after the step's offload quota was spent (NOTE [ The pack
    decision ] in _decision/policy.py): ``ranges`` is the pass's
    :class:`~ssdtrain._decision.policy.PassedRanges` and ``nbytes`` the bytes this save added to
    it (0 for a later save of the same bytes), which leave the prefetch window at its
    first unpack (``Store.unpack``)."""

    __slots__ = ("ranges", "nbytes")

    def __init__(self, t, ranges, nbytes):
        PassThrough.__init__(self, t)
        self.ranges = ranges
        self.nbytes = nbytes


def inplace_error(t, now, expected):
    from .._errors import InplaceModificationError
    return InplaceModificationError(
        f"ssdtrain: one of the variables needed for gradient computation has been modified by "
        f"an inplace operation: [{t.type()} {list(t.size())}] is at version {now}; expected "
        f"version {expected} instead. Autograd does not check this while saved-tensor hooks are "
        f"installed, so ssdtrain does. Hint: avoid the in-place operation, or clone the tensor "
        f"before modifying it.")


def swapped(t):
    """The saved tensor ``t`` (alive) was given other data (``t.data = ...``, ``set_``)
    after it was saved. Autograd saves a leaf (a parameter, an input) as the tensor
    itself, so backward sees the new data (DeepSpeed ZeRO-3 relies on this: it frees and
    regathers parameters between forward and backward): return it. For any other tensor
    autograd's choice depends on whether the saving op produced it, which a hook cannot
    know: raise."""
    if t.is_leaf:
        return t.detach()
    raise swapped_error(t, "its tensor was given other data (`.data = ...` or `set_`)")


def swapped_error(t, what):
    from .._errors import InplaceModificationError
    return InplaceModificationError(
        f"ssdtrain: a tensor saved for backward ([{t.dtype} {list(t.size())}]) was changed "
        f"after it was saved: {what}. The version counter does not see this, so neither "
        f"autograd nor ssdtrain can give backward the values it expects. Hint: do not resize, "
        f"`set_` or reassign `.data` of tensors an autograd graph still needs; clone first.")


# States a record counted in the budget may be in: due to be copied (PENDING), being
# copied, in RAM, or loaded from RAM.
IN_TIER = frozenset({State.PENDING, State.HOSTING, State.HOSTED, State.LOADED})
