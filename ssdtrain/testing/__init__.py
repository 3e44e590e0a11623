"""What tests and tools may look at inside an :class:`~ssdtrain.Offloader`: a small,
documented inspection surface.

The store behind an offloader is private and its shape changes (docs/ARCHITECTURE.md).
A test that reached into it (``off._store.check_invariants()``) would break whenever it
does, and one that only reads what it needs through here breaks only if the meaning
changes. Nothing here waits for I/O or changes what the offloader decides; only
:func:`check_invariants` acts, as every store operation does first: it applies the
completions already queued (a request that ended, a handle that died) before it looks.

* :func:`check_invariants`: the store's invariants (records, tables, counts, the tail
  window, the host tier) hold, else ``AssertionError`` naming each that does not.
* :func:`engine`: the I/O engine in use (after any ``wrap_engine``).
* :func:`spill`: the spill files and their slot allocator (``SpillSet``).
* :func:`probe`: the measurements the policies take through the store (the disk's
  bandwidth, the copy engines', the memory's headroom).
* :func:`write_behind`, :func:`prefetch_window`, :func:`step_limits`: the limits in
  force (the running step's, NOTE [ The offload quota ] in ``_policies/auto.py``).
"""

from __future__ import annotations

__all__ = ["check_invariants", "engine", "spill", "probe", "write_behind", "prefetch_window",
           "step_limits"]


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
