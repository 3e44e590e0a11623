"""``io_timeout_s`` ends a wait, never a request: no memory an I/O may touch is freed early.

A tiny ``io_timeout_s`` with large records makes a wait give up while the write or
read is really still in flight. ``SpillIOError`` is the right answer; what used to
follow was not: ``close()`` (or the graph being dropped) released the read buffer or
the source tensor while the engine, or the CRC on its worker, still used it, and the
process died of SIGSEGV (or, where the memory had been reused, wrote into another
tensor). The rule (INV-OWNED in docs/ARCHITECTURE.md: memory of an I/O request that
may still be in flight is owned by that request) is checked here by searching for the
race, for both engines and with ``verify`` on and off:

- ``write_forward``: a pack throttled by a small ``write_behind_bytes`` times out
  waiting for a write, so forward raises;
- ``wait``: ``off.wait()`` times out on the writes of the step;
- ``read_backward``: backward times out waiting for a (prefetch) read.

After each, everything is dropped and ``close()`` must return (or raise
``SpillIOError``) within a hang guard; fresh tensors of the same sizes then reuse
whatever memory was freed, every request is let finish, and the process must exit
0 through its normal exit path (engine shutdown, finalizers) with no crash, no
sanitizer report and no corrupted tensor.

Each scenario runs in a subprocess (a segfault must fail the test, not kill
pytest), a few times with different sizes. :class:`SlowEngine` makes it
deterministic: requests complete only after a delay, and the memory is really
touched at completion time (a write's source is read again and must be unchanged,
a read's data is copied into its destination then), so an early free shows as a
crash, an AddressSanitizer report (``make asan-test`` runs this file) or a
detected change. One scenario per engine uses the real engine with no wrapper.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import mmap
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from ssdtrain import SpillIOError
from ssdtrain.io import checksum as _checksum
from ssdtrain.io import native
from ssdtrain.io.base import Capabilities, Engine, EngineWrapper

_TESTS = str(Path(__file__).resolve().parent)
_ROOT = str(Path(__file__).resolve().parent.parent)

ENGINES = pytest.mark.parametrize("engine", [
    "posix",
    pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                    reason=native.unavailable_reason())),
])
SCENARIOS = ("write_forward", "wait", "read_backward")
IO_TIMEOUT_S = 1e-4
DELAY_S = 0.15          # how long SlowEngine keeps a request in flight
CLOSE_GUARD_S = 15.0    # close() "hangs" beyond this (it is bounded by io_timeout_s)
PROCESS_GUARD_S = 90.0  # the whole program (faulthandler then dumps every thread)
USE_AFTER_FREE = "USE-AFTER-FREE"


# ------------------------------------------------------------ the slow engine
def _snapshot(address: int, nbytes: int) -> int:
    """CRC32 of ``nbytes`` at ``address``, read through libc ``memmove`` (into a private
    buffer) so that AddressSanitizer checks the range: reading freed memory is reported
    there, and an unmapped range is a SIGSEGV everywhere."""
    copy = bytearray(nbytes)
    ctypes.memmove((ctypes.c_char * nbytes).from_buffer(copy), address, nbytes)
    return zlib.crc32(copy)


class SlowEngine(EngineWrapper):
    """Wraps ``inner``; the requests of ``ops`` complete ``delay_s`` after ``inner`` ends
    them, and use their memory until then, as a slow device would.

    - write: the source is read at submission (its CRC32) and read again at completion;
      if it changed, the memory was freed and reused (or written) while the request
      still owned it: recorded in :attr:`violations` and printed with
      ``USE-AFTER-FREE``.
    - read: ``inner`` reads into a private page-aligned buffer (congruent to the
      destination modulo the block, as O_DIRECT needs); the bytes are copied into the
      destination only at completion, with libc ``memmove``.

    Completions run on non-daemon threads, so the interpreter's exit waits for them
    (before finalizers run) and no request outlives the process unnoticed.
    """

    # Its requests take no keyword arguments: no crc=True (the store checksums behind
    # them) and no device memory (NOTE [ Engine capabilities ] in ssdtrain/io/base.py).
    capabilities = Capabilities()

    def __init__(self, inner: Engine, delay_s: float, ops=("write", "read")):
        super().__init__(inner)
        self.delay_s = delay_s
        self.ops = frozenset(ops)
        self.violations = []
        self.completed = 0
        self._threads = []
        self._lock = threading.Lock()

    def write(self, file, offset, address, nbytes, *, owner=None):
        if "write" not in self.ops:
            return self.inner.write(file, offset, address, nbytes, owner=owner)
        before = _snapshot(address, nbytes)
        inner = self.inner.write(file, offset, address, nbytes, owner=owner)
        return self._later(inner, lambda: self._check_source(file, offset, address, nbytes,
                                                             before), owner)

    def read(self, file, offset, address, nbytes, *, owner=None):
        if "read" not in self.ops:
            return self.inner.read(file, offset, address, nbytes, owner=owner)
        skew = address % 4096
        bounce = mmap.mmap(-1, skew + nbytes + 4096)
        bounce_address = ctypes.addressof(ctypes.c_char.from_buffer(bounce)) + skew
        inner = self.inner.read(file, offset, bounce_address, nbytes, owner=(owner, bounce))

        def land():
            ctypes.memmove(address, bounce_address, nbytes)  # the destination, touched now
        return self._later(inner, land, (owner, bounce))

    def _check_source(self, file, offset, address, nbytes, before):
        if _snapshot(address, nbytes) != before:
            msg = (f"{USE_AFTER_FREE}: the source of a write of {nbytes} bytes at offset "
                   f"{offset} of {file.name} changed while the write was in flight")
            self.violations.append(msg)
            print(msg, file=sys.stderr, flush=True)

    def _later(self, inner: Future, touch, owner) -> Future:
        """``owner`` (the request's: NOTE [ Requests own their memory ] in
        ssdtrain/io/base.py) is held until the memory was touched, and let go of before
        the future is settled, as an engine does."""
        outer = Future()
        outer.set_running_or_notify_cancel()

        def run():
            exc = inner.exception()  # the inner engine ends it (its shutdown finishes it)
            time.sleep(self.delay_s)
            if exc is None:
                try:
                    touch()
                except BaseException as e:  # noqa: BLE001 - the future must end
                    exc = e
            with self._lock:
                self.completed += 1
            del keep_alive[:]
            if exc is None:
                outer.set_result(inner.result())
            else:
                outer.set_exception(exc)

        keep_alive = [owner]
        t = threading.Thread(target=run, name="slow-engine", daemon=False)
        with self._lock:
            self._threads.append(t)
        t.start()
        return outer

    def join(self):
        """Waits until every request made so far has completed (one whose thread an
        interrupt kept from starting is completed now: its owner is let go of then)."""
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            if t.ident is None:
                t.start()
            t.join()

    def shutdown(self):
        self.join()
        self.inner.shutdown()

    def abandon(self):
        self._threads = []
        self._lock = threading.Lock()
        self.inner.abandon()


def install_slow(off, delay_s, ops) -> SlowEngine:
    """Wraps ``off``'s engine in a :class:`SlowEngine` (as ``faulty.install`` does)."""
    return off.wrap_engine(lambda engine: SlowEngine(engine, delay_s, ops))


# ------------------------------------------------------------ the program
class _Chain(torch.nn.Module):
    """Four elementwise ops on a ``numel`` vector: each saves one activation of the full
    size for backward (exp saves its output, the others their inputs)."""

    def forward(self, x):
        h = (x * 0.5).exp()
        h = h.sin()
        h = h.cos()
        h = h.tanh()
        return h.sum()


def _reference(numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g).requires_grad_()
    _Chain()(x).backward()
    return x.grad


def _run_once(spill_dir, engine, scenario, mode, size_mib, verify):
    """One repetition; prints what happened. Returns (timed out?, close raised?)."""
    numel = (size_mib << 20) // 4 + 37  # not a whole number of blocks: partial edge blocks
    cfg = dict(spill_dir=spill_dir, policy="static",
                                    engine=engine, io_timeout_s=IO_TIMEOUT_S, verify=verify,
               min_tensor_bytes=4096, keep_tail_bytes=0,
               write_behind_bytes=(1 << 20) if scenario == "write_forward" else (1 << 30))
    off = ssdtrain.Offloader(**cfg)
    slow = None
    if mode == "slow":
        slow = install_slow(off, DELAY_S, ("read",) if scenario == "read_backward" else ("write",))
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g).requires_grad_()
    timed_out = False
    loss = None
    try:
        with off:
            loss = _Chain()(x)
            if scenario == "wait":
                off.wait()
            elif scenario == "read_backward":
                # Every write done (a deadline of its own: the tiny io_timeout_s is for the
                # reads), so backward must read; prefetch starts at exit. The store's own
                # flush: wait() has no deadline but io_timeout_s.
                off._store.flush(timeout=CLOSE_GUARD_S)
        if scenario == "read_backward":
            loss.backward()
    except SpillIOError as e:
        timed_out = "io_timeout_s" in str(e)
        if not timed_out:
            raise
    if scenario == "read_backward" and not timed_out:
        assert torch.equal(x.grad, _reference(numel)), "wrong gradient after a clean backward"
    del loss, x
    gc.collect()

    faulthandler.dump_traceback_later(CLOSE_GUARD_S, exit=True)  # a hang is a failure
    close_raised = False
    try:
        off.close()
    except SpillIOError:
        close_raised = True
    faulthandler.cancel_dump_traceback_later()
    assert off.closed

    # Reuse whatever was freed, with known contents; a late write into it shows.
    junk = [torch.full((numel,), 7.0) for _ in range(3)]
    if slow is not None:
        slow.join()
        assert slow.completed > 0
        assert not slow.violations, slow.violations
    for j in junk:
        if not bool((j == 7.0).all()):
            print(f"{USE_AFTER_FREE}: a {size_mib} MiB tensor allocated after close() was "
                  f"overwritten by a request that was still in flight", file=sys.stderr,
                  flush=True)
            raise AssertionError("memory reused after close() was overwritten")
    del junk
    print(f"rep {scenario} {engine} {mode} {size_mib}MiB verify={verify}: "
          f"timed_out={timed_out} close_raised={close_raised}", flush=True)
    return timed_out


def program(spill_dir, engine, scenario, mode):
    """The subprocess: every repetition of ``scenario``; prints ``ALL DONE`` at the end,
    then exits through the interpreter's normal exit path."""
    faulthandler.enable()  # a crash prints every thread's Python stack
    faulthandler.dump_traceback_later(PROCESS_GUARD_S, exit=True)
    torch.set_num_threads(1)
    verifies = (True, False) if _checksum.available() else (False,)
    sizes = (8, 24) if mode == "slow" else (8, 32)
    scenarios = SCENARIOS if scenario == "all" else (scenario,)
    hits = 0
    for name in scenarios:
        for size in sizes:
            for verify in verifies:
                print(f"begin {name} {size}MiB verify={verify}", flush=True)
                hits += _run_once(spill_dir, engine, name, mode, size, verify)
    # Deterministic with the slow engine; with the real one a 8+ MiB request taking
    # under 0.1 ms is not plausible, but only one timeout is needed to prove anything.
    need = len(scenarios) * len(sizes) * len(verifies) if mode == "slow" else 1
    assert hits >= need, f"only {hits} of the repetitions timed out (needed {need})"
    faulthandler.cancel_dump_traceback_later()
    print("ALL DONE", flush=True)


_PROGRAM = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import test_timeouts
    test_timeouts.program(*sys.argv[3:])
""")


def _run(spill_dir, engine, scenario, mode):
    proc = subprocess.run([sys.executable, "-c", _PROGRAM, _ROOT, _TESTS, str(spill_dir), engine,
                           scenario, mode],
                          cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=PROCESS_GUARD_S + 60)
    out = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, out
    assert "ALL DONE" in proc.stdout, out
    for bad in (USE_AFTER_FREE, "AddressSanitizer", "runtime error:", "Fatal Python error",
                "Traceback", "Exception ignored", "terminate called"):
        assert bad not in proc.stderr, out


# One process per engine and mode runs every scenario (a process start costs seconds):
# its output says which repetition ("begin ...") crashed.
@ENGINES
def test_timeout_then_close_with_a_slow_engine(spill_dir, engine):
    """Deterministic: every repetition of every scenario times out while its request
    is in flight (SlowEngine), and the memory is touched when the request ends."""
    _run(spill_dir, engine, "all", "slow")


@ENGINES
def test_timeout_then_close_with_the_real_engine(spill_dir, engine):
    """The engine as it is, no wrapper: 8 and 32 MiB records against a 0.1 ms timeout."""
    _run(spill_dir, engine, "all", "real")


def test_slow_engine_detects_a_changed_source(spill_dir):
    """The detector itself: a write whose source is overwritten while in flight is
    reported, so a clean run above means the memory really was left alone."""
    from ssdtrain.io.spill import SpillFile
    from ssdtrain.io.posix import PosixEngine
    file = SpillFile(str(spill_dir), "off")
    slow = SlowEngine(PosixEngine(io_threads=1), 0.05, ("write",))
    try:
        src = torch.arange(4096, dtype=torch.uint8)
        fut = slow.write(file, 0, src.data_ptr(), src.numel())
        src.fill_(3)  # what a reuse of freed memory does
        assert fut.result(timeout=30) == src.numel()
        assert slow.violations and USE_AFTER_FREE in slow.violations[0]
    finally:
        slow.shutdown()
        file.close()
