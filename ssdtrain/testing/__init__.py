"""What tests and tools may look at inside an :class:`~ssdtrain.Offloader`: a small,
documented inspection surface.

The store behind an offloader is private and its shape changes (docs/ARCHITECTURE.md).
A test that reached into it (``off._store.check_invariants()``) would break whenever it
does, and one that only reads what it needs through here breaks only if the meaning
changes. What looks waits for no I/O and changes nothing the offloader decides, except
that :func:`check_invariants`, :func:`records` and :func:`headroom` apply the completions
already queued (a request that ended, a handle that died) first, as every store
operation does, and ``transfers(off, dev)`` makes the device's transfers its first record
would. What acts is named for what it does to the store; no function hands the store out.

What looks:

* :func:`check_invariants`: the store's invariants (records, tables, counts, the tail
  window, the host tier) hold, else ``AssertionError`` naming each that does not.
* :func:`engine`: the I/O engine in use (after any ``wrap_engine``).
* :func:`spill`: the spill files and their slot allocator (``SpillSet``).
* :func:`probe`: the measurements the policies take through the store (the disk's
  bandwidth, the copy engines', the memory's headroom).
* :func:`write_behind`, :func:`prefetch_window`, :func:`step_limits`: the limits in
  force (the running step's, NOTE [ The offload quota ] in ``_policies/auto.py``).
* :func:`records`: the records themselves, with what ``Offloader.records()`` hides.
* :func:`prefetch`, :func:`outbound`: the prefetch window's fill, and the bytes on their
  way out of memory (samples, read without the lock: tests poll them).
* :func:`headroom`: the free and total memory ``policy="auto"``'s floor reads.
* :func:`io_thread`, :func:`transfers`: the store's I/O thread, and its devices'
  transfers (streams, copies landing, staging).
* :func:`store_alive`: whether the store still exists, without holding it.

What acts:

* :func:`wrap_hooks`, :func:`wrap_io`: wrap the saved-tensor hooks, or the I/O thread's
  round and wake-up, to count, trace or pace them.
* :func:`hold_io`, :func:`start_due`, :func:`release_now`: hold back what the store
  starts on its own, start now what is due, release now what was let go of.
* :func:`limit_write_behind`: a standing write-behind limit, as an applied plan puts one.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

__all__ = ["check_invariants", "engine", "spill", "probe", "write_behind", "prefetch_window",
           "step_limits", "records", "Prefetch", "prefetch", "Outbound", "outbound", "headroom",
           "io_thread", "transfers", "store_alive", "wrap_hooks", "wrap_io", "hold_io",
           "start_due", "release_now", "limit_write_behind"]


def _store(off):
    store = getattr(off, "_store", None)
    if store is None:
        raise TypeError(f"ssdtrain.testing: expected an ssdtrain.Offloader, got "
                        f"{type(off).__name__}")
    return store


def check_invariants(off) -> None:
    """Apply the completions already queued, then raise ``AssertionError`` naming every
    store invariant that does not hold (docs/ARCHITECTURE.md, "Invariants"); return None
    when all hold."""
    _store(off).check_invariants()


def engine(off):
    """The engine ``off`` submits its reads and writes to (``wrap_engine``'s result, if
    one was set)."""
    return _store(off).engine


def spill(off):
    """``off``'s spill files and their slot allocator (a ``SpillSet``: ``files``,
    ``used_bytes()``, ``alloc``)."""
    return _store(off).spill


def probe(off):
    """What the policies measure through ``off``'s store (``time_io``, ``time_copies``)."""
    return _store(off).probe


def write_behind(off) -> int:
    """The write-behind limit in force, in bytes: the running step's, else the standing
    one (the config's, or an applied plan's)."""
    return _store(off).write_behind


def prefetch_window(off) -> int:
    """The prefetch window in force, in bytes (``prefetch_bytes``, or under
    ``policy="auto"`` the running step's)."""
    return _store(off).window


def step_limits(off):
    """The running step's limits (a frozen ``StepLimits``: quota, floor, write-behind,
    prefetch window; ``NO_LIMITS`` for a step without its own)."""
    return _store(off).limits


# ------------------------------------------------------------------ what looks
def records(off, *states) -> list:
    """The store's records (its ``Record`` objects, oldest first), only those in one of
    ``states`` (``State`` members) if any are given: what tests of the record states need
    that ``Offloader.records()`` does not show (``seq``, the ``State`` itself, ``slot``,
    ``crc``, ``claimed``)."""
    recs = sorted(_store(off).records(), key=lambda r: r.seq)
    return [r for r in recs if not states or r.state in states]


class Prefetch(NamedTuple):
    """The prefetch window's fill (:func:`prefetch`)."""

    ahead: int    # bytes held or being read ahead of backward's use (prefetched, kept,
                  # passed through), not used yet: what fills the window
    passed: int   # forwards whose tensors passed through without a record still count in it
    queued: int   # records in the read queue of the forward read back now (the newest)
    unread: int   # bytes of queued records a graph still holds, neither read ahead nor used
    due: bool     # the window has room and a queue to fill it from: the I/O thread has work


def prefetch(off) -> Prefetch:
    """The prefetch window's fill (NOTE [ Prefetch window ] in _store/prefetch.py), read
    without the lock (a sample, as the I/O thread's hints are): tests wait on it for the
    window to fill, or check what backward found ahead of it."""
    store = _store(off)
    table, reads = store._table, store._reads
    passes = list(reads.passes)
    queues = [list(p.queue or ()) for p in passes]
    return Prefetch(ahead=table.ahead, passed=len(table.passed),
                    queued=len(queues[-1]) if queues else 0,
                    unread=sum(r.nbytes for q in queues for r in q
                               if r.tokens and not r.prefetched and not r.used),
                    due=reads.due())


class Outbound(NamedTuple):
    """Bytes on their way out of memory (:func:`outbound`)."""

    writing: int   # a write or a copy to RAM in flight (counted against write-behind)
    due: int       # decided to be written, the write not started
    spilling: int  # evicted from the host tier, the write not started


def outbound(off) -> Outbound:
    """The bytes decided to leave memory whose request has not ended, read without the
    lock (a sample, as ``policy="auto"``'s lag is): tests of the write-behind limit and of
    who starts the writes poll it."""
    table = _store(off)._table
    return Outbound(writing=table.writing_bytes, due=table.due_bytes,
                    spilling=sum(r.nbytes for r in list(table.spill_due)))


def headroom(off):
    """``(free, total)`` memory as ``policy="auto"``'s floor reads it (the probe's, with the
    bytes leaving memory counted free): tests of what the floor sees."""
    return _store(off).headroom()


def io_thread(off):
    """The store's I/O thread (a ``threading.Thread``): tests that tell its work from the
    hooks' thread's (by ident, or native id in a trace)."""
    return _store(off)._io.thread


def transfers(off, dev=None):
    """The store's per-device transfers (``DeviceTransfers``: streams ``d2h``/``h2d``,
    copies ``landing``, staging ``pool``), a list; with ``dev`` (its own leaf: a loopback
    device) that device's, made now if no record made them yet: tests that hold a
    device's copies or check its staging."""
    devices = _store(off)._devices
    return list(devices.transfers.values()) if dev is None else devices.get(dev, dev)


def store_alive(off):
    """A callable saying whether ``off``'s store (its records, threads and files) still
    exists, holding it weakly: tests of its lifetime past the Offloader's."""
    ref = weakref.ref(_store(off))
    return lambda: ref() is not None


# ------------------------------------------------------------------- what acts
def wrap_hooks(off, pack=None, unpack=None):
    """Wrap the saved-tensor hooks ``off`` pushes from its next entry on: ``pack(hook)``
    and ``unpack(hook)`` get the store's hook and return the one to push; returns the
    ``(pack, unpack)`` in place before (to put back). Tests that count, trace or pace
    the hooks' calls."""
    store = _store(off)
    before = store.pack, store.unpack
    if pack is not None:
        store.pack = pack(before[0])
    if unpack is not None:
        store.unpack = unpack(before[1])
    return before


def wrap_io(off, round=None, wake=None):  # noqa: A002 - the I/O thread's round
    """Wrap the store's I/O thread: ``round(fn)`` gets what it runs each time it wakes
    (start what is due, release memory) and returns what to run instead, ``wake(fn)``
    likewise what wakes it; returns the ``(round, wake)`` in place before (to put back).
    Tests that hold the thread back, count its rounds or wakes, or never wake it."""
    store = _store(off)
    before = store._background_round, store._kick
    if round is not None:
        store._background_round = round(before[0])
    if wake is not None:
        store._kick = wake(before[1])
    return before


def hold_io(off, held=True) -> None:
    """Hold (``held``) or let go of what the store starts on its own: while held, neither
    the I/O thread nor the hooks start a request (as during ``wrap_engine``), what is due
    waits for the end of forward, the throttle or ``wait()``; letting go wakes the thread.
    Tests that need every write started at one point."""
    store = _store(off)
    store._paused = held
    if not held:
        store._kick()


def start_due(off) -> None:
    """Start on this thread every request that is due, as the I/O thread's next round
    would (it may start some first); nothing on a closed store. Tests whose outcome must
    not depend on when that thread runs."""
    store = _store(off)
    if not store.closed:
        store._background_round()


def release_now(off) -> None:
    """Release on this thread the memory the store let go of (saved tensors' storages,
    read buffers), not when its I/O thread gets to it: tests that need the allocator to
    reuse it at once."""
    _store(off)._bury()


def limit_write_behind(off, nbytes=None) -> None:
    """Put ``nbytes`` in force as the standing write-behind limit, as an applied plan does
    (``None``: the store's default again); the config is not changed. Tests of the limit
    without a plan."""
    _store(off).limit_write_behind(nbytes)
