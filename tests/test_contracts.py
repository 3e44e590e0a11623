"""Contracts kept by code, not by prose: each rule is one function or
one type, and these tests check that nothing goes around it.

* A record's state changes through ``_records.transition`` alone (NOTE [ Record state
  machine ]): ``Record.state`` is read-only, nothing else writes the slot behind it, and
  the store calls ``transition`` only from ``RecordTable.move`` (which also moves the
  aggregates that follow the state: NOTE [ Record table ] in ssdtrain/_store/table.py).
  Checked at run time and by scanning the source.
* What an engine's requests take (``crc=``, ``device=``) is declared on its type
  (NOTE [ Engine capabilities ] in ssdtrain/io/base.py): every engine class declares
  ``capabilities``, one that does not cannot be made, and wrappers (fault injection
  included) have their inner engine's, so a fault-injection run takes the CRC path a
  production run takes.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import inject
from ssdtrain._decision import records as _records
from ssdtrain import testing
from ssdtrain._decision.records import Record, State

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for tree in ("ssdtrain", "integrations") for p in (ROOT / tree).rglob("*.py")
                 if "__pycache__" not in p.parts)


class _Scan(ast.NodeVisitor):
    """Every write of a record's state and every call of ``transition`` in one module,
    with the qualified name of the function it is in."""

    def __init__(self, path, handles_records):
        self.path = path
        self.handles_records = handles_records
        self.scope = []
        self.writes = []   # (line, scope, what)
        self.calls = []    # (line, scope)

    def _visit_scope(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_scope

    def _target(self, target, line):
        for t in ast.walk(target):
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store) and (
                    t.attr == "_state" or (t.attr == "state" and self.handles_records)):
                self.writes.append((line, ".".join(self.scope), f".{t.attr} ="))

    def visit_Assign(self, node):
        for target in node.targets:
            self._target(target, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Call(self, node):
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) \
            else None
        if name == "transition":
            self.calls.append((node.lineno, ".".join(self.scope)))
        if name in ("setattr", "__setattr__") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in ("state",
                                                                                  "_state"):
            self.writes.append((node.lineno, ".".join(self.scope), f"{name}(..., "
                                f"{node.args[1].value!r})"))
        self.generic_visit(node)


def _imports_records(tree):
    """Whether a module uses ssdtrain's records (imports ``_records`` or the store)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[-1] in ("_records", "_store"):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _scans():
    out = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        scan = _Scan(path.relative_to(ROOT), _imports_records(tree))
        scan.visit(tree)
        out.append(scan)
    return tuple(out)


def test_record_state_cannot_be_assigned():
    t = torch.zeros(4)
    rec = Record(0, None, 0, 16, 0, t, 1, t.untyped_storage())
    with pytest.raises(AttributeError):
        rec.state = State.FREED
    assert rec.state is State.PENDING
    _records.transition(rec, State.KEPT)
    assert rec.state is State.KEPT
    with pytest.raises(AssertionError, match="illegal record transition kept -> on_disk"):
        _records.transition(rec, State.ON_DISK)
    assert rec.state is State.KEPT


def test_only_transition_writes_a_record_state():
    allowed = {("ssdtrain/_decision/records.py", "transition"), ("ssdtrain/_decision/records.py", "Record.__init__")}
    bad = [f"{s.path}:{line}: {what} in {scope or '<module>'}"
           for s in _scans() for line, scope, what in s.writes
           if (str(s.path), scope) not in allowed]
    assert not bad, "a record state written outside transition():\n" + "\n".join(bad)


def test_the_store_calls_transition_only_from_the_record_table():
    allowed = {("ssdtrain/_store/table.py", "RecordTable.move")}
    calls = [(str(s.path), scope, line) for s in _scans() for line, scope in s.calls]
    assert ("ssdtrain/_store/table.py", "RecordTable.move") in {(p, sc) for p, sc, _ in calls}
    bad = [f"{p}:{line}: transition() in {scope}" for p, scope, line in calls
           if (p, scope) not in allowed]
    assert not bad, ("a state change that bypasses RecordTable.move (its aggregates go "
                     "stale):\n" + "\n".join(bad))


# --------------------------------------------------- NOTE [ Engine capabilities ]
def _engine_classes():
    """Every engine class ssdtrain and the test helpers define (imported first)."""
    import manual_engine  # noqa: F401 - test helpers' engines count too
    import ssdtrain.io.faulty  # noqa: F401
    import ssdtrain.io.gds  # noqa: F401
    import ssdtrain.io.native  # noqa: F401
    import ssdtrain.io.posix  # noqa: F401
    from ssdtrain.io.base import Engine
    out, todo = [], [Engine]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith(("ssdtrain", "manual_engine", "test_")):
                out.append(sub)
            todo.append(sub)
    return out


def _takes(fn, name):
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_every_engine_class_declares_its_capabilities():
    import test_fork  # noqa: F401 - GatedEngine
    import test_timeouts  # noqa: F401 - SlowEngine
    from ssdtrain.io.base import Capabilities, Engine, EngineWrapper
    classes = _engine_classes()
    names = {c.__name__ for c in classes}
    assert {"PosixEngine", "NativeEngine", "KvikioEngine", "FaultyEngine", "EngineWrapper",
            "ManualEngine", "GatedEngine", "SlowEngine"} <= names, names
    bad = []
    for cls in classes:
        for op in (cls.write, cls.read):  # NOTE [ Requests own their memory ] in io/base.py
            if not _takes(op, "owner"):
                bad.append(f"{cls.__qualname__}.{op.__name__}() takes no owner=")
        declared = [k for k in cls.__mro__ if k is not Engine and "capabilities" in k.__dict__]
        if not declared:
            bad.append(f"{cls.__qualname__}: no capabilities")
            continue
        caps = declared[0].__dict__["capabilities"]
        if isinstance(caps, property):  # a wrapper: inner's, and every keyword passes on
            assert issubclass(cls, EngineWrapper), cls
            for op in (cls.write, cls.read):
                if not _takes(op, "crc") or not _takes(op, "device"):
                    bad.append(f"{cls.__qualname__}.{op.__name__} does not forward keywords")
            continue
        if not isinstance(caps, Capabilities):
            bad.append(f"{cls.__qualname__}.capabilities is {caps!r}")
            continue
        for flag, kw in (("checksums", "crc"), ("device_memory", "device")):
            for op in (cls.write, cls.read):
                if getattr(caps, flag) and not _takes(op, kw):
                    bad.append(f"{cls.__qualname__} declares {flag} but "
                               f"{op.__name__}() takes no {kw}=")
    assert not bad, "\n".join(bad)


def test_an_engine_class_without_capabilities_cannot_be_made():
    from ssdtrain.io.base import Engine

    class Bare(Engine):
        def write(self, file, offset, address, nbytes, *, owner=None):
            raise AssertionError

        read = write

        def shutdown(self):
            pass

    with pytest.raises(TypeError, match="does not declare its capabilities"):
        Bare()


def test_engine_capabilities_are_read_only():
    from ssdtrain.io.posix import PosixEngine
    engine = PosixEngine(io_threads=1)
    try:
        with pytest.raises(AttributeError):
            engine.checksums = True
        with pytest.raises(dataclasses.FrozenInstanceError):
            engine.capabilities.checksums = True
    finally:
        engine.shutdown()


def _inner_engines():
    from ssdtrain.io import native
    yield "posix"
    if native.available():
        yield "native"


@pytest.mark.parametrize("inner_name", list(_inner_engines()))
@pytest.mark.parametrize("wrapper", ["EngineWrapper", "FaultyEngine", "ManualEngine"])
def test_wrappers_have_their_inner_engines_capabilities(tmp_path, inner_name, wrapper):
    import manual_engine
    from ssdtrain.io.base import EngineWrapper
    from ssdtrain.io.faulty import FaultyEngine
    from ssdtrain.io.native import NativeEngine
    from ssdtrain.io.posix import PosixEngine
    from ssdtrain.tools import SpillSet, crc32c
    inner = NativeEngine(io_threads=2) if inner_name == "native" else PosixEngine(io_threads=2)
    make = {"EngineWrapper": EngineWrapper, "FaultyEngine": FaultyEngine,
            "ManualEngine": manual_engine.ManualEngine}[wrapper]
    engine = make(inner)
    spill = SpillSet([str(tmp_path)], "off")
    try:
        assert engine.capabilities == inner.capabilities
        assert (engine.name, engine.backend, engine.checksums) == \
            (inner.name, inner.backend, inner.checksums)
        src = torch.arange(10_000, dtype=torch.uint8)
        slot = spill.alloc(src.numel(), src.data_ptr() % 4096)
        kw = {"crc": True} if engine.capabilities.checksums else {}
        fut = engine.write(slot.file, slot.offset, src.data_ptr(), src.numel(), **kw)
        if wrapper == "ManualEngine":
            engine.complete(0)
        want = crc32c(src.data_ptr(), src.numel()) if kw else src.numel()
        assert fut.result(timeout=30) == want
    finally:
        engine.shutdown()
        spill.close()


@pytest.mark.skipif("not __import__('ssdtrain').io.native.available()")
def test_fault_injection_takes_the_production_crc_path(make_offloader, monkeypatch):
    """Under ``faulty.install`` the native engine's workers still take the CRCs
    (``crc=True``), as without it: no CRC in Python; a corrupted read is still caught."""
    import ssdtrain
    from helpers import SaveForBackward
    from ssdtrain.io import checksum as _checksum
    from ssdtrain.io import faulty
    real = _checksum.crc32c
    calls = []
    monkeypatch.setattr(_checksum, "crc32c", lambda *a: calls.append(a) or real(*a))
    off = make_offloader(engine="native", verify=True, min_tensor_bytes=1, keep_tail_bytes=0,
                         prefetch_bytes=0)
    inj = faulty.install(off, faulty.Fault("read", "corrupt", nth=2))
    for attempt in range(2):
        t = torch.randn(100_001)
        anchor = torch.zeros((), requires_grad=True)
        sink = []
        with off:
            out = SaveForBackward.apply(anchor, sink, t)
            off.wait()
        if attempt == 0:
            out.backward()
            assert torch.equal(sink[0][0], t)
        else:
            with pytest.raises(ssdtrain.IntegrityError, match="CRC32C"):
                out.backward()
    assert inj.injected == [("read", 2, "corrupt")]
    assert calls == [], "a CRC taken in Python: the wrapper hid the engine's checksums"


# ------------------------------------------------ NOTE [ Memory owned by requests ]
def test_the_bandwidth_probe_keeps_its_buffer_and_slot_past_a_timeout(make_offloader):
    """The adaptive policy's bandwidth probe goes through the store's probe (``Probe.time_io``):
    a write past ``io_timeout_s`` raises an ssdtrain error, keeps its buffer (owned by
    the request) and its disk slot until it really ends; then the slot is freed."""
    import ssdtrain
    from ssdtrain._policies.profile import measure_bandwidth
    from ssdtrain.io import faulty
    off = make_offloader(io_timeout_s=0.2)
    inj = faulty.install(off, faulty.Fault("write", "hang"))
    nbytes = 1 << 20
    store = off._store  # measure_bandwidth takes the store itself, as the adaptive policy does
    with pytest.raises(ssdtrain.SpillIOError, match="bandwidth probe's write.*io_timeout_s=0.2"):
        measure_bandwidth(store, nbytes=nbytes, repeats=1)
    (fut, *_, owner), = inj._hung
    assert off.spill_bytes_in_use() >= nbytes, "the slot was freed under a running write"
    view, buf, slot = owner  # the request owns its buffer and slot: still mapped, leased
    assert not buf.closed and int(view[nbytes - 1]) == 0x5A
    assert slot.file.holds(slot)
    del view, buf, slot, owner
    inj._hung.clear()  # the hung write ends now: its owner goes, then its future
    fut.set_result(nbytes)
    assert off.spill_bytes_in_use() == 0
    testing.check_invariants(off)
    inj.faults.clear()
    w, r = measure_bandwidth(store, nbytes=nbytes, repeats=1)
    assert w > 0 and r > 0 and off.spill_bytes_in_use() == 0


def test_engine_requests_are_made_only_where_they_own_their_memory():
    """Outside ssdtrain/io/, an engine's ``write``/``read`` is called in three functions
    only, each of which hands the request the memory and slot it uses (``owner=``, every
    call: NOTE [ Memory owned by requests ])."""
    allowed = {("ssdtrain/_store/writeback.py", "WritePath.submit_write"),
               ("ssdtrain/_store/prefetch.py", "ReadPath.submit_read"),
               ("ssdtrain/_store/probe.py", "Probe.submit")}
    found = set()
    for rel, scope, node in _nodes_outside_io():
        if isinstance(node, ast.Attribute) and node.attr in ("write", "read") and \
                "engine" in ast.unparse(node.value):
            found.add((rel, scope, node.lineno))
    bad = [f"{p}:{line}: engine.{'write/read'} in {scope}" for p, scope, line in sorted(found)
           if (p, scope) not in allowed]
    bad += [f"{p}:{line}: an engine request without owner= in {scope}"
            for p, scope, line in sorted(_engine_calls_without_owner())]
    assert not bad, "an engine request outside the functions that own its memory:\n" + \
        "\n".join(bad)
    assert {(p, s) for p, s, _ in found} == allowed


def _engine_calls_without_owner():
    """``(path, scope, line)`` of the calls of an engine's ``write``/``read`` (or of the
    variable a function bound one to) outside ssdtrain/io/ that pass no ``owner=``."""
    out = []
    for rel, scope, node in _nodes_outside_io():
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        engine_op = isinstance(fn, ast.Attribute) and fn.attr in ("write", "read") and \
            "engine" in ast.unparse(fn.value)
        bound_op = isinstance(fn, ast.Name) and fn.id == "do" and "Probe" in scope
        if (engine_op or bound_op) and not any(k.arg == "owner" for k in node.keywords):
            out.append((rel, scope, node.lineno))
    return out


def _nodes_outside_io():
    """``(path, scope, node)`` for every AST node of the sources outside ssdtrain/io/."""
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        if not rel.startswith("ssdtrain/io/"):
            for scope, node in _walk_scoped(ast.parse(path.read_text(), rel)):
                yield rel, scope, node


def _walk_scoped(tree, scope=()):
    for node in ast.iter_child_nodes(tree):
        inner = scope + (node.name,) if isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                          ast.AsyncFunctionDef)) else scope
        yield ".".join(inner), node
        yield from _walk_scoped(node, inner)


# ------------------------------------------ NOTE [ Requests own their memory ] (io/base.py)
# Every engine class and wrapper, each as the store drives it: a request's ``owner`` is
# held from before the request is queued until the request has ended, and let go of
# before its future is settled, whether or not the caller ever receives the future.
# Each engine runs with one worker, blocked by the test (a "gate") until it says so, so
# that "queued, not yet run" lasts as long as the test needs; the owner is an object
# the test observes through a weak reference, holding nothing the request needs (the
# test keeps the memory mapped): what is checked is the engine's reference alone.
OWNED_BYTES = 3 * 4096 + 100
PATTERN = 0x5A
SWEEP_DIRS = ("ssdtrain/io/", "/concurrent/futures/", "tests/manual_engine.py",
              "tests/late_io.py", "tests/test_bounded.py", "tests/test_fork.py",
              "tests/test_timeouts.py")


class _Owner:
    """What a request is handed as ``owner``: observed by weak reference only."""


class _Gate:
    """Blocks an engine's only worker until :meth:`open` (the request then waits behind
    it in the engine's queue)."""

    def __init__(self):
        self.event = threading.Event()
        self.hooks = []   # what else opens with it (a wrapper's own queue)

    def block_pool(self, pool):
        started = threading.Event()
        pool.submit(lambda: (started.set(), self.event.wait(60)))
        assert started.wait(10)

    def block_native(self, engine, spill_file):
        import mmap
        started = threading.Event()
        buf = mmap.mmap(-1, 4096)
        address = ctypes_address(buf)
        engine._engine.submit_write(spill_file.fd, spill_file.direct, 0, address, 1,
                                    spill_file.name,
                                    lambda *a: (started.set(), self.event.wait(60)), False)
        assert started.wait(10)
        self.keep = buf  # what the blocking request writes from: mapped while it runs

    def open(self):
        self.event.set()
        for hook in self.hooks:
            hook()


def ctypes_address(buf):
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class _FakeCuFile:
    """What ``KvikioEngine`` needs of kvikio's ``CuFile`` (host memory only), over
    ``os.pwrite``/``os.preadv``: the engine's own code runs, on a machine without kvikio."""

    def __init__(self, path, mode):
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def pwrite(self, buf, nbytes, offset):
        return _Got(os.pwrite(self.fd, memoryview(buf).cast("B")[:nbytes], offset))

    def pread(self, buf, nbytes, offset):
        return _Got(os.preadv(self.fd, [memoryview(buf).cast("B")[:nbytes]], offset))

    def close(self):
        os.close(self.fd)


class _Got:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


def _kvikio_engine():
    import types

    from ssdtrain.io.base import start_pool
    from ssdtrain.io.gds import KvikioEngine
    engine = KvikioEngine.__new__(KvikioEngine)  # no probe: a fake kvikio, host memory
    engine._kvikio = types.SimpleNamespace(CuFile=_FakeCuFile)
    engine._files = {}
    engine._lock = threading.Lock()
    engine._pool = start_pool(1, "ssdtrain-gds", "kvikio engine")
    return engine


OWNER_KINDS = ("posix", "native", "kvikio", "EngineWrapper", "FaultyEngine",
               "FaultyEngine-corrupt", "FaultyEngine-hang", "ManualEngine", "GatedEngine",
               "LaggingDisk", "SlowEngine", "LateEngine")


def _make_engine(kind, spill_file):
    """``(engine, gate, finish)``: ``kind`` over a gated inner engine with one worker;
    ``gate.open()`` lets everything run; ``finish()`` ends every request and shuts the
    engine down."""
    from ssdtrain.io import native
    from ssdtrain.io.base import EngineWrapper
    from ssdtrain.io.faulty import Fault, FaultyEngine
    from ssdtrain.io.posix import PosixEngine
    gate = _Gate()
    if kind == "native":
        if not native.available():
            pytest.skip(native.unavailable_reason())
        engine = native.NativeEngine(io_threads=1)
        gate.block_native(engine, spill_file)
    elif kind == "kvikio":
        engine = _kvikio_engine()
        gate.block_pool(engine._pool)
    else:
        inner = PosixEngine(io_threads=1)
        gate.block_pool(inner._pool)
    if kind in ("posix", "native", "kvikio"):
        engine = inner if kind == "posix" else engine
    elif kind == "EngineWrapper":
        engine = EngineWrapper(inner)
    elif kind == "FaultyEngine":
        engine = FaultyEngine(inner)
    elif kind == "FaultyEngine-corrupt":
        engine = FaultyEngine(inner, [Fault("write", "corrupt", times=None),
                                      Fault("read", "corrupt", times=None)])
    elif kind == "FaultyEngine-hang":
        engine = FaultyEngine(inner, [Fault("write", "hang", times=None),
                                      Fault("read", "hang", times=None)])
    elif kind == "ManualEngine":
        import manual_engine
        engine = manual_engine.ManualEngine(inner)
        gate.hooks.append(engine.complete_all)
    elif kind == "GatedEngine":
        import test_fork
        engine = test_fork.GatedEngine(inner)
        gate.hooks.append(engine.release)
    elif kind == "LaggingDisk":
        import test_bounded
        engine = test_bounded.LaggingDisk(inner)
        gate.hooks.append(engine.land)
    elif kind == "SlowEngine":
        import test_timeouts
        engine = test_timeouts.SlowEngine(inner, 0.02)
    elif kind == "LateEngine":
        import late_io
        engine = late_io.LateEngine(inner, 0.02)
    else:
        raise AssertionError(kind)

    def finish():
        gate.open()
        engine.shutdown()
    return engine, gate, finish


def _request(engine, op, slot, address, owner):
    do = engine.write if op == "write" else engine.read
    return do(slot.file, slot.offset, address, OWNED_BYTES, owner=owner)


def _owned_setup(tmp_path, op):
    """A spill file whose slot holds ``PATTERN`` for a read (zeros for a write), and the
    memory a request moves: ``PATTERN`` for a write, zeros for a read."""
    import mmap

    from ssdtrain.tools import SpillSet
    spill = SpillSet([str(tmp_path)], "off")
    slot = spill.alloc(OWNED_BYTES, 100)
    mm = mmap.mmap(-1, OWNED_BYTES + 4096)
    address = ctypes_address(mm) + 100
    if op == "read":
        os.pwrite(slot.file.fd, bytes([PATTERN]) * OWNED_BYTES, slot.offset)
    else:
        ctypes_memset(address, PATTERN, OWNED_BYTES)
    return spill, slot, mm, address


def ctypes_memset(address, value, n):
    import ctypes
    ctypes.memset(address, value, n)


def _landed(op, slot, address):
    """Whether the request moved its bytes (a corrupted one: all but one)."""
    import ctypes
    if op == "write":
        got = os.pread(slot.file.fd, OWNED_BYTES, slot.offset)
    else:
        got = ctypes.string_at(address, OWNED_BYTES)
    return got.count(PATTERN) >= OWNED_BYTES - 1


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("kind", OWNER_KINDS)
def test_every_engine_holds_a_requests_owner_until_it_ends(tmp_path, kind, op):
    """Queued behind a blocked worker (or held by the wrapper), the request keeps its
    owner alive though the caller dropped it; when it ends, the owner is gone before the
    future is settled (a done-callback sees it gone), and a caller that keeps the future
    keeps nothing."""
    import weakref
    spill, slot, mm, address = _owned_setup(tmp_path, op)
    engine, gate, finish = _make_engine(kind, slot.file)
    try:
        owner = _Owner()
        ref = weakref.ref(owner)
        fut = _request(engine, op, slot, address, owner)
        del owner
        seen = []
        fut.add_done_callback(lambda f: seen.append(ref() is None))
        time.sleep(0.05)  # a request that ran now would be a worker the gate missed
        assert not fut.done() and ref() is not None, f"{kind}: the owner went while queued"
        if kind == "FaultyEngine-hang":
            finish()  # a hung request ends at shutdown
            assert fut.exception(timeout=30) is not None
        else:
            gate.open()
            assert fut.exception(timeout=30) is None
            assert _landed(op, slot, address)
        assert seen == [True], f"{kind}: the owner outlived the request's future: {seen}"
        assert ref() is None, f"{kind}: a future kept by its caller keeps the owner"
    finally:
        finish()
        spill.close()


def _sweep_lines(run):
    """``{(file, line): runs}`` of the lines ``run()`` runs on this thread in the engine
    and wrapper code (``SWEEP_DIRS``): where an interrupt can land in a submission."""
    import collections
    import sys
    counts = collections.Counter()

    def tracer(frame, event, arg):
        if any(d in frame.f_code.co_filename for d in SWEEP_DIRS):
            return local
        return None

    def local(frame, event, arg):
        if event == "line" and inject._is_signal_point(frame):
            counts[(frame.f_code.co_filename, frame.f_lineno)] += 1
        return local
    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    return counts


class _InterruptAt:
    """Raises KeyboardInterrupt at the first run of ``file:line`` (as a SIGINT there)."""

    def __init__(self, file, line):
        self.file, self.line, self.fired = file, line, False

    def __call__(self, frame, event, arg):
        if self.fired or frame.f_code.co_filename != self.file:
            return None
        return self._local

    def _local(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.line and not self.fired \
                and inject._is_signal_point(frame):
            self.fired = True
            raise KeyboardInterrupt(f"injected at {self.file}:{self.line}")
        return self._local


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("kind", [k for k in OWNER_KINDS if k != "FaultyEngine-hang"])
def test_an_interrupt_anywhere_in_a_submission_never_loses_the_owner(tmp_path, kind, op):
    """KeyboardInterrupt at each line the submission runs on the caller's thread (the
    engine's and the wrapper's code, and ``ThreadPoolExecutor.submit``: an interrupt
    after its queue put loses the future, not the request): a request that was queued
    and then ran had its owner alive until it ran, though the caller never got the
    future; and once every request has ended, the owner is gone (nothing keeps it)."""
    import gc
    import sys
    import weakref

    def one(target):
        spill, slot, mm, address = _owned_setup(tmp_path, op)
        engine, gate, finish = _make_engine(kind, slot.file)
        try:
            owner = _Owner()
            ref = weakref.ref(owner)
            injector = None if target is None else _InterruptAt(*target)
            fired = False
            counts = None
            try:
                if injector is None:
                    counts = _sweep_lines(lambda: _request(engine, op, slot, address, owner))
                else:
                    sys.settrace(injector)
                    try:
                        _request(engine, op, slot, address, owner)
                    finally:
                        sys.settrace(None)
            except KeyboardInterrupt:
                fired = True
            del owner
            gc.collect()  # the interrupt's traceback and frames are gone
            alive = ref() is not None
            finish()
            landed = _landed(op, slot, address)
            problems = []
            if landed and not alive:
                problems.append("the request ran after its owner was let go of")
            deadline = time.monotonic() + 5  # a late engine ends its requests after shutdown
            while ref() is not None and time.monotonic() < deadline:
                time.sleep(0.005)
            if ref() is not None:
                problems.append("the owner outlived every request")
            return counts, fired, problems
        finally:
            finish()
            spill.close()

    counts, _, problems = one(None)
    assert not problems, problems
    assert counts, "no line of the engine's code traced"
    bad, fired = [], 0
    for file, line in sorted(counts):
        _, hit, problems = one((file, line))
        fired += hit
        bad += [f"{file}:{line}: {p}" for p in problems]
    assert not bad, f"{kind} {op}:\n" + "\n".join(bad)
    assert fired >= len(counts) // 2, (fired, len(counts))
