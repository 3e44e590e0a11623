"""A slow disk for the whole suite: ``SSDTRAIN_TEST_IO_DELAY_MS=<ms>`` makes every
engine request of every Offloader the tests create complete that much later than it
did (a loaded machine's disk, or an I/O thread that runs late).

Tests must not depend on how fast I/O completes relative to the training thread (the
class of bug behind a CI failure: a leak check right after a step found records
whose writes were still in flight). Run the suite with a delay to find such tests:

    SSDTRAIN_TEST_IO_DELAY_MS=30 make test

Installed by tests/conftest.py when the variable is set; nothing changes without it.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from concurrent.futures import Future

import ssdtrain
from ssdtrain.io.base import EngineWrapper

ENV = "SSDTRAIN_TEST_IO_DELAY_MS"  # SSDTRAIN_TEST_*: not config (from_env)


class _Clock:
    """One thread that completes delayed futures when they are due."""

    def __init__(self):
        self._heap, self._n = [], itertools.count()
        self._cv = threading.Condition()
        self._thread = None
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self):
        """In a forked child: the requests waiting here are the parent's (their callbacks
        would run the parent's store in the child, and may block there, holding up the
        child's own requests behind them), and the lock may have been held at the fork.
        Forget both, as the store abandons the parent's requests."""
        self._heap = []
        self._cv = threading.Condition()
        self._thread = None

    def start(self):
        """Start the thread if it is not running (at install, so that tests counting
        threads count it before and after; again in a forked child)."""
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="late-io", daemon=True)
                self._thread.start()

    def later(self, seconds, src, dst, held):
        self.start()
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._n), src, dst,
                                        held))
            self._cv.notify()

    def _run(self):
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap else
                                  max(0.0, self._heap[0][0] - time.monotonic()))
                _, _, src, dst, held = heapq.heappop(self._heap)
            held.clear()  # the request's owner, let go of before it ends (as engines do)
            exc = src.exception()
            if exc is None:
                dst.set_result(src.result())
            else:
                dst.set_exception(exc)
            # Not kept until the next request is due: a done future keeps its callbacks,
            # and theirs keep what the store gave the request (a staging lease, a
            # record), which would then outlive the request here and nowhere else.
            del src, dst, exc, held


_CLOCK = _Clock()


class LateEngine(EngineWrapper):
    """Every request's future completes ``seconds`` after the inner engine's did."""

    def __init__(self, inner, seconds):
        super().__init__(inner)
        self.seconds = seconds

    def write(self, file, offset, address, nbytes, **kw):
        return self._late(self.inner.write(file, offset, address, nbytes, **kw),
                          kw.get("owner"))

    def read(self, file, offset, address, nbytes, **kw):
        return self._late(self.inner.read(file, offset, address, nbytes, **kw),
                          kw.get("owner"))

    def _late(self, src, owner):
        """The request ends late, and its ``owner`` is held until then (NOTE [ Requests
        own their memory ] in ssdtrain/io/base.py)."""
        dst = Future()
        dst.set_running_or_notify_cancel()
        held = [owner]
        src.add_done_callback(lambda f: _CLOCK.later(self.seconds, f, dst, held))
        return dst


def install():
    """Wrap the engine of every Offloader made from now on (see the module docstring)."""
    ms = os.environ.get(ENV)
    if not ms:
        return
    seconds = float(ms) / 1000.0
    _CLOCK.start()
    real = ssdtrain.Offloader.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.wrap_engine(lambda engine: LateEngine(engine, seconds))
    ssdtrain.Offloader.__init__ = init
