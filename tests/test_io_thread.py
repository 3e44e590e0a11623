"""The store's I/O thread (NOTE [ The store's I/O thread ] in ssdtrain/_store/store.py) and
who starts the requests (NOTE [ The data path on the hooks' thread ] there).

The hooks run on the thread that launches every kernel on a GPU machine. With the
Offloader's native engine (polled: NOTE [ Polled completions ] in ssdtrain/io/base.py)
they start host records' writes and reads themselves and settle what ended, and the I/O
thread runs no Python per record; with an engine that settles its own futures (posix)
pack only decides and records, and the I/O thread starts the writes of the tail's
overflow; unpack calls it only for a miss or when the I/O thread lags a whole window.
What the thread has not done yet is done by whoever needs it: the end of forward, the
throttle, ``wait()``. The thread ends with ``close()``, with the store when it is
collected, and does not exist in a forked child; an exception that escapes its round is
raised at the next pack, never lost.

Each test waits for the thread with a deadline (``_until``) instead of sleeping, so
that a slow machine makes it slower, not wrong.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
import weakref
from concurrent.futures import Future

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from ssdtrain import SSDTrainError

WAIT_S = 20.0  # how long a test waits for the I/O thread before it fails


def _until(cond, what):
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"the store's I/O thread did not {what} within {WAIT_S} s")
        time.sleep(0.001)


@contextlib.contextmanager
def _held_back(off):
    """The store's I/O thread, woken inside the block, waits until the block is left
    (at most ``WAIT_S``) before it does its round: it is busy elsewhere meanwhile."""
    held = threading.Event()

    def blocked(real):
        def round_():
            held.wait(WAIT_S)
            real()
        return round_
    testing.wrap_io(off, round=blocked)
    try:
        yield
    finally:
        held.set()


def _deaths(tensors):
    """A list that gets one entry as each tensor's storage dies."""
    died = []
    for t in tensors:
        weakref.finalize(t.untyped_storage(), died.append, 1)
    return died


def _io_threads():
    return [t for t in threading.enumerate() if t.name == "ssdtrain-store"]


class Spy:
    """Records, per engine call, the calling thread and which hook was running on it."""

    def __init__(self, off):
        self.calls = []  # (op, thread name, hook running on that thread or None)
        self._hook = threading.local()
        engine = testing.engine(off)
        for op in ("write", "read"):
            setattr(engine, op, self._wrap_engine(op, getattr(engine, op)))
        testing.wrap_hooks(off, pack=lambda fn: self._wrap_hook("pack", fn),
                           unpack=lambda fn: self._wrap_hook("unpack", fn))

    def _wrap_engine(self, op, fn):
        def call(*args, **kwargs):
            self.calls.append((op, threading.current_thread().name,
                               getattr(self._hook, "name", None)))
            return fn(*args, **kwargs)
        return call

    def _wrap_hook(self, name, fn):
        def hook(arg):
            self._hook.name = name
            try:
                return fn(arg)
            finally:
                self._hook.name = None
        return hook

    def inside(self, hook, op):
        return [c for c in self.calls if c[0] == op and c[2] == hook]


class _Slow(torch.autograd.Function):
    """Saves ``x``; forward and backward run ``between`` (a stand-in for compute that
    takes a while) after their work."""

    @staticmethod
    def forward(ctx, a, x, between):
        ctx.save_for_backward(x)
        ctx.between = between
        between("forward")
        return a * 1

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        ctx.between("backward")
        return grad * x.view(-1)[:1].sum().clamp(max=1.0), None, None


def _chain(off, xs, between=lambda where: None, settle=False):
    """Forward of ``xs`` under ``off`` (``between("forward")`` runs in each op, before
    the op's own tensor is packed, and once more at the end); with ``settle``, every
    write has ended before forward does (backward then reads every record back)."""
    a = torch.ones((), requires_grad=True)
    with off:
        y = a
        for x in xs:
            y = _Slow.apply(y, x, between)
        between("forward")
        if settle:
            off.wait()
    return a, y


def _reference(xs):
    a = torch.ones((), requires_grad=True)
    y = a
    for x in xs:
        y = _Slow.apply(y, x, lambda where: None)
    y.backward()
    return a.grad


def _tensors(n, nbytes=256 << 10):
    g = torch.Generator().manual_seed(n)
    return [torch.rand(nbytes // 4, generator=g) for _ in range(n)]


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_who_starts_the_writes(make_offloader, engine):
    """Native (polled): every write of the tail's overflow is submitted inside the pack
    that decided it, on the training thread, and the I/O thread does not run a single
    round during forward (nothing per record is left to it). Posix (its workers settle
    the futures): every write is submitted by the I/O thread, none inside a pack (forward
    waits, untimed, after each save until the record has left the tail)."""
    off = make_offloader(engine=engine, keep_tail_bytes=0, min_tensor_bytes=4096)
    polled = getattr(testing.engine(off), "poller", None) is not None
    assert polled == (engine == "native")
    spy = Spy(off)
    rounds = []

    def counted(real):
        def round_():
            rounds.append(threading.current_thread().name)
            real()
        return round_
    testing.wrap_io(off, round=counted)
    xs = _tensors(12)

    def between(where):
        if where == "forward" and not polled:
            _until(lambda: all(r.state != "PENDING" for r in off.records()),
                   "start the write of the record just saved")

    a, y = _chain(off, xs, between)
    in_forward = list(rounds)
    y.backward()
    assert torch.equal(a.grad, _reference(xs))
    writes = [c for c in spy.calls if c[0] == "write"]
    assert len(writes) == len(xs)
    if polled:
        assert spy.inside("pack", "write") == writes, writes
        assert {name for _, name, _ in writes} == {threading.current_thread().name}
        assert in_forward == [], in_forward
    else:
        assert spy.inside("pack", "write") == []
        assert {name for _, name, _ in writes} == {"ssdtrain-store"}, writes


def test_end_of_forward_starts_what_the_thread_has_not(make_offloader):
    """With the I/O thread held back, forward still ends with every record beyond
    ``keep_tail_bytes`` being written (started by the end of forward itself), and the
    kept tail within ``keep_tail_bytes``."""
    off = make_offloader(keep_tail_bytes=512 << 10, min_tensor_bytes=4096)
    xs = _tensors(10)
    with _held_back(off):
        a, y = _chain(off, xs)
        states = [r.state for r in off.records()]
        kept = sum(r.nbytes for r in off.records() if r.state == "KEPT")
        assert "PENDING" not in states
        assert kept <= 512 << 10
        assert states.count("KEPT") == 2 and len(states) == 10
    y.backward()
    assert torch.equal(a.grad, _reference(xs))


def test_throttle_starts_overdue_writes(make_offloader):
    """The writes the I/O thread has not started count against ``write_behind_bytes``:
    with the thread held back, forward does not pile up records in memory; the
    throttle starts the writes itself and waits."""
    off = make_offloader(keep_tail_bytes=0, min_tensor_bytes=4096,
                         write_behind_bytes=1 << 20)
    peak = [0]

    def between(where):
        if where == "forward":
            out = testing.outbound(off)
            overdue = out.due + out.writing
            peak[0] = max(peak[0], overdue)
    xs = _tensors(24)  # 6 MiB in 256 KiB records
    with _held_back(off):
        a, y = _chain(off, xs, between)
    # One record over the limit at most (the pack that crosses it waits after it).
    assert peak[0] <= (1 << 20) + (256 << 10), peak[0]
    assert off.stats().write_stall_seconds > 0
    y.backward()
    assert torch.equal(a.grad, _reference(xs))


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_sliding_window_reads_start_as_backward_consumes(make_offloader, engine):
    """A window of 4 records over 16: the end of forward starts the first window's reads;
    as backward consumes, the next ones start: inside unpack, on the training thread,
    with the native engine (polled: NOTE [ The data path on the hooks' thread ]), by the
    I/O thread with posix, none inside unpack. Backward waits (after each op, untimed)
    until the window is refilled: nothing misses."""
    nbytes = 256 << 10
    off = make_offloader(engine=engine, keep_tail_bytes=0, min_tensor_bytes=4096,
                         prefetch_bytes=4 * nbytes)
    polled = getattr(testing.engine(off), "poller", None) is not None
    xs = _tensors(16, nbytes)

    def due():  # bytes the window could still take in (racy reads: a test's poll)
        window = testing.prefetch(off)
        return min(4 * nbytes - window.ahead, window.unread)

    def between(where):
        if where == "backward":
            _until(lambda: due() <= 0, "refill the prefetch window")

    spy = Spy(off)  # before forward: autograd unpacks with the hooks that packed
    a, y = _chain(off, xs, between, settle=True)  # each record comes back by a read
    n_forward = len(spy.calls)
    y.backward()
    assert torch.equal(a.grad, _reference(xs))
    st = off.stats()
    assert st.prefetch_misses == 0 and st.records_read == len(xs)
    reads = [c for c in spy.calls[n_forward:] if c[0] == "read"]  # those of backward
    assert len(reads) == len(xs) - 4  # the first window's were started by forward's end
    if polled:
        assert spy.inside("unpack", "read") == reads, reads
        assert {name for _, name, _ in reads} == {threading.current_thread().name}, reads
    else:
        assert spy.inside("unpack", "read") == [], reads
        assert {name for _, name, _ in reads} == {"ssdtrain-store"}, reads


def test_unpack_refills_a_window_the_thread_left_dry(make_offloader):
    """With the I/O thread held back for the whole backward, unpack starts reads itself
    while less than a quarter of the window is ahead of use: backward stays exact and
    never waits for a thread that does not come."""
    nbytes = 256 << 10
    off = make_offloader(keep_tail_bytes=0, min_tensor_bytes=4096,
                         prefetch_bytes=4 * nbytes)
    xs = _tensors(12, nbytes)
    spy = Spy(off)  # before forward: autograd unpacks with the hooks that packed
    a, y = _chain(off, xs, settle=True)
    with _held_back(off):
        y.backward()
    assert torch.equal(a.grad, _reference(xs))
    assert off.stats().prefetch_misses == 0, "unpack did not refill the window in time"
    assert spy.inside("unpack", "read"), "unpack never refilled the window"


def test_memory_is_released_by_the_io_thread(make_offloader):
    """A written record's memory is let go outside the store's lock, on the I/O thread:
    the saved tensor's storage dies there, not in a hook. The write is held until the
    test has dropped its own reference."""
    off = make_offloader(keep_tail_bytes=0, min_tensor_bytes=4096, prefetch_bytes=0)
    gate = threading.Event()
    engine = testing.engine(off)
    real = engine.write

    def gated(*args, **kwargs):
        inner, outer = real(*args, **kwargs), Future()
        outer.set_running_or_notify_cancel()

        def finish():
            gate.wait(WAIT_S)
            exc = inner.exception()
            outer.set_exception(exc) if exc is not None else outer.set_result(inner.result())
        threading.Thread(target=finish, daemon=True).start()
        return outer
    engine.write = gated
    died = []
    x = torch.rand(1 << 16)
    weakref.finalize(x.untyped_storage(), lambda: died.append(threading.current_thread().name))
    a, y = _chain(off, [x])
    del x
    assert not died and [r.state for r in off.records()] == ["WRITING"]
    gate.set()
    _until(lambda: died, "release the written tensor")
    assert died == ["ssdtrain-store"], died
    y.backward()


def test_thread_ends_with_close_and_with_the_store(spill_dir):
    def new_thread():
        before = set(_io_threads())
        off = ssdtrain.Offloader(policy="static", spill_dir=str(spill_dir), keep_tail_bytes=0,
                                 min_tensor_bytes=4096)
        (thread,) = set(_io_threads()) - before
        a, y = _chain(off, _tensors(3))
        y.backward()
        return off, thread

    off, thread = new_thread()
    off.close()
    assert not thread.is_alive()
    off, thread = new_thread()  # never closed: the thread goes when the store is collected
    del off
    gc.collect()
    _until(lambda: not thread.is_alive(), "end with its collected store")


def test_a_failed_round_is_raised_at_the_next_pack(make_offloader, caplog):
    """An exception escaping a round of the I/O thread (a bug) is repaired, logged and
    raised by the next pack as an SSDTrainError; the steps after it are exact."""
    off = make_offloader(keep_tail_bytes=0, min_tensor_bytes=4096)
    # The failure is injected inside the round's locked part (its repair is under test):
    # the store's own method, not a seam.
    store = off._store
    real = store._io.start_one_locked
    armed, fired = threading.Event(), []

    def failing(on):
        if armed.is_set() and not fired:
            fired.append(True)
            raise RuntimeError("injected failure of the I/O thread")
        return real(on)
    store._io.start_one_locked = failing
    xs = _tensors(4)
    a, y = _chain(off, xs[:1])
    armed.set()
    store._kick()  # the next round fails
    _until(lambda: fired and store._events.failure, "report its failure")
    with pytest.raises(SSDTrainError, match="I/O thread failed.*injected failure"):
        _chain(off, xs)
    y.backward()
    assert torch.equal(a.grad, _reference(xs[:1]))
    for _ in range(2):
        a, y = _chain(off, xs)
        y.backward()
        assert torch.equal(a.grad, _reference(xs))
    store.check_invariants()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_has_no_io_thread_and_offloads_with_its_own(spill_dir):
    off = ssdtrain.Offloader(policy="static",
                             spill_dir=str(spill_dir), keep_tail_bytes=0, min_tensor_bytes=4096)
    a, y = _chain(off, _tensors(3))
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        code = 1
        try:
            if not _io_threads() and off.closed:
                child = ssdtrain.Offloader(policy="static",
                                           spill_dir=str(spill_dir), keep_tail_bytes=0,
                                           min_tensor_bytes=4096)
                own = len(_io_threads()) == 1
                xs = _tensors(5)

                def between(where):  # the child's own thread starts its writes
                    if where == "forward":
                        _until(lambda: all(r.state != "PENDING" for r in child.records()),
                               "start a write in the forked child")
                b, z = _chain(child, xs, between)
                z.backward()
                ok = torch.equal(b.grad, _reference(xs))
                child.close()
                code = 0 if ok and own and not _io_threads() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    y.backward()
    off.close()


def test_memory_is_back_when_backward_returns(make_offloader):
    """The end of backward releases what the handles it freed held (the kept tail here)
    on its own thread: when ``backward()`` returns, nothing waits for the I/O thread."""
    off = make_offloader(keep_tail_bytes=64 << 20, min_tensor_bytes=4096)
    xs = _tensors(4, 4 << 20)
    died = _deaths(xs)
    a, y = _chain(off, xs)
    assert [r.state for r in off.records()] == ["KEPT"] * 4
    del xs
    with _held_back(off):  # busy elsewhere for the whole backward
        y.backward()
        assert len(died) == 4, f"{4 - len(died)} kept tensors outlived backward"


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_read_buffers_are_unmapped_off_the_training_thread(make_offloader, monkeypatch, engine):
    """Read buffers given back beyond the idle limit are unmapped by the I/O thread,
    never by the hooks' thread, the end of backward included (with 64 MiB records that
    cost 7 ms a step; NOTE [ Unmapping off the training thread ] in io/readbuf.py), while
    the records the end of backward frees are still released before it returns, those
    behind a mapping in the graveyard included."""
    from ssdtrain._store import iothread as _iothread
    unmapped, real = [], _iothread.unmap_now

    def spy(mm):
        unmapped.append(threading.current_thread().name)
        real(mm)
    monkeypatch.setattr(_iothread, "unmap_now", spy)
    # 1 MiB records, a window and idle limit of two: most give-backs unmap; a kept tail.
    off = make_offloader(engine=engine, keep_tail_bytes=2 << 20, min_tensor_bytes=4096,
                         prefetch_bytes=2 << 20)
    for step in range(3):
        xs = _tensors(10, 1 << 20)
        died = _deaths(xs[-2:])  # the tail: freed by the end of backward
        a, y = _chain(off, xs, settle=True)
        assert [r.state for r in off.records()][-2:] == ["KEPT"] * 2
        del xs
        y.backward()
        assert len(died) == 2, f"step {step}: {2 - len(died)} kept tensors outlived backward"
        assert torch.equal(a.grad, _reference(_tensors(10, 1 << 20)))
    # The store's graveyard is what the I/O thread is tested to empty: no seam shows it.
    _until(lambda: not off._store._graveyard, "unmap the idle read buffers")
    assert unmapped, "no read buffer was unmapped: the test is void"
    assert set(unmapped) == {"ssdtrain-store"}, unmapped


def test_memory_dropped_by_any_operation_is_released(make_offloader):
    """A graph dropped without backward, then only ``live_records()``: the records it
    frees let go of their memory (through the I/O thread) with no later call."""
    off = make_offloader(keep_tail_bytes=64 << 20, min_tensor_bytes=4096)
    xs = _tensors(2, 4 << 20)
    died = _deaths(xs)
    a, y = _chain(off, xs)
    del xs, a, y
    assert off.live_records() == 0
    _until(lambda: len(died) == 2, "release the records of a dropped graph")


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_no_memory_for_a_prefetch_buffer_is_not_an_error(make_offloader, caplog, engine):
    """A read buffer that cannot be mapped (ENOMEM) when the window slides (whichever
    thread slides it): the read is left to backward (a miss), logged once; nothing is
    raised, gradients are exact, and later steps prefetch again."""
    nbytes = 256 << 10
    off = make_offloader(engine=engine, keep_tail_bytes=0, min_tensor_bytes=4096,
                         prefetch_bytes=4 * nbytes)
    # The failure is injected into the store's read buffers, where the window slides.
    store = off._store
    real, pump = store._buffers.storage, store._reads.pump_locked
    failing, pumping = [True], threading.local()

    def storage(*args):
        if failing[0] and getattr(pumping, "on", False):
            raise OSError(12, "Cannot allocate memory (injected)")
        return real(*args)

    def pumped(*args, **kwargs):
        pumping.on = True
        try:
            return pump(*args, **kwargs)
        finally:
            pumping.on = False
    store._buffers.storage = storage
    store._reads.pump_locked = pumped
    xs = _tensors(12, nbytes)
    with caplog.at_level("WARNING", logger="ssdtrain"):
        a, y = _chain(off, xs, settle=True)
        y.backward()
    assert torch.equal(a.grad, _reference(xs))
    assert store._events.failure is None
    warned = [r for r in caplog.records if "could not get its buffer" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    failing[0] = False
    misses = off.stats().prefetch_misses
    a, y = _chain(off, xs, settle=True)
    y.backward()
    assert torch.equal(a.grad, _reference(xs))
    store.check_invariants()
    assert off.stats().prefetch_misses - misses < len(xs) - 4  # the thread prefetched again


def test_stats_show_the_read_buffers_and_a_steady_run_keeps_the_first_windows(make_offloader):
    """``Stats.read_buffer_bytes`` / ``read_buffer_idle_bytes``: after a step whose forward's
    end read ahead, the buffers it mapped are idle, kept for the next step's (NOTE [ Read
    buffers across steps ] in io/readbuf.py), and the next step maps no more."""
    off = make_offloader(keep_tail_bytes=0, min_tensor_bytes=4096, prefetch_bytes=8 << 20)
    seen = []
    for _ in range(3):
        xs = _tensors(4, 1 << 20)
        a, y = _chain(off, xs, settle=True)
        y.backward()
        assert torch.equal(a.grad, _reference(xs))
        del xs, a, y
        off.wait()
        s = off.stats()
        seen.append((s.read_buffer_bytes, s.read_buffer_idle_bytes))
    assert seen[0][1] > 0 and all(b == idle for b, idle in seen), seen  # nothing in use
    assert seen[1] == seen[2] == seen[0], seen  # the same buffers, step after step
