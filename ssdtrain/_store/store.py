"""The store: pack and unpack hooks, the lock and its inbox, the passes, flush, close.

Its parts, each an object given what it uses (none holds the store: NOTE [ The store's
paths ], below): the records and their state table in ``_decision/records.py`` (NOTE
[ Record state machine ]); the registry of a store's records and every count over their
states in ``_store/table.py`` (``RecordTable``: NOTE [ Record table ]), whose ``move`` is
the one way a record's state changes and whose ``free`` ends a record; the write path
(the pack decision's verdicts, writes, the spill budget, the write-behind throttle) in
``_store/writeback.py``, the read path (prefetch and reads) in ``_store/prefetch.py``,
the host tier in ``_store/hosttier.py``; the repair after an interrupt, the releases of
dead handles and the invariants in ``_store/repair.py`` (``Repair``); the engine and
the waits that poll it in ``_store/engine.py`` (``EngineSlot``); the I/O thread and
its round in ``_store/iothread.py`` (``IOThread``); failure events and once-only
warnings in ``_store/events.py`` (``Events``: NOTE [ One event, one error ]); the
devices' transfers and staging in ``_device/transfers.py`` (``DeviceMap``); what
``policy="auto"`` measures through the store in ``_store/probe.py`` (``Probe``); read
buffers in ``io/readbuf.py``; spill files in ``io/spill.py``.

NOTE [ The store's paths ]); the devices' transfers and staging in ``_device/transfers.py``
(``DeviceMap``); what ``policy="auto"`` measures through the store (the bandwidth probe,
the copies' probe, the devices' headroom) in ``_store/probe.py`` (``Probe``, ``Store.probe``);
read buffers in ``io/readbuf.py``; spill files in ``io/spill.py``.

NOTE [ The store's paths ]

The pack decision's verdicts, and what happens to a record after them, are carried
out by three objects the store composes, each given what it uses in its constructor
(none holds the store, and they hold one another without a cycle, so a store nobody
references is collected at once with its records, and its I/O thread ends):
``WritePath`` (``Store._writes``, _store/writeback.py: the verdicts on the records leaving
the tail window, ``decide_locked``; the due writes, their completion, the spill
budget's verdicts and its wait at a pass's start, keeping and failing a record; the
write-behind limit and the throttle), ``ReadPath`` (``Store._reads``, _store/prefetch.py: the
pass queues, prefetch, reads, dropping read copies, unpack of a record not in memory)
and ``HostTier`` (``Store._tier``, _store/hosttier.py: admission, copies to RAM and back,
evictions to the SSD). The write path and the tier call each other (an eviction is a
write; a copy to RAM is started and completed where writes are): the store sets
``WritePath.tier`` once both exist, to a weak proxy of the tier (a strong one would
make a cycle holding the record table, and the records' memory would wait for the
garbage collector). The store keeps what takes or spans the
lock: the hooks, the inbox and its drain, the passes' boundaries, flush, close, fork
and repair; every path method ending in ``_locked`` runs under it. A path that waits
outside the lock and takes it between waits (the throttle, ``WritePath.throttle``;
``WritePath.await_retiring``) is handed the store's ``_locked`` (and ``_settle``) for
that call and keeps nothing of it; the probe (``Store.probe``, _store/probe.py), which takes
the lock for callers outside the store, holds ``_locked`` and ``_settle`` through weak
references (``_weakly``). The devices' transfers and staging are a ``DeviceMap``
(``Store._devices``, _device/transfers.py) the store, its I/O thread and the probe share.
Completions reach the store through ``callback`` (``_completions``: a weak reference
to the store); the engine through ``engine``, which ``Store.engine``'s setter keeps
equal to the store's (``replace_engine``). The hints the hooks read without the lock
(``WritePath.overdue``, ``over_write_behind``, ``ReadPath.due``) and what unpack calls
for every record it serves (``ReadPath.use_locked``: the view, the window's slide) are
bound once as store attributes of the same names as before (``_write_overdue``,
``_over_write_behind``, ``_read_due``, ``_use_locked``): the per-tensor path looks up
no more attributes than the mixins did. Unpack checks the record (closed, failed,
changed in place) and serves one in memory itself; one that is not is the read path's
(``ReadPath.fetch_locked``: a read, a wait for one, a copy from RAM; ``ReadPath.wait``).
A second round after the wait (``Store._loaded_locked``) stays in the store: it
completes an eviction's write (the write path's) and raises the record's event.

NOTE [ Store lock discipline ]

* One non-reentrant lock, ``Store._lock``, guards every record and aggregate. It is
  taken with ``with self._lock:`` (acquire and release are C calls no asynchronous
  exception can separate from the block), never held across a wait (the throttle,
  unpack and flush wait on futures outside it), and methods that need it end in
  ``_locked``.
* Nothing that can run inside a locked region re-enters the store. A handle's death
  is queued by its weak reference's callback, which is ``deque.append`` of
  ``Store._inbox`` itself (``Token``): C code, no Python frame, so neither a garbage
  collection nor an interrupt can cut it short; there is no ``Handle.__del__``. Read
  buffers' finalizers only append to the pool's own deque. I/O completion callbacks
  append too, and on an engine thread (never the main thread, where a
  KeyboardInterrupt could land between a non-blocking acquire and its ``try``) drain
  the inbox if the lock is free (``_settle_nowait``). A cyclic GC fired by any
  allocation under the lock therefore only queues work; nothing ever blocks on, or
  takes, the store lock from a finalizer.
* The inbox is drained at safe points: at the start of every locked region, after
  each one (``_settle``; after the hooks' by the I/O thread), by engine threads and
  the I/O thread, and at the end of every backward that unpacked a record (a callback
  queued on autograd's engine), so a graph's records are released before the
  optimizer step. Event handlers are idempotent and clear their trigger last
  (``rec.future = None``; a handle's token leaves a set), so a handler cut short by
  an exception can run again. ``_sweep_locked`` (each step's start,
  ``live_records()``...) also releases tokens whose handle is gone, whatever
  happened to their event.
* Memory is not released under the lock: a host tensor whose last reference the
  store drops, or a read buffer's mapping, goes to ``_graveyard`` and is let go of
  outside the lock, by the I/O thread or at the end of backward (freeing a 64 MiB
  tensor or unmapping a buffer costs milliseconds of the kernel's time), or, under a
  memory budget, at layer boundaries where the I/O thread lags (``release_dropped``:
  NOTE [ Measured memory ] in _policies/adaptive.py). A device
  record's memory is freed in place (the caching allocator's free costs nothing).
* CRC32C runs on engine threads (``then`` callbacks), never under the lock (unless an
  engine completes a request inline, which none of ssdtrain's do).
* If any exception (``KeyboardInterrupt`` included) escapes a locked region, the region
  ends with ``Repair.repair_locked``: every aggregate is recomputed from the records (the
  spill allocator from its slots alive), records no handle references are freed,
  completion callbacks are attached again, and a record whose request's future never
  reached it falls back to a state that does not depend on that request (NOTE [ Memory
  owned by requests ]). After it the next steps are exact.

NOTE [ The store's I/O thread ]

pack and unpack run on the thread that, on a GPU machine, launches every kernel. With a
polled engine they also start and complete host records' requests themselves (NOTE
[ The data path on the hooks' thread ], below), and the thread keeps the rest. Otherwise
they decide and record (the keep/offload decision, identity and dedup, the record and its
handle: NOTE [ The pack decision ] in _decision/policy.py) and leave requests to the store's I/O
thread ("ssdtrain-store", one per store): pack puts a record in the tail window and,
when the window holds more than ``keep_tail_bytes``, decides its oldest records then
and there (written or kept), puts those to be written in the record table's ``due``
and wakes the thread (a ``SimpleQueue.put``), which starts their writes
(``WritePath.start_due_locked``). The thread decides nothing: what is written does not depend on
when it runs. unpack serves a record that is in memory and wakes the
thread when the prefetch window has room, which starts the next reads (``ReadPath.pump_locked``).
The thread also drains what arrives after a hook's locked section (and what an
engine thread could not drain, the lock being busy) and releases the graveyard; the
end of each backward releases it itself, so that memory is back before the optimizer
step. Every store operation wakes the thread when its locked section left memory in
the graveyard. It takes the lock once per request and yields the GIL between
requests, so a hook waits for one request's submission at most.

Whatever the thread has not done yet is done by whoever needs it done, on its own
thread: the end of forward (once per pass, not per tensor) starts the due writes (what
stays in the window is the kept tail, ``keep_tail_bytes`` at most) and the first
window's reads (backward's first unpacks come at once, in whatever order its graph
takes); the throttle starts overdue writes before it waits (they count against
``write_behind_bytes``, so memory stays bounded however far the thread lags);
``flush()`` starts every due write and read before it waits (``close()`` starts
nothing: it would only throw the results away); unpack starts reads
itself when the thread lags so far that backward would soon miss (less than a quarter
of ``prefetch_bytes`` held or loading ahead of use, or the next record the window
would take among the next two backward uses: ``ReadPath.pump_low_locked``), and reads a record
that is only on disk at once (a miss).

A request the thread cannot start for want of memory (a read buffer's mapping, pinned
staging) is not an error: a prefetch read is left to backward (a miss), a device
record that cannot be staged stays in device memory (KEPT); each is logged once.
``wrap_engine()`` pauses the thread while it swaps the engine.

The thread itself is an :class:`~ssdtrain._store.iothread.IOThread` (``Store._io``): it owns
the queue that wakes it (``kick``), the graveyard and its release (``bury``), its end
(``stop``), what happens at a fork and the release of the engine and the files when
the store is closed or collected, and what a round does (``IOThread.round``: the lock,
one request per hold).

The thread holds the store only while it works (a weak reference otherwise), ends at
``close()`` (joined) or when the store is collected, does not exist in a forked child,
and reports an exception escaping its round (a bug: the round's locked region has
repaired the store) at the next pack or end of forward, as a failure event (NOTE [ One
event, one error ] in _store/events.py).

NOTE [ The data path on the hooks' thread ]

With a polled engine (the Offloader's native engine: NOTE [ Polled completions ] in
io/base.py) a record's requests are started and completed on the thread that runs the
hooks, and no other thread of ssdtrain's runs Python for it. On a GPU host that thread
launches every kernel; a foreign thread that takes the GIL per record cost it 100-200 us
a record (docs/results/launch_loop_cpu_2026-11-27.md), where the same work on its own
thread costs it some tens of microseconds and no wait.

* pack decides, as before (NOTE [ The pack decision ] in _decision/policy.py), and then starts
  the writes it made due, oldest first, while the write-behind limit has room
  (``WritePath.start_due_locked(inline=True)``): a slot, the engine call, the
  future's callback (none while ``wrap_engine()`` swaps the engine: its pause holds
  the hooks as it holds the I/O thread). The engine's workers write, and take the CRC,
  in C++, and end each request into its finished list without the GIL.
* Every locked region polls the engine first (``_drain_locked``): the hooks settle the
  requests that ended since the last one, and a write that landed drops its record's
  memory, which the hook then releases itself, outside the lock
  (``IOThread.bury_records``; a read buffer's mapping is still the I/O thread's to
  unmap: NOTE [ Unmapping off the training thread ] in io/readbuf.py).
* unpack, once it has used a record, starts the reads the prefetch window has room for
  (``ReadPath.pump_locked(inline=True)``), as the I/O thread did.
* Whoever waits for a request polls while it waits (``EngineSlot.wait`` in _store/engine.py).

Left to the I/O thread: device records (staging, copies to the host tier, evictions:
each may need a pinned allocation, milliseconds, which must not run under the lock or
on the launching thread), the unmapping of read buffers, and writes that wait for room
under the write-behind limit while no hook runs (forward's end to backward, say): with
writes due and none startable, its round waits for an engine completion without the
GIL (``wait_any``), polls and starts the next. With an engine whose workers settle
their futures (posix, kvikio, a bare ``NativeEngine``) the I/O thread starts every
request, as NOTE [ The store's I/O thread ] says. What is written, and when a pass
waits, is decided as before: only which thread carries it out changed.

NOTE [ Memory owned by requests ]

One rule: an engine request holds whatever it reads from or writes into (the saved
tensor, a read buffer, pinned staging) and the disk slot it uses, from before it is
queued until it has ended. Every request is made with ``owner=`` those objects, and
the engine keeps them from before its queue takes the request until the request has
ended, whether or not the caller ever receives the future (NOTE [ Requests own their
memory ] in io/base.py: the native engine's completion, the posix and kvikio work
items, the device waiter's queue (``DeviceTransfers.after``), a CRC chained behind
the request (``then``), every wrapper that holds a request). A slot is a lease too
(NOTE [ Slots are leases ] in io/spill.py): its blocks go back to the allocator when
its last holder drops it, so a request keeps its slot's blocks from being handed to
another record as it keeps its memory from being freed.

So nothing can be freed, or reused, under an I/O: the store may drop its references
at any time (a timeout, ``close()``, a repair, an interrupt between the engine's
queue and the future reaching the record) and the memory and the slot then live as
long as the request, never less, never forever. A record whose request's future
never reached it (``Record.future`` is None in WRITING, HOSTING, SPILLING or LOADING:
an interrupt cut the submission short, before the engine call or after it) falls back
to a state that does not depend on the request, and forgets it
(``Repair.fall_back_locked`` in _store/repair.py): a write or a copy to RAM to KEPT (its bytes are still
in memory; FAILED if its storage was replaced meanwhile), an eviction's write to
HOSTED (evicted again), a read to ON_DISK; the record drops the request's slot (a
write's) and buffer (a read's). Whether the request was ever submitted no longer
matters, and nothing is kept for the rest of the process. The bandwidth probe's
requests, outside records, follow the same rule (``Probe.time_io`` in _store/probe.py).

NOTE [ Bounded memory ]

What ssdtrain holds in memory beyond the saved tensors a live graph references is
bounded, whatever the disk or the link does (INV-BOUNDED in docs/ARCHITECTURE.md):

* A record no graph references is freed at its last handle's death unless a request of
  it is in flight; a write that was due and had not started is then never started (its
  bytes count in ``Stats.unwritten_bytes``). Outbound requests (writes, copies to the
  host tier, its evictions to the SSD) start only while fewer bytes than
  ``write_behind_bytes`` (the lower limit of a plan in force) are in flight, or none
  (``WritePath.room``): what is held for requests no graph needs is at most that limit
  plus one record. The I/O thread, the end of forward, the throttle and ``flush()``
  all start writes through ``WritePath.start_due_locked``, which keeps to it; a write
  that ends makes room, and the engine thread that completes it wakes the I/O thread
  for the next (``_settle_nowait``). Under ``"static"`` (and a plan, and ``"auto"``
  under a memory floor) forward also waits when more than the limit is written or due
  (the throttle); under ``"auto"`` otherwise forward never waits for a write: the writes
  past the limit stay due, in memory with their graph, as a kept record would. Records
  evicted from the host tier are the exception: each holds its pinned copy until its
  write ends, so more than ``write_behind_bytes`` of them waiting for the SSD
  (``RecordTable.spill_due_bytes``) makes forward wait under every policy
  (``WritePath.over_write_behind``; said once).
* A step of ``"auto"`` whose writes lag (more than a quarter of the bytes it decided to
  write not landed when the next step begins, or freed unwritten) counts as slowed: the
  quota halves (NOTE [ The offload quota ] in _policies/auto.py, step 4), and the first time the
  policy says so (a warning).
* Read-ahead: at most the window (plus one record) held or loading ahead of use
  (NOTE [ Prefetch window ] in _store/prefetch.py): ``prefetch_bytes``, or under ``"auto"``
  up to the bytes the step held at forward's end (NOTE [ Loads in time ] in _policies/auto.py); the host tier: at most
  ``host_budget_bytes`` (INV-HOST-BUDGET); idle pinned staging and read buffers: their
  pools' idle limits (NOTE [ Device records ] in _device/transfers.py, NOTE [ Read buffer pool ]
  in io/readbuf.py).
"""

import collections
import threading
import time
import weakref
from _thread import get_ident

import torch

from .. import _fork
from .._device import trace as _trace
from .._config import ResolvedConfig
from .._errors import OffloaderClosedError, SSDTrainError
from .._device.transfers import DeviceMap, leaf_of
from .._identity import StorageWeakRef, byte_extent, record_range, storage_key
from .._decision.budget import HostBudget
from .._decision.policy import (NO_LIMITS, PASS_CAPTURE, TRACKER, PassedRanges, TailWindow,
                                pass_reason)
from .table import PassedRef, RecordTable
from .prefetch import ReadPath, _Pass
from ..io.readbuf import ReadBuffers
from .hosttier import HostTier
from .iothread import IOThread
from .engine import EngineSlot
from .probe import Probe
from .repair import Repair
from .._decision.records import (OUTBOUND, SERVABLE, Handle, PassThrough, QuotaPassThrough,
                                 Record, State, Token, find_record, inplace_error, swapped,
                                 swapped_error)
from .events import Events, timeout_error
from .writeback import _WRITTEN, WritePath

__all__ = ["Store", "Record", "State", "Handle", "PassThrough"]

_IS_STATE = TRACKER.contains  # a parameter's or a buffer's storage (pass_reason)
_ENGINE = torch.autograd.Variable._execution_engine
_PROFILER = _trace.PROFILER  # the hooks' one check: NOTE [ Profiler ranges ] in _device/trace.py


class Store:
    """The records of one offloader, and every transition between their states."""

    def __init__(self, config, spill, engine, stats, write_behind=None):
        if not isinstance(config, ResolvedConfig):  # NOTE [ One resolved config ]
            raise AssertionError("ssdtrain: the store runs on a ResolvedConfig "
                                 "(OffloadConfig.resolve()); please report this bug.")
        self.cfg = config
        self.spill = spill
        self.stats = stats
        self._lock = threading.Lock()
        self._inbox = collections.deque()      # (kind, record, arg): NOTE [ Store lock discipline ]
        self._holder = None                    # the thread that took the lock last
        # NOTE [ The pack decision ] in _decision/policy.py: the PENDING records are in the tail
        # window (not decided yet) or due (decided to be written, write not started).
        self._min_bytes = max(1, config.min_tensor_bytes)
        self._window = TailWindow(config.keep_tail_bytes, config.max_spill_bytes)
        # NOTE [ Host tier ] in _store/hosttier.py: the budget (None: no host tier).
        self._host = None if config.host_budget_bytes is None else \
            HostBudget(config.host_budget_bytes, bool(spill.files), stats)
        self._current = None                   # the pass being recorded (forward running)
        self._seq = 0
        self._events = Events(stats)           # NOTE [ One event, one error ] in _store/events.py
        self._ended = None                     # the pass whose forward ended last
        # NOTE [ Device records ] in _device/transfers.py: each device's transfers, and their staging
        # (idle staging kept for reuse: what may be in flight at once, and the host tier's).
        self._devices = DeviceMap(stats, config.write_behind_bytes + config.prefetch_bytes +
                                  (config.host_budget_bytes or 0), engine)
        self._transfers = self._devices.get    # bound once: pack calls it per device record
        self._passed_device = self._devices.passed
        # The I/O thread (_store/iothread.py) and the memory it releases outside the lock (NOTE
        # [ The store's I/O thread ]); kick and bury are bound once: the hooks call them.
        self._io = IOThread(self, engine, spill, self._devices)
        self._graveyard = self._io.graveyard
        self._kick = self._io.kick
        self._bury = self._io.bury
        # NOTE [ Record table ] in _store/table.py: the records and every count over them.
        self._table = RecordTable(self._window, self._host, stats, self._graveyard)
        self._buffers = ReadBuffers(config.prefetch_bytes, unmap=self._graveyard.append)
        # A completion's callback queues it in the inbox; it holds the store weakly, as do
        # the paths that attach it (the store must stay collectable by reference counting).
        self._callback = _completions(weakref.ref(self))
        # The paths (NOTE [ The store's paths ]): objects given what they use; none holds
        # the store. The write path and the host tier call each other (an eviction is a
        # write; a copy to RAM is started and completed where writes are); the write
        # path holds the tier weakly, so no cycle keeps the records alive past the store.
        self._writes = WritePath(self._table, self._window, spill, engine, config, stats,
                                 self._events, self._callback)
        self._tier = HostTier(self._table, self._host, self._writes, config, stats,
                              self._events, self._callback)
        self._writes.tier = weakref.proxy(self._tier)
        self._reads = ReadPath(self._table, self._buffers, engine, config, stats, self._events,
                               self._callback, self._tier.load_locked)
        # What ends every locked region an exception cuts short, and the releases of dead
        # handles (_store/repair.py).
        self._repair = Repair(self._table, spill, self._writes, self._reads, self._events,
                              self._callback)
        self._released = self._repair.released_locked
        # What the hooks call on every pack and unpack: bound once (the per-tensor path
        # looks up no more than it did when the paths were mixins).
        self._over_write_behind = self._writes.over_write_behind
        self._read_due = self._reads.due
        self._use_locked = self._reads.use_locked
        # The measurements policy "auto" and the adaptive profile make (_store/probe.py).
        self.probe = Probe(spill, self._devices, self._host is not None, engine, config,
                           _weakly(self._locked))
        # The engine every path submits to, and the waits that poll it (_store/engine.py):
        # every wait for a request outside the lock polls a polled engine while it waits.
        self._slot = EngineSlot(engine, (self._reads, self._writes, self._devices, self.probe),
                                _weakly(self._locked))
        # (the paths hold the slot weakly: it holds them, NOTE [ The store's paths ])
        self._writes.wait_for = self._reads.wait_for = self.probe.wait_for = \
            _weakly(self._slot.wait)
        self._poll_with()
        self.loopback = None                   # _loopback.LoopbackDevice (tests): its tensors
                                               # take the device path
        self._forked = False
        self._task = -1                        # the graph task whose end drains (unpack)
        # Told when a backward that unpacked anything of this store ends (policy "auto"'s
        # step clock: NOTE [ The offload quota ], "A step's time"); None: nobody, and
        # unpacks of tensors passed through queue nothing.
        self.on_backward_end = None
        self.layers = None                     # _adaptive.LayerPolicy (Offloader.track)
        self.limits = NO_LIMITS                # the running pass's (begin_pass)
        # NOTE [ Hooks off past the window ] in _policies/auto.py: once the running pass passed
        # through this many bytes after its quota was spent, on_cut() is called (once).
        self.cut_after = None
        self.on_cut = None
        # The write-behind limit without a plan's: write_behind_bytes, or what the owner
        # gives (policy "auto": none, NOTE [ The offload quota ] in _policies/auto.py).
        self._default_write_behind = config.write_behind_bytes if write_behind is None \
            else write_behind
        self._standing_write_behind = None     # the default, or a plan's (limit_write_behind)
        self.limit_write_behind(None)          # the write path's limit in force
        self.closed = False
        self._paused = False                   # wrap_engine(): the thread starts nothing
        _fork.register(self, Store._after_fork_in_child)
        try:
            self._io.start(engine)
        except RuntimeError:  # no thread to be had: the store never ran (released)
            self.closed = True
            raise

    @property
    def engine(self):
        """The engine requests go to."""
        return self._slot.engine

    @engine.setter
    def engine(self, engine):
        """``replace_engine``, and tests that put a wrapper in place: the paths submit to
        the new engine from their next request on."""
        self._slot.put(engine)
        self._poll_with()

    def _poll_with(self):
        """NOTE [ Polled completions ] in io/base.py: ``_poller``, the engine whose
        futures settle only when polled (every locked region polls it first; a wrapper,
        ``io.base.EngineWrapper``, reports its inner engine's), or None; and what tells
        the hooks that writes are left for the I/O thread (NOTE [ The data path on the
        hooks' thread ]: with a polled engine, any write due, room or not)."""
        self._poller = self._slot.poller
        self._write_overdue = self._writes.overdue if self._poller is None else \
            self._writes.waiting

    def replace_engine(self, fn):
        """``Offloader.wrap_engine``: the engine becomes ``fn(engine)``. The I/O thread is
        paused and every request due is started and done first, so nothing is submitted
        to the engine ``fn`` may shut down or wrap while it does."""
        try:
            with self._lock:  # a plain assignment: nothing to repair (after the request
                self._paused = True  # the I/O thread may be submitting right now)
            self.flush()
            engine = fn(self.engine)
            if engine is None:
                raise SSDTrainError("ssdtrain: wrap_engine(fn): fn returned None; it must "
                                    "return the engine to use (a wrapper of the one it was "
                                    "given).")
            with self._lock:
                self.engine = engine
            return engine
        finally:
            self._paused = False
            self._kick()

    def limit_write_behind(self, nbytes=None) -> None:
        """Put ``nbytes`` in force as the standing write-behind limit (an applied plan's,
        lowered to fit its memory budget), or with ``None`` the store's default (the
        config's, or the one it was made with: none under ``policy="auto"``, whose
        forward never waits for a write but where a step says so, NOTE [ The offload
        quota ] in _policies/auto.py). A step's own limit (``StepLimits.write_behind``) replaces
        it for that step. The config itself is never changed (NOTE [ One resolved
        config ])."""
        if nbytes is None:
            nbytes = self._default_write_behind
        self._standing_write_behind = nbytes
        self._writes.write_behind = nbytes

    @property
    def write_behind(self):
        """The write-behind limit in force (:meth:`limit_write_behind`), in bytes."""
        return self._writes.write_behind

    @property
    def window(self) -> int:
        """The prefetch window in force (NOTE [ Prefetch window ] in _store/prefetch.py)."""
        return self._reads.window

    # ------------------------------------------------------------------ forward
    def begin_pass(self, limits=NO_LIMITS):
        """A forward pass opens, with its step's ``limits`` (a :class:`~ssdtrain._decision.policy.
        StepLimits`: the quota and its floor, the write-behind limit, the prefetch
        window), in force from its first pack to the next pass."""
        if self._window.limit is not None:  # the spill budget: WritePath.await_retiring
            self._writes.await_retiring(self._locked, self._settle)
        with self._lock:
            self._guarded_locked(self._begin_pass_locked, limits)
        self._settle()
        self._devices.trim()  # NOTE [ Bounded staging ] in _device/staging.py

    def _begin_pass_locked(self, limits):
        self._check_open()
        self._repair.sweep_locked()
        # Idle read buffers beyond what the last forward's end mapped would only add to
        # forward's peak (NOTE [ Read buffers across steps ] in io/readbuf.py); unmapped by
        # the I/O thread (NOTE [ Unmapping off the training thread ]).
        self._buffers.trim_unused()
        self._current = _Pass()
        # The step's limits, all at once (NOTE [ Store lock discipline ]: a repair after
        # an interrupt here leaves the last pass's, which the next begin_pass replaces).
        self.limits = limits
        self._window.begin_step(limits.quota, limits.floor)
        self._writes.write_behind = self._standing_write_behind if limits.write_behind \
            is None else limits.write_behind
        self._reads.window = self.cfg.prefetch_bytes if limits.window is None \
            else limits.window

    def _end_pass_locked(self):
        """Forward ended: writes the I/O thread has not started yet start now, the tail
        stays in memory, and the read path queues the pass's records for prefetch, in
        reverse pack order (NOTE [ Prefetch window ] in _store/prefetch.py)."""
        p, self._current = self._current, None
        self._ended = p  # an error raised at the end of forward is this pass's
        if p is None or self.closed:
            return
        writes = self._writes
        writes.start_due_locked()  # what pack decided and the I/O thread has not started
        for rec in self._window.close():  # the kept tail: keep_tail_bytes at most
            writes.keep_locked(rec)
            # The kept tail is what backward uses first: it fills the window, so
            # kept + prefetched bytes stay within prefetch_bytes (not their sum).
            self._table.count_ahead(rec)
        if p.passed is not None:  # passed through after the quota was spent: the same
            ranges, p.passed = p.passed, None  # (only its tensors keep it alive now)
            self._table.count_passed(ranges, self._inbox.append)
        # What the first window maps is kept for the next forward's end (NOTE [ Read
        # buffers across steps ] in io/readbuf.py).
        self._buffers.watching = True
        try:
            self._reads.queue_pass_locked(p)
        finally:
            self._buffers.watching = False

    def end_pass(self):
        """Forward ended: the tail stays in memory; prefetch starts in reverse pack order."""
        with _trace.span(_trace.END_FORWARD):
            with self._lock:
                self._guarded_locked(self._end_pass_locked)
            self._settle()

    def _locked(self, fn, *args):
        """``fn(*args)`` in a locked region of its own (:meth:`_guarded_locked`): for a
        path that waits outside the lock and takes it between waits (the throttle)."""
        with self._lock:
            return self._guarded_locked(fn, *args)

    def _guarded_locked(self, fn, *args):
        """``fn(*args)`` after draining the inbox; any exception out of it (an interrupt
        included) repairs the store first (NOTE [ Store lock discipline ]). Every locked
        region is ``with self._lock:`` around one call of this: nothing can be raised
        between taking the lock and entering the ``try`` but at this function's entry,
        where nothing has changed yet."""
        self._holder = get_ident()  # whose callbacks need not drain (_completions)
        try:
            self._drain_locked()
            return fn(*args)
        except BaseException:
            self._repair.repair_locked()
            raise

    def pack(self, t):
        """The saved-tensor pack hook (NOTE [ The pack decision ] in _decision/policy.py)."""
        stats = self.stats
        nbytes = t.numel() * t.element_size()
        # One attribute read while no profiler runs (NOTE [ Profiler ranges ] in _device/trace.py).
        span = _trace.begin(_trace.PACK, {"bytes": nbytes}) \
            if _PROFILER._is_profiler_enabled else None
        try:
            stats.packed_bytes += nbytes
            reason, storage, key = pass_reason(t, nbytes, self._min_bytes, _IS_STATE)
            leaf = None if reason is not None else leaf_of(t, self.loopback)
            if leaf is not None and leaf.capturing(leaf.device(t)):
                # A CUDA graph capture: no event, no staging (NOTE [ Device records ], rule 8).
                reason = PASS_CAPTURE
            if reason is not None:
                stats.kept_bytes += nbytes
                return PassThrough(t)
            version = t._version
            extent = byte_extent(t)
            events = self._events  # an event pending for this pass: pack raises it
            if self._window.spent and self.layers is None and key not in self._table.registry \
                    and events.failure is None and self._current not in events.pending:
                cur = self._current  # the quota is spent: kept without a record
                if cur is not None:  # (NOTE [ The pack decision ] in _decision/policy.py)
                    if leaf is not None and not self._passed_device:  # for the probe
                        self._passed_device.append((leaf, leaf.device(t)))
                    handle = self._pass_spent(t, cur, key, version, extent, storage, nbytes)
                    cut = self.cut_after
                    if cut is not None and cur.passed.nbytes >= cut:
                        self.cut_after = None  # once (NOTE [ Hooks off past the window ])
                        self.on_cut()
                    return handle
            layers = self.layers
            choice = None if layers is None else layers.choice()  # NOTE [ Applying a plan ]
            with self._lock:
                handle = self._guarded_locked(self._pack_locked, t, storage, key, version,
                                             extent, nbytes, choice, leaf)
            self._after_hook(self._write_overdue())
            if self._over_write_behind():
                self._throttle()
            return handle
        finally:
            if span is not None:
                _trace.end(span)

    def _pass_spent(self, t, cur, key, version, extent, storage, nbytes):
        """Pack once the step's quota is spent, for a storage with no live record: the
        tensor stays in memory without a record, counted as the record it would have been
        (NOTE [ The pack decision ] in _decision/policy.py). Without the lock: only the thread
        running the pass's forward writes its ranges until forward ends."""
        ranges = cur.passed
        if ranges is None:
            ranges = cur.passed = PassedRanges()
        stats = self.stats
        added = ranges.add(key, version, extent, storage.data_ptr(), storage.nbytes())
        if added:
            stats.unique_bytes += added
            stats.quota_kept_bytes += added
            stats.kept_bytes += added
        else:
            stats.deduplicated_bytes += nbytes
        return QuotaPassThrough(t, ranges, added)

    def _pack_locked(self, t, storage, key, version, extent, nbytes, choice, leaf=None):
        self._check_open()
        events = self._events  # NOTE [ One event, one error ] in _store/events.py
        if events.failure is not None or self._current in events.pending:
            self._raise_event_locked()
        self._seq += 1
        table = self._table
        group = table.registry.get(key)
        rec = None if group is None else \
            find_record(group, version, extent, storage.data_ptr(), storage.nbytes())
        if rec is None:
            lo, hi = record_range(extent, storage.nbytes())
            rec = Record(key, StorageWeakRef(storage), lo, hi, version, t.detach(), self._seq,
                         storage)
            if leaf is not None:  # NOTE [ Device records ] in _device/transfers.py
                rec.device = self._transfers(leaf, leaf.device(t))
                rec.produced = rec.device.produced()
            table.add(rec)
            self.stats.unique_bytes += rec.nbytes
            if self.layers is not None:
                self.layers.attribute(rec.nbytes)
            if choice == "keep":  # "offload" and no plan: the tail window (NOTE [ Applying a plan ])
                self._writes.keep_locked(rec)
            else:
                window = self._window
                window.add(rec)
                if window.nbytes > window.keep_bytes:  # decided now (NOTE [ The pack decision ])
                    self._writes.decide_locked(
                        0 if window.limit is None else self._outside_spill_bytes())
                    if self._poller is not None and table.due and not self._paused:
                        # NOTE [ The data path on the hooks' thread ]
                        self._writes.start_due_locked(inline=True)
        else:
            self.stats.deduplicated_bytes += nbytes
            rec.seq = self._seq
            rec.used = False
            self._window.touch(rec)
        if self._current is not None:
            self._current.records.append(rec)
            rec.owner = self._current
        handle = Handle(rec, t, extent[0], version, self._inbox.append)
        rec.tokens.add(handle.token); rec.unseen.add(handle.token)  # noqa: E702 (NOTE [ Store lock discipline ])
        return handle  # due writes left: the I/O thread's (NOTE [ The store's I/O thread ])

    def _outside_spill_bytes(self):
        """Spill bytes of live slots no record holds (they count against
        ``max_spill_bytes`` too): the bandwidth probe's while its requests run, and the
        slot of a request a repair cut loose from its record, until it ends
        (``SpillSet.outside_bytes``)."""
        return self.spill.outside_bytes()

    # ----------------------------------------------------------------- throttle
    def _throttle(self):
        """pack's wait for the write-behind limit (``WritePath.throttle``: it waits
        outside the lock and takes it through :meth:`_locked`)."""
        try:
            self._writes.throttle(self._locked, self._raise_event_locked)
        finally:
            if self._graveyard:  # writes it completed dropped memory
                self._kick()

    # ----------------------------------------------------------------- backward
    def unpack(self, handle):
        """The saved-tensor unpack hook."""
        if type(handle) is PassThrough:
            if self.on_backward_end is not None:  # the step clock needs backward's end
                self._at_backward_end()
            if _PROFILER._is_profiler_enabled:  # NOTE [ Profiler ranges ] in _device/trace.py
                with _trace.begin(_trace.UNPACK, {"kept": 1}):
                    return handle.unpack()
            return handle.unpack()
        if type(handle) is QuotaPassThrough:
            if self.on_backward_end is not None:  # the step clock needs backward's end
                self._at_backward_end()
            if handle.nbytes:  # its bytes leave the prefetch window: reads may start
                with self._lock:
                    self._guarded_locked(self._use_passed_hook_locked, handle)
                self._after_hook(self._read_due())
            if _PROFILER._is_profiler_enabled:
                with _trace.begin(_trace.UNPACK, {"kept": 1}):
                    return handle.unpack()
            return handle.unpack()
        span = _trace.begin(_trace.UNPACK, {"bytes": handle.record.nbytes,
                                            "record": handle.record.seq}) \
            if _PROFILER._is_profiler_enabled else None
        try:
            self._at_backward_end()
            rec = handle.record
            t = handle.tensor_ref()
            base = None if handle.base_ref is None else handle.base_ref()
            if t is not None:
                if t._version != handle.version:
                    raise inplace_error(t, t._version, handle.version)
                s = t.untyped_storage()
                if storage_key(s) != rec.key:
                    return swapped(t)
            elif base is not None:
                s = base.untyped_storage()
            else:
                s = None
            if base is not None and base._version != handle.version:
                raise inplace_error(base, base._version, handle.version)
            if s is not None and (s.data_ptr() != rec.ptr or s.nbytes() != rec.span):
                raise swapped_error(t if t is not None else base, "its storage was resized or "
                                    "replaced (untyped_storage().resize_() or set_)")
            with self._lock:
                view, fut = self._guarded_locked(self._unpack_hook_locked, rec, handle)
            self._after_hook(self._read_due())
            # LOADING and this handle not yet unpacked in this generation: nothing can drop
            # the bytes between the read's end and their use below. SPILLING (NOTE [ Host
            # tier ]): once its write ends, it is loaded from RAM (claimed), or, should the
            # write have failed or been cut short, looked at again (a second round).
            while view is None:
                self._reads.wait(rec, fut)
                with self._lock:
                    view, fut = self._guarded_locked(self._loaded_hook_locked, rec, handle, fut)
                self._after_hook(self._read_due())
            return view
        finally:
            if span is not None:
                _trace.end(span)

    def _read_ahead_locked(self):
        """With a polled engine, the hook that slid the prefetch window starts the reads
        it has room for (NOTE [ The data path on the hooks' thread ])."""
        if self._poller is not None and self._reads.passes and not self._paused:
            self._reads.pump_locked(inline=True)

    def _unpack_hook_locked(self, rec, handle):
        """unpack's locked section: :meth:`_unpack_locked`, then the reads ahead."""
        got = self._unpack_locked(rec, handle)
        self._read_ahead_locked()
        return got

    def _loaded_hook_locked(self, rec, handle, fut):
        """:meth:`_loaded_locked`, then the reads ahead."""
        got = self._loaded_locked(rec, handle, fut)
        self._read_ahead_locked()
        return got

    def _use_passed_hook_locked(self, handle):
        """:meth:`_use_passed_locked`, then the reads ahead."""
        self._use_passed_locked(handle)
        self._read_ahead_locked()

    def _use_passed_locked(self, handle):
        """The first unpack of a tensor passed through with bytes of its own: they leave
        the prefetch window (NOTE [ The pack decision ] in _decision/policy.py). The trigger is
        cleared first: cut short, the bytes stay counted until their graph dies."""
        nbytes, handle.nbytes = handle.nbytes, 0
        ranges = handle.ranges
        if nbytes and ranges is not None:
            ranges.nbytes -= nbytes
            if ranges.ref is not None:
                self._table.use_passed(ranges.ref, nbytes)

    def _loaded_locked(self, rec, handle, fut):
        """``(view, None)`` of ``rec`` once the request ``fut`` that unpack waited for
        has ended; ``(None, future)`` when there is another one to wait for."""
        if rec.state is State.SPILLING:
            self._writes.write_done_locked(rec, fut)
        if rec.state is State.ON_DISK:  # a read cut short: read again (a miss again)
            return self._unpack_locked(rec, handle)
        if rec.state is State.HOSTED or rec.state is State.SPILLING:
            # Only an eviction's write waited for (counted then) ends here: it failed
            # (on_spill_error="keep") or was cut short (evicted again).
            return self._unpack_locked(rec, handle, True)
        self._reads.read_done_locked(rec, fut)
        if rec.state is State.FAILED:
            self._raise_event_locked(rec)
        if rec.storage is None or rec.state not in SERVABLE:
            raise SSDTrainError(f"ssdtrain: record {rec!r} has no data after its read; "
                                f"please report this bug.")
        return self._use_locked(rec, handle), None

    def _unpack_locked(self, rec, handle, counted=False):
        """``(view, None)`` if the bytes are in memory, else ``(None, the future to wait
        for)`` (``ReadPath.fetch_locked``). ``counted``: this unpack's hit or miss was
        counted already."""
        if self.closed:
            raise OffloaderClosedError(
                "ssdtrain: backward needs a tensor saved under an Offloader that has been "
                "closed" + (" (in a process forked after the save: the parent's offloader "
                            "cannot be used in the child)" if self._forked else "") +
                "; call Offloader.close() only after the last backward of the graphs built "
                "under it (or keep the Offloader open).")
        first = handle.token in rec.unseen
        if rec.state is State.FAILED:
            self._raise_event_locked(rec)
        src = rec.source
        if src is not None:
            if src._version != rec.version:
                raise inplace_error(src, src._version, rec.version)
            if rec.storage_changed():
                raise swapped_error(src, "its storage was resized or replaced "
                                         "(untyped_storage().resize_() or set_)")
        if rec.state in SERVABLE:
            if first and rec.prefetched and rec.state is not State.KEPT:
                self.stats.prefetch_hits += 1
            else:
                self.stats.forwarded += 1
            # Used now, under the lock: once it is released, a write that ends
            # drops the bytes from memory (State.ON_DISK).
            return self._use_locked(rec, handle), None
        return self._reads.fetch_locked(rec, handle, first, counted)

    # ----------------------------------------------------------------- events
    def _settle(self):
        """Drain the inbox (a safe point: called after every locked section of the store
        operations but the hooks, and at the end of each backward), polling a polled
        engine first; memory that dropped goes with the I/O thread, or, with a polled
        engine, is released here as after a hook (:meth:`_after_hook`): the next step's
        first copies to the host tier find the pinned buffers the last step's records
        held back in the pool, not waiting for the I/O thread to let go of them."""
        if self._poller is not None:
            with self._lock:
                self._guarded_locked(_nothing)
        while self._inbox:
            with self._lock:
                self._guarded_locked(_nothing)
        if self._poller is not None:
            self._after_hook(self._write_overdue())
        elif self._graveyard or self._write_overdue():  # a write that ended made room
            self._kick()

    def _settle_nowait(self):
        """Drain the inbox if the lock is free, never waiting: for engine threads only. A
        non-blocking acquire cannot be made safe against an asynchronous exception between
        it and the ``try`` (the lock would stay held), and those are raised only on the
        main thread; nothing else may use this."""
        lock = self._lock
        while self._inbox and lock.acquire(False):
            try:
                self._guarded_locked(_nothing)
            finally:
                lock.release()
        # The lock was busy (the I/O thread drains it), or a write that ended made room
        # for a due one (NOTE [ Bounded memory ]).
        if self._graveyard or self._inbox or self._write_overdue():
            self._kick()

    # ----------------------------------------------------------- the I/O thread
    def _after_hook(self, due):
        """After a hook's locked section: wake the I/O thread if a request is ``due`` or
        memory waits for it (events in the inbox wait for the next locked section or the
        end of backward). Costs a ``SimpleQueue.put`` (C code) at most. With a polled
        engine the memory is released here, on this thread: the hooks settled the
        requests that dropped it, and a wake per request would hand the GIL to the I/O
        thread per request (NOTE [ The data path on the hooks' thread ])."""
        if self._poller is not None:
            if self._graveyard and self._io.bury_records():
                due = True  # a read buffer's mapping: unmapped by the I/O thread
            if due:
                self._kick()
        elif due or self._graveyard:
            self._kick()

    def _background_round(self):
        """One round of the I/O thread on this store (``IOThread.round``)."""
        self._io.round(self)

    def settle(self):
        """Poll and drain (:meth:`_settle`): what ended is applied now (before policy
        ``"auto"`` measures a step)."""
        self._settle()

    def _settle_and_release(self):
        """The end of a backward (autograd's callback): the releases of the handles it
        freed are applied, and their memory is let go here, so that it is back before
        the optimizer step (on a GPU, in the caching allocator). Idle read buffers'
        mappings are left to the I/O thread (NOTE [ Unmapping off the training thread ]
        in io/readbuf.py): unmapping them here cost 7 ms a step with 64 MiB records."""
        self._settle()
        if self._io.bury_records(every=True):
            self._kick()

    def held_bytes(self):
        """Bytes of saved storages in memory, and of those let go of but not yet released
        (the graveyard): what the budget mode measures (NOTE [ Measured memory ] in
        _policies/adaptive.py). Read without the lock: a sample."""
        return self._table.resident + self._io.dropped_bytes()

    def release_dropped(self):
        """Apply the releases queued (handles autograd freed) and release the memory let
        go of, on this thread, where the I/O thread has not yet: the budget mode does
        it at layer boundaries (late frees). Whether there was anything to do."""
        if not (self._inbox or self._graveyard) or self.closed:
            return False
        self._settle_and_release()
        return True

    def _at_backward_end(self):
        """Queue a drain for the end of the running backward (once per graph task): the
        releases of the handles autograd frees as it goes are applied then, not at the next
        step, so kept records' memory is back before the optimizer step."""
        task = torch._C._current_graph_task_id()
        if task != self._task and task >= 0:
            self._task = task
            _ENGINE.queue_callback(self._backward_ended)

    def _backward_ended(self):
        """Autograd's callback at the end of a backward that unpacked a record of this
        store (or, with :attr:`on_backward_end` set, anything it intercepted): the step
        clock is told first (a clock read), then the drain and release."""
        told = self.on_backward_end
        if told is not None:
            told()
        self._settle_and_release()

    def _drain_locked(self):
        """Apply the queued events. Each is looked at, applied, then popped: an interrupt
        in a handler leaves the event queued and it is applied again (handlers are
        idempotent). A handler that fails otherwise (a bug) has its event dropped first,
        so one bad event cannot stop every later store operation. A polled engine is
        polled first (NOTE [ Polled completions ] in io/base.py): the requests that ended
        queue their completions here, on this thread. An interrupt in a future's
        callbacks loses the rest of them; the repair this region then runs attaches the
        store's again (``Repair.repair_locked``). Not after ``close()``: the engine's shutdown
        settles what is left, and polls must not overlap."""
        poller = self._poller
        if poller is not None and not self.closed:
            poller.poll()
        # Copies the hooks started: settled by the threads that run hooks or wait, never
        # by the I/O thread (NOTE [ Copies the hooks start ] in _device/transfers.py).
        if self._devices.transfers and get_ident() != self._io.thread.ident:
            self._devices.poll()
        inbox = self._inbox
        while inbox:
            ev = inbox[0]
            try:
                if type(ev) is Token:  # a handle died (its weak reference's callback)
                    self._released(ev.record, ev)
                elif type(ev) is PassedRef:  # a pass's passed-through tensors died
                    self._table.uncount_passed(ev)
                elif ev[0] is _WRITTEN:
                    self._writes.write_done_locked(ev[1], ev[2])
                else:
                    self._reads.read_done_locked(ev[1], ev[2])
            except Exception:
                if inbox and inbox[0] is ev:
                    inbox.popleft()
                raise
            inbox.popleft()
        self._buffers.collect()

    def headroom(self):
        """``(free, total)`` for ``policy="auto"``'s memory floor (NOTE [ The offload
        quota ] in _policies/auto.py): :meth:`Probe.headroom`, with the bytes decided to leave
        memory whose request has not ended counted as free (a slow disk's writes at
        forward's end are the write throttle's matter, not memory the floor must free).
        Both under the lock, the inbox drained: a write whose end is handled between two
        separate reads would count as neither free nor leaving (its record holds the
        memory until then, NOTE [ Device records ] rule 3), a spurious rise of the
        floor."""
        return self._locked(self._headroom_locked)

    def _headroom_locked(self):
        free, total = self.probe.headroom()
        return free + self._table.leaving_bytes(), total

    def outbound_bytes(self):
        """Bytes decided to be written (or copied to the host tier) whose request has not
        ended: in flight or due. Read without the lock: a sample (policy ``"auto"``'s lag,
        NOTE [ Bounded memory ])."""
        table = self._table
        return table.writing_bytes + table.due_bytes

    def check_invariants(self):
        """Raise ``AssertionError`` if an aggregate disagrees with the records (tests): the
        record table's (``RecordTable.problems``) and the spill allocators'
        (``SpillSet.problems``: each file's books against its slots alive, and every
        record's slot a live one of them)."""
        with self._lock:
            bad = self._guarded_locked(self._repair.problems_locked)
        self._settle()
        if bad:
            raise AssertionError("ssdtrain store invariants broken: " + "; ".join(bad))

    # -------------------------------------------------------------------- misc
    def records(self):
        """The live records (a debug view for tests and benchmarks)."""
        with self._lock:
            recs = self._table.records()
        self._settle()
        return recs

    def _check_open(self):
        if self.closed:
            raise OffloaderClosedError("ssdtrain: this Offloader has been closed" +
                                       (" (it belongs to the parent of this forked process)"
                                        if self._forked else "") +
                                       "; create a new one (ssdtrain.offload(...)) to offload "
                                       "again.")

    def raise_pending_error(self):
        """Raise the pending failure event, if any (NOTE [ One event, one error ] in
        _store/events.py)."""
        with self._lock:
            self._guarded_locked(self._raise_event_locked)

    def _raise_event_locked(self, rec=None):
        """Raise the pending event or, with ``rec``, ``rec``'s error (``Events.raise_pending``):
        the step it is raised in is ``rec``'s, the forward running, or the one that ended
        last."""
        self._events.raise_pending(rec, self._current, self._ended)

    def snapshot(self):
        """(live records, resident bytes, spill bytes in use) for stats and tests.

        Live records are those a graph still references. A record whose handles are all
        gone while its write (or read) is still in flight stays in the registry until
        the I/O completes (``Repair.released_locked``): it is not live, but its memory and
        slot are still held and counted in the other two (``flush()`` settles them)."""
        with self._lock:
            out = self._guarded_locked(self._snapshot_locked)
        self._settle()  # what the sweep released goes with the I/O thread
        return out

    def _snapshot_locked(self):
        self._repair.sweep_locked()
        buffers, stats = self._buffers, self.stats
        buffers.collect()  # read buffers whose storage died are idle now, not in use
        stats.read_buffer_bytes, stats.read_buffer_idle_bytes = \
            buffers.mapped_bytes(), buffers.idle_bytes()
        live = sum(1 for group in self._table.registry.values() for r in group if r.tokens)
        return live, self._table.resident, self.spill.used_bytes()  # the dead slots reaped

    def flush(self, timeout=None, start=True):
        """Wait until every write and read in flight has completed; one deadline
        (``io_timeout_s``) for all of them. With ``start``, the writes and prefetch reads
        that are due are started first (as the I/O thread would), so that they are done
        too; ``close()`` passes False: it would only throw them away. Then the staging
        pools are trimmed (NOTE [ Bounded staging ] in _device/staging.py)."""
        with _trace.span(_trace.FLUSH):
            self._flush(timeout, start)
            self._devices.trim(sync=True)

    def _flush(self, timeout, start):
        deadline = time.monotonic() + (self.cfg.io_timeout_s if timeout is None else timeout)
        while True:
            with self._lock:
                pending = self._guarded_locked(self._in_flight_locked, start)
            self._settle()
            if not pending:
                return
            left = deadline - time.monotonic()
            not_done = self._slot.wait([f for _, f in pending], left)
            if not_done:
                rec = next(r for r, f in pending if f in not_done)
                raise timeout_error(rec, "I/O of", f" while waiting for I/O in flight (wait() or "
                                    f"close()); {len(not_done)} request(s) still in flight. The "
                                    f"device may be hung or overloaded.", self.cfg.io_timeout_s)

    def _in_flight_locked(self, start=True):
        """``[(record, future)]`` of the requests not done; completes the done ones (their
        callbacks may still be queued). With ``start``, starts first what the I/O thread
        would: the writes and prefetch reads that are due, so that ``wait()`` returns with
        them done."""
        if start and not self.closed:
            self._writes.start_due_locked()
            self._reads.pump_locked()
        pending = []
        # Copies: completing a write whose handles are gone frees its record, which
        # leaves its group (and an emptied group the registry).
        for group in list(self._table.registry.values()):
            for r in list(group):
                f = r.future
                if f is None:
                    continue
                if not f.done():
                    pending.append((r, f))
                elif r.state in OUTBOUND:
                    self._writes.write_done_locked(r, f)
                else:
                    self._reads.read_done_locked(r, f)
        return pending

    def close(self):
        """Wait (``io_timeout_s`` at most) for I/O in flight, then release everything.
        Memory of a request still in flight stays with the request (NOTE [ Memory owned
        by requests ]); the engine is then shut down on a background thread."""
        if self.closed:
            return
        in_flight = False
        try:
            self.flush(start=False)
        finally:
            with self._lock:
                self.closed = self._table.closed = True
                for group in self._table.registry.values():
                    for rec in group:
                        if rec.future is not None and not rec.future.done():
                            in_flight = True
                        rec.storage = rec.source = rec.staging = rec.ready = rec.produced = None
                        rec.slot = rec.future = rec.host = None
                        rec.tokens.clear()
                        rec.unseen.clear()
                        if rec.state is not State.FREED:  # final, whatever it was: close()
                            self._table.move(rec, State.FREED)  # ends all (aggregates: below)
                self._table.registry.clear()
                self._reads.passes.clear()
                self._inbox.clear()
                # Every aggregate is recomputed from what is left, as a repair does, the
                # spill allocator from the slots alive: the records' slots go back, but a
                # request still in flight keeps its own (and its memory) until it ends
                # (NOTE [ Memory owned by requests ]). Zeroing the counters by hand forgot
                # the allocator, and spill_bytes_in_use() kept the slots of every record
                # a graph held at close() for good.
                self._repair.recount_locked()
                self._buffers.trim()  # idle read buffers are memory too: not kept until GC
            self._io.stop()  # later work is done inline
            self._bury()
            self._io.release(self.engine, in_flight)

    def _after_fork_in_child(self):
        """In a forked child: this store belongs to the parent. Never touch its engine,
        files or threads; every later call sees a closed store."""
        self._forked = True
        self.closed = self._table.closed = True
        self._io.forked()  # the I/O thread is the parent's: not in this process
        self._lock = threading.Lock()  # another parent thread may have held it at fork
        self._inbox = collections.deque()


def _nothing():
    pass


def _weakly(method):
    """``method`` (a bound method of the store, or of a part the paths must not hold, the
    engine slot) called through a weak reference: what a collaborator is given so that it
    keeps no store alive (NOTE [ The store's paths ])."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def _completions(ref):
    """``callback(rec, kind)``: a future's done-callback that queues the completion in the
    inbox of the store ``ref`` refers to (weakly: it does not keep the store alive). On an
    engine thread it also drains the inbox if the lock is free (``_settle_nowait``)."""
    def callback(rec, kind):
        def done(fut):
            s = ref()
            if s is not None and not s._forked:
                s._inbox.append((kind, rec, fut))
                # get_ident, not current_thread(): that would register a dummy Thread
                # object for every engine thread, forever. Settled by a poll in a locked
                # region (the hooks', on the autograd engine's device thread too): that
                # region drains it next, and a kick would hand the I/O thread the GIL.
                me = get_ident()
                if me != threading.main_thread().ident and not (
                        s._holder == me and s._lock.locked()):
                    s._settle_nowait()
        return done
    return callback

