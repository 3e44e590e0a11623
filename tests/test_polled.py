"""Polled completions (NOTE [ Polled completions ] in ssdtrain/io/base.py): the native
engine made with ``poll=True`` ends its requests in C++ without the GIL and settles
their futures only when polled.

What must hold, and is searched for here: a future is settled by a poll (never by a
worker), exactly once, with the request's outcome (result, CRC or error); ``result()``
and ``exception()`` poll while they wait, from any thread; polls from several threads
take turns and lose nothing (hypothesis over request counts and thread counts); a poll
that a callback starts on the polling thread returns at once instead of deadlocking; a
``KeyboardInterrupt`` raised inside a poll (from a future's callback, at every request
in turn) leaves every other request to the next poll; ``wait_any`` sleeps without the
GIL; the Offloader's engine is polled, and no engine worker runs Python for it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ssdtrain
from ssdtrain import SpillIOError
from ssdtrain.io import native

if not native.available():
    pytest.skip(f"native engine not built: {native.unavailable_reason()}",
                allow_module_level=True)

from ssdtrain.io.native import NativeEngine  # noqa: E402
from test_engine import Buffer, spill_files  # noqa: E402,F401  (spill_files is a fixture)

KiB = 1 << 10


def _writes(engine, f, n, nbytes=8 * KiB, crc=False):
    bufs = [Buffer(nbytes, 0) for _ in range(n)]
    for i, b in enumerate(bufs):
        b.fill(bytes([i % 251]) * nbytes)
    futs = [engine.write(f, i * nbytes * 2, b.address, nbytes, crc=crc, owner=b)
            for i, b in enumerate(bufs)]
    return futs, bufs


def _until_ended(engine, count, timeout=30.0):
    """Wait (without polling) until ``count`` requests have ended in C++."""
    deadline = time.monotonic() + timeout
    while engine.ended() < count:
        assert time.monotonic() < deadline, "requests did not end"
        engine.wait_any(engine.ended(), 0.05)


def test_futures_settle_only_when_polled(spill_files):
    """The requests end (``ended()`` counts them) and their futures stay pending until a
    poll settles them on the polling thread; each settles once, with its byte count or
    its CRC."""
    f = spill_files(False)
    eng = NativeEngine(io_threads=2, poll=True)
    assert eng.poller is eng
    where = []
    futs, _ = _writes(eng, f, 8, crc=True)
    for fut in futs:
        fut.add_done_callback(lambda _: where.append(threading.current_thread().name))
    _until_ended(eng, 8)
    assert not any(fut.done() for fut in futs)
    assert eng.poll() == 8 and eng.poll() == 0
    assert all(fut.done() and isinstance(fut.result(), int) for fut in futs)
    assert where == [threading.current_thread().name] * 8
    eng.shutdown()


def test_a_failed_request_fails_its_future_at_the_poll(spill_files):
    """A request that fails (a closed file: EBADF) fails its future with SpillIOError,
    at the poll."""
    f = spill_files(False)
    eng = NativeEngine(io_threads=1, poll=True)
    b = Buffer(4 * KiB, 0)
    f.close()
    fut = eng.write(f, 0, b.address, 4 * KiB, owner=b)
    _until_ended(eng, 1)
    assert not fut.done()
    eng.poll()
    assert isinstance(fut.exception(), SpillIOError)
    eng.shutdown()


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 40), waiters=st.integers(1, 4))
def test_waiters_on_several_threads_settle_every_future_once(tmp_path_factory, n, waiters):
    """``result()`` polls: threads waiting on different futures take turns polling, and
    every future ends exactly once with its own outcome; nothing is lost between them."""
    from ssdtrain.io.spill import SpillFile
    f = SpillFile(str(tmp_path_factory.mktemp("polled")), "off")
    eng = NativeEngine(io_threads=3, poll=True)
    try:
        futs, _ = _writes(eng, f, n, nbytes=4 * KiB)
        settled = collections.Counter()
        for fut in futs:
            fut.add_done_callback(lambda fu: settled.update([id(fu)]))
        results, errors = [None] * n, []

        def wait(k):
            try:
                for i in range(k, n, waiters):
                    results[i] = futs[i].result(timeout=30)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=wait, args=(k,)) for k in range(waiters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert results == [4 * KiB] * n
        assert sorted(settled.values()) == [1] * n
    finally:
        eng.shutdown()
        f.close()


def test_a_poll_started_by_a_callback_returns_at_once(spill_files):
    """A future's callback that polls again (on the polling thread) gets 0 back instead of
    a deadlock, and the outer poll settles every other future."""
    f = spill_files(False)
    eng = NativeEngine(io_threads=2, poll=True)
    inner = []
    futs, _ = _writes(eng, f, 6)
    futs[0].add_done_callback(lambda _: inner.append(eng.poll()))
    _until_ended(eng, 6)
    assert eng.poll() == 6
    assert inner == [0] and all(fut.done() for fut in futs)
    eng.shutdown()


@pytest.mark.parametrize("at", range(6))
def test_an_interrupt_inside_a_poll_loses_no_other_completion(spill_files, at):
    """A KeyboardInterrupt from the callback of request ``at`` escapes the poll (as a
    Ctrl-C inside it would); that future is settled already, and the next poll settles
    every other one, once."""
    f = spill_files(False)
    eng = NativeEngine(io_threads=2, poll=True)
    futs, _ = _writes(eng, f, 6)
    settled = collections.Counter()

    def interrupt(_):
        raise KeyboardInterrupt
    futs[at].add_done_callback(interrupt)
    for fut in futs:
        fut.add_done_callback(lambda fu: settled.update([id(fu)]))
    _until_ended(eng, 6)
    with pytest.raises(KeyboardInterrupt):
        eng.poll()
    eng.poll()
    assert all(fut.done() for fut in futs)
    assert all(fut.result() == 8 * KiB for fut in futs)
    # The interrupted future's later callbacks were lost with the interrupt (the store's
    # repair attaches its own again); every other one ran once.
    assert sorted(settled[id(fut)] for k, fut in enumerate(futs) if k != at) == [1] * 5
    eng.shutdown()


def test_wait_any_sleeps_without_the_gil(spill_files):
    """While a thread sleeps in ``wait_any`` another thread runs Python."""
    eng = NativeEngine(io_threads=1, poll=True)
    spun = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            spun[0] += 1
    t = threading.Thread(target=spin)
    t.start()
    try:
        eng.wait_any(eng.ended(), 0.3)
    finally:
        stop.set()
        t.join()
    assert spun[0] > 1000
    eng.shutdown()


def test_shutdown_settles_what_ended(spill_files):
    """Requests that ended and were never polled are settled by ``shutdown()``: no future
    stays pending after the engine is gone."""
    f = spill_files(False)
    eng = NativeEngine(io_threads=2, poll=True)
    futs, _ = _writes(eng, f, 5)
    eng.shutdown()
    assert all(fut.done() for fut in futs)


def test_the_offloaders_engine_is_polled_and_its_workers_run_no_python(tmp_path):
    """The Offloader makes its native engine polled; a training step's requests are
    settled on the thread that runs the hooks (or waits), never on an engine worker."""
    import torch
    from helpers import SaveForBackward
    off = ssdtrain.Offloader(spill_dir=str(tmp_path), engine="native", keep_tail_bytes=0,
                             min_tensor_bytes=4096, policy="static")
    store = off._store  # which thread runs the store's own completion callbacks is tested
    assert store._poller is store.engine and store.engine.poller is store.engine
    threads = set()
    real = store._callback

    def spying(rec, kind):
        done = real(rec, kind)

        def callback(fut):
            threads.add(threading.current_thread().name)
            done(fut)
        return callback
    store._callback = store._writes._callback = store._reads._callback = spying
    sink, xs = [], [torch.rand(4096) for _ in range(8)]
    a = torch.ones((), requires_grad=True)
    with off:
        y = a
        for x in xs:
            y = SaveForBackward.apply(y, sink, x)
        off.wait()
    y.backward()
    assert all(torch.equal(s[0], x) for s, x in zip(reversed(sink), xs))
    st_ = off.stats()
    assert st_.records_written == 8 and st_.records_read == 8
    assert threads and not any(name.startswith("ssdtrain-io") for name in threads), threads
    off.close()


class _NoEngine:
    """Stands for the engine of a future settled by hand: its polls settle nothing."""

    def settle(self, fut, timeout=None):
        pass


def _observe(fut, ops):
    """Run ``ops`` on ``fut`` and return everything a caller could observe: each op's
    outcome (a value, or the exception type), and the calls of every callback."""
    seen, calls = [], []

    def callback(i, raises):
        def fn(f):
            calls.append((i, f is fut))
            if raises:
                raise ValueError("a callback that fails")
        return fn

    def outcome(fn):
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - compared by type
            return ("raised", type(e).__name__, e.args if isinstance(e, KeyError) else ())
        if isinstance(value, BaseException):  # exception(): the one set, by type and args
            return ("ok", type(value).__name__, value.args)
        return ("ok", value)

    for i, (op, arg) in enumerate(ops):
        if op == "add":
            seen.append(outcome(lambda: fut.add_done_callback(callback(i, arg))))
        elif op == "set_result":
            seen.append(outcome(lambda: fut.set_result(arg)))
        elif op == "set_exception":
            seen.append(outcome(lambda: fut.set_exception(KeyError(arg))))
        elif op in ("result", "exception"):  # a read that does not wait
            seen.append(outcome(lambda: getattr(fut, op)(0)))
        else:
            seen.append(outcome(getattr(fut, op)))
        seen.append(list(calls))
    return seen


_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.booleans()),
    st.tuples(st.sampled_from(["set_result", "set_exception"]), st.integers(0, 3)),
    st.tuples(st.sampled_from(["done", "running", "cancelled", "cancel", "result",
                               "exception"]), st.none())), max_size=12)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS)
def test_a_polled_future_behaves_as_a_future(ops):
    """NOTE [ A future without a condition ]: whatever is done to it (callbacks added
    before and after it is settled, callbacks that raise, a second settlement, every
    read), a polled engine's future shows what ``concurrent.futures.Future`` shows."""
    engine = _NoEngine()
    polled = native._PolledFuture(engine)
    plain = concurrent.futures.Future()
    plain.set_running_or_notify_cancel()
    assert _observe(polled, ops) == _observe(plain, ops)


@settings(max_examples=20, deadline=None)
@given(adders=st.integers(1, 4), per=st.integers(1, 50))
def test_callbacks_added_while_it_settles_run_once(adders, per):
    """Callbacks added from several threads while another settles the future: each runs
    exactly once, none is lost between the check and the append."""
    engine = _NoEngine()
    fut = native._PolledFuture(engine)
    ran = collections.Counter()
    go = threading.Barrier(adders + 1)

    def add(k):
        go.wait()
        for i in range(per):
            fut.add_done_callback(lambda f, key=(k, i): ran.update([key]))

    threads = [threading.Thread(target=add, args=(k,)) for k in range(adders)]
    for t in threads:
        t.start()
    go.wait()
    fut.set_result(1)
    for t in threads:
        t.join()
    assert ran == collections.Counter({(k, i): 1 for k in range(adders) for i in range(per)})


def test_concurrent_futures_wait_says_it_cannot_wait_for_a_polled_future(spill_files):
    """``concurrent.futures.wait`` never polls, so it would hang: it is refused with a
    message that says what to call instead."""
    engine = NativeEngine(poll=True)
    try:
        futs, bufs = _writes(engine, spill_files(False), 1)
        with pytest.raises(TypeError, match="result"):
            concurrent.futures.wait(futs, timeout=1)
        assert futs[0].result(timeout=30) == 8 * KiB
        assert "finished returned int" in repr(futs[0])
    finally:
        engine.shutdown()


def test_an_interrupt_while_settling_never_drops_the_callbacks_unrun():
    """An interrupt at any line of settling a polled future (the sweeps raise them on
    the polling thread) leaves it either as it was (the poll's retry settles it and
    runs every callback) or settled, with the callbacks it had already started; never
    settled with its callbacks dropped before they ran."""
    import sys

    import inspect

    code = native._PolledFuture._finish.__code__
    lines = sorted({ln for _, _, ln in code.co_lines() if ln is not None})
    source, first = inspect.getsourcelines(native._PolledFuture._finish)
    loop = first + next(i for i, text in enumerate(source) if "for fn in callbacks" in text)
    for at in lines:
        fut = native._PolledFuture(_NoEngine())
        ran = []
        fut.add_done_callback(lambda f: ran.append(1))
        fired = []

        def tracer(frame, event, arg):
            if frame.f_code is code:
                def local(frame, event, arg):
                    if event == "line" and frame.f_lineno == at and not fired:
                        fired.append(at)
                        raise KeyboardInterrupt
                    return local
                return local
            return None

        sys.settrace(tracer)
        try:
            fut.set_result(7)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if not fut.done():          # cut short before it was settled: the retry
            fut.set_result(7)
        assert fut.result(0) == 7
        # Its callback ran, unless the interrupt came inside the loop that runs them
        # (then it is lost, as with Future; the store's repair attaches its own again).
        assert ran == [1] or at >= loop, (at, fired, ran)
