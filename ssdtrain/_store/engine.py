"""A store's engine slot: the engine its requests go to, put in place in one step for
every path that submits to it, and the waits that poll it.

The store, its write and read paths, its device map and its probe all submit to the
engine in the slot; :meth:`EngineSlot.put` (``Store.engine``'s setter: ``replace_engine``,
tests' wrappers) changes it for all of them at once. ``poller`` is the engine whose
futures settle only when polled (NOTE [ Polled completions ] in io/base.py), or None;
every wait for a request outside the store lock goes through :meth:`EngineSlot.wait`,
which polls such an engine while it waits.
"""

import time

from .._device.transfers import _CopyFuture
from ..io.base import wait_futures

__all__ = ["EngineSlot", "WAIT_SLICE_S"]

WAIT_SLICE_S = 0.05  # the longest sleep between polls of a wait (a missed wake's cost)


def _nothing():
    pass


class EngineSlot:
    """The engine of one store and the objects that submit to it.

    Args:
        engine: the engine in place first.
        holders: objects with an ``engine`` attribute that :meth:`put` sets (the paths,
            the device map, the probe).
        locked: the store's ``_locked``, called through a weak reference (the slot keeps
            no store alive): a wait polls in a locked region of its own.
    """

    __slots__ = ("engine", "poller", "_holders", "_locked", "__weakref__")

    def __init__(self, engine, holders, locked):
        self._holders = tuple(holders)
        self._locked = locked
        self.put(engine)

    def put(self, engine):
        """``engine`` is where every holder's next request goes."""
        for holder in self._holders:
            holder.engine = engine
        self.engine = engine
        self.poller = getattr(engine, "poller", None)

    def wait(self, futures, timeout):
        """Wait outside the lock until every future of ``futures`` is done, ``timeout``
        seconds at most; the ones not done (a list). With a polled
        engine (NOTE [ Polled completions ] in io/base.py) nobody else settles its
        futures: this thread polls, in a locked region of its own (the inbox is drained
        too), then sleeps without the GIL until a request ends after the count read
        before that poll, so one that ended between the two is not waited for. A future
        that ends elsewhere (a device copy's waiter, a wrapper's timer) wakes it through
        a done-callback. The I/O thread does not poll while it waits for nothing."""
        poller = self.poller
        if poller is None:
            return wait_futures(futures, timeout)
        deadline = time.monotonic() + max(0.0, timeout)
        for f in futures:
            f.add_done_callback(poller.wake)
        pending, first = list(futures), 0
        while True:
            since = poller.ended()
            self._locked(_nothing)
            # All must end, so only the first not done is looked at again: a wake per
            # request that looked at every future was quadratic in a flush.
            while first < len(pending) and pending[first].done():
                first += 1
            if first == len(pending):
                return []
            left = deadline - time.monotonic()
            if left <= 0:
                return [f for f in pending[first:] if not f.done()]
            if type(pending[first]) is _CopyFuture:  # only a poll settles it: poll soon
                pending[first].wait(min(left, WAIT_SLICE_S))
            else:
                poller.wait_any(since, min(left, WAIT_SLICE_S))
