"""Fork safety: a child forked from a process that trains with ssdtrain.

``os.fork()`` copies memory but only the forking thread (NOTE [ Engines after fork ]
in ssdtrain/_fork.py). The native engine's workers do not exist in the child, so a
child that joined them (its exit ran the store's finalizer, or it called
``off.close()``) crashed or hung. Every engine is now abandoned in the child right
after the fork. For both engines:

(a) the child runs the real interpreter exit path (a ``python -c`` program whose
    child returns normally: atexit and finalizers run) with the offloader open and a
    graph alive, settled or with writes in flight at the fork: it exits 0;
(b) the child calls ``off.close()`` on the inherited offloader: it returns promptly,
    settled or with writes in flight (those belong to the parent: the child must not
    wait for them);
(c) the child makes its own Offloader and trains a few steps, bitwise equal to
    training without offloading;
(d) the parent keeps training bitwise exactly after the fork, while the child closed
    its copy of the offloader;
(e) the inherited engine refuses requests in the child and shuts down at once;
plus the registry's own contract (weak, child only, errors logged).

Children of the pytest process are forked in-process and always leave through
``os._exit`` (their result comes back as the exit code and a message on a pipe);
each is reaped with a deadline and SIGKILLed if it hangs, failing the test. Torch
runs with one intra-op thread here: a pool of torch's threads used in the parent
does not exist in the child either (a torch limitation, not ssdtrain's), and one
thread also keeps reference and offloaded runs bitwise comparable.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from ssdtrain import _fork
from ssdtrain.io import native
from ssdtrain.io.base import Engine, EngineWrapper
from ssdtrain.io.faulty import FaultyEngine
from ssdtrain.io.posix import PosixEngine

_TESTS = str(Path(__file__).resolve().parent)
_ROOT = str(Path(__file__).resolve().parent.parent)  # the subprocess imports this checkout
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
import models  # noqa: E402
from helpers import assert_same, run_step  # noqa: E402

ENGINES = pytest.mark.parametrize("engine", [
    "posix",
    pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                    reason=native.unavailable_reason())),
])
IN_FLIGHT = pytest.mark.parametrize("in_flight", [False, True], ids=["settled", "in_flight"])
# Every activation of the MLP qualifies and is written (no tail kept in memory).
DISK = dict(policy="static", min_tensor_bytes=4096, keep_tail_bytes=0)
CHILD_DEADLINE_S = 20.0


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------- helpers
class GatedEngine(EngineWrapper):
    """Holds every request until :meth:`release`, then runs it on ``inner``.

    Makes "writes in flight at the fork" deterministic: the parent forks while the
    requests are held, and releases them afterwards. In a child, :meth:`abandon`
    forgets the held requests (they are the parent's) and abandons ``inner``.
    """

    def __init__(self, inner: Engine):
        super().__init__(inner)  # inner's capabilities, name and back end
        self.held = []
        self._open = False
        self._lock = threading.Lock()

    def write(self, file, offset, address, nbytes, **kw):
        return self._request(self.inner.write, (file, offset, address, nbytes), kw)

    def read(self, file, offset, address, nbytes, **kw):
        return self._request(self.inner.read, (file, offset, address, nbytes), kw)

    def _request(self, do, args, kw):
        with self._lock:
            if not self._open:
                fut = Future()
                fut.set_running_or_notify_cancel()
                self.held.append((do, args, kw, fut))
                return fut
        return do(*args, **kw)

    def release(self):
        """Runs the held requests (and every later one) on ``inner``."""
        with self._lock:
            self._open = True
            held, self.held = self.held, []
        while held:  # each request's owner goes to the inner engine, which lets go of it
            do, args, kw, fut = held.pop(0)
            do(*args, **kw).add_done_callback(lambda f, fut=fut: _copy_outcome(f, fut))
            del kw

    def shutdown(self):
        self.release()
        self.inner.shutdown()

    def abandon(self):
        self._lock = threading.Lock()
        self.held = []
        self.inner.abandon()


def _copy_outcome(src, dst):
    exc = src.exception()
    if exc is None:
        dst.set_result(src.result())
    else:
        dst.set_exception(exc)


def install_gate(off) -> GatedEngine:
    """Wraps ``off``'s engine in a :class:`GatedEngine` (as ``faulty.install`` does)."""
    return off.wrap_engine(GatedEngine)


def reap(pid: int, deadline_s: float = CHILD_DEADLINE_S) -> int:
    """The exit code of child ``pid`` (negative: killed by that signal), polling
    ``waitpid(WNOHANG)``; a child still running after ``deadline_s`` is SIGKILLed and
    ``None`` returned (it hung)."""
    end = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)


def in_child(body, what: str) -> None:
    """Runs ``body()`` in a forked child that leaves through ``os._exit``; fails the
    test if it raised, crashed or did not exit within the deadline."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            os.close(r)
            try:
                body()
                code = 0
            except BaseException:  # noqa: BLE001 - reported to the parent
                os.write(w, traceback.format_exc()[-16000:].encode())
                code = 1
        finally:
            os._exit(code)
    os.close(w)
    code = reap(pid)
    with os.fdopen(r, "rb") as fh:
        report = fh.read().decode(errors="replace")
    if code is None:
        pytest.fail(f"{what}: the forked child did not exit within {CHILD_DEADLINE_S} s (hung); "
                    f"killed it. {report}")
    assert code == 0, f"{what}: the forked child exited with {code}:\n{report}"


def _forward(model, inputs, off, *, settle):
    """Forward under ``off``; with ``settle``, every write and the prefetch reads that
    the end of forward starts have completed when it returns."""
    model.zero_grad(set_to_none=True)
    with off:
        loss = model(*inputs)
    if settle:
        off.wait()
    return loss


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _sgd(model, lr=0.05):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)


# ------------------------------------------------------------ (a) exit path
_EXIT_PATH = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import test_fork
    test_fork.exit_path_program(*sys.argv[3:])
""")


def exit_path_program(spill_dir: str, engine: str, in_flight: str) -> None:
    """The program of test (a): train a step's forward, fork; the child returns from
    here, so ``python -c`` ends and the interpreter exits normally with the offloader
    open and the graph alive (kept in a module global until finalization). The parent
    reaps it, finishes the step bitwise exactly, closes, and prints a verdict."""
    torch.set_num_threads(1)
    model, inputs = models.mlp()
    ref = run_step(model, inputs)
    off = ssdtrain.Offloader(spill_dir=spill_dir, engine=engine, **DISK)
    gate = install_gate(off) if in_flight == "1" else None
    loss = _forward(model, inputs, off, settle=gate is None)
    assert off.live_records() > 0, "nothing was offloaded: the test would prove nothing"
    pid = os.fork()
    if pid == 0:
        _KEPT.append((off, loss, model))  # alive until the interpreter finalizes
        return
    code = reap(pid)
    if gate is not None:
        gate.release()
    loss.backward()
    assert_same(ref, (loss.detach(), _grads(model)))
    off.close()
    print(f"child exit code: {code}", flush=True)


_KEPT = []


@ENGINES
@IN_FLIGHT
def test_a_child_exits_through_the_interpreter_exit_path(spill_dir, engine, in_flight):
    """The child's normal exit (atexit, weakref finalizers: the store's and the engine's)
    must not join the parent's engine threads: exit code 0, nothing printed as an
    error. Before the fix the native child died of SIGSEGV (exit code -11)."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_PATH, _ROOT, _TESTS, str(spill_dir),
                           engine, "1" if in_flight else "0"],
                          cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "child exit code: 0" in proc.stdout, out
    for bad in ("Traceback", "Exception ignored", "Fatal Python error", "terminate called"):
        assert bad not in proc.stderr, out


# ---------------------------------------------------- (b) close in the child
@ENGINES
@IN_FLIGHT
def test_b_child_closes_the_inherited_offloader_promptly(make_offloader, engine, in_flight):
    """``off.close()`` in the child returns well within the deadline (io_timeout_s is
    600 s: waiting for the parent's requests would hang), and the offloader is closed
    there; the parent's offloader is untouched and still finishes its step."""
    model, inputs = models.mlp()
    ref = run_step(model, inputs)
    off = make_offloader(engine=engine, **DISK)
    gate = install_gate(off) if in_flight else None
    loss = _forward(model, inputs, off, settle=not in_flight)
    assert off.live_records() > 0
    if in_flight:
        assert gate.held, "no write was in flight at the fork: the test would prove nothing"

    def child():
        off.close()
        assert off.closed

    try:
        in_child(child, "off.close() in the child")
    finally:
        if gate is not None:  # else the fixture's close() would wait for held writes
            gate.release()
    assert not off.closed
    loss.backward()
    assert_same(ref, (loss.detach(), _grads(model)))


# ------------------------------------------- (c) a new offloader in the child
@ENGINES
def test_c_child_trains_exactly_with_its_own_offloader(make_offloader, spill_dir, engine):
    """The child leaves the inherited offloader alone, makes its own (same engine kind:
    new threads of its own) and trains three steps whose losses and gradients are
    bitwise those of training without offloading; it closes it cleanly."""
    model, inputs = models.mlp()
    off = make_offloader(engine=engine, **DISK)
    run_step(model, inputs, off)  # the parent has trained: engine threads exist
    child_dir = spill_dir / "child"
    child_dir.mkdir()

    def child():
        ref_model, ref_inputs = models.mlp()
        own = ssdtrain.Offloader(spill_dir=str(child_dir), engine=engine, **DISK)
        try:
            for step in range(3):
                ref = run_step(ref_model, ref_inputs)
                # Writes land before backward, which must read (records_read below).
                got = run_step(model, inputs, own, settle=True)
                assert_same(ref, got)
                _sgd(ref_model)
                _sgd(model)
            own.wait()
            stats = own.stats()
            assert stats.records_written > 0 and stats.records_read > 0, stats
            assert own.live_records() == 0
        finally:
            own.close()

    in_child(child, "training with a new Offloader in the child")


# --------------------------------------------- (d) the parent keeps training
@ENGINES
@IN_FLIGHT
def test_d_parent_keeps_training_exactly_after_the_fork(make_offloader, engine, in_flight):
    """Forked mid-step (writes settled or in flight); the child closes its copy of the
    offloader and exits. The parent finishes that step and trains three more with the
    same offloader, each bitwise equal to the same training without offloading."""
    model, inputs = models.mlp()
    ref_model, _ = models.mlp()
    off = make_offloader(engine=engine, **DISK)
    gate = install_gate(off) if in_flight else None
    loss = _forward(model, inputs, off, settle=not in_flight)

    try:
        in_child(off.close, "off.close() in the child")
    finally:
        if gate is not None:
            gate.release()
    loss.backward()
    got = (loss.detach(), _grads(model))
    for step in range(4):
        ref = run_step(ref_model, inputs)
        if step:
            got = run_step(model, inputs, off)
        assert_same(ref, got)
        _sgd(ref_model)
        _sgd(model)
    off.wait()
    assert off.live_records() == 0
    assert off.stats().engine.startswith(engine)


# ------------------------------------- (e) the inherited engine in the child
@ENGINES
def test_e_inherited_engine_refuses_requests_in_the_child(make_offloader, engine):
    """In the child the parent's engine is abandoned: a request fails with SpillIOError
    (moving no data), shutdown() returns at once (and again: idempotent)."""
    model, inputs = models.mlp()
    off = make_offloader(engine=engine, **DISK)
    run_step(model, inputs, off)
    eng = testing.engine(off)
    native_engine = getattr(eng, "inner", eng)  # under tests/late_io.py's wrapper
    buf = torch.zeros(4096, dtype=torch.uint8)
    file = testing.spill(off).files[0]
    # Far beyond any slot, and congruent to the address modulo the block (O_DIRECT).
    offset = (1 << 30) + buf.data_ptr() % 4096

    def child():
        if engine == "native":
            assert native_engine._engine.abandoned
        fut = eng.write(file, offset, buf.data_ptr(), buf.numel())
        with pytest.raises(ssdtrain.SpillIOError, match="forked"):
            fut.result(timeout=5)
        eng.shutdown()
        eng.shutdown()

    in_child(child, "the inherited engine in the child")
    # The parent's engine still works.
    fut = eng.write(file, offset, buf.data_ptr(), buf.numel())
    assert fut.result(timeout=30) == buf.numel()
    if engine == "native":
        assert not native_engine._engine.abandoned


@ENGINES
def test_e_wrapped_engine_abandons_its_inner_engine(spill_dir, engine):
    """FaultyEngine.abandon forgets its hung requests without failing them (their
    callbacks belong to the parent) and abandons the engine it wraps."""
    inner = PosixEngine(io_threads=2) if engine == "posix" else native.NativeEngine(io_threads=2)
    wrapped = FaultyEngine(inner)
    wrapped._hung.append(("never touched in the child",) * 5)
    try:
        def child():
            assert wrapped._hung == []
            assert inner._abandoned
            wrapped.shutdown()  # does not touch the forgotten hung request, returns at once

        in_child(child, "FaultyEngine in the child")
        assert not inner._abandoned and len(wrapped._hung) == 1
    finally:
        wrapped._hung.clear()
        wrapped.shutdown()


def test_e_kvikio_engine_abandon_makes_no_cuda_call():
    """KvikioEngine.abandon (no GPU here: the object is built by hand around a real
    thread pool): its kvikio file handles are never closed (a CUDA call), shutdown()
    returns at once, and a request is refused instead of starting a thread."""
    from concurrent.futures import ThreadPoolExecutor

    from ssdtrain.io.gds import KvikioEngine

    closed = []

    class FakeCuFile:
        def close(self):
            closed.append(self)

    eng = object.__new__(KvikioEngine)
    eng._files = {"spill file": FakeCuFile()}
    eng._lock = threading.Lock()
    eng._pool = ThreadPoolExecutor(2)
    eng._pool.submit(lambda: None).result()  # a worker thread exists
    parent_pool = eng._pool
    try:
        eng.abandon()
        eng.abandon()  # idempotent
        eng.shutdown()
        assert closed == []
        with pytest.raises(RuntimeError):
            eng.write(None, 0, 0, 0)
    finally:
        parent_pool.shutdown(wait=True)


# ------------------------------------------------------------- the registry
class _Thing:
    pass


def test_registry_keeps_nothing_alive():
    thing = _Thing()
    key = _fork.register(thing, lambda obj: None)
    assert key in _fork._registry
    ref = weakref.ref(thing)
    del thing
    assert ref() is None
    assert key not in _fork._registry


def test_registry_refuses_a_bound_method_of_the_object():
    thing = _Thing()
    thing.cb = lambda obj: None
    with pytest.raises(ValueError, match="bound method"):
        _fork.register(thing, _Thing.__init__.__get__(thing))
    _fork.unregister(_fork.register(thing, thing.cb))  # not bound to thing: accepted


def test_registry_runs_callbacks_in_the_child_only_and_logs_their_errors(caplog):
    """Callbacks run in the child (all of them, even after one raised: that one is
    logged), never in the parent; unregistered ones do not run."""
    seen = []
    first, second, gone = _Thing(), _Thing(), _Thing()

    def boom(obj):
        raise RuntimeError("boom in a fork callback")

    _fork.register(first, boom)
    _fork.register(second, lambda obj: seen.append("second"))
    _fork.unregister(_fork.register(gone, lambda obj: seen.append("gone")))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ssdtrain")
    logger.addHandler(handler)
    try:
        def child():
            assert seen == ["second"], seen
            assert any("boom in a fork callback" in str(r.exc_info[1]) for r in records
                       if r.exc_info), [r.getMessage() for r in records]

        in_child(child, "the fork registry in the child")
    finally:
        logger.removeHandler(handler)
    assert seen == []
    del first, second, gone
